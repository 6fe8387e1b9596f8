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
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fastopt import _C
from fastopt.forked import ChildDied, call_forked
from fastopt.quant.activation_ranges import ActivationRanges, collect_ranges, describe

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

    @property
    def reason(self) -> str:
        return f"{self.value}: {describe(self.max_abs, self.samples)}"


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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, entry in zip(self.kept, d["kept"]):
            entry["reason"] = k.reason
        return d

    def option(self) -> str:
        """convert_precision's ``precision_f32_values``: the kept nodes' output names."""
        return "\n".join(k.output for k in self.kept)

    def summary(self) -> str:
        if self.skipped:
            return (
                f"fp16 range check skipped: {self.skipped}; activations that overflow fp16 were "
                "not looked for (--verify checks the outputs)"
            )
        if not self.kept:
            return (
                f"fp16 range check: no value reached {self.limit:.0f} "
                f"({self.observed} values over {self.samples} inputs, {self.seconds:.2f} s)"
            )
        return (
            f"fp16 range check: {len(self.kept)} ops whose values reach {self.limit:.0f} (a "
            f"quarter of fp16's max) stay float32, {self.newly_kept} of them because of the check "
            f"(the others were float32 already) ({self.observed} values over {self.samples} "
            f"inputs, {self.seconds:.2f} s)"
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
            kept.append(
                KeptOp(n.name or first.name, n.op_type, first.name, where, worst, ranges.samples)
            )
    return kept


def check_ranges(model: _C.Model, limit: float = LIMIT, workdir: str = "") -> RangeCheck:
    """Runs the range pass on ``model`` (unchanged) and decides which ops stay float32."""
    start = time.perf_counter()
    try:
        # (in a child: ORT dies on some graphs fastopt keeps, e.g. SIGFPE on INT_MIN / -1)
        ranges = call_forked(collect_ranges, model, None, None, workdir)
    except (_C.ModelError, ChildDied) as e:
        # A model ORT cannot run on made-up inputs cannot be measured; the conversion goes on
        # (the pass has its own refusals) and the report says what was not checked.
        return RangeCheck(limit, 0, 0, time.perf_counter() - start, skipped=str(e))
    kept = kept_ops(model, ranges, limit)
    return RangeCheck(limit, ranges.samples, len(ranges.max_abs), time.perf_counter() - start, kept)
