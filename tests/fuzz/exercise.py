"""Touch everything the public API exposes on a model the reader accepted.

Shared by the fuzz harness (fuzz_reader.py) and the mutant loop (mutate_loads.py). A model that
loads must be fully usable: every accessor works, tensor bytes are readable (an out-of-bounds
view would crash here, not later in a user's program), verify() either passes or raises
ModelError, and a model that verifies can be saved and loaded back. Anything other than
fastopt.ModelError escaping from here is a finding.
"""

from __future__ import annotations

import os
from typing import Any

import fastopt

STRING = 8  # onnx.TensorProto.STRING


class RoundTripError(AssertionError):
    """A model fastopt accepted, verified and saved could not be loaded back."""


def _touch_value(v: Any) -> None:
    _ = (v.name, v.dtype, v.shape, v.is_graph_input, v.is_graph_output)
    p = v.producer
    if p is not None:
        _ = p.op_type
    for node, idx in v.uses:
        _ = (node.op_type, idx)
    t = v.initializer
    if t is not None:
        _ = t.name


def _touch_tensor(t: Any) -> None:
    _ = (t.name, t.dtype, t.shape, t.is_external)
    nbytes = t.nbytes
    try:
        arr = t.numpy()
    except fastopt.ModelError:
        return  # e.g. a dtype numpy cannot represent, or external data that vanished
    data = arr.tobytes()  # reads every byte of the view
    if t.dtype != STRING and len(data) != nbytes:
        raise AssertionError(
            f"tensor {t.name!r}: numpy() has {len(data)} bytes, nbytes says {nbytes}"
        )


def _touch_attr(a: Any, depth: int) -> None:
    if isinstance(a, (list, tuple)):
        for x in a:
            _touch_attr(x, depth)
        return
    if hasattr(a, "nodes"):  # Graph
        walk_graph(a, depth + 1)
    elif hasattr(a, "numpy"):  # Tensor
        _touch_tensor(a)


def walk_graph(g: Any, depth: int = 0) -> None:
    _ = g.name
    for v in list(g.inputs) + list(g.outputs):
        if v is not None:
            _touch_value(v)
            _ = g.value(v.name)
    for t in g.initializers:
        _touch_tensor(t)
        _ = g.initializer(t.name)
    for n in g.nodes:
        _ = (n.op_type, n.domain, n.name)
        for v in list(n.inputs) + list(n.outputs):
            if v is not None:
                _touch_value(v)
        for a in n.attributes.values():
            _touch_attr(a, depth)
        for sg in n.subgraphs:
            walk_graph(sg, depth + 1)


def exercise(m: Any, scratch_dir: str | None = None) -> None:
    """Raise anything but ModelError on a finding. `scratch_dir`: also save and reload."""
    _ = (m.ir_version, m.producer_name, m.producer_version, m.domain, m.model_version)
    _ = (dict(m.opset_imports), dict(m.metadata_props), m.path)
    walk_graph(m.graph)
    for f in m.functions:
        _ = (f.name, f.domain)
        walk_graph(f.graph)
    _ = (m.op_counts(), m.external_data_files())
    for name in ("num_parameters", "parameter_bytes"):  # in the contract; not in every build
        if hasattr(m, name):
            _ = getattr(m, name)()
    try:
        m.verify()
    except fastopt.ModelError:
        return
    if scratch_dir is None:
        return
    out = os.path.join(scratch_dir, "roundtrip.onnx")
    try:
        m.save(out, external_data=False)
    except fastopt.ModelError:
        return  # e.g. too large to be self-contained
    try:
        m2 = fastopt.load(out)
    except fastopt.ModelError as e:
        raise RoundTripError(f"saved model does not load back: {e}") from e
    if m2.op_counts() != m.op_counts():
        raise RoundTripError(f"op counts changed: {m.op_counts()} -> {m2.op_counts()}")
