"""The pass manager: runs a list of passes on one PassContext and reports what each did.

optimize() (the facade) checks the arguments and builds the list and the context; this runs it.
An idempotent pass is not rerun while nothing has been rewritten since its last run, a pass that
does not apply at the model's opset is skipped with the reason, and internal ops left by a list
that fused attention without lowering it are lowered by the pass that establishes the fact
"no internal ops".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from fastopt import _C
from fastopt.pipeline.registry import (
    NO_INTERNAL_OPS,
    PassContext,
    default_opset,
    finishing_pass,
    get_pass,
)

# Called before each pass with (index, count, pass name); for progress displays.
ProgressFn = Callable[[int, int, str], None]
# Called by long passes (quantization) with (done, total, what): source bytes quantized so far.
WorkProgressFn = Callable[[int, int, str], None]
# (pass name, model, the pass's error) -> a clearer error to raise instead, or None.
FailureFn = Callable[[str, _C.Model, _C.ModelError], Optional[Exception]]


@dataclass
class PassReport:
    name: str
    rewrites: int
    seconds: float
    nodes_after: int
    counters: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None  # why the pass did not run
    # Not rerun: the pass is idempotent and no pass changed the model since it last ran.
    unchanged: bool = False


def run_passes(
    names: Sequence[str],
    ctx: PassContext,
    progress: ProgressFn | None = None,
    explain_failure: FailureFn | None = None,
) -> list[PassReport]:
    """Run `names` in order on `ctx`, then lower any internal op left; one report per pass run."""
    reports: list[PassReport] = []
    # An idempotent pass is not rerun while the model is as it left it: `changes` counts the
    # passes that rewrote something, `clean_at[name]` is that count when `name` last ran.
    changes = 0
    clean_at: dict[str, int] = {}
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        spec = get_pass(name)
        opset = default_opset(ctx.model)
        if not spec.applies_to(opset):
            reports.append(
                PassReport(name, 0, 0.0, ctx.model.node_count(), skipped=f"opset {opset}")
            )
            continue
        if clean_at.get(name) == changes:
            reports.append(PassReport(name, 0, 0.0, ctx.model.node_count(), unchanged=True))
            continue
        try:
            reports.append(run_pass(name, ctx))
        except _C.ModelError as e:
            clearer = explain_failure(name, ctx.model, e) if explain_failure else None
            if clearer is not None:
                raise clearer from e
            raise
        changes += reports[-1].rewrites > 0
        if spec.idempotent:
            clean_at[name] = changes
    if any(op.startswith(_INTERNAL_DOMAIN + "::") for op in ctx.model.op_counts()):
        # A pass list that fused attention without lowering it: internal ops never leave.
        reports.append(run_pass(finishing_pass(NO_INTERNAL_OPS), ctx))
        left = [op for op in ctx.model.op_counts() if op.startswith(_INTERNAL_DOMAIN + "::")]
        if left:  # a bug: no runtime knows these ops, so no output may hold one
            raise _C.ModelError(
                f"internal error: {', '.join(left)} could not be lowered (see --explain "
                "lower_attention); nothing was written"
            )
    return reports


def run_pass(name: str, ctx: PassContext) -> PassReport:
    # The pass counts into a fresh dict, merged afterwards: its own counters without comparing
    # every counter of the run before and after each pass.
    spec = get_pass(name)
    totals, ctx.counters = ctx.counters, {}
    try:
        t0 = time.perf_counter()
        rewrites = spec.run(ctx)
        seconds = time.perf_counter() - t0
    finally:
        own, ctx.counters = ctx.counters, totals
        for k, v in own.items():
            totals[k] = totals.get(k, 0) + v
    return PassReport(
        name, rewrites, seconds, ctx.model.node_count(), {k: v for k, v in own.items() if v}
    )


# Ops that exist only between two passes (see csrc/passes/attention/internal_op.h).
_INTERNAL_DOMAIN = _C.INTERNAL_DOMAIN
