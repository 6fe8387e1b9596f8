"""Data-free importance (``--importance norms``): each weight's input importance (mean x_k^2 per
input channel, what calibration measures) estimated from the weights alone, without running
the model.

The estimate follows the residual stream's per-channel mean square r through the graph, as if
every channel were an independent zero-mean variable:

- r starts as the token embedding's per-column mean square (its rows read as the tokens);
- a MatMul fed by a norm's gain gamma (RMSNorm/LayerNorm, fused or as ``Mul(x, gamma)``) reads
  gamma_k^2 * r_k / mean(r): the norm divides by the stream's rms, the gain scales each channel;
- its output's mean square per column is sum_k imp_k W_kn^2; a gated MLP's product
  ``silu(gate) * up`` reads E[silu(g)^2] * E[u^2] per channel (g normal with that variance);
- a MatMul that is not fed by a norm and writes the stream's width back (attention's output,
  the MLP's down projection) adds its output's mean square to r; attention's output reads its
  value projection's mean square, one value for all its channels (softmax-weighted sums of
  values: the heads' order is not traced), and adds a third of it (kAttentionMix).
- a MatMul fed by a product (the MLP's down projection) also weighs its super rows: a row whose
  largest |weight| is kSuperRowRatio times the median row's or more is read kSuperRowPower-fold
  (ratio^4). Those rows are the "super weights" that write the stream's massive activations
  (Yu et al. 2024): on SmolLM2 the largest row is 5-8.7x the median row in 14 of 30 layers,
  and calibration measures 50-1,400x the mean importance on most of those channels, where the
  product's estimate sees nothing special. The stream's r keeps the unweighted estimate (fed
  into r, the boost made every later norm's estimate worse: KL 0.307 vs 0.246 dithered).

The importance weights the search (csrc/quant/search.cc) as calibration's does. On SmolLM2-135M
(bench/results/quantize_accuracy.md) it takes ``--recipe q4m``'s KL from 0.299 to 0.235 (0.214
with the super rows), and 0.329 to 0.278 (0.246) on the grid-broken copy; calibration's measured
importance gives 0.188 / 0.210.
Gains alone (gamma^2, r ignored) gave 0.277 / 0.328: the residual stream's uneven channels
(the embedding's, and what the layers write) are most of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.quant.blas_threads import blas_threads
from fastopt.quant.calibration import WeightUse, weight_matmuls

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

_NORM_SCALE_INPUT = {
    "LayerNormalization": 1,
    "SimplifiedLayerNormalization": 1,
    "SkipLayerNormalization": 2,
    "SkipSimplifiedLayerNormalization": 2,
}
_PASS_THROUGH = {"Cast", "Identity", "Dropout"}
# Ops between attention's value projection and its output projection (heads, repeats, the
# attention product itself: followed through its values only).
_ATTENTION_PATH = {"Reshape", "Transpose", "Expand", "Tile", "Concat", "Unsqueeze", "Squeeze"}
_ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
# What attention's output adds to the stream, relative to its values' mean square: a softmax
# average of a few weakly correlated values has a smaller mean square than one value.
kAttentionMix = 0.3
# A product-fed MatMul's rows whose largest |weight| is this many times the median row's are
# super rows, read (ratio ** kSuperRowPower)-fold: powers 3-6 and ratios 4-6 all gave KL
# 0.246-0.248 on the dithered SmolLM2 (0.278 without), power 2 0.258.
kSuperRowRatio = 5.0
kSuperRowPower = 4.0
_FLOAT_TYPES = (1, 10, 16)
# Rows of the embedding table read for its per-column mean square (a vocabulary's worth of
# tokens: reading all of Qwen2-0.5B's 151936 took 0.6 s).
_EMBEDDING_ROWS = 8192


def _float_initializer(v: _C.Value | None) -> np.ndarray | None:
    t = v.initializer if v is not None else None
    if t is None or t.dtype not in _FLOAT_TYPES:
        return None
    return np.asarray(t.numpy(), np.float32)


def _skip_casts(v: _C.Value | None) -> _C.Node | None:
    p = v.producer if v is not None else None
    while p is not None and p.op_type in _PASS_THROUGH and p.inputs:
        p = p.inputs[0].producer if p.inputs[0] is not None else None
    return p


def norm_gain(a: _C.Value, k: int) -> np.ndarray | None:
    """The [K] gain of the norm that produces ``a``, or None when no norm does."""
    p = _skip_casts(a)
    if p is None:
        return None
    if p.op_type in _NORM_SCALE_INPUT:
        i = _NORM_SCALE_INPUT[p.op_type]
        g = _float_initializer(p.inputs[i]) if len(p.inputs) > i else None
    elif p.op_type == "Mul":
        g = next((x for x in map(_float_initializer, p.inputs) if x is not None), None)
    else:
        return None
    return g.reshape(-1) if g is not None and g.size == k else None


def _embedding_mean_square(model: _C.Model) -> np.ndarray | None:
    """Per column, the mean square of the token embedding (the first Gather of a 2-D float
    table), from about _EMBEDDING_ROWS of its rows (evenly spaced)."""
    for n in model.graph.nodes:
        if n.op_type != "Gather" or not n.inputs or n.attributes.get("axis", 0) != 0:
            continue
        t = n.inputs[0].initializer if n.inputs[0] is not None else None
        if t is None or t.dtype not in _FLOAT_TYPES or len(t.shape) != 2 or not t.shape[0]:
            continue
        stride = max(1, t.shape[0] // _EMBEDDING_ROWS)
        return np.asarray(_C.weight_column_sums(t, row_stride=stride), np.float64) / t.shape[0]
    return None


# E[(g sigmoid(alpha g))^2] for g ~ N(0, var), per channel (Gauss-Hermite quadrature): silu
# (alpha 1, x * Sigmoid(x)) and the fused QuickGelu (its alpha).
def _silu_square(var: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    z, w = np.polynomial.hermite_e.hermegauss(48)
    w = w / w.sum()
    g = np.sqrt(np.maximum(var, 0.0))[:, None] * z[None, :]
    return np.asarray(((g / (1.0 + np.exp(-alpha * g))) ** 2) @ w, np.float64)


def _key(node: _C.Node) -> str:
    out = node.outputs[0] if node.outputs else None
    return out.name if out is not None else ""


def _weight_nodes(model: _C.Model) -> dict[str, tuple[_C.Node, WeightUse]]:
    """The weight MatMuls (calibration.weight_matmuls) with their nodes, in graph order, keyed
    by their output's name."""
    uses = weight_matmuls(model)
    out: dict[str, tuple[_C.Node, WeightUse]] = {}
    i = 0
    for n in model.graph.nodes:
        if i == len(uses):
            break
        u = uses[i]
        if n.op_type != "MatMul" or n.name != u.node or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        w = b.producer.inputs[0] if b is not None and b.producer is not None else b
        if a is None or a.name != u.a or w is None or w.name != u.weight:
            continue
        out[_key(n)] = (n, u)
        i += 1
    return out


