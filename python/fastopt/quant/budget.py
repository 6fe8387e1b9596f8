"""Mixed precision under a size budget (``--bits-budget B``): which MatMul weights go to int8.

Every weight starts at int4. Its error at int4 and at int8 (fastopt.quant.error: the squared
error of the dequantized weight, weighted by the input's importance when calibrated; estimated
from a sample of its blocks, _weight_sample) and its
size at each (codes, scales and zero points, as MatMulNBits stores them) give the gain of
moving it to int8: error removed per extra bit. The lm_head comes first (as llama.cpp's q4_K_M
keeps its output tensor at higher precision; a tied embedding is the same tensor), then the rest
by gain; each weight that still fits moves, so the average bits per weight of the quantized
MatMul weights never exceeds B. The weights' names go to the pass as ``quant_int8_weights``.

The squared error alone ranks badly: on SmolLM2-135M it picked the attention q/k projections
(large weights, but their error is damped by the softmax), with or without calibration. So the
attention value projections and the MLP down projections (q4_K_M's attn_v / ffn_down, found by
structure: the MatMul feeding attention's V, and a MatMul contracting more rows than it has
columns) come before the rest, each group by gain: KL 0.480 -> 0.33 at 4.6 bits there
(bench/results/quantize_accuracy.md).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.quant.calibration import weight_matmuls
from fastopt.quant.error import bits_per_weight, weighted_error

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")


@dataclass
class TensorBits:
    """One weight's allocation: bits chosen, its size and error at int4 and int8."""

    weight: str
    shape: tuple[int, int]  # [K, N] as the MatMul reads it
    lm_head: bool
    bits: int
    bits_per_weight: float  # at the chosen bits, scales and zero points included
    error_int4: float  # estimated from a sample (_weight_sample)
    error_int8: float
    role: str = ""  # "value" (attention V) or "down" (MLP down projection): ranked first
    node: str = ""  # the MatMul reading it


@dataclass
class BitsAllocation:
    budget: float | None
    weighted: bool  # errors weighted by calibration importance
    tensors: list[TensorBits] = field(default_factory=list)

    @property
    def average_bits(self) -> float:
        n = sum(t.shape[0] * t.shape[1] for t in self.tensors)
        used = sum(t.bits_per_weight * t.shape[0] * t.shape[1] for t in self.tensors)
        return used / n if n else 0.0

    @property
    def int8_weights(self) -> list[str]:
        return [t.weight for t in self.tensors if t.bits == 8]

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "average_bits": self.average_bits,
            "weighted": self.weighted,
            "tensors": [t.__dict__ for t in self.tensors],
        }


def _lm_head_outputs(model: _C.Model) -> set[str]:
    """Names of MatMul nodes whose output (through up to two Add/Cast) is a graph output."""
    out = set()
    for n in model.graph.nodes:
        if n.op_type != "MatMul":
            continue
        v = n.outputs[0]
        for _ in range(3):
            if v is None:
                break
            if v.is_graph_output:
                out.add(n.name)
                break
            if len(v.uses) != 1 or v.uses[0][0].op_type not in ("Add", "Cast"):
                break
            v = v.uses[0][0].outputs[0]
    return out


# Ops between the V projection and the attention that reads it (heads split, bias, cast,
# grouped-query repeats).
_DATA_MOVEMENT = {
    "Reshape",
    "Transpose",
    "Add",
    "Cast",
    "Squeeze",
    "Unsqueeze",
    "Concat",
    "Expand",
    "Tile",
}
_ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}


def _from_softmax(v: _C.Value | None) -> bool:
    """Whether `v` is a Softmax output, through casts, dropout and Where (the exports' guard
    against NaN rows of a fully masked softmax)."""
    todo, seen = [v], 0
    while todo and seen < 8:
        value = todo.pop()
        p = value.producer if value is not None else None
        seen += 1
        if p is None:
            continue
        if p.op_type == "Softmax":
            return True
        if p.op_type in ("Cast", "Dropout"):
            todo.append(p.inputs[0])
        elif p.op_type == "Where":
            todo.extend(p.inputs[1:3])
    return False


