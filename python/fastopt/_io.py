"""Loading models: thin wrappers over the C++ reader (saving is ``Model.save``); small side files
written atomically."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import TYPE_CHECKING, Union

from fastopt import _C
from fastopt.errors import entry_point, foreign_errors

if TYPE_CHECKING:
    import onnx

PathLike = Union[str, "os.PathLike[str]"]


@entry_point("load")
def load(path: PathLike) -> _C.Model:
    """Read an ONNX model. The file is memory-mapped: weights are never copied into memory.

    Parameters
    ----------
    path : str or os.PathLike
        The .onnx file. External data is resolved against its folder; locations outside it are
        refused.

    Returns
    -------
    fastopt.Model
        The model; its weights stay views of the file, which must not change while it is used.

    Raises
    ------
    fastopt.ModelError
        The file is missing, not an ONNX model, or malformed (the message names the problem).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise _C.ModelError(f"'{path}' is a directory, not an ONNX model file")
    try:
        return _C.load(path)
    except _C.ModelError as e:
        # A file that fails at its very first field is some other kind of file: say so
        # rather than which protobuf field its first byte would be.
        why = _not_a_model(path) if str(e).startswith("corrupt ModelProto") else ""
        if why:
            raise _C.ModelError(f"'{path}' is not an ONNX model: {why}") from e
        raise


# ModelProto's field numbers (onnx.proto).
_MODEL_FIELDS = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 14, 20, 25, 26})


def _not_a_model(path: str) -> str:
    """Why the file cannot be an ONNX model when its first bytes are no ModelProto field (an
    unknown field number, or a wire type protobuf no longer writes or never had: text, an image,
    an archive); "" when they could be one (then it is a corrupt model)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return ""
    tag = shift = 0
    complete = False
    for byte in head[:5]:  # the first field's tag, a varint
        tag |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            complete = True
            break
    if not complete or (tag >> 3 in _MODEL_FIELDS and tag & 7 in (0, 1, 2, 5)):
        return ""  # a broken tag, or a ModelProto field of the wrong type: a corrupt model
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:  # text cut inside a character at the end is still text
        text = head[: e.start].decode("utf-8") if e.start >= len(head) - 3 else "\0"
    if text and all(c.isprintable() or c in "\t\r\n" for c in text):
        first = text.strip().splitlines()[0] if text.strip() else ""
        return f"it starts with text ({first[:40]!r}); an ONNX model is a binary protobuf file"
    return (
        f"its first bytes ({head[:8].hex(' ')}) are not a ModelProto field; an ONNX model is "
        "a binary protobuf file"
    )


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
    """Read a serialized ModelProto held in memory.

    Parameters
    ----------
    data : bytes
        The ModelProto's bytes.
    base_dir : str or os.PathLike, optional
        The folder external data locations are relative to.

    Returns
    -------
    fastopt.Model

    Raises
    ------
    fastopt.ModelError
        The bytes are not a well-formed model.
    """
    return _C.load_bytes(bytes(data), os.fspath(base_dir) if base_dir is not None else "")


def from_onnx(proto: onnx.ModelProto, base_dir: PathLike | None = None) -> _C.Model:
    """Convert an ``onnx.ModelProto`` (a small model: protobuf's limit is 2 GB) to a Model.

    Parameters
    ----------
    proto : onnx.ModelProto
    base_dir : str or os.PathLike, optional
        The folder external data locations are relative to.

    Returns
    -------
    fastopt.Model

    Raises
    ------
    fastopt.ModelError
        protobuf cannot serialize the proto, or the model is malformed.
    """
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


def write_atomically(path: PathLike, data: bytes, prefix: str) -> None:
    """Writes ``data`` to ``path`` through a temporary file (``prefix``) in the same folder,
    renamed over it: a reader sees the old file or the whole new one, never a part."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
