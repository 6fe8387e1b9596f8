"""The error a weight takes from blockwise quantization: from the C++ kernels where this build
has them (``_C.quantization_error``: the pass's own rounding), else round-to-nearest in NumPy
with the formulas of csrc/quant/blockwise.h (ORT's RTN: signed max-based scale when symmetric,
min/max range with a zero point otherwise; the reciprocal of the scale multiplied), scales kept
in float32 (fp16 weights' figures then differ by the scale rounding, far below the error).

Used to rank weights (--bits-budget) and to choose AWQ scales; the written bytes always come
from the C++ pass. Swappable: ``weighted_error`` is the one entry point the callers use, so a
C++ error query (the rounding search's own) can replace it without touching them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

# Columns quantized at once: bounds the temporaries to a few times K x COLUMNS floats.
COLUMNS = 4096


def dequantized(w: np.ndarray, bits: int, block_size: int, symmetric: bool) -> np.ndarray:
    """RTN quantize-dequantize of ``w`` [K, N] (float32) in blocks of ``block_size`` rows.
    Halves round to even here (np.rint), not away from zero: exact ties are too rare in trained
    weights to move an error estimate, and rint is one pass instead of four."""
    k, n = w.shape
    kb = -(-k // block_size)
    if kb * block_size == k:
        x = np.ascontiguousarray(w, np.float32).reshape(kb, block_size, n)
    else:
        padded = np.zeros((kb * block_size, n), np.float32)
        padded[:k] = w
        x = padded.reshape(kb, block_size, n)
    mn = x.min(axis=1, keepdims=True)
    mx = x.max(axis=1, keepdims=True)
    top = float((1 << bits) - 1)
    zp: Any
    if symmetric:
        scale = np.where(np.abs(mx) > np.abs(mn), mx, mn) * np.float32(-1.0 / (1 << (bits - 1)))
        zp = np.float32(1 << (bits - 1))
    else:
        mn = np.minimum(mn, 0)
        scale = (np.maximum(mx, 0) - mn) / np.float32(top)
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.clip(np.rint(np.where(scale != 0, -mn / scale, 0)), 0, top)
    with np.errstate(divide="ignore"):
        recip = np.where(scale != 0, np.float32(1) / scale, np.float32(0))
    q = x * recip
    q += zp
    np.rint(q, out=q)
    np.clip(q, 0, top, out=q)
    q -= zp
    q *= scale
    return q.reshape(kb * block_size, n)[:k]


def weighted_error(
    w: np.ndarray,
    bits: int,
    block_size: int,
    symmetric: bool,
    importance: np.ndarray | None = None,
    row_scale: np.ndarray | None = None,
    method: str | None = None,
) -> float:
    """sum_k importance_k * sum_n (w - w')^2: the expected squared output error per token when
    the inputs' channels are uncorrelated with mean square ``importance`` (1 when None).
    ``row_scale`` s: the error of w quantized as diag(s) w and read back divided by s (AWQ).
    With the C++ error query (``_C.quantization_error``, the pass's own kernels and rounding
    ``method``) when this build has it; else RTN in NumPy."""
    k, n = w.shape
    native = getattr(_C, "quantization_error", None)
    if native is not None:
        x, imp32 = w, importance
        if row_scale is not None:  # sum imp/s^2 (s w - Q(s w))^2 == sum imp (w - Q(s w)/s)^2
            s = np.asarray(row_scale, np.float32)
            x = w * s[:, None]
            base = np.ones(k, np.float32) if importance is None else importance
            imp32 = np.asarray(base, np.float32) / (s * s)
        extra = {} if method is None else {"method": method}
        got = native(
            np.asarray(x, np.float32),
            bits,
            block_size,
            symmetric,
            importance=(None if imp32 is None else np.asarray(imp32, np.float32)),
            **extra,
        )
        return float(got["sq_err"])
    imp = np.ones(k, np.float64) if importance is None else np.asarray(importance, np.float64)
    total = 0.0
    for c in range(0, n, COLUMNS):
        block = np.asarray(w[:, c : c + COLUMNS], np.float32)
        if row_scale is None:
            back = dequantized(block, bits, block_size, symmetric)
        else:
            s = np.asarray(row_scale, np.float32)[:, None]
            back = dequantized(block * s, bits, block_size, symmetric) / s
        back -= block
        total += float(imp @ np.einsum("kn,kn->k", back, back, dtype=np.float64))
    return total


def bits_per_weight(
    k: int, n: int, bits: int, block_size: int, symmetric: bool, scale_bytes: int
) -> float:
    """Average bits per weight of a [K, N] weight as MatMulNBits stores it: codes (K padded to
    blocks), scales and packed zero points."""
    kb = -(-k // block_size)
    data = n * kb * block_size * bits // 8
    scales = n * kb * scale_bytes
    zps = 0 if symmetric else n * -(-(kb * bits) // 8)
    return 8.0 * (data + scales + zps) / (k * n)
