"""Loading models: thin wrappers over the C++ reader (saving is ``Model.save``)."""

from __future__ import annotations

import hashlib
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


def check_output_path(input_path: PathLike, output_path: PathLike) -> None:
    """Raises :class:`fastopt.ModelError` when ``output_path`` is the input model file itself,
    compared by identity (device and inode, after resolving links), not by spelling. A quick
    check before optimizing; ``Model.save`` makes the full one (every external data file too)."""
    try:
        same = os.path.samefile(input_path, output_path)
    except OSError:
        return  # the output does not exist yet
    if same:
        raise _C.ModelError(
            f"output '{os.fspath(output_path)}' is the input model file "
            f"'{os.fspath(input_path)}': the output path must differ from the input (it is "
            "never modified)"
        )


@entry_point("load")
def load_bytes(data: bytes, base_dir: PathLike | None = None) -> _C.Model:
    """Reads a serialized ModelProto held in memory; external data resolves against base_dir."""
    return _C.load_bytes(bytes(data), os.fspath(base_dir) if base_dir is not None else "")


def from_onnx(proto: onnx.ModelProto, base_dir: PathLike | None = None) -> _C.Model:
    """Converts an ``onnx.ModelProto`` (a small model) into a fastopt Model."""
    with foreign_errors("from_onnx (protobuf serialization)"):
        data = proto.SerializeToString()
    return load_bytes(data, base_dir)


def verify_checksums(model: _C.Model) -> int:
    """Verifies the ``checksum`` keys of the model's external data, which load does not (it would
    read every weight). As ONNX's external data spec defines it, a checksum is the SHA-1 hex
    digest of the whole data file named by ``location``; each file is read once. Returns the
    number of tensors checked; raises :class:`fastopt.ModelError` naming the first mismatch."""
    digests: dict[str, str] = {}
    checked = 0
    for tensor, path, want in model.external_checksums():
        if path not in digests:
            h = hashlib.sha1(usedforsecurity=False)
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            digests[path] = h.hexdigest()
        if digests[path] != want.strip().lower():
            raise _C.ModelError(
                f"tensor '{tensor}': external data file '{path}' has SHA-1 {digests[path]}, "
                f"but its checksum key says {want!r} (the file changed or is corrupt)"
            )
        checked += 1
    return checked
