"""GPTQ's second-order statistics: per MatMul input, H = X^T X over the calibration tokens
(collected by fastopt.quant.calibration with ``hessians=True``), and per weight the factor the C++
kernel reads (csrc/quant/gptq.h): the upper Cholesky factor U of the dampened H's inverse,
H^-1 = U^T U, float32 [K, K].

The factors are computed here with LAPACK (scipy's dpotrf / dtrtri where it is installed, else
numpy), not in C++: a blocked factorization without BLAS would be several times slower. One
factor per distinct input (and AWQ scaling), shared by the weights that read it (q/k/v, gate/up),
2 K^3 / 3 flops each. They go to one file, ``hessian.onnx`` plus its data file: an ONNX model whose
initializers are named as the weights and hold their factor as external data, the weights of
one input pointing at the same bytes (written once). The quantization pass maps the file and
reads each factor in place (option ``quant_hessian``).

AWQ scales a weight's rows by s and its input by 1 / s, so the Hessian of the scaled weight is
diag(1/s) H diag(1/s); ``write_factors`` takes those per-channel factors 1/s.

Memory: the accumulators are float32 K x K per distinct input (ONNX Runtime's own sums per run
are float32), 4 * sum K^2 bytes, and each run's outputs the same again while they are summed: on
SmolLM2-135M (30 layers, inputs of K = 576 x 3 and 1536, and the lm_head's) 0.40 GB; a 0.5B
Qwen2 shape (24 layers, K = 896 x 3 and 4864) 2.5 GB; a 7B shape (K = 4096 x 3 and 11008, 32
layers) 20.5 GiB. The factors file is as large (mapped by the pass, read in place).

Where they pass MAX_HESSIAN_BYTES, the inputs are cut into groups in graph order, each under
the limit (``hessian_groups``; a 7B shape: 8 groups), and the calibration makes one pass over
the same tokens per group (the first also gathers the importance vectors and the probes): each
group's sums are factored and appended to the factors file (``FactorWriter``) and freed before
the next pass. Each sum is the one pass's, bit for bit (the same ONNX Runtime values added in
the same order), so the factors and the quantized bytes are too. What it costs is one more
forward pass over the calibration tokens per extra group; the X^T X products and the factors
are the same work. Measured (bench/quant/bench_gptq_groups.py; bench/results/
quantize_accuracy.md, "GPTQ"): the 0.5B at a 1 GiB limit, 3 passes, 114 s and 4.2 GB peak RSS
against one pass's 97 s and 7.0 GB (same bytes); SmolLM2 at 0.125 GiB, 4 passes, 20.5 s and 1.28
GB against 12.9 s and 1.78 GB (same bytes, KL 0.1059). Refused only where one input's
K x K alone passes the limit (K > 28,377 at 3 GiB), naming it; ``--recipe q4m`` then rounds by
the search and says why. AWQ with groups is refused too: its scaling of the factors needs every
sum first (the recipe with ``--awq`` rounds by the search).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._io import write_atomically
from fastopt._lazy import lazy_module
from fastopt.quant.blas_threads import blas_threads

if TYPE_CHECKING:
    import numpy as np

    from fastopt.quant.calibration import WeightUse
else:
    np = lazy_module("numpy")

# H += DAMP * mean(diag H) * I before the inverse (GPTQ's percdamp): the calibration tokens do
# not span every direction of a layer's input.
DAMP = 0.01
# The most bytes of float32 Hessian accumulators a calibration may hold (4 * sum of K^2 over
# distinct MatMul inputs).
MAX_HESSIAN_BYTES = 3 << 30
_ALIGN = 64  # offsets of the factors in the data file
# Act order: each weight's rows coded in decreasing H_kk (written as "<weight>#order", the
# factor being that of the permuted H; csrc/quant/gptq.h), blocks' parameters chosen before any
# row is coded. Off: on SmolLM2 (q4m + GPTQ, fp16) KL 0.113 against 0.106 along K, dithered
# 0.147 against 0.144 (noise level), though its in-sample error is lower
# (bench/results/quantize_accuracy.md, "GPTQ").
ACT_ORDER = False


def hessian_bytes(uses: Sequence[WeightUse]) -> int:
    """Bytes of the float32 accumulators for these MatMul uses (one K x K per distinct input)."""
    ks = {u.a: u.k for u in uses}
    return sum(4 * k * k for k in ks.values())


def hessian_groups(uses: Sequence[WeightUse], limit: int | None = None) -> list[list[str]]:
    """The distinct MatMul inputs in graph order, cut into runs whose float32 X^T X take at most
    ``limit`` bytes (MAX_HESSIAN_BYTES) each: one calibration pass collects each run. One group
    when everything fits (the one-pass collection); ModelError when one input's K x K alone is
    over the limit."""
    limit = MAX_HESSIAN_BYTES if limit is None else limit
    too_big = oversized(uses, limit)
    if too_big:
        raise _C.ModelError(f"gptq: {too_big}; use --method search with the calibration instead")
    groups: list[list[str]] = []
    held = limit + 1  # (the first input opens a group)
    for a, k in {u.a: u.k for u in uses}.items():
        need = 4 * k * k
        if held + need > limit:
            groups.append([])
            held = 0
        groups[-1].append(a)
        held += need
    return groups


def oversized(uses: Sequence[WeightUse], limit: int | None = None) -> str:
    """What passes ``limit`` (MAX_HESSIAN_BYTES) alone: the first MatMul input whose K x K
    float32 sum does, in words; "" when none does."""
    limit = MAX_HESSIAN_BYTES if limit is None else limit
    for a, k in {u.a: u.k for u in uses}.items():
        if 4 * k * k > limit:
            return (
                f"the X^T X of MatMul input {a!r} (K = {k}) alone takes "
                f"{4 * k * k / 2**30:.2f} GiB of float32, over the {limit / 2**30:.2f} GiB limit"
            )
    return ""


def factor(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """U, upper triangular with H'^-1 = U^T U, of H' = H + damp * mean(diag H) * I (channels
    no token used get H_kk = 1), float32. More damping where the Cholesky fails.

    With P the reversal of the channels and P H' P = L L^T (Cholesky), H'^-1 = M^T M for
    M = P L^-1 P, upper triangular: one Cholesky and one triangular inverse (K^3 / 3 flops each
    with LAPACK through scipy, else numpy's general inverse), where the textbook route (Cholesky,
    inverse, Cholesky again) takes about 2.7 K^3."""
    h = np.array(h, np.float64)  # a copy: the caller's stays
    d = np.diagonal(h).copy()
    dead = d <= 0
    idx = np.arange(h.shape[0])
    h[idx[dead], idx[dead]] = 1.0
    mean = float(d[~dead].mean()) if (~dead).any() else 1.0
    flipped = np.ascontiguousarray(h[::-1, ::-1])
    for attempt in range(6):
        hd = flipped.copy()
        hd[idx, idx] += damp * (10.0**attempt) * mean
        try:
            linv = _lower_inverse(_cholesky(hd))
        except np.linalg.LinAlgError:
            continue
        return np.ascontiguousarray(linv[::-1, ::-1], np.float32)
    raise _C.ModelError("gptq: a Hessian stays singular after damping (NaN in the activations?)")


def _lapack() -> Any:
    """scipy.linalg.lapack, or None without scipy (not a dependency of fastopt)."""
    import importlib

    try:
        return importlib.import_module("scipy.linalg.lapack")
    except ImportError:
        return None


def _cholesky(a: np.ndarray) -> np.ndarray:
    """Lower Cholesky factor (LAPACK's dpotrf through scipy where installed: 6x numpy's
    cholesky at K = 1536 here); LinAlgError when ``a`` is not positive definite."""
    lapack = _lapack()
    if lapack is None:
        return np.linalg.cholesky(a)
    c, info = lapack.dpotrf(a.T, lower=1, clean=1)  # (symmetric: a.T is its Fortran order)
    if info != 0:
        raise np.linalg.LinAlgError(f"dpotrf: {info}")
    return c


def _lower_inverse(lower: np.ndarray) -> np.ndarray:
    """The inverse of a lower triangular matrix (LAPACK's dtrtri where scipy is installed)."""
    lapack = _lapack()
    if lapack is None:
        return np.tril(np.linalg.inv(lower))
    inv, info = lapack.dtrtri(lower, lower=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"dtrtri: {info}")
    return np.tril(inv)


@dataclass
class FactorReport:
    weights: int = 0  # weights given a factor
    factors: int = 0  # distinct factors computed (one per input and AWQ scaling)
    bytes: int = 0  # the data file
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class FactorWriter:
    """The factors file written group by group: ``add`` factors some weights' Hessians and
    appends the factors to the data file, the Hessians free to go after; ``finish`` writes
    ``path`` (an ONNX file naming each weight's bytes). ``input_scales`` and ``act_order`` as
    for write_factors. Weights share a factor only within one ``add`` (one input's weights are
    never split)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        input_scales: Mapping[str, np.ndarray] | None = None,
        damp: float = DAMP,
        act_order: bool | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.data_name = os.path.basename(self.path) + ".data"
        self.scales = input_scales or {}
        self.damp = damp
        self.ordered = ACT_ORDER if act_order is None else act_order
        self.report = FactorReport()
        self._inits: list[Any] = []
        data_path = os.path.join(os.path.dirname(os.path.abspath(self.path)), self.data_name)
        self._data = open(data_path, "wb")  # noqa: SIM115 (closed by finish or close)

    def add(self, hessians: Mapping[str, np.ndarray]) -> None:
        """Factors and appends ``hessians`` (weight -> H [K, K], the same array for the weights
        of one input)."""
        from onnx import TensorProto

        start = time.perf_counter()
        f, scales = self._data, self.scales
        # (H, scaling) -> offset and length of its factor, and of its order. Keyed by id(H):
        # only while this call holds the arrays.
        placed: dict[tuple[int, bytes], tuple[tuple[int, int], tuple[int, int] | None]] = {}
        with _blas_threads(1):
            for name in sorted(hessians):
                h = hessians[name]
                c = scales.get(name)
                key = (id(h), b"" if c is None else np.asarray(c, np.float32).tobytes())
                if key not in placed:
                    hh = h if c is None else h * np.outer(c, c)
                    order = np.argsort(-np.diagonal(hh), kind="stable") if self.ordered else None
                    u = factor(hh if order is None else hh[np.ix_(order, order)], self.damp)
                    at = _append(f, u.tobytes())
                    placed[key] = (at, None if order is None else _append(f, order.tobytes()))
                    self.report.factors += 1
                where, order_at = placed[key]
                k = h.shape[0]
                self._inits.append(
                    _external(name, TensorProto.FLOAT, [k, k], self.data_name, where)
                )
                if order_at is not None:
                    self._inits.append(
                        _external(f"{name}#order", TensorProto.INT64, [k], self.data_name, order_at)
                    )
                self.report.weights += 1
        self.report.seconds += time.perf_counter() - start

    def finish(self) -> FactorReport:
        from onnx import helper

        start = time.perf_counter()
        self.report.bytes = self._data.tell()
        self._data.close()
        graph = helper.make_graph([], "fastopt_hessian", [], [], initializer=self._inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        write_atomically(self.path, model.SerializeToString(), ".hessian-")
        self.report.seconds += time.perf_counter() - start
        return self.report

    def close(self) -> None:
        self._data.close()

    def __enter__(self) -> FactorWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_factors(
    hessians: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    input_scales: Mapping[str, np.ndarray] | None = None,
    damp: float = DAMP,
    act_order: bool | None = None,
) -> FactorReport:
    """Writes the factor of each weight's Hessian (``hessians``: weight -> H [K, K], the same
    array for the weights of one input) to ``path`` (an ONNX file) and its data file beside it.
    ``input_scales`` (weight -> c [K]): the weight's input is c * x (AWQ), H becomes
    diag(c) H diag(c). ``act_order`` (None: ACT_ORDER) adds each weight's coding order."""
    start = time.perf_counter()
    with FactorWriter(path, input_scales, damp, act_order) as writer:
        writer.add(hessians)
        report = writer.finish()
    report.seconds = time.perf_counter() - start
    return report