class _Estimate:
    """The walk's state: r, and each weight MatMul's importance and output mean square."""

    def __init__(self, model: _C.Model) -> None:
        self.model = model
        self.nodes = _weight_nodes(model)  # by output name (node names may be empty)
        self.uses = {key: use for key, (_, use) in self.nodes.items()}
        self.r = _embedding_mean_square(model)
        self.importance: dict[str, np.ndarray] = {}  # by node
        self._out: dict[str, np.ndarray] = {}

    def out_mean_square(self, node: str, row_max: np.ndarray | None = None) -> np.ndarray:
        """Per output column of a weight MatMul: sum_k imp_k W_kn^2 (read in C++ from the
        mapping, whose pages leave the process once read, as the pass reads weights); with
        ``row_max`` (float64 [K]) each row's largest |W_kn| from the same read, on the first."""
        if node not in self._out:
            use = self.uses[node]
            t = self.model.graph.initializer(use.weight)
            assert t is not None
            imp = self.importance.get(node)
            self._out[node] = _C.weight_column_sums(
                t,
                t.shape[0] != use.k,
                None if imp is None else np.asarray(imp, np.float32),
                row_max=row_max,
            )
        return self._out[node]

    def mean_square(self, v: _C.Value | None, depth: int = 0) -> np.ndarray | None:
        """Per channel of ``v``: its mean square where the ops that make it are understood
        (weight MatMuls, silu, products, casts), else None."""
        p = v.producer if v is not None else None
        if p is None or depth > 6:
            return None
        key = _key(p)
        if key in self.uses and key in self.importance:
            return self.out_mean_square(key)
        if p.op_type in _PASS_THROUGH:
            return self.mean_square(p.inputs[0], depth + 1)
        if p.op_type == "QuickGelu" and p.inputs:  # x * Sigmoid(alpha x), fused
            m = self.mean_square(p.inputs[0], depth + 1)
            alpha = float(p.attributes.get("alpha", 1.702))
            return None if m is None else _silu_square(m, alpha)
        if p.op_type == "Mul" and len(p.inputs) == 2:
            a, b = p.inputs
            for x, y in ((a, b), (b, a)):  # silu: x * Sigmoid(x)
                q = y.producer if y is not None else None
                if (
                    q is not None
                    and q.op_type == "Sigmoid"
                    and x is not None
                    and q.inputs[0] is not None
                    and q.inputs[0].name == x.name
                ):
                    m = self.mean_square(x, depth + 1)
                    return None if m is None else _silu_square(m)
            ma, mb = self.mean_square(a, depth + 1), self.mean_square(b, depth + 1)
            if ma is not None and mb is not None and ma.shape == mb.shape:
                return ma * mb
        return None

    def attention_values(self, a: _C.Value) -> float | None:
        """The mean square of the value projection that ``a`` mixes (attention's output), or
        None when ``a`` is not reached from one through attention."""
        todo: list[_C.Value | None] = [a]
        seen, through_attention = 0, False
        while todo and seen < 24:
            v = todo.pop()
            seen += 1
            p = v.producer if v is not None else None
            if p is None:
                continue
            key = _key(p)
            if key in self.uses:
                if through_attention and key in self.importance:
                    return float(self.out_mean_square(key).mean())
                continue
            if p.op_type == "MatMul" and len(p.inputs) == 2:  # softmax(q k) @ v: the values
                through_attention = True
                todo.append(p.inputs[1])
            elif p.op_type in _ATTENTION_OPS and len(p.inputs) > 2:
                through_attention = True
                todo.append(p.inputs[2])
            elif p.op_type in _ATTENTION_PATH or p.op_type in _PASS_THROUGH:
                todo.extend(p.inputs[:1])
        return None

    def visit(self, key: str, use: WeightUse, a: _C.Value) -> None:
        gain = norm_gain(a, use.k)
        if gain is not None:
            imp = np.asarray(gain, np.float64) ** 2
            if self.r is not None and self.r.size == use.k and self.r.mean() > 0:
                imp = imp * self.r / self.r.mean()
            self.importance[key] = imp
            return
        mix = 1.0
        product = self.mean_square(a)
        row_max = None
        if product is not None and product.size == use.k:
            self.importance[key] = product
            row_max = np.zeros(use.k)
        else:
            values = self.attention_values(a)
            if values is None:
                return
            self.importance[key] = np.full(use.k, values)
            mix = kAttentionMix
        n = self.out_mean_square(key, row_max)
        if self.r is not None and n.shape == self.r.shape:  # writes the stream back
            self.r = self.r + mix * n
        if row_max is not None:  # (after r's update, which keeps the product's estimate)
            self.importance[key] = self.importance[key] * super_rows(row_max)