def _feeds_attention_value(node: _C.Node) -> bool:
    """Whether the MatMul's output reaches attention as its values: the second input of a
    MatMul whose first is a Softmax, or input 2 of a fused attention op."""
    todo, seen = [v for v in node.outputs[:1] if v is not None], 0
    while todo and seen < 16:
        v = todo.pop()
        seen += 1
        for user, index in v.uses:
            if user.op_type == "MatMul" and index == 1 and _from_softmax(user.inputs[0]):
                return True
            if user.op_type in _ATTENTION_OPS and index == 2:
                return True
            if user.op_type in _DATA_MOVEMENT:
                todo.extend(o for o in user.outputs if o is not None)
    return False


def _roles(model: _C.Model, heads: set[str]) -> dict[str, str]:
    """MatMul nodes whose weight error reaches the residual stream undamped: attention's value
    projections ("value"), and MLP down projections ("down": more rows K than columns N, neither
    the lm_head nor a q/k projection beside a value one: grouped-query k has K > N too)."""
    nodes = {n.name: n for n in model.graph.nodes if n.op_type == "MatMul"}
    uses = [u for u in weight_matmuls(model) if u.node in nodes and u.node not in heads]
    roles = {u.node: "value" for u in uses if _feeds_attention_value(nodes[u.node])}
    beside_values = {u.a for u in uses if u.node in roles}
    for use in uses:
        init = model.graph.initializer(use.weight)
        if init is None or len(init.shape) != 2 or use.a in beside_values:
            continue
        n = init.shape[1] if init.shape[0] == use.k else init.shape[0]  # (transposed: [N, K])
        if use.k > n:
            roles[use.node] = "down"
    return roles


def _layer_ends(model: _C.Model, roles: Mapping[str, str]) -> dict[str, int]:
    """Per down projection, its distance from the nearer end of the stack (graph order): q4_K_M
    keeps the first and last layers' ffn_down at higher precision."""
    downs = [n.name for n in model.graph.nodes if roles.get(n.name) == "down"]
    return {name: min(i, len(downs) - 1 - i) for i, name in enumerate(downs)}


# Order after the lm_head: every attention V (small, and the most KL per bit on
# SmolLM2), then the down projections from the ends of the stack inwards, then the rest by gain.
_ROLE_RANK = {"value": 0, "down": 1}


# A weight's int4 and int8 errors are estimated from a sample, read in C++ from the mapping
# (pages released): at least _ERROR_ROWS rows of K in whole blocks evenly spaced along K (each
# block's error is exact), all columns; a transposed weight (stored [N, K], the tied lm_head)
# from _ERROR_COLUMNS of its columns, all rows. The estimate only ranks weights (by role first);
# every column of every weight at int4 and int8 cost more than the quantization pass itself
# (q4m's command took 2.0-2.1x round to nearest's), and the pass reports each exact error.
_ERROR_ROWS = 128
_ERROR_COLUMNS = 64
# ... and of a wide weight (an lm_head stored [K, vocab]) at most this many columns, evenly spaced.
_ERROR_WIDE_COLUMNS = 2048


