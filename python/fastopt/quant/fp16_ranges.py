"""The fp16 range check: which ops would overflow float16, found by running the float model.

float16 ends at 65504; activations of some models pass it (Gemma's residual stream: the
embedding is scaled by sqrt(hidden) and grows layer by layer), and an fp16 model then computes
inf and NaN. Before ``convert_precision`` runs in mode fp16, the model as it is then (after the
preset's fusions) runs in ONNX Runtime on a few representative inputs
(fastopt.quant.activation_ranges: the inputs ``--verify`` uses, four seeds), and every op one of
whose float32 inputs or outputs reached ``LIMIT`` stays float32, with Casts at its edges (the pass's
text option ``precision_f32_values``), as onnxconverter-common's and ORT's float16 converters do
by hand with ``op_block_list`` / ``node_block_list``.

``LIMIT`` is a quarter of float16's maximum (16376): the inputs are a sample (random prompts of
16 tokens), and other prompts, longer contexts and other batches reach larger values; ops also
accumulate inside (a ReduceSum or MatMul sums many terms before it writes its output). A value
that came within a factor 4 (two binades) of overflowing is kept in float32. Weights are not
measured here: one past the range is clamped by the pass, which counts it (a warning).
A model ONNX Runtime cannot run on made-up inputs is converted without the check, and the
report (a warning line on the command line) says so.

With calibration text (``--calibration FILE|builtin|sampled``) the values are measured on that text
too: real token ids in sequences of 128 tokens (fastopt.quant.calibration's tokenization; a frequent
token that triggers a massive activation is drawn by random ids only by chance), then on the random
inputs, in one ONNX Runtime session (a RangeProbe riding calibration's runs). Each kept op reports
its maximum per source. The limit stays a quarter of fp16's range: on SmolLM2 a second text (4,096
tokens of this README) reached up to 1.9x the built-in text's maxima, and random ids up to 1.5x
(bench/results/fp16_ranges.md), so one text is no tighter a sample than random ids. Here a failure
to run is a ModelError (the text was asked for), not a skipped check."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fastopt import _C
from fastopt.forked import ChildDied, call_forked
from fastopt.quant.activation_ranges import (
    ActivationRanges,
    RangeProbe,
    collect_ranges,
    describe,
    representative_inputs,
)
from fastopt.quant.angles import angle_ops
from fastopt.quant.calibration import (
    SAMPLED,
    SEQUENCE,
    calibration_text,
    collect_importance,
)

FP16_MAX = 65504.0
LIMIT = FP16_MAX / 4
# Ops whose float inputs do not take part in their arithmetic (their outputs are not floats).
_SHAPE_OPS = {"Shape", "Size"}


@dataclass
class KeptOp:
    """An op kept float32 because one of its values reached the limit."""

    node: str
    op: str
    output: str  # the node's first output: how the pass finds it (node names need not be unique)
    value: str  # the input or output with the largest magnitude
    max_abs: float
    samples: int
    # max |x| of `value` per source of inputs ("calibration", "random") when there were several
    by_source: dict[str, float] = field(default_factory=dict)
    why: str = ""  # kept for another reason than its range (fastopt.quant.angles)

    @property
    def reason(self) -> str:
        if self.why:
            return self.why
        if len(self.by_source) < 2:
            return f"{self.value}: {describe(self.max_abs, self.samples)}"
        parts = [f"{m:.3g} on {_SOURCE_NAMES[s]}" for s, m in sorted(self.by_source.items())]
        return f"{self.value}: max |x| {', '.join(parts)}"


_SOURCE_NAMES = {"calibration": "calibration text", "random": "random inputs"}


@dataclass
class RangeCheck:
    """What the range check observed and kept; ``kept`` is empty when nothing came near."""

    limit: float
    samples: int
    observed: int  # float32 values measured
    seconds: float
    kept: list[KeptOp] = field(default_factory=list)
    skipped: str = ""  # why the model could not be measured (nothing kept then)
    # of `kept`, the ops convert_precision would have converted otherwise (the rest were float32
    # already: an exporter's fp32 island, a float32-only op); set once the pass ran
    newly_kept: int = 0
    # with calibration text: what the text was, its tokens, and input sets per source
    calibration: str = ""
    tokens: int = 0
    samples_by_source: dict[str, int] = field(default_factory=dict)
    # of `kept`, the ops computing a Sin/Cos angle (fastopt.quant.angles), listed last
    angles: int = 0
    measured: bool = True  # False: bf16, no range check (its `kept` are the angles alone)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, entry in zip(self.kept, d["kept"]):
            entry["reason"] = k.reason
        return d

    def option(self) -> str:
        """convert_precision's ``precision_f32_values``: the kept nodes' output names."""
        return "\n".join(k.output for k in self.kept)

    def inputs(self) -> str:
        """What the values were measured on."""
        if not self.calibration:
            return f"{self.samples} inputs"
        text = self.samples_by_source.get("calibration", 0)
        rand = self.samples_by_source.get("random", 0)
        return (
            f"{text} sequences of calibration text ({self.tokens} tokens, {self.calibration}) "
            f"and {rand} random inputs"
        )

    def summary(self) -> str:
        angles = (
            f"{self.angles} ops computing Sin/Cos angles (rotary positions) stay float32: an "
            "angle needs absolute precision"
        )
        if not self.measured:
            return angles
        if not self.angles:
            return self._range_summary()
        return f"{self._range_summary()}; {angles}"

    def _range_summary(self) -> str:
        if self.skipped:
            return (
                f"fp16 range check skipped: {self.skipped}; activations that overflow fp16 were "
                "not looked for (--verify checks the outputs)"
            )
        ranged = len(self.kept) - self.angles
        if not ranged:
            return (
                f"fp16 range check: no value reached {self.limit:.0f} "
                f"({self.observed} values over {self.inputs()}, {self.seconds:.2f} s)"
            )
        newly = f"{self.newly_kept} of them because of the check"
        if self.angles:  # (the pass counts the angle ops with them)
            newly = f"{self.newly_kept} of all kept because of the checks"
        return (
            f"fp16 range check: {ranged} ops whose values reach {self.limit:.0f} (a "
            f"quarter of fp16's max) stay float32, {newly} "
            f"(the others were float32 already) ({self.observed} values over {self.inputs()}, "
            f"{self.seconds:.2f} s)"
        )


def kept_ops(model: _C.Model, ranges: ActivationRanges, limit: float = LIMIT) -> list[KeptOp]:
    """The main graph's ops one of whose measured values reached ``limit``, in graph order."""
    kept = []
    for n in model.graph.nodes:
        if n.op_type in _SHAPE_OPS or n.op_type == "Constant" or not n.outputs:
            continue
        worst, where = 0.0, ""
        for v in [*n.inputs, *n.outputs]:
            if v is None:
                continue
            m = ranges.of(v.name)
            if m is not None and m > worst:
                worst, where = m, v.name
        first = next((o for o in n.outputs if o is not None and o.name), None)
        if worst >= limit and first is not None:
            by_source = {s: t.get(where, 0.0) for s, t in ranges.by_source.items()}
            kept.append(
                KeptOp(
                    n.name or first.name,
                    n.op_type,
                    first.name,
                    where,
                    worst,
                    ranges.samples,
                    by_source if len(by_source) > 1 else {},
                )
            )
    return kept


