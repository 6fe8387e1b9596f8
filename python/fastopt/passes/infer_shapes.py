"""``infer_shapes``: value types from the native shape analysis, onnx's where it has no rule
(see ``fastopt.shapes``).

Options: ``strict_shapes`` (bool, default False) runs onnx's inference too and raises on its
errors; ``data_prop`` (bool, default True; False: onnx's inference without shape values);
``shape_engine`` (0 auto, 1 native only, 2 onnx only). Counters: ``types_refined``, and
``engine:native`` / ``engine:onnx`` (which ran), ``native_unknown:<op>`` (nodes the native
analysis has no rule for, the reason onnx ran).
"""

from __future__ import annotations

from fastopt.registry import PassContext, register_pass
from fastopt.shapes import AUTO, run_inference


@register_pass(
    "infer_shapes",
    "value types from the C++ shape analysis (onnx's for ops it does not know), in place",
    tags=("analysis",),
)
def infer_shapes(ctx: PassContext) -> int:
    run = run_inference(
        ctx.model,
        strict=bool(ctx.options.get("strict_shapes", False)),
        data_prop=bool(ctx.options.get("data_prop", True)),
        engine=int(ctx.options.get("shape_engine", AUTO)),  # type: ignore[call-overload]
    )
    ctx.shapes_inferred = True
    counters = ctx.counters
    if run.changed:
        counters["types_refined"] = counters.get("types_refined", 0) + run.changed
    for engine in run.engines:
        counters[f"engine:{engine}"] = counters.get(f"engine:{engine}", 0) + 1
    for op, n in run.unknown_ops.items():
        counters[f"native_unknown:{op}"] = counters.get(f"native_unknown:{op}", 0) + n
    return 0  # an analysis: the graph is unchanged (what changed is in the counter)
