"""Tensor bytes -> numpy arrays, without copying where the bytes allow it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

from fastopt._lazy import lazy_module
from fastopt.errors import UnsupportedModelError

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

if TYPE_CHECKING:
    from fastopt._C import Tensor

# numpy type names (not the types: numpy is imported on first use).
_NUMPY_TYPES: dict[int, str] = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    14: "complex64",
    15: "complex128",
}
# Types numpy lacks come from ml_dtypes (a dependency of onnx).
_ML_DTYPES_NAMES = {
    16: "bfloat16",
    17: "float8_e4m3fn",
    18: "float8_e4m3fnuz",
    19: "float8_e5m2",
    20: "float8_e5m2fnuz",
    24: "float8_e8m0fnu",
}
_SUB_BYTE = {
    21: ("uint4", 4),
    22: ("int4", 4),
    23: ("float4_e2m1fn", 4),
    25: ("uint2", 2),
    26: ("int2", 2),
}
_STRING = 8


def _ml_dtype(name: str) -> Any:
    import ml_dtypes

    return getattr(ml_dtypes, name)


def numpy_dtype(onnx_type: int) -> Any:
    """The numpy dtype of an ONNX element type."""
    if onnx_type in _NUMPY_TYPES:
        return np.dtype(_NUMPY_TYPES[onnx_type])
    if onnx_type in _ML_DTYPES_NAMES:
        return np.dtype(_ml_dtype(_ML_DTYPES_NAMES[onnx_type]))
    if onnx_type in _SUB_BYTE:
        return np.dtype(_ml_dtype(_SUB_BYTE[onnx_type][0]))
    if onnx_type == _STRING:
        return np.dtype(object)
    raise UnsupportedModelError(f"unsupported ONNX element type {onnx_type}")


def tensor_to_numpy(tensor: Tensor) -> np.ndarray:
    shape = tuple(tensor.shape)
    dtype = tensor.dtype
    if dtype == _STRING:
        # As onnx.numpy_helper does: UTF-8 text becomes str; other bytes stay bytes.
        items: list[object] = []
        for raw in tensor.strings():
            try:
                items.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                items.append(raw)
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    data = np.frombuffer(cast(bytes, tensor.raw_bytes()), dtype=np.uint8)
    if dtype in _SUB_BYTE:
        # Packed low nibble first (or 2-bit groups low bits first); unpacking copies.
        name, bits = _SUB_BYTE[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        per_byte = 8 // bits
        mask = (1 << bits) - 1
        parts = [(data >> (bits * i)) & mask for i in range(per_byte)]
        codes = np.stack(parts, axis=-1).reshape(-1)[:count]
        return codes.astype(np.uint8).view(_ml_dtype(name)).reshape(shape)
    return data.view(numpy_dtype(dtype)).reshape(shape)


@functools.cache
def _onnx_types() -> dict[Any, int]:
    return {np.dtype(v): k for k, v in _NUMPY_TYPES.items()}


def onnx_dtype(dtype: Any) -> int:
    """The ONNX element type of a numpy dtype."""
    dt = np.dtype(dtype)
    onnx_types = _onnx_types()
    if dt in onnx_types:
        return onnx_types[dt]
    for code, name in _ML_DTYPES_NAMES.items():
        try:
            if dt == np.dtype(_ml_dtype(name)):
                return code
        except (ImportError, AttributeError):
            break
    raise ValueError(f"no ONNX element type for numpy dtype {dt}")


def tensor_from_numpy(array: Any) -> Tensor:
    """A new tensor holding a copy of ``array``'s elements."""
    from fastopt import _C

    arr = np.ascontiguousarray(array)
    return _C.make_tensor(onnx_dtype(arr.dtype), list(arr.shape), arr.tobytes())
