"""``infer_shapes``: value types from onnx shape inference (see ``fastopt.shapes``).

Options: ``strict_shapes`` (bool, default False) raises on inference errors; ``data_prop``
(bool, default True) propagates constant shape values.
"""

from __future__ import annotations

from fastopt.registry import PassContext, register_pass
from fastopt.shapes import apply_inferred_types


@register_pass(
    "infer_shapes",
    "value types from onnx shape inference on the skeleton, applied in place",
    tags=("analysis",),
)
def infer_shapes(ctx: PassContext) -> int:
    changed = apply_inferred_types(
        ctx.model,
        strict=bool(ctx.options.get("strict_shapes", False)),
        data_prop=bool(ctx.options.get("data_prop", True)),
    )
    ctx.shapes_inferred = True
    ctx.counters["types_refined"] = ctx.counters.get("types_refined", 0) + changed
    return 0  # an analysis: the graph is unchanged (what changed is in the counter)
