"""``verify_generation``: does a decoder with a KV cache generate what the original generates?

A cached model takes inputs the original does not (``past_key_values.*``), so output-by-output
verification cannot compare them. This runs greedy decoding in ONNX Runtime (graph
optimizations off) on both, batch 1, from the same prompt: the original recomputes the whole
sequence each step; the cached model prefills the prompt on an empty cache (a zeroed
max-length buffer for an in-place cache) and then takes one token per step, its presents fed
back as the next pasts. The generated tokens must be equal and each step's logits within the
dtype's tolerance (float32 1e-3, float16 2e-2: a cache changes the accumulation order). An
original exported with a cache is given empty pasts (past length 0), so it recomputes the whole
sequence at each step too.

An encoder-decoder's decoder (an ``encoder_hidden_states`` input) decodes over random encoder
states (batch 1, 8 rows, encoder_attention_mask all ones). A cached decoder with a cross cache
gets it from one priming run (its present.<i>.encoder.* outputs; _prime_cross_cache), then reads
it at every step: add_kv_cache's seq2seq form, and its cross_attention_cache 2 (the decoder half
of genai whisper's form, whose cross cache the encoder computes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.errors import UnsupportedModelError, entry_point, foreign_errors
from fastopt.genai.cache_dims import cache_geometry
from fastopt.verify.check import onnxruntime
from fastopt.verify.core import InputRejectedError, OutputRejectedError, VerifyError, make_inputs
from fastopt.verify.step_feeds import present_name, step_feeds

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

_TOLERANCE = {"tensor(float)": 1e-3, "tensor(float16)": 2e-2, "tensor(double)": 1e-6}
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
# The seq2seq cache forms (csrc/passes/kv_cache/cache_form.h): the cross cache's names, the
# in-place decoder's past-length input.
_CROSS_SECTION = _C.kv_cache_forms()["seq2seq_cross"].section + "."
_PAST_LENGTH_INPUT = _C.kv_cache_forms()["seq2seq_inplace"].past_length


@dataclass
class GenerationReport:
    original: str
    cached: str
    prompt: list[int]
    tokens_original: list[int] = field(default_factory=list)
    tokens_cached: list[int] = field(default_factory=list)
    max_abs_err: float = 0.0
    atol: float = 0.0
    inplace: bool = False
    nonfinite: int = 0  # cached logits NaN/inf where the original's are finite

    @property
    def ok(self) -> bool:
        return (
            self.tokens_original == self.tokens_cached
            and self.max_abs_err <= self.atol
            and not self.nonfinite
        )

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ok": self.ok}

    def __str__(self) -> str:
        verdict = "passed" if self.ok else "FAILED"
        form = "in-place" if self.inplace else "standard"
        return (
            f"verify {verdict}: greedy generation, {self.cached} ({form} KV cache) vs "
            f"{self.original} (recompute)\n"
            f"prompt {len(self.prompt)} tokens, {len(self.tokens_original)} generated; tokens "
            f"{'equal' if self.tokens_original == self.tokens_cached else 'DIFFER'}: "
            f"{self.tokens_cached}; logits max_abs {self.max_abs_err:.3g} (atol {self.atol:g})"
            + (
                f"; {self.nonfinite} logits NaN/inf where the original's are finite"
                if self.nonfinite
                else ""
            )
        )


def _session(path: str, role: str) -> Any:
    ort = onnxruntime()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with foreign_errors(f"ONNX Runtime session of the {role} model"):
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _encoder_feeds(sess: Any, seed: int) -> dict[str, np.ndarray]:
    """Random encoder states (1, 8, D) and an all-ones encoder_attention_mask for a seq2seq
    decoder; {} for a decoder-only model."""
    inputs = {i.name: i for i in sess.get_inputs()}
    hidden = inputs.get("encoder_hidden_states")
    if hidden is None:
        return {}
    width = hidden.shape[2] if len(hidden.shape) == 3 else None
    if not isinstance(width, int) or hidden.type not in _NUMPY:
        raise UnsupportedModelError(f"encoder_hidden_states {hidden.shape}: no static width")
    rng = np.random.default_rng(seed)
    feeds = {
        "encoder_hidden_states": rng.standard_normal((1, 8, width)).astype(_NUMPY[hidden.type])
    }
    if "encoder_attention_mask" in inputs:
        feeds["encoder_attention_mask"] = np.ones((1, 8), np.int64)
    return feeds


def _feed(sess: Any, ids: list[int], past_len: int) -> dict[str, np.ndarray]:
    names = {i.name for i in sess.get_inputs()}
    feed = step_feeds(np.array([ids], np.int64), past_len)
    # an in-place seq2seq decoder: the tokens its self-attention buffers hold
    feed[_PAST_LENGTH_INPUT] = np.array([past_len], np.int32)
    return {k: v for k, v in feed.items() if k in names}


@entry_point("verify_generation")
def verify_generation(
    original: str, cached: str, *, steps: int = 8, prompt_length: int = 8, seed: int = 0
) -> GenerationReport:
    """Greedy generation of `steps` tokens from a `prompt_length`-token prompt, by `original`
    (no cache) and `cached` (a standard or in-place KV cache); see the module docstring.
    Returns the report when they agree; raises :class:`fastopt.VerifyError` (its ``report``
    the GenerationReport) when they do not."""
    ids_feed = make_inputs(original, {"batch_size": 1, "sequence_length": prompt_length}, seed)
    prompt = [int(t) for t in ids_feed["input_ids"].reshape(-1)[:prompt_length]]
    report = GenerationReport(str(original), str(cached), prompt)
    ref_sess = _session(original, "original")
    sess = _session(cached, "cached")
    pasts = [i for i in sess.get_inputs() if i.name.startswith(_C.KV_PAST_PREFIX)]
    if not pasts:
        raise UnsupportedModelError(f"{cached} has no past_key_values.* inputs")
    outputs = [o.name for o in sess.get_outputs()]
    logits_type = next(o.type for o in sess.get_outputs() if o.name == "logits")
    report.atol = _TOLERANCE.get(logits_type, 1e-3)
    geometry = cache_geometry(cached)
    # In place: past and present share the buffer's length dim (a seq2seq decoder's cross cache
    # stays standard beside in-place self-attention buffers).
    in_place = {
        p.name
        for p, o in zip(pasts, _presents(sess, pasts))
        if p.shape[2] == o.shape[2] and not _is_cross(p.name)
    }
    report.inplace = bool(in_place)
    total = prompt_length + steps
    cache: dict[str, np.ndarray] = {}
    for p in pasts:
        inplace = p.name in in_place
        heads = p.shape[1] if isinstance(p.shape[1], int) else geometry and geometry[0]
        size = p.shape[3] if isinstance(p.shape[3], int) else geometry and geometry[1]
        if not heads or not size:
            raise UnsupportedModelError(f"{p.name} {p.shape}: the kv heads / head size are unknown")
        cache[p.name] = np.zeros((1, heads, total if inplace else 0, size), _NUMPY[p.type])

    # An original exported with a cache recomputes each step from an empty past (length 0).
    encoder = {**_encoder_feeds(ref_sess, seed), **_empty_pasts(original, ref_sess)}
    cross = dict(encoder)  # what the cached model gets
    seq = list(prompt)
    past_len = 0
    step_ids = list(prompt)
    if any(_is_cross(p.name) for p in pasts):
        _prime_cross_cache(sess, outputs, pasts, cache, cross, _feed(sess, step_ids, 0), report)
    for _ in range(steps):
        try:
            (ref,) = ref_sess.run(["logits"], {**_feed(ref_sess, seq, 0), **encoder})
        except Exception as e:
            raise InputRejectedError(f"the original model does not run: {e}", report) from e  # type: ignore[arg-type]
        got = _run_cached(
            sess, outputs, {**_feed(sess, step_ids, past_len), **cross, **cache}, report
        )
        want, have = ref[0, -1].astype(np.float64), got["logits"][0, -1].astype(np.float64)
        report.nonfinite += int(np.count_nonzero(np.isfinite(want) & ~np.isfinite(have)))
        diff = np.abs(want - have)
        diff = diff[np.isfinite(diff)]
        report.max_abs_err = max(report.max_abs_err, float(diff.max()) if diff.size else 0.0)
        report.tokens_original.append(int(want.argmax()))
        report.tokens_cached.append(int(have.argmax()))
        for p in pasts:
            if not _is_cross(p.name):  # (the cross cache stays what the priming run gave)
                cache[p.name] = got[present_name(p.name)]
        past_len += len(step_ids)
        step_ids = [report.tokens_original[-1]]  # both continue from the reference token
        seq.append(step_ids[0])
    if not report.ok:
        raise VerifyError(str(report), report)  # type: ignore[arg-type]
    return report


def _empty_pasts(original: str, sess: Any) -> dict[str, np.ndarray]:
    """Zero-length past_key_values.* for an original exported with a cache, {} for one
    without: the original then recomputes the whole sequence each step, as one without a cache
    does."""
    names = [i.name for i in sess.get_inputs() if i.name.startswith(_C.KV_PAST_PREFIX)]
    if not names:
        return {}
    cross = [n for n in names if _is_cross(n)]
    if cross:
        # Its cross cache holds the encoder's projections: empty, the decoder would attend to
        # nothing, not to the encoder states the cached model reads.
        raise UnsupportedModelError(
            f"the original takes a cross-attention cache ({cross[0]}): generation is compared "
            "from an original without one"
        )
    made = make_inputs(original, {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 0})
    pasts = {n: made[n] for n in names}
    wrong = [f"{n} {v.shape}" for n, v in pasts.items() if 0 not in v.shape]
    if wrong:
        raise UnsupportedModelError(
            f"the original's past inputs have no past length to set to 0: {', '.join(wrong)}"
        )
    return pasts


def _prime_cross_cache(
    sess: Any,
    outputs: list[str],
    pasts: list[Any],
    cache: dict[str, np.ndarray],
    cross: dict[str, np.ndarray],
    feed: dict[str, np.ndarray],
    report: GenerationReport,
) -> None:
    """Puts the cross cache into `cache`, once, from the encoder states in `cross`: one run gives
    it as present.<i>.encoder.*, which every step then reads.

    add_kv_cache's cross_attention_cache 1 appends the projection of encoder_hidden_states to its
    past (a past of another length than its present): the run gets empty pasts, and later steps
    0 encoder rows. Option 2 reads the past as given, of the present's length (the projection is
    an output only; genai whisper's encoder computes it): the run gets zeros of the encoder's
    length, whose logits are not used, and the states stay whole."""
    crossed = [p for p in pasts if _is_cross(p.name)]
    appends = any(p.shape[2] != o.shape[2] for p, o in zip(crossed, _presents(sess, crossed)))
    rows = cross["encoder_hidden_states"].shape[1]
    for p in crossed:
        shape = cache[p.name].shape
        cache[p.name] = np.zeros(
            (shape[0], shape[1], 0 if appends else rows, shape[3]), cache[p.name].dtype
        )
    primed = _run_cached(sess, outputs, {**feed, **cross, **cache}, report)
    for p in crossed:
        cache[p.name] = primed[present_name(p.name)]
    if appends:
        cross["encoder_hidden_states"] = cross["encoder_hidden_states"][:, :0]


def _run_cached(
    sess: Any, outputs: list[str], feeds: dict[str, np.ndarray], report: GenerationReport
) -> dict[str, np.ndarray]:
    try:
        return dict(zip(outputs, sess.run(outputs, feeds)))
    except Exception as e:
        raise OutputRejectedError(
            f"the cached model does not run (the original does: a fastopt bug): {e}",
            report,  # type: ignore[arg-type]
        ) from e


def _is_cross(past: str) -> bool:
    return _CROSS_SECTION in past  # past_key_values.<i>.encoder.key|value: a seq2seq cross cache


def _presents(sess: Any, pasts: list[Any]) -> list[Any]:
    by_name = {o.name: o for o in sess.get_outputs()}
    missing = [p.name for p in pasts if present_name(p.name) not in by_name]
    if missing:
        raise UnsupportedModelError(f"no present output for {', '.join(missing)}")
    return [by_name[present_name(p.name)] for p in pasts]
