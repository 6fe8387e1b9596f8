"""``convert_version``: converts the model to another opset of the default domain.

Built on ``onnx.version_converter`` run over the model's skeleton (no weights through protobuf);
``fastopt._C.load_skeleton`` then binds the converted graph to the original weights without
copying them. The target is ``options["opset"]``; without it the pass does nothing.
"""

from __future__ import annotations

from fastopt import _C
from fastopt.errors import OptionError, foreign_errors
from fastopt.pipeline.registry import PassContext, default_opset, register_pass


@register_pass(
    "convert_version",
    "convert to the opset options['opset'] (onnx.version_converter on the skeleton)",
    tags=("conversion",),
)
def convert_version(ctx: PassContext) -> int:
    target = ctx.options.get("opset")
    if target is None:
        return 0
    if not isinstance(target, int) or isinstance(target, bool) or target < 1:
        raise OptionError(f"options['opset'] must be an opset number, not {target!r}")
    if default_opset(ctx.model) == target:
        return 0
    return _convert(ctx, target)


def _convert(ctx: PassContext, target: int) -> int:
    # Imported here: `import fastopt` (the CLI, the pytest plugin) should not pay for onnx.
    import onnx.version_converter

    skeleton = ctx.model.skeleton()
    # The converter raises RuntimeError / ValueError / ConvertError; protobuf a DecodeError for a
    # model past its nesting limit.
    with foreign_errors(f"version conversion to opset {target} (onnx)"):
        proto = onnx.ModelProto.FromString(skeleton)
        converted = onnx.version_converter.convert_version(proto, target).SerializeToString()
    ctx.model = _C.load_skeleton(converted, ctx.model)
    ctx.counters["converted"] = ctx.counters.get("converted", 0) + 1
    return 1


# The opset of the standard fused ops target "onnx" emits: RMSNormalization, RotaryEmbedding,
# Attention.
FUSED_OPS_OPSET = _C.FUSED_OPS_OPSET


@register_pass(
    "target_opset",
    f"target onnx: convert to opset {FUSED_OPS_OPSET} (the standard fused ops) when older; "
    "target ort: nothing",
    tags=("conversion", "llm"),
)
def target_opset(ctx: PassContext) -> int:
    if ctx.target != "onnx" or default_opset(ctx.model) >= FUSED_OPS_OPSET:
        return 0
    return _convert(ctx, FUSED_OPS_OPSET)
