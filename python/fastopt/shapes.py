"""Shape inference as a step: onnx's shape inference on the model's skeleton, applied in place.

The skeleton (``Model.skeleton``) is the model without its weights (payloads of 1 KiB or more
become placeholders), so inference runs on a few MB whatever the model weighs: no 2 GB limit, no
weights through protobuf. Small constants stay inline, so data propagation still sees the shape
tensors it needs.
"""

from __future__ import annotations

from fastopt import _C
from fastopt.errors import entry_point, foreign_errors

# What an onnx refusal is reported as ("shape inference (onnx): InferenceError: ...").
STAGE = "shape inference (onnx)"


@entry_point(STAGE)
def infer_shapes(model: _C.Model, *, strict: bool = False, data_prop: bool = True) -> None:
    """Infers value types with onnx and applies them to ``model`` in place.

    Values without a type get the inferred one; values whose inferred type is more specific
    (known element type, a shape, numbers where dims were unknown or symbolic) are refined; graph
    inputs keep their declared types. Refined values get value_info entries, so the types are
    saved with the model. ``strict`` makes inference errors raise instead of leaving the node's
    outputs untyped; onnx's refusals (inference errors, a model onnx cannot parse or validate:
    missing opset imports, recursive or duplicate functions, protobuf's nesting limit) raise
    :class:`fastopt.RejectedModelError` with onnx's exception as ``__cause__``;
    ``data_prop`` propagates constant shape values (Shape -> Gather -> Concat -> Reshape).
    """
    apply_inferred_types(model, strict=strict, data_prop=data_prop)


def apply_inferred_types(model: _C.Model, *, strict: bool = False, data_prop: bool = True) -> int:
    """``infer_shapes``, returning the number of values whose type changed."""
    import onnx.shape_inference  # here: `import fastopt` should not pay for onnx

    skeleton = model.skeleton()
    with foreign_errors(STAGE):
        inferred = onnx.shape_inference.infer_shapes(
            skeleton, check_type=False, strict_mode=strict, data_prop=data_prop
        ).SerializeToString()
    return model.apply_types(inferred)