def super_rows(row_max: np.ndarray) -> np.ndarray:
    """Per row, how many times its importance is read: (ratio ** kSuperRowPower) where a row's
    largest |weight| is kSuperRowRatio times the median row's or more, else 1."""
    median = float(np.median(row_max)) if row_max.size else 0.0
    if not median > 0:
        return np.ones_like(row_max)
    ratio = row_max / median
    return np.where(ratio >= kSuperRowRatio, ratio**kSuperRowPower, 1.0)


def norm_importance(
    model: _C.Model, keep: Callable[[WeightUse], bool] | None = None
) -> dict[str, np.ndarray]:
    """Per weight initializer, its estimated input importance (float32 [K]): see the module
    docstring. Weights with no estimate are left out (uniform); a weight read by several
    MatMuls takes the first's."""
    np.asarray(0)  # numpy (and its OpenBLAS) loaded, for blas_threads to find
    # One thread: _silu_square's small products gain nothing from more, and between them the
    # idle threads' spin beside weight_column_sums took 29 % of the CPU (the same results: each
    # output of a matrix-vector product is one thread's dot product either way).
    with blas_threads(1):
        est = _Estimate(model)
        for key, (node, use) in est.nodes.items():
            if node.inputs[0] is not None:
                est.visit(key, use, node.inputs[0])
    out: dict[str, np.ndarray] = {}
    for key, imp in est.importance.items():
        use = est.uses[key]
        if use.weight in out or (keep is not None and not keep(use)):
            continue
        if np.all(np.isfinite(imp)) and imp.max() > 0:
            out[use.weight] = np.asarray(np.maximum(imp, imp.max() * 1e-6), np.float32)
    return out
