"""onnxruntime's own weight quantization, the reference fastopt's bytes must equal: the MLAS
kernels behind MatMulNBitsQuantizer's default RTN (quantize_matmul_4bits / 8bits), called the way
the quantizer calls them (K padded with zeros, scales in the weight's type; bf16 through fp32)."""

from __future__ import annotations

import numpy as np
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits


def ort_quantize(
    w: np.ndarray, bits: int, block_size: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(B uint8 [N, k_blocks, blob], scales [N, k_blocks], zero points or None)."""
    k, n = w.shape
    k_blocks = (k + block_size - 1) // block_size
    pack = 8 // bits
    packed = np.zeros((n, k_blocks, block_size // pack), dtype=np.uint8)
    zp = np.zeros((n, (k_blocks + pack - 1) // pack), dtype=np.uint8)
    scales = np.zeros((n, k_blocks), dtype=w.dtype)
    padded = np.pad(w, ((0, k_blocks * block_size - k), (0, 0)))
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, padded, scales, zp, block_size, n, k, symmetric)
    return packed, scales, None if symmetric else zp


def dequantize_nbits(
    b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, bits: int, k: int
) -> np.ndarray:
    """MatMulNBits' weight as it computes with it, float64 [K, N]: (q - zero point) * scale per
    block, from B [N, k_blocks, blob], scales [N, k_blocks] and packed zero points (or None:
    2^(bits-1))."""
    n, k_blocks, blob = b.shape
    bs = blob * 8 // bits
    if bits == 4:
        q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, k_blocks, bs)
    else:
        q = b.reshape(n, k_blocks, bs)
    if zp is None:
        z = np.full((n, k_blocks), 1 << (bits - 1), dtype=np.float64)
    elif bits == 4:
        z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :k_blocks].astype(np.float64)
    else:
        z = zp[:, :k_blocks].astype(np.float64)
    s = scales.reshape(n, k_blocks).astype(np.float64)
    w = (q.astype(np.float64) - z[:, :, None]) * s[:, :, None]
    return w.reshape(n, k_blocks * bs)[:, :k].T
