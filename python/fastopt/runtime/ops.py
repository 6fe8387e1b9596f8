"""ONNX Runtime's own operators: which nodes of a model only ORT runs, and how ``check`` lets
onnx's checker judge them by ORT's schemas.

ORT registers contrib ops in its own domains (``com.microsoft``: GroupQueryAttention,
MatMulNBits, SkipSimplifiedLayerNormalization, ...) and a few in the ONNX domain, where onnx has
no schema for them (``SimplifiedLayerNormalization``, which fastopt's target "ort" writes). onnx's
checker skips nodes of a domain it does not know, but stops at an ONNX-domain op it has no schema
for. While :func:`ort_schemas` is active, onnx holds ORT's own schemas of those ops (inputs,
outputs, type constraints, attributes; no shape inference), so the checker checks their nodes
as ORT's graph resolution would, and everything else as usual.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastopt import _C

_STANDARD = ("", "ai.onnx")
# register_schema changes onnx's process-wide registry: one check at a time touches it.
_REGISTRY_LOCK = threading.RLock()


def _is_standard(domain: str) -> bool:
    return domain in _STANDARD or domain.startswith("ai.onnx.")


@functools.cache
def _ort_schemas() -> dict[tuple[str, str], list[Any]]:
    """ORT's operator schemas by (domain, op type), every version ("" for "ai.onnx")."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c  # type: ignore[import-untyped]

    out: dict[tuple[str, str], list[Any]] = {}
    for s in ort_c.get_all_operator_schema():
        domain = "" if s.domain == "ai.onnx" else s.domain
        out.setdefault((domain, s.name), []).append(s)
    return out


def ort_knows(op_type: str, domain: str = "") -> bool:
    """Whether the installed ONNX Runtime has a schema for the op."""
    return ("" if domain == "ai.onnx" else domain, op_type) in _ort_schemas()


def _onnx_knows(domain: str, op_type: str) -> bool:
    import onnx

    return bool(onnx.defs.has(op_type, domain))


def runtime_ops(model: _C.Model) -> dict[str, int]:
    """Nodes only ONNX Runtime runs, counted by op: "com.microsoft::GroupQueryAttention" for its
    contrib domains, "SimplifiedLayerNormalization" (no prefix) for ORT's ops in the ONNX
    domain. Ops neither onnx nor ORT knows, and calls of model-local functions, are not
    counted."""
    functions = {(f.domain, f.name) for f in model.functions}
    counts: dict[str, int] = {}
    graphs = [model.graph] + [f.graph for f in model.functions]
    while graphs:
        g = graphs.pop()
        for n in g.nodes:
            graphs.extend(n.subgraphs)
            domain = "" if n.domain == "ai.onnx" else n.domain
            if (domain, n.op_type) in functions or _onnx_knows(domain, n.op_type):
                continue
            if not ort_knows(n.op_type, domain):
                continue
            key = n.op_type if _is_standard(domain) else f"{domain}::{n.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def describe(ops: dict[str, int]) -> str:
    """The report line of a model with ORT-only ops."""
    listed = ", ".join(
        f"{op} x{n}" + ("" if "::" in op else " in the ONNX domain") for op, n in ops.items()
    )
    return (
        f"runs in ONNX Runtime only ({sum(ops.values())} nodes of its ops, checked against its "
        f"schemas: {listed}); --target onnx writes standard ONNX"
    )


def _to_onnx_schema(s: Any) -> Any:
    from onnx import defs

    option = {
        0: defs.OpSchema.FormalParameterOption.Single,
        1: defs.OpSchema.FormalParameterOption.Optional,
        2: defs.OpSchema.FormalParameterOption.Variadic,
    }

    def params(formal: Any) -> list[Any]:
        return [
            defs.OpSchema.FormalParameter(
                p.name,
                p.typeStr,
                p.description or "",
                param_option=option[int(p.option)],
                is_homogeneous=p.isHomogeneous,
            )
            for p in formal
        ]

    return defs.OpSchema(
        s.name,
        "",
        s.since_version,
        s.doc or "",
        inputs=params(s.inputs),
        outputs=params(s.outputs),
        type_constraints=[
            (t.type_param_str, list(t.allowed_type_strs), t.description or "")
            for t in s.type_constraints
        ],
        attributes=[
            defs.OpSchema.Attribute(
                a.name,
                getattr(defs.OpSchema.AttrType, a.type.name),
                a.description or "",
                required=a.required,
            )
            for a in s.attributes.values()
        ],
    )


@contextmanager
def ort_schemas(ops: dict[str, int]) -> Iterator[None]:
    """While active, onnx has ORT's schemas of the ONNX-domain ops among `ops` (those of
    :func:`runtime_ops`). Does nothing where onnx cannot register schemas (before 1.16)."""
    from onnx import defs

    names = [op for op in ops if "::" not in op]
    if not names or not hasattr(defs, "register_schema"):
        yield
        return
    with _REGISTRY_LOCK:
        added: list[tuple[str, int]] = []
        try:
            for name in names:
                if defs.has(name, ""):  # registered by someone else meanwhile
                    continue
                for s in _ort_schemas()[("", name)]:
                    defs.register_schema(_to_onnx_schema(s))
                    added.append((name, s.since_version))
            yield
        finally:
            for name, version in added:
                defs.deregister_schema(name, version, "")
