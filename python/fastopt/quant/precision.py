"""Which standard ops have no float16 / bfloat16 form at a model's opset, from onnx's schemas.

convert_precision (C++) keeps those ops in float32 with Casts around them; it takes the list as
the text option ``precision_f32_ops``. ONNX Runtime's own kernels are a narrower set than the
schemas for bfloat16 on CPU (tests/ort_behaviour/test_bf16_cpu_kernels.py): that is not decided
here.
"""

from __future__ import annotations

from collections.abc import Iterable

_TYPE = {"fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}


def f32_only_ops(op_types: Iterable[str], opset: int, mode: str) -> list[str]:
    """Default-domain op types among ``op_types`` whose schema at ``opset`` accepts float32 for
    some type parameter and the type of ``mode`` (fp16 | bf16) for none."""
    import onnx.defs

    want = _TYPE[mode]
    out = []
    for op in sorted(set(op_types)):
        try:
            schema = onnx.defs.get_schema(op, opset, "")
        except onnx.defs.SchemaError:
            continue  # not a standard op (or not at this opset): the C++ tables decide
        # Some parameter takes float32 and none takes the new type (a parameter without it
        # beside one with it is a stash type, as LayerNormalization's U, which stays float32).
        floats = [set(c.allowed_type_strs) for c in schema.type_constraints]
        if any("tensor(float)" in a for a in floats) and not any(want in a for a in floats):
            out.append(op)
    return out


def precision_options(model: object, mode: str) -> dict[str, str]:
    """The text options convert_precision needs for ``model`` (a fastopt Model)."""
    ops = [k.split("::")[-1] for k in model.op_counts()]  # type: ignore[attr-defined]
    opset = int(model.opset_imports.get("", 0) or model.opset_imports.get("ai.onnx", 0))  # type: ignore[attr-defined]
    return {"precision_f32_ops": ",".join(f32_only_ops(ops, opset, mode))} if opset else {}
