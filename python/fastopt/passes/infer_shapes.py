"""``infer_shapes``: value types from the native shape analysis, onnx's where it has no rule
(see ``fastopt.pipeline.shapes``).

Options: ``strict_shapes`` (bool, default False) runs onnx's inference too and raises on its
errors; ``data_prop`` (bool, default True; False: onnx's inference without shape values);
``shape_engine`` (0 auto, 1 native only, 2 onnx only). Counters: ``types_refined``, and
``engine:native`` / ``engine:onnx`` (which ran), ``native_nodes`` / ``native_bodies`` (nodes
the native analysis gave facts to, If/Loop/Scan bodies included), ``native_unknown:<op>``
(nodes the native analysis has no rule for, the reason onnx ran).
"""

from __future__ import annotations

from fastopt.pipeline.registry import VALUE_TYPES, PassContext, register_pass
from fastopt.pipeline.shapes import AUTO, run_inference


@register_pass(
    "infer_shapes",
    "value types from the C++ shape analysis (onnx's for ops it does not know), in place",
    tags=("analysis",),
    ensures_facts=(VALUE_TYPES,),
)
def infer_shapes(ctx: PassContext) -> int:
    run = run_inference(
        ctx.model,
        strict=bool(ctx.options.get("strict_shapes", False)),
        data_prop=bool(ctx.options.get("data_prop", True)),
        engine=int(ctx.options.get("shape_engine", AUTO)),  # type: ignore[call-overload]
    )
    ctx.shapes_inferred = True
    ctx.shape_runs.append(("infer_shapes", run))
    for key, n in run.counters().items():
        ctx.counters[key] = ctx.counters.get(key, 0) + n
    return 0  # an analysis: the graph is unchanged (what changed is in the counter)