@contextmanager
def _blas_threads(n: int) -> Iterator[None]:
    """numpy's and scipy's OpenBLAS at ``n`` threads inside (fastopt.quant.blas_threads, scipy's
    library loaded first so that it is found). One factor of K <= a few thousand gains little
    from threads, and on a busy machine they cost: SmolLM2's 121 factors took 27-158 s with
    OpenBLAS's threads on 2 loaded cores, 4-6 s with one."""
    _lapack()
    with blas_threads(n):
        yield


def _append(f: Any, data: bytes) -> tuple[int, int]:
    """Writes ``data`` at the next aligned offset of ``f``: (offset, length)."""
    f.write(b"\0" * (-f.tell() % _ALIGN))
    offset = f.tell()
    f.write(data)
    return offset, len(data)


def _external(name: str, dtype: int, dims: list[int], location: str, at: tuple[int, int]) -> Any:
    """A TensorProto whose bytes are ``at`` (offset, length) in the data file ``location``."""
    from onnx import TensorProto

    t = TensorProto(name=name, data_type=dtype, dims=dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", at[0]), ("length", at[1])):
        entry = t.external_data.add()
        entry.key, entry.value = k, str(v)
    return t


def awq_input_scales(
    before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Per weight AWQ rescaled, c = 1 / s (its input is x / s), from the importance before and
    after (after = before / s^2); weights it left alone are not listed."""
    out = {}
    for name, b in before.items():
        a = after.get(name)
        if a is None or a is b:
            continue
        b64, a64 = np.asarray(b, np.float64), np.asarray(a, np.float64)
        ratio = np.divide(a64, b64, out=np.ones_like(b64), where=b64 > 0)
        if not np.allclose(ratio, 1.0, rtol=0, atol=1e-7):
            out[name] = np.sqrt(ratio).astype(np.float64)
    return out
