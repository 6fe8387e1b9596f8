"""Mixed precision under a size budget (``--bits-budget B``): which MatMul weights go to int8.

Every weight starts at int4. Its error at int4 and at int8 (fastopt.quant.error: the squared
error of the dequantized weight, weighted by the input's importance when calibrated) and its
size at each (codes, scales and zero points, as MatMulNBits stores them) give the gain of
moving it to int8: error removed per extra bit. The lm_head comes first (as llama.cpp's q4_K_M
keeps its output tensor at higher precision; a tied embedding is the same tensor), then the rest
by gain; each weight that still fits moves, so the average bits per weight of the quantized
MatMul weights never exceeds B. The weights' names go to the pass as ``quant_int8_weights``.
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
    error_int4: float
    error_int8: float


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


def _weight_array(model: _C.Model, name: str, transposed: bool) -> np.ndarray:
    t = model.graph.initializer(name)
    assert t is not None
    a = np.asarray(t.numpy(), np.float32)
    return a.T if transposed else a


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
        w = _weight_array(model, use.weight, transposed)
        k, n = w.shape
        scale_bytes = 4 if init.dtype == 1 else 2
        imp = None if importance is None else importance.get(use.weight)
        e4 = weighted_error(w, 4, block_size, symmetric, imp, method=method)
        e8 = weighted_error(w, 8, block_size, symmetric, imp, method=method)
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
        key=lambda t: (not t.lm_head, -gain(t)),
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
