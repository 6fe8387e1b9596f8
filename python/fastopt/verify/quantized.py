"""``--verify`` for quantized models: quantization changes the outputs by design, so instead of
the elementwise tolerances of ``fastopt.verify.core`` the quantized model is compared with its float
original by what quantization should preserve:

- cosine similarity of the logits (each output flattened), per output;
- max abs error relative to the logit scale: max |q - f| / max |f|;
- top-1 agreement: the fraction of positions (all but the last axis) whose argmax is the same,
  over the positions where the original's top two logits differ by more than 1 % of the logit
  scale (``TIE_FRACTION``): a swap of near-tied logits is rounding the cosine and max-error
  gates bound, not a changed prediction. The random-weight fixtures' logits are nearly tied:
  int8 --asymmetric --block-size 128 on the llama fixture measured top-1 0.844 against the 0.90
  gate, 5 swaps among 32 positions, 4 between logits within 0.2 % of the scale (its weights and
  MatMulNBits' results equal the dequantized weights' exactly); with ties left out, 0.96;
- no NaN or inf where the original's output is finite (an fp16 overflow, say): any such value
  fails the verification, whatever the other measures say.

Both models run in ONNX Runtime (CPU, optimizations off) on the same inputs
(``fastopt.verify.core.make_inputs``: a prompt of 16 tokens; each model's own past inputs at past
length 0: an original exported with a cache gets empty pasts, a cache that ``--kv-cache`` added
its empty cache or zeroed in-place buffers). A bf16 model ONNX Runtime's CPU provider has no
kernels for is not compared: the report says why (``skipped``). Thresholds (``THRESHOLDS``)
come from measurements on the test fixtures: random-weight decoders, whose logits are small and
nearly tied, the hard case for top-1. There int4 RTN at block 32 measured cosine 0.952..0.988,
max rel err 0.12..0.39, top-1 0.47..0.97; int8 cosine >= 0.9996, max rel err <= 0.038, top-1 >=
0.94. The bytes equal onnxruntime's, so its quantizer's output scores the same. That includes
where the int4 criteria fail: on the random 24-layer Qwen2-0.5B-shaped export
(bench/models/make_llm_model.py's shape) MatMulNBitsQuantizer's own output (block 32, symmetric,
accuracy level 4) measures cosine 0.879, max rel err 0.535, top-1 0.406, the same as fastopt's:
round-to-nearest's error on random weights grows with depth, which the 2-layer fixtures the
thresholds come from do not show (bench/results/quantize.md). The thresholds are left as they
are: a failure there is RTN's error on that model, not a fastopt difference.

A causal language model (``input_ids`` in, ``logits`` out) is judged on real text instead
(:mod:`fastopt.verify.real_text`, issue 29): perplexity ratio, KL and top-1 agreement over
the built-in prose and ``--verify-text`` files tokenized with the model's tokenizer, or over
sequences sampled from the original model, with that module's per-mode thresholds. Random ids
are not text: a real int4 Gemma 3 measured top-1 0.25 on them against 0.64 on text, int4
SmolLM2-135M 0.33 against 0.64. The measures on random ids above are still taken and reported
(``outputs``), and their NaN/inf check still fails a model; their cosine / max-error / top-1
gates apply only to models the real-text check cannot score (encoders, seq2seq decoders,
non-causal graphs: ``text_skipped`` says why).

====  ===========  ===============  ==============
mode  cosine >=    max rel err <=   top-1 >=
====  ===========  ===============  ==============
int8  0.999        0.05             0.90
int4  0.93         0.50             0.40
fp16  0.9999       0.01             0.95
bf16  0.999        0.05             0.90
====  ===========  ===============  ==============
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np

    from fastopt.verify.real_text import TextReport
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

# A position whose original top-1 and top-2 logits differ by at most this fraction of the
# output's logit scale (max |f|) is a near-tie, left out of the top-1 agreement: any rounding
# may swap the two, and the cosine and max-error gates bound that change already.
TIE_FRACTION = 0.01
# mode -> (min cosine, max relative error, min top-1 agreement)
THRESHOLDS: dict[str, tuple[float, float, float]] = {
    "int8": (0.999, 0.05, 0.90),
    "int8-dynamic": (0.99, 0.15, 0.80),
    "int4": (0.93, 0.50, 0.40),
    "fp16": (0.9999, 0.01, 0.95),
    "bf16": (0.999, 0.05, 0.90),
}


@dataclass
class OutputAccuracy:
    name: str
    cosine: float
    max_rel_error: float
    top1_agreement: float | None  # None for outputs of rank < 2
    nonfinite: int = 0  # NaN/inf values where the original's are finite
    size: int = 0
    near_ties: int = 0  # positions left out of top-1: the original's top two within TIE_FRACTION

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class QuantVerifyReport:
    mode: str
    thresholds: tuple[float, float, float]
    outputs: list[OutputAccuracy] = field(default_factory=list)
    # Why the models were not compared (ONNX Runtime's CPU provider cannot run the quantized
    # model's types: bf16), or None. Not ok, and not a failure: nothing was measured.
    skipped: str | None = None
    # The real-text check (a causal LM), the gate where present; else why it did not apply.
    text: TextReport | None = None
    text_skipped: str | None = None

    @property
    def ok(self) -> bool:
        cos, rel, top1 = self.thresholds
        if self.skipped is not None or any(o.nonfinite for o in self.outputs):
            return False
        if self.text is not None:
            return self.text.ok
        return all(
            o.cosine >= cos
            and o.max_rel_error <= rel
            and (o.top1_agreement is None or o.top1_agreement >= top1)
            for o in self.outputs
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "skipped": self.skipped,
            "thresholds": {
                "min_cosine": self.thresholds[0],
                "max_rel_error": self.thresholds[1],
                "min_top1": self.thresholds[2],
            },
            "outputs": [o.to_dict() for o in self.outputs],
            "text": self.text.to_dict() if self.text else None,
            "text_skipped": self.text_skipped,
        }

    @property
    def accuracy(self) -> str:
        """One line for the size-and-time line: the real-text measures, or ''."""
        return self.text.summary() if self.text else ""

    def __str__(self) -> str:
        cos, rel, top1 = self.thresholds
        if self.skipped is not None:
            return f"quantization accuracy ({self.mode}): not verified: {self.skipped}"
        if self.text is not None:
            lines = [f"quantization accuracy ({self.mode}): {'ok' if self.ok else 'FAILED'}"]
            lines.append(str(self.text))
            for o in self.outputs:
                if o.nonfinite:
                    lines.append(
                        f"  {o.name} on random ids: FAILED: {o.nonfinite} of {o.size} values "
                        "are NaN/inf where the original's are finite"
                    )
            return "\n".join(lines)
        lines = [
            f"quantization accuracy ({self.mode}; need cosine >= {cos}, max rel err <= {rel}, "
            f"top-1 >= {top1}): {'ok' if self.ok else 'FAILED'}"
        ]
        for o in self.outputs:
            t1 = "-" if o.top1_agreement is None else f"{o.top1_agreement:.3f}"
            if o.near_ties:
                t1 += f" ({o.near_ties} near-ties left out)"
            line = (
                f"  {o.name}: cosine {o.cosine:.6f}, max rel err {o.max_rel_error:.4f}, top-1 {t1}"
            )
            if o.nonfinite:
                line += (
                    f"; FAILED: {o.nonfinite} of {o.size} values are NaN/inf where the "
                    "original's are finite"
                )
            lines.append(line)
        if self.text_skipped:
            lines.append(f"  (no real-text check: {self.text_skipped})")
        return "\n".join(lines)


def _accuracy(name: str, ref: np.ndarray, got: np.ndarray) -> OutputAccuracy:
    f = ref.astype(np.float64).ravel()
    q = got.astype(np.float64).ravel()
    nonfinite = int(np.count_nonzero(np.isfinite(f) & ~np.isfinite(q))) if f.shape == q.shape else 0
    denom = float(np.linalg.norm(f) * np.linalg.norm(q))
    cosine = float(f @ q / denom) if denom > 0 else float(np.array_equal(f, q))
    scale = float(np.max(np.abs(f))) if f.size else 0.0
    err = float(np.max(np.abs(f - q))) if f.size else 0.0
    rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    top1, ties = None, 0
    if ref.ndim >= 2 and ref.shape[-1] > 1 and ref.shape == got.shape:
        rows = ref.astype(np.float64).reshape(-1, ref.shape[-1])
        picks = np.argmax(got.reshape(-1, got.shape[-1]), axis=-1)
        top2 = np.sort(rows, axis=-1)[:, -2:]
        decisive = top2[:, 1] - top2[:, 0] > TIE_FRACTION * scale
        ties = int(np.count_nonzero(~decisive))
        if decisive.any():
            top1 = float(np.mean(np.argmax(rows, axis=-1)[decisive] == picks[decisive]))
    return OutputAccuracy(name, cosine, rel, top1, nonfinite, int(f.size), ties)


def verify_quantized(
    original: str | os.PathLike[str],
    quantized: str | os.PathLike[str],
    mode: str,
    *,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    tokenizer: str | os.PathLike[str] | None = None,
    texts: Sequence[str | os.PathLike[str]] = (),
) -> QuantVerifyReport:
    """Runs both models on the same inputs and compares their float outputs (logits first;
    present/KV outputs are left out: they follow from the logits' inputs).

    Each model gets its own past inputs at past length 0 (an original exported with a cache:
    empty pasts; a quantized model given a cache: its empty cache, or for an in-place cache
    zeroed buffers) and the same token ids, mask and positions. An original ONNX Runtime cannot
    run raises InputRejectedError; a quantized model it cannot run, OutputRejectedError, except
    where its CPU provider has no kernel for the quantized model's types (bf16): the report then
    says why it was not verified (``skipped``).

    A causal LM is then scored on real text (``report.text``; :func:`fastopt.verify.real_text.
    evaluate_text` with `tokenizer` and `texts`, the user's text files)."""
    from contextlib import ExitStack

    from fastopt.verify.check import open_source, summarize_error
    from fastopt.verify.core import InputRejectedError, OutputRejectedError, _run, make_inputs

    if mode not in THRESHOLDS:
        raise _C.ModelError(f"no accuracy criteria for mode {mode!r}")
    report = QuantVerifyReport(mode, THRESHOLDS[mode])
    all_dims = {"sequence_length": 16, "past_sequence_length": 0, **(dims or {})}
    ref_feeds = make_inputs(os.fspath(original), dims=all_dims, seed=seed)
    feeds = {
        **make_inputs(os.fspath(quantized), dims=all_dims, seed=seed),
        **{k: v for k, v in ref_feeds.items() if not k.startswith(_C.KV_PAST_PREFIX)},
    }
    with ExitStack() as stack:
        try:
            _, ref, _ = _run(open_source(os.fspath(original), stack), ref_feeds, None)
        except (FileNotFoundError, TypeError):
            raise
        except Exception as e:
            why = f"ONNX Runtime could not run the original model: {summarize_error(str(e))}"
            raise InputRejectedError(why, report) from e  # type: ignore[arg-type]
        try:
            _, got, _ = _run(open_source(os.fspath(quantized), stack), feeds, None)
        except (FileNotFoundError, TypeError):
            raise
        except Exception as e:
            why = summarize_error(str(e))
            if type(e).__name__ == "NotImplemented":  # ORT's NOT_IMPLEMENTED: no such kernel
                report.skipped = (
                    f"ONNX Runtime's CPU provider cannot run the {mode} model ({why}); {mode} "
                    "models are for GPU providers"
                )
                return report
            raise OutputRejectedError(
                f"ONNX Runtime could not run the quantized model (the original runs: a "
                f"fastopt bug, please report it): {why}",
                report,  # type: ignore[arg-type]
            ) from e
    for name, value in ref.items():
        arr = np.asarray(value)
        if name.startswith("present") or arr.dtype.kind != "f" or name not in got:
            continue
        report.outputs.append(_accuracy(name, arr, np.asarray(got[name])))
    if not report.outputs:
        raise _C.ModelError("verify: the model has no float outputs to compare")
    from fastopt.verify.real_text import ModelRunError, NotLanguageModel, evaluate_text

    try:
        report.text = evaluate_text(
            original, quantized, mode, tokenizer=tokenizer, texts=texts, seed=seed
        )
    except NotLanguageModel as e:
        report.text_skipped = str(e)
    except ModelRunError as e:
        # Both ran on random ids above: a failure on text is the same kind of problem.
        if e.role == "original":
            raise InputRejectedError(
                f"ONNX Runtime could not run the original model on text: {e}",
                report,  # type: ignore[arg-type]
            ) from e
        raise OutputRejectedError(
            f"ONNX Runtime could not run the quantized model on text (the original runs: a "
            f"fastopt bug, please report it): {e}",
            report,  # type: ignore[arg-type]
        ) from e
    return report