def _weight_sample(
    model: _C.Model, name: str, transposed: bool, block_size: int, k: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """A sample of the weight as the MatMul reads it ([rows, columns]), the rows of K it holds,
    and the weight's size over the sample's."""
    t = model.graph.initializer(name)
    assert t is not None
    if transposed:
        cols = t.shape[0]
        picked = list(range(0, cols, max(1, -(-cols // _ERROR_COLUMNS))))
        w = _C.weight_rows(t, True, 0, k, picked)
        return w, np.arange(k), cols / len(picked)
    cols = t.shape[1]
    picked = list(range(0, cols, max(1, -(-cols // _ERROR_WIDE_COLUMNS))))
    full = k // block_size
    want = -(-_ERROR_ROWS // block_size)
    if full <= want:
        return _C.weight_rows(t, False, 0, k, picked), np.arange(k), cols / len(picked)
    blocks = np.linspace(0, full - 1, want).round().astype(int)
    parts = [_C.weight_rows(t, False, int(b) * block_size, block_size, picked) for b in blocks]
    rows = np.concatenate([np.arange(b * block_size, (b + 1) * block_size) for b in blocks])
    return np.concatenate(parts), rows, k * cols / (rows.size * len(picked))


def allocate(
    model: _C.Model,
    budget: float | None,
    *,
    block_size: int,
    symmetric: bool,
    importance: Mapping[str, np.ndarray] | None = None,
    exclude: Sequence[str] = (),
    lm_head: str | None = None,
    method: str | None = None,
    over_floor_ok: bool = False,
) -> BitsAllocation:
    """The int4/int8 choice per MatMul weight for an average of at most ``budget`` bits per
    weight (None: all int4, errors only, for the report). ModelError when even all-int4 is
    over the budget, unless ``over_floor_ok`` (a recipe's budget): then all int4."""
    heads = _lm_head_outputs(model)
    roles = _roles(model, heads)
    ends = _layer_ends(model, roles)
    alloc = BitsAllocation(budget, importance is not None)
    seen: set[str] = set()
    fixed: dict[str, int] = {}
    sizes: dict[str, tuple[float, float]] = {}  # total bits at int4, at int8
    for use in weight_matmuls(model):
        if use.weight in seen:
            continue
        if any(fnmatch.fnmatchcase(x, g) for g in exclude for x in (use.node, use.weight) if x):
            continue
        is_head = use.node in heads
        if is_head and lm_head == "keep":
            continue
        seen.add(use.weight)
        init = model.graph.initializer(use.weight)
        assert init is not None
        transposed = init.shape[0] != use.k
        k = use.k
        w, rows, scale = _weight_sample(model, use.weight, transposed, block_size, k)
        n = init.shape[0] if transposed else init.shape[1]
        scale_bytes = 4 if init.dtype == 1 else 2
        imp = None if importance is None else importance.get(use.weight)
        if imp is not None:
            imp = np.asarray(imp, np.float32)[rows]
        e4 = scale * weighted_error(w, 4, block_size, symmetric, imp, method=method)
        e8 = scale * weighted_error(w, 8, block_size, symmetric, imp, method=method)
        del w
        alloc.tensors.append(
            TensorBits(
                use.weight,
                (k, n),
                is_head,
                4,
                bits_per_weight(k, n, 4, block_size, symmetric, scale_bytes),
                e4,
                e8,
                roles.get(use.node, ""),
                use.node,
            )
        )
        sizes[use.weight] = (
            bits_per_weight(k, n, 4, block_size, symmetric, scale_bytes) * k * n,
            bits_per_weight(k, n, 8, block_size, symmetric, scale_bytes) * k * n,
        )
        if is_head and lm_head in ("int4", "int8"):
            fixed[use.weight] = 4 if lm_head == "int4" else 8
    if budget is None:
        return alloc
    total_weights = sum(t.shape[0] * t.shape[1] for t in alloc.tensors)
    limit = budget * total_weights
    used = sum(sizes[t.weight][0] for t in alloc.tensors)
    for t in alloc.tensors:
        if fixed.get(t.weight) == 8:
            used += sizes[t.weight][1] - sizes[t.weight][0]
            _to_int8(t, sizes)
    if used > limit * (1 + 1e-12) and over_floor_ok:
        return alloc
    if used > limit * (1 + 1e-12):
        floor = used / total_weights
        raise _C.ModelError(
            f"bits budget {budget:g} is below what int4 takes here ({floor:.3f} bits per weight "
            f"at block size {block_size}, scales{'' if symmetric else ' and zero points'} "
            "included); raise the budget or the block size"
        )

    def gain(t: TensorBits) -> float:
        extra = sizes[t.weight][1] - sizes[t.weight][0]
        return (t.error_int4 - t.error_int8) / extra if extra > 0 else float("inf")

    order = sorted(
        (t for t in alloc.tensors if t.weight not in fixed),
        key=lambda t: (not t.lm_head, _ROLE_RANK.get(t.role, 2), ends.get(t.node, 0), -gain(t)),
    )
    for t in order:
        extra = sizes[t.weight][1] - sizes[t.weight][0]
        if used + extra <= limit * (1 + 1e-12):  # (the budget's own float rounding)
            used += extra
            _to_int8(t, sizes)
    return alloc


def _to_int8(t: TensorBits, sizes: Mapping[str, tuple[float, float]]) -> None:
    k, n = t.shape
    t.bits = 8
    t.bits_per_weight = sizes[t.weight][1] / (k * n)
