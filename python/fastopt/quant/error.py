"""The error a weight takes from blockwise quantization, from the C++ kernels
(``_C.quantization_error``: the pass's own rounding, RTN or the search, without writing).

Used to rank weights (--bits-budget) and to choose AWQ scales; the written bytes always come
from the C++ pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastopt import _C
from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")


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
    ``row_scale`` s: the error of w quantized as diag(s) w and read back divided by s (AWQ)."""
    x, imp = w, importance
    if row_scale is not None:  # sum imp/s^2 (s w - Q(s w))^2 == sum imp (w - Q(s w)/s)^2
        s = np.asarray(row_scale, np.float32)
        x = w * s[:, None]
        base = np.ones(w.shape[0], np.float32) if importance is None else importance
        imp = np.asarray(base, np.float32) / (s * s)
    got = _C.quantization_error(
        np.asarray(x, np.float32),
        bits,
        block_size,
        symmetric,
        importance=None if imp is None else np.asarray(imp, np.float32),
        **({} if method is None else {"method": method}),  # None: the binding's default
    )
    return float(got["sq_err"])


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
