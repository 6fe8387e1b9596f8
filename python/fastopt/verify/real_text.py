"""The real-text check of ``--verify`` (issue 29): how much does an output model's language model
differ from the original's on text?

Both models run in ONNX Runtime (CPU, graph optimizations off) on the same token sequences
(:mod:`fastopt.verify.text_tokens`: the built-in prose and ``--verify-text`` files through the
model's tokenizer, else sequences sampled from the original), in windows of at most ``WINDOW``
tokens, each from an empty cache. Over every next-token position of every window:

- perplexity of each model, exp(mean -log p(next token)), and their ratio (output / original);
- KL(original || output) of the next-token distributions, mean over positions (nats);
- top-1 agreement: the fraction of positions where both models' argmax is the same; the gate
  reads it over the decisive positions, where the original's top token is at least twice as
  likely as its runner-up (``DECISIVE_GAP``): a swap of near-tied tokens changes little (KL
  bounds it) and random-weight models' near-flat distributions are all near-ties (int4 on the
  llama fixture: 0.55 over all positions). With fewer than ``MIN_DECISIVE`` decisive positions
  top-1 is reported, not gated;
- no NaN or inf in the output's logits where the original's are finite.

Greedy continuations are compared too, from the first ``PROMPT`` tokens of up to three windows,
``STEPS`` tokens each, each model continuing its own tokens (a model with a KV cache through
it, one without recomputing the whole sequence): the report gives the tokens until the first
divergence. Reported, not gated: one near-tie early changes everything after it.

A model is scored this way when it is a causal language model: an ``input_ids`` input, a
``logits`` output [batch, sequence, vocab], no encoder states, and logits at a position that do
not change with later tokens (checked). Otherwise :class:`NotLanguageModel` says why.

Thresholds per mode (``THRESHOLDS``), from bench/results/verify_real_text.md: SmolLM2-135M-Instruct
(a real trained model, its tokenizer, the built-in prose, 484 positions) and the random-weight
fixtures (sampled and tokenized):

============  ==========  ========  ======  =============================================
mode          ppl ratio   KL <=     top-1   measured (SmolLM2: ratio / KL / decisive top-1)
============  ==========  ========  ======  =============================================
fp32 rewrite  1.001       1e-4      0.98    llm preset, KV cache: 1.0000 / 9e-12 / 1.000
fp16          1.005       1e-3      0.95    0.9999 / 9.2e-6 / 1.000
bf16          1.02        0.01      0.90    not measured: ORT's CPU provider has no kernels
int8          1.02        0.01      0.90    block 32: 1.0052 / 0.0043 / 1.000
int8-dynamic  1.02        0.01      0.90    fails: 1.879 / 0.61 / 0.688 (fixtures 0.001)
int4          1.50        0.50      0.70    block 32: 1.158 / 0.366 / 0.786; asymmetric
                                            1.334 / 0.374 / 0.774; block 128 fails: 1.464 /
                                            0.597 / 0.669
============  ==========  ========  ======  =============================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt.verify.check import onnxruntime, summarize_error
from fastopt.verify.step_feeds import present_name, step_feeds
from fastopt.verify.text_tokens import (
    PROSE,
    NoTokenizerLibrary,
    TextFileError,
    Tokens,
    find_tokenizer,
    prose,
    read_text_file,
    sample_tokens,
    start_token,
    tokenize,
)

if TYPE_CHECKING:
    import numpy as np
else:
    from fastopt._lazy import lazy_module

    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

WINDOW = 128  # tokens per scored window (the fixtures' contexts are 256)
PROMPT = 16  # greedy continuations: prompt tokens,
STEPS = 16  # new tokens,
GREEDY_RUNS = 3  # and prompts (the first windows')
DECISIVE_GAP = math.log(2.0)  # top-1 gate: original's log p(top) - log p(runner-up) at least this
MIN_DECISIVE = 16


@dataclass(frozen=True)
class TextThresholds:
    max_ppl_ratio: float  # output perplexity / original's
    max_kl: float  # mean KL(original || output), nats
    min_top1: float  # top-1 agreement


# mode -> gates; "fp32": a rewrite that should compute the same (optimize --verify).
THRESHOLDS: dict[str, TextThresholds] = {
    "fp32": TextThresholds(1.001, 1e-4, 0.98),
    "fp16": TextThresholds(1.005, 1e-3, 0.95),
    "bf16": TextThresholds(1.02, 0.01, 0.90),
    "int8": TextThresholds(1.02, 0.01, 0.90),
    "int8-dynamic": TextThresholds(1.02, 0.01, 0.90),
    "int4": TextThresholds(1.50, 0.50, 0.70),
}


class NotLanguageModel(Exception):
    """The model is not a causal LM the real-text check can score; the message says why."""


class ModelRunError(Exception):
    """ONNX Runtime could not load or run one of the two models (`role`)."""

    def __init__(self, role: str, error: Exception) -> None:
        super().__init__(summarize_error(str(error)))
        self.role = role
        self.error = error


@dataclass
class GreedyComparison:
    prompt: list[int]
    original: list[int]
    output: list[int]

    @property
    def matched(self) -> int:
        """Tokens equal before the first divergence."""
        n = 0
        for a, b in zip(self.original, self.output):
            if a != b:
                break
            n += 1
        return n


@dataclass
class TextReport:
    mode: str
    thresholds: TextThresholds
    source: str  # what made the tokens: the tokenizer and its library, or sampling
    texts: dict[str, int] = field(default_factory=dict)  # text name -> tokens
    positions: int = 0  # next-token positions scored
    perplexity_original: float = 0.0
    perplexity_output: float = 0.0
    kl_mean: float = 0.0
    kl_max: float = 0.0
    top1: float = 0.0  # over all positions
    top1_decisive: float | None = None  # over the decisive ones (the gate), None: too few
    decisive: int = 0  # positions where the original's top token is >= 2x its runner-up
    nonfinite: int = 0  # output logits NaN/inf where the original's are finite
    greedy: list[GreedyComparison] = field(default_factory=list)
    output_cached: bool = False  # the output generated through its KV cache

    @property
    def perplexity_ratio(self) -> float:
        if self.perplexity_original == 0 or not math.isfinite(self.perplexity_output):
            return math.inf
        return self.perplexity_output / self.perplexity_original

    def failures(self) -> list[str]:
        t = self.thresholds
        out = []
        if self.nonfinite:
            out.append(f"{self.nonfinite} logits NaN/inf where the original's are finite")
        if not self.perplexity_ratio <= t.max_ppl_ratio:
            out.append(f"perplexity ratio {self.perplexity_ratio:.4f} > {t.max_ppl_ratio}")
        if not self.kl_mean <= t.max_kl:
            out.append(f"KL {self.kl_mean:.4g} > {t.max_kl}")
        if self.top1_decisive is not None and not self.top1_decisive >= t.min_top1:
            out.append(
                f"top-1 {self.top1_decisive:.3f} < {t.min_top1} over {self.decisive} decisive "
                "positions"
            )
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "failures": self.failures(),
            "source": self.source,
            "texts": self.texts,
            "positions": self.positions,
            "perplexity_original": self.perplexity_original,
            "perplexity_output": self.perplexity_output,
            "perplexity_ratio": self.perplexity_ratio,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top1": self.top1,
            "top1_decisive": self.top1_decisive,
            "decisive": self.decisive,
            "nonfinite": self.nonfinite,
            "thresholds": self.thresholds.__dict__,
            "greedy": [
                {**g.__dict__, "matched": g.matched, "steps": len(g.original)} for g in self.greedy
            ],
            "output_cached": self.output_cached,
        }

    def summary(self) -> str:
        """One line: perplexity ratio, KL, top-1."""
        return (
            f"perplexity x{self.perplexity_ratio:.4f}, KL {self.kl_mean:.4g}, top-1 {self.top1:.3f}"
        )

    def __str__(self) -> str:
        t = self.thresholds
        if all(k.startswith("sample ") for k in self.texts):
            texts = f"{len(self.texts)} sequences, {sum(self.texts.values())} tokens"
        else:
            texts = " + ".join(f"{k} {v} tokens" for k, v in self.texts.items())
        head = f"real-text check ({self.mode}; {texts}; {self.source}): " + (
            "ok" if self.ok else "FAILED: " + "; ".join(self.failures())
        )
        greedy = ", ".join(f"{g.matched}/{len(g.original)}" for g in self.greedy)
        if self.top1_decisive is None:
            decisive = f"{self.decisive} decisive (too few to gate)"
        else:
            decisive = (
                f"{self.top1_decisive:.3f} over {self.decisive} decisive (need >= {t.min_top1})"
            )
        how = "with its KV cache" if self.output_cached else "recomputing"
        return (
            f"{head}\n"
            f"  perplexity {self.perplexity_original:.4g} -> {self.perplexity_output:.4g} "
            f"(ratio {self.perplexity_ratio:.4f}, need <= {t.max_ppl_ratio}); KL mean "
            f"{self.kl_mean:.4g} max {self.kl_max:.4g} (need <= {t.max_kl}); top-1 "
            f"{self.top1:.3f} over {self.positions} positions, {decisive}\n"
            f"  greedy continuations: {greedy} tokens equal before the first divergence "
            f"(output {how})"
        )


# --- running a language model in ONNX Runtime ---------------------------------------------------


class _LanguageModel:
    """One model's session: full passes from an empty cache, and greedy decoding (through its
    KV cache when it has one)."""

    def __init__(self, path: str | os.PathLike[str], role: str) -> None:
        ort = onnxruntime()
        self.path, self.role = os.fspath(path), role
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            self.sess = ort.InferenceSession(self.path, so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ModelRunError(role, e) from e
        inputs = {i.name: i for i in self.sess.get_inputs()}
        outputs = {o.name: o for o in self.sess.get_outputs()}
        self.output_names = list(outputs)
        if "input_ids" not in inputs:
            raise NotLanguageModel(f"the {role} model has no input_ids input")
        if "logits" not in outputs or len(outputs["logits"].shape) != 3:
            raise NotLanguageModel(f"the {role} model has no logits output [batch, seq, vocab]")
        if "encoder_hidden_states" in inputs:
            raise NotLanguageModel(f"the {role} model is a seq2seq decoder (encoder states)")
        self.inputs = inputs
        self.pasts = [i for i in inputs.values() if i.name.startswith(_C.KV_PAST_PREFIX)]
        if any(".encoder." in p.name for p in self.pasts):
            raise NotLanguageModel(f"the {role} model has a cross-attention cache")
        known = {"input_ids", "attention_mask", "position_ids", *(p.name for p in self.pasts)}
        self.other = [n for n in inputs if n not in known]
        self.inplace: set[str] = set()
        for p in self.pasts:
            present = outputs.get(present_name(p.name))
            if present is None:
                raise NotLanguageModel(f"the {role} model has no present output for {p.name}")
            if p.shape[2] == present.shape[2]:
                self.inplace.add(p.name)
        from fastopt.genai.cache_dims import cache_geometry

        self.geometry = cache_geometry(self.path) if self.pasts else None

    def _cache(self, batch: int, length: int) -> dict[str, np.ndarray]:
        """Empty pasts: length 0, or zeroed buffers of `length` for an in-place cache."""
        np_types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
        cache = {}
        for p in self.pasts:
            heads = (
                p.shape[1] if isinstance(p.shape[1], int) else self.geometry and self.geometry[0]
            )
            size = p.shape[3] if isinstance(p.shape[3], int) else self.geometry and self.geometry[1]
            if not heads or not size or p.type not in np_types:
                raise NotLanguageModel(f"{p.name} {p.shape} {p.type}: cache geometry unknown")
            rows = length if p.name in self.inplace else 0
            cache[p.name] = np.zeros((batch, heads, rows, size), np_types[p.type])
        return cache

    def _feeds(self, ids: np.ndarray, past: int) -> dict[str, np.ndarray]:
        batch, seq = ids.shape
        feeds = step_feeds(ids, past)
        if self.other:  # inputs a decoder rarely has (token_type_ids, ...): make_inputs' values
            from fastopt.verify.core import make_inputs

            dims = {"batch_size": batch, "sequence_length": seq, "past_sequence_length": past}
            made = make_inputs(self.path, dims=dims)
            feeds.update({n: made[n] for n in self.other})
        return {k: v for k, v in feeds.items() if k in self.inputs}

    def _run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return list(self.sess.run(names, feeds))
        except Exception as e:
            raise ModelRunError(self.role, e) from e

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """[batch, seq, vocab] float64 logits of a full pass over `ids` from an empty cache."""
        feeds = {**self._feeds(ids, 0), **self._cache(ids.shape[0], ids.shape[1])}
        (out,) = self._run(["logits"], feeds)
        return np.asarray(out, dtype=np.float64)

    def greedy(self, prompt: Sequence[int], steps: int) -> list[int]:
        if not self.pasts:
            seq = list(prompt)
            for _ in range(steps):
                seq.append(int(np.argmax(self.logits(np.array([seq]))[0, -1])))
            return seq[len(prompt) :]
        cache = self._cache(1, len(prompt) + steps)
        step, past, made = list(prompt), 0, []
        for _ in range(steps):
            got = dict(
                zip(
                    self.output_names,
                    self._run(self.output_names, {**self._feeds(np.array([step]), past), **cache}),
                )
            )
            made.append(int(np.argmax(got["logits"][0, -1])))
            for p in self.pasts:
                cache[p.name] = got[present_name(p.name)]
            past += len(step)
            step = [made[-1]]
        return made


def _check_causal(model: _LanguageModel, ids: np.ndarray) -> None:
    """Logits at the first positions must not change when a later token does (a masked LM's
    would: its next-token perplexity means nothing)."""
    a = model.logits(ids[None, :8])
    changed = ids[:8].copy()
    changed[-1] = (changed[-1] + 1) % a.shape[-1]
    b = model.logits(changed[None])
    if not np.allclose(a[0, :-1], b[0, :-1], rtol=1e-4, atol=1e-5):
        raise NotLanguageModel(
            f"the {model.role} model is not causal (its logits see later tokens)"
        )


# --- scoring -------------------------------------------------------------------------------------


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def score_window(
    ref: np.ndarray, got: np.ndarray, ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Per next-token position of one window ([n, vocab] logits of each model, [n] ids): the
    original's and the output's -log p(next), KL(original || output), top-1 equal, the
    original's top-1 / top-2 logit gap; and the output's NaN/inf count where the original's
    logits are finite."""
    ref, got = ref[:-1], got[:-1]
    nonfinite = int(np.count_nonzero(np.isfinite(ref) & ~np.isfinite(got)))
    lr, lg = _log_softmax(ref), _log_softmax(got)
    rows = np.arange(len(ids) - 1)
    target = ids[1:]
    kl = np.sum(np.exp(lr) * (lr - lg), axis=-1)
    same = np.argmax(ref, axis=-1) == np.argmax(got, axis=-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    return -lr[rows, target], -lg[rows, target], kl, same, gap, nonfinite


def _windows(tokens: Tokens, window: int) -> list[np.ndarray]:
    if tokens.sampled:
        return [np.array(ids, np.int64) for _, ids in tokens.texts]
    size = max(window - len(tokens.prefix), 2)
    out = []
    for _, ids in tokens.texts:
        for i in range(0, len(ids), size):
            chunk = ids[i : i + size]
            if len(chunk) >= 2 or i == 0:
                out.append(np.array([*tokens.prefix, *chunk], np.int64))
    return out


def gather_tokens(
    original: _LanguageModel,
    vocab: int,
    tokenizer: str | os.PathLike[str] | None,
    texts: Sequence[str | os.PathLike[str]],
    models: Sequence[str | os.PathLike[str]],
    seed: int,
) -> Tokens:
    """The sequences to score: the prose and `texts` tokenized, or sampled from `original`."""
    files = [(os.fspath(t), read_text_file(t)) for t in texts]  # bad files fail first
    path = find_tokenizer(tokenizer, models)
    why = "no tokenizer"
    if path is not None:
        try:
            return tokenize(path, [(PROSE, prose()), *files], vocab)
        except NoTokenizerLibrary as e:
            why = f"no tokenizer library ({e})"
    if files:
        raise TextFileError(
            f"--verify-text {files[0][0]}: no tokenizer to read it with ({why}; a tokenizer.json "
            "beside the model, or --tokenizer)"
        )
    start, where = start_token(models[0], vocab)
    ids = sample_tokens(original.logits, start, vocab, seed=seed)
    sampled = Tokens(
        f"{why}: {len(ids)} sequences sampled from the original model (greedy and "
        f"temperature, seed {seed}) from {where}",
        sampled=True,
    )
    sampled.texts = [(f"sample {i}", [int(t) for t in row]) for i, row in enumerate(ids)]
    return sampled


def evaluate_text(
    original: str | os.PathLike[str],
    output: str | os.PathLike[str],
    mode: str = "fp32",
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    texts: Sequence[str | os.PathLike[str]] = (),
    seed: int = 0,
    window: int = WINDOW,
    steps: int = STEPS,
) -> TextReport:
    """Scores `output` against `original` on real text (module docstring) with `mode`'s
    thresholds; "rewrite" (optimize's passes) is "fp32", or "fp16" for a model whose logits are
    float16/bfloat16. `tokenizer`: a
    tokenizer.json or a folder with one (default: beside either model); `texts`: further UTF-8
    text files. Raises NotLanguageModel when the check does not apply, ModelRunError when ONNX
    Runtime cannot run a model, TextFileError (a ModelError) for a bad text file or tokenizer."""
    if mode not in THRESHOLDS and mode != "rewrite":
        raise _C.ModelError(f"no real-text criteria for mode {mode!r}")
    ref = _LanguageModel(original, "original")
    if mode == "rewrite":  # optimize's passes: the same computation in the model's precision
        logits_type = next(o.type for o in ref.sess.get_outputs() if o.name == "logits")
        mode = "fp32" if logits_type in ("tensor(float)", "tensor(double)") else "fp16"
    vocab = int(ref.logits(np.zeros((1, 8), np.int64)).shape[-1])
    tokens = gather_tokens(ref, vocab, tokenizer, texts, [original, output], seed)
    windows = _windows(tokens, window)
    _check_causal(ref, windows[0] if len(windows[0]) >= 8 else np.arange(8) % vocab)
    out = _LanguageModel(output, "output")
    report = TextReport(mode, THRESHOLDS[mode], tokens.source, output_cached=bool(out.pasts))
    report.texts = {name: len(ids) for name, ids in tokens.texts}
    parts: list[tuple[np.ndarray, ...]] = []
    for ids in windows:
        scored = score_window(ref.logits(ids[None])[0], out.logits(ids[None])[0], ids)
        report.nonfinite += scored[5]
        parts.append(scored[:5])
    nll_ref, nll_out, kl, same, gap = (np.concatenate([p[i] for p in parts]) for i in range(5))
    report.positions = int(nll_ref.size)
    report.perplexity_original = float(np.exp(np.mean(nll_ref)))
    report.perplexity_output = float(np.exp(np.mean(nll_out)))
    report.kl_mean = float(np.mean(kl))
    report.kl_max = float(np.max(kl))
    report.top1 = float(np.mean(same))
    decisive = gap >= DECISIVE_GAP
    report.decisive = int(np.count_nonzero(decisive))
    if report.decisive >= MIN_DECISIVE:
        report.top1_decisive = float(np.mean(same[decisive]))
    for ids in windows[:GREEDY_RUNS]:
        prompt = [int(t) for t in ids[:PROMPT]]
        report.greedy.append(
            GreedyComparison(prompt, ref.greedy(prompt, steps), out.greedy(prompt, steps))
        )
    return report