def check_ranges(
    model: _C.Model,
    limit: float = LIMIT,
    workdir: str = "",
    calibration: str | None = None,
    hf_config: str | None = None,
    sequence: int = SEQUENCE,
) -> RangeCheck:
    """Runs the range pass on ``model`` (unchanged) and decides which ops stay float32. With
    ``calibration`` (a text file or "builtin") the values are measured on that text (tokenized
    as fastopt.quant.calibration does, ``sequence`` tokens a run) and on the random inputs, in
    one ONNX Runtime session; a failure is then a ModelError, not a skipped check."""
    start = time.perf_counter()
    if calibration:
        return _calibrated_check(model, limit, workdir, calibration, hf_config, sequence, start)
    try:
        # (in a child: ORT dies on some graphs fastopt keeps, e.g. SIGFPE on INT_MIN / -1)
        ranges = call_forked(collect_ranges, model, None, None, workdir)
    except (_C.ModelError, ChildDied) as e:
        # A model ORT cannot run on made-up inputs cannot be measured; the conversion goes on
        # (the pass has its own refusals) and the report says what was not checked.
        return RangeCheck(limit, 0, 0, time.perf_counter() - start, skipped=str(e))
    kept = kept_ops(model, ranges, limit)
    return RangeCheck(limit, ranges.samples, len(ranges.max_abs), time.perf_counter() - start, kept)


def _calibrated_check(
    model: _C.Model,
    limit: float,
    workdir: str,
    calibration: str,
    hf_config: str | None,
    sequence: int,
    start: float,
) -> RangeCheck:
    if calibration != SAMPLED:
        calibration_text(calibration)  # an unreadable or empty file: its error before any run
    try:
        ranges, tokens, source = call_forked(
            _calibrated_ranges, model, calibration, hf_config, workdir, sequence
        )
    except ChildDied as e:
        raise _C.ModelError(f"calibration: {e}") from e
    check = RangeCheck(
        limit,
        ranges.samples,
        len(ranges.max_abs),
        time.perf_counter() - start,
        kept_ops(model, ranges, limit),
        calibration=source,
        tokens=tokens,
        samples_by_source=dict(ranges.samples_by_source),
    )
    return check


def _calibrated_ranges(
    model: _C.Model, calibration: str, hf_config: str | None, workdir: str, sequence: int
) -> tuple[ActivationRanges, int, str]:
    """(in the child) max |x| per value on the calibration text, then the random inputs."""
    probe = RangeProbe(model, representative_inputs(model))
    imp = collect_importance(
        model,
        calibration,
        hf_config,
        sequence=sequence,
        workdir=workdir,
        probes=[probe],
        importance=False,
        run_tokens=1,  # one sequence a run: the range check's peak memory stays a sequence's
    )
    probe.ranges.seconds = imp.seconds
    return probe.ranges, imp.tokens, imp.source


def with_angles(check: RangeCheck | None, model: _C.Model) -> RangeCheck | None:
    """``check`` (None: a bf16 record) with the ops computing Sin/Cos angles added to ``kept``
    (fastopt.quant.angles); ``check`` itself where there are none."""
    from fastopt.quant.activation_ranges import float32_value_names

    found = angle_ops(model, set(float32_value_names(model)))
    if not found:
        return check
    if check is None:
        check = RangeCheck(0.0, 0, 0, 0.0, measured=False)
    have = {k.output for k in check.kept}
    why = "computes a Sin/Cos angle (absolute precision; fastopt.quant.angles)"
    added = [
        KeptOp(node, op, output, output, 0.0, 0, why=why)
        for node, op, output in found
        if output not in have
    ]
    check.kept += added
    check.angles = len(added)
    return check
