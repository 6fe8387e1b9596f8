"""Loading models: thin wrappers over the C++ reader (saving is ``Model.save``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Union

from fastopt import _C
from fastopt.errors import entry_point, foreign_errors

if TYPE_CHECKING:
    import onnx

PathLike = Union[str, "os.PathLike[str]"]


@entry_point("load")
def load(path: PathLike) -> _C.Model:
    """Reads an ONNX model. The file is memory-mapped: weights are never copied into memory.

    External data is resolved against the model's folder; locations outside it are refused.
    Raises :class:`fastopt.ModelError` naming the problem for any malformed input.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise _C.ModelError(f"'{path}' is a directory, not an ONNX model file")
    return _C.load(path)


@entry_point("load")
def load_bytes(data: bytes, base_dir: PathLike | None = None) -> _C.Model:
    """Reads a serialized ModelProto held in memory; external data resolves against base_dir."""
    return _C.load_bytes(bytes(data), os.fspath(base_dir) if base_dir is not None else "")


def from_onnx(proto: onnx.ModelProto, base_dir: PathLike | None = None) -> _C.Model:
    """Converts an ``onnx.ModelProto`` (a small model) into a fastopt Model."""
    with foreign_errors("from_onnx (protobuf serialization)"):
        data = proto.SerializeToString()
    return load_bytes(data, base_dir)
