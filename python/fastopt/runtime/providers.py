"""ONNX Runtime execution providers: short names, and where a session ran each node.

Short names (case-insensitive) stand for ORT's provider names: ``cpu`` is
``CPUExecutionProvider``, ``cuda`` ``CUDAExecutionProvider``, ``tensorrt`` (or ``trt``)
``TensorrtExecutionProvider``, ``rocm``, ``migraphx``, ``dml`` (or ``directml``), ``openvino``,
``coreml``, ``qnn``, ``webgpu``, ``xnnpack``, ``nnapi`` and ``azure`` likewise. Full names pass
through unchanged, and so do ``(name, options)`` pairs.

Node placement comes from ORT's profiler: a profiled session writes one "Node" event per kernel
run, whose ``args`` name the op type (``op_name``) and the provider that ran it (``provider``);
the event's name is the node's name followed by ``_kernel_time``. A node asked to run on an
accelerator that ORT gave to ``CPUExecutionProvider`` is a *fallback*: the accelerator has no
kernel for it (or not for its types), and its inputs and outputs cross the bus. The
``MemcpyToHost`` / ``MemcpyFromHost`` nodes ORT inserts around such nodes are counted apart as
transfers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CPU = "CPUExecutionProvider"

SHORT_NAMES = {
    "cpu": CPU,
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "nnapi": "NnapiExecutionProvider",
    "azure": "AzureExecutionProvider",
}
# The short name shown for a full name (the first spelling above wins).
_SHORT = {full: short for short, full in reversed(list(SHORT_NAMES.items()))}

# Ops ORT inserts to move tensors between host and device memory.
TRANSFER_OPS = ("MemcpyToHost", "MemcpyFromHost")
_KERNEL_SUFFIX = "_kernel_time"


def provider_name(entry: Any) -> str:
    """The ORT name of a provider entry: a name or a ``(name, options)`` pair, short or full."""
    name = entry[0] if isinstance(entry, (tuple, list)) else entry
    if not isinstance(name, str):
        raise TypeError(f"a provider is a name or a (name, options) pair, not {entry!r}")
    return SHORT_NAMES.get(name.lower(), name)


def resolve(entry: Any) -> Any:
    """`entry` with its short name replaced by ORT's name; options are kept."""
    if isinstance(entry, (tuple, list)):
        if len(entry) != 2 or not isinstance(entry[1], Mapping):
            raise TypeError(f"a provider is a name or a (name, options) pair, not {entry!r}")
        return (provider_name(entry), dict(entry[1]))
    return provider_name(entry)


def short_name(name: str) -> str:
    """``cuda`` for ``CUDAExecutionProvider``; an unknown name unchanged."""
    return _SHORT.get(name, name)


def labels(entries: Sequence[Any]) -> list[str]:
    """Display names for a list of provider entries, unique: a repeated provider (e.g. CPU with
    two sets of options) gets ``#2``, ``#3``."""
    out: list[str] = []
    for entry in entries:
        base = short_name(provider_name(entry))
        label, n = base, 1
        while label in out:
            n += 1
            label = f"{base}#{n}"
        out.append(label)
    return out


def is_accelerator(name: str) -> bool:
    """Whether a provider runs kernels of its own, other than ORT's CPU ones (whose float
    results may then legitimately differ more: other accumulation orders, TF32, fused
    kernels)."""
    return provider_name(name) != CPU


@dataclass
class Placement:
    """Where one session ran its nodes (each node counted once, however often it ran)."""

    provider: str  # the provider asked for
    nodes: dict[str, int] = field(default_factory=dict)  # provider -> nodes it ran
    # op type -> names of the nodes ORT ran on CPU although `provider` was asked for
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)  # Memcpy op type -> nodes

    @property
    def fallback_count(self) -> int:
        return sum(len(v) for v in self.fallbacks.values())

    def fallback_text(self) -> str:
        """``Op n`` per op type, most frequent first."""
        items = sorted(self.fallbacks.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        return ", ".join(f"{op} {len(names)}" for op, names in items)


def placement_from_events(events: Iterable[Mapping[str, Any]], requested: str) -> Placement:
    """The placement recorded in the events of an ORT profile (its JSON list).

    requested: the provider the session was asked to use first (short or full name).
    """
    requested = provider_name(requested)
    out = Placement(requested)
    seen: set[tuple[str, str]] = set()
    for e in events:
        if e.get("cat") != "Node":
            continue
        args = e.get("args") or {}
        op, provider = args.get("op_name"), args.get("provider")
        name = str(e.get("name", ""))
        if not op or not provider or not name.endswith(_KERNEL_SUFFIX):
            continue  # fence events and others without a kernel
        node = name[: -len(_KERNEL_SUFFIX)]
        if (node, op) in seen:
            continue
        seen.add((node, op))
        if op in TRANSFER_OPS:
            out.transfers[op] = out.transfers.get(op, 0) + 1
            continue
        out.nodes[provider] = out.nodes.get(provider, 0) + 1
        if provider == CPU and requested != CPU:
            out.fallbacks.setdefault(op, []).append(node)
    return out


def read_profile(path: str, requested: str) -> Placement:
    """The placement in the profile ORT wrote at `path`; the file is deleted (profiles of large
    models are large)."""
    try:
        with open(path) as f:
            events = json.load(f)
    finally:
        os.remove(path)
    return placement_from_events(events, requested)
