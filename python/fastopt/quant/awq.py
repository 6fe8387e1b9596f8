"""AWQ-style per-channel scaling (activation-aware weight quantization), over fastopt's IR.

Where a per-channel scale gamma [K] feeds only MatMuls with constant weights W_j [K, N_j] (a
norm's weight: LayerNormalization / SimplifiedLayerNormalization / Skip*LayerNormalization, or
a ``Mul`` by a 1-D constant, the form exported RMSNorms take), then for any s > 0

    MatMul(norm(x; gamma / s, beta / s), diag(s) W_j) == MatMul(norm(x; gamma, beta), W_j)

exactly in real arithmetic (float32: a rounding apart). Channels that carry large activations
(importance = mean x^2 from calibration) get s > 1: their weight rows are quantized with more
relative precision, the cheap channels with less. s = importance^alpha, normalized to a
geometric mean of 1 between its extremes, with alpha chosen from ALPHAS per group by the
importance-weighted error of the quantized weights (fastopt.quant.error): alpha 0 (s = 1) is
among them, so a group whose error would not drop is left alone. The MatMuls sharing one scale
(q/k/v reading one norm, gate/up) share one s.

Only float32 weights and scales are rewritten (float16 would add its own rounding to the
identity); weights or scales read elsewhere too are left alone, with the reason recorded.
The importance of a rescaled weight's input becomes importance / s^2 (its input is x / s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.quant.error import weighted_error

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

ALPHAS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.75)
_FLOAT = 1
# op -> (gamma input, beta input or -1) for norms whose output 0 is gamma-scaled.
_NORMS: dict[str, tuple[int, int]] = {
    "LayerNormalization": (1, 2),
    "SimplifiedLayerNormalization": (1, -1),
    "SkipSimplifiedLayerNormalization": (2, -1),
    "SkipLayerNormalization": (2, 3),
}


@dataclass
class ScaledGroup:
    scale_node: str  # the norm or Mul whose per-channel scale absorbed 1/s
    weights: list[str]
    alpha: float
    error_before: float  # importance-weighted quantization error at s = 1 and at the chosen s
    error_after: float
    skipped: str = ""  # why the group was left alone ("" when scaled, or alpha 0 chosen)


@dataclass
class AwqReport:
    groups: list[ScaledGroup] = field(default_factory=list)

    @property
    def scaled(self) -> list[ScaledGroup]:
        return [g for g in self.groups if not g.skipped and g.alpha > 0]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [g.__dict__ for g in self.groups]}


def _gamma_of(node: _C.Node) -> tuple[list[tuple[_C.Value, int]], str]:
    """What absorbs 1/s when ``node``'s output 0 is scaled: (value, axis) pairs, the values 1-D
    or 2-D float constants divided by s along the axis; or why nothing can."""
    op = node.op_type
    if op in _NORMS:
        gi, bi = _NORMS[op]
        ins = node.inputs
        out = [(v, 0) for i in (gi, bi) if 0 <= i < len(ins) and (v := ins[i]) is not None]
        return out, "" if out else f"{op} without a scale input"
    if op == "Mul" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
        consts = [(v, t) for v in node.inputs if v is not None and (t := v.initializer) is not None]
        if len(consts) == 1 and len(consts[0][1].shape) == 1:
            return [(consts[0][0], 0)], ""
        # Mul(act(gate(x)), up(x)): up's output columns are the scaled channels (an MLP's
        # gate/up product feeding down_proj).
        for v in node.inputs:
            p = v.producer if v is not None else None
            if v is None or p is None or p.op_type != "MatMul" or not _only_use(v):
                continue
            w = p.inputs[1]
            if w is not None and w.initializer is not None and len(w.initializer.shape) == 2:
                return [(w, 1)], ""
        return [], "Mul of no 1-D constant or MatMul output"
    return [], f"{op} is not a per-channel scale"


def _only_use(v: _C.Value) -> bool:
    return len(v.uses) == 1 and not v.is_graph_output and not v.is_graph_input


def find_groups(model: _C.Model, weights: set[str]) -> list[tuple[_C.Node, list[_C.Node]]]:
    """(scale node, its MatMuls) where the scale node's output 0 feeds only MatMuls (as A)
    whose B is one of ``weights`` (2-D float32 initializers)."""
    groups = []
    seen: set[str] = set()
    for n in model.graph.nodes:
        a = n.inputs[0] if n.op_type == "MatMul" and n.inputs else None
        p = a.producer if a is not None else None
        if a is None or p is None:
            continue
        if a.name in seen or p.outputs[0] is None or p.outputs[0].name != a.name:
            continue
        seen.add(a.name)
        if a.is_graph_output:
            continue
        # Shape and Size read only the shape, which the scaling keeps.
        users = [u for u, _ in a.uses if u.op_type not in ("Shape", "Size")]
        ok = all(
            u.op_type == "MatMul"
            and i == 0
            and u.inputs[1] is not None
            and u.inputs[1].name in weights
            for u, i in a.uses
            if u.op_type not in ("Shape", "Size")
        )
        if ok and users:
            groups.append((p, users))
    return groups


def _buffer(a: np.ndarray) -> Any:
    return np.ascontiguousarray(a, np.float32)  # a buffer (numpy's stubs say so from 3.12)


def _array(v: _C.Value) -> np.ndarray:
    t = v.initializer
    assert t is not None
    return np.asarray(t.numpy())


def _choose_alpha(
    ws: list[np.ndarray],
    imp: np.ndarray,
    bits: int,
    block_size: int,
    symmetric: bool,
    method: str | None,
) -> tuple[float, np.ndarray, float, float]:
    base = sum(weighted_error(w, bits, block_size, symmetric, imp, method=method) for w in ws)
    best = (0.0, np.ones_like(imp), base)
    x = np.maximum(imp.astype(np.float64), 1e-12)
    for alpha in ALPHAS[1:]:
        s = x**alpha
        s = s / np.sqrt(s.max() * s.min())
        s32 = s.astype(np.float32)
        err = sum(weighted_error(w, bits, block_size, symmetric, imp, s32, method) for w in ws)
        if err < best[2]:
            best = (alpha, s32, err)
    return best[0], best[1], base, best[2]


def apply_awq(
    model: _C.Model,
    importance: Mapping[str, np.ndarray],
    *,
    bits: int = 4,
    block_size: int = 32,
    symmetric: bool = True,
    method: str | None = None,
) -> tuple[AwqReport, dict[str, np.ndarray]]:
    """Scales ``model``'s weights in place (see the module docstring) and returns the report and
    the importance, divided by s^2 for the scaled weights (whose names stay)."""
    report = AwqReport()
    imp_out = dict(importance)
    candidates = set()
    for t in model.graph.initializers:
        if t.dtype == _FLOAT and len(t.shape) == 2 and t.name in importance:
            candidates.add(t.name)
    # name a replaced constant had -> its latest replacement (an up_proj weight can be scaled
    # twice: its rows with its norm's group, its columns for down_proj's)
    pending: dict[str, _C.Value] = {}
    for node, users in find_groups(model, candidates):
        wvals = [w for u in users if (w := u.inputs[1]) is not None]
        names = [w.name for w in wvals]
        holders, why = _gamma_of(node)
        group = ScaledGroup(node.name, names, 0.0, 0.0, 0.0)
        report.groups.append(group)
        k = _array(wvals[0]).shape[0]
        if not holders:
            group.skipped = why
            continue
        bad = [
            v.name
            for v, axis in holders
            if v.initializer is None
            or v.initializer.dtype != _FLOAT
            or len(v.initializer.shape) <= axis
            or v.initializer.shape[axis] != k
        ]
        if bad:
            group.skipped = f"{bad[0]} is not a float32 constant with {k} channels"
            continue
        if any(not _only_use(v) for v in [*(h for h, _ in holders), *wvals]) or len(
            set(names)
        ) != len(names):
            group.skipped = "a weight or the scale is read elsewhere too"
            continue
        ws = [_array(w) for w in wvals]
        imp = np.asarray(importance[names[0]], np.float64)
        alpha, s, before, after = _choose_alpha(ws, imp, bits, block_size, symmetric, method)
        group.alpha, group.error_before, group.error_after = alpha, before, after
        if alpha == 0.0:
            continue
        renames = []
        for w, arr in zip(wvals, ws):
            scaled = _buffer(arr * s[:, None])
            renames.append((w.replace_with_constant(_FLOAT, list(arr.shape), scaled), w.name))
        for v, axis in holders:
            arr = _array(v)
            by = s if arr.ndim == 1 else (s[:, None] if axis == 0 else s[None, :])
            div = _buffer(arr / by)
            renames.append((v.replace_with_constant(_FLOAT, list(arr.shape), div), v.name))
        for name in names:  # its input is x / s now
            imp_out[name] = (np.asarray(importance[name], np.float64) / (s * s)).astype(np.float32)
        for v, name in renames:
            original = next((o for o, p in pending.items() if p.name == name), name)
            pending[original] = v
    if pending:
        # The replaced initializers go, and the new ones take their names (the importance file
        # and the report name the weights as the model did).
        _C.run_pass(model, "eliminate_dead_nodes", "ort", 1, "", {}, {}, None)
        for name, v in pending.items():
            v.rename(name)
    model.note_edit()
    return report, imp_out
