"""The oldest ONNX Runtime that runs what fastopt writes, checked when fastopt is imported.

fastopt's outputs use IR version 10, opset 20 and 23 (target "onnx") and contrib ops whose
float32 kernels are recent (GroupQueryAttention on CPU in float32): an older ORT refuses most of
them at load. Measured with scripts/ort_floor.py (every preset x target, KV-cache and quantized
output of six fixtures, loaded and run once under each release; the table is in
bench/results/ort_floor.md). pyproject.toml declares the same floor; this check refuses the
older ORT that pip was told to ignore, or that another package pinned, with one clear line
instead of an INVALID_GRAPH at the first session.

The installed version is read from the package metadata (milliseconds), not by importing
onnxruntime (a second or more): ``import fastopt`` stays fast.
"""

from __future__ import annotations

import re
from importlib import metadata

ORT_FLOOR = (1, 32, 0)
# The names ORT's builds are published under; all install the module `onnxruntime`.
_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-migraphx",
    "onnxruntime-training",
)


class OnnxRuntimeTooOldError(ImportError):
    """The installed onnxruntime is older than fastopt's floor (:data:`ORT_FLOOR`)."""


def _release(version: str) -> tuple[int, ...]:
    """(1, 17, 3) from "1.17.3", "1.20.0.dev20240101", "1.19.2+cu118", "1.22.0rc1"."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:  # "0rc1": the release number ends here
            break
    return tuple(parts)


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed ONNX Runtime, or None when no known
    distribution is installed (a build from source, or none)."""
    for name in _DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_floor() -> None:
    """Raises OnnxRuntimeTooOldError when the installed onnxruntime is older than the floor."""
    found = installed()
    if found is None:
        return
    name, version = found
    release = _release(version)
    if release and release < ORT_FLOOR:
        floor = ".".join(map(str, ORT_FLOOR))
        raise OnnxRuntimeTooOldError(
            f"fastopt needs onnxruntime >= {floor}, but {name} {version} is installed: older "
            "releases cannot load the models fastopt writes (IR 10, opset 23, float32 "
            f"GroupQueryAttention). Upgrade it: pip install -U '{name}>={floor}'"
        )
