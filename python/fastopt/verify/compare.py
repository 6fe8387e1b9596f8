"""Comparing one run's outputs with another's: tolerances by dtype (wider where an
accelerator ran, see the ``fastopt.verify.core`` docstring), NaN/inf placement, and the text that
describes a mismatch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.verify.check import ModelLike
from fastopt.verify.report import OutputComparison

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

Tolerance = Union[float, Mapping[str, float], None]


# dtype name -> (atol, rtol)
_TOLERANCES = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (1e-2, 1e-2),
    "complex128": (1e-7, 1e-7),
    "complex64": (1e-4, 1e-4),
}


# The same when a side ran on an accelerator (see the module docstring).
_ACCELERATOR_TOLERANCES = {
    **_TOLERANCES,
    "float32": (1e-3, 1e-3),
    "float16": (2e-2, 2e-2),
    "bfloat16": (5e-2, 5e-2),
    "complex64": (1e-3, 1e-3),
}


def _float_kind(dtype: np.dtype) -> bool:
    return dtype.kind in "fc" or dtype.name in ("bfloat16",) or dtype.name.startswith("float")


def _default_tolerance(
    dtype: np.dtype, table: Mapping[str, tuple[float, float]] = _TOLERANCES
) -> tuple[float, float]:
    if dtype.name in table:
        return table[dtype.name]
    if _float_kind(dtype):
        import ml_dtypes

        eps = 2 * float(ml_dtypes.finfo(dtype).eps)
        return eps, eps
    return 0.0, 0.0


def _pick(option: Tolerance, name: str, is_float: bool, default: float) -> float:
    if isinstance(option, Mapping):
        return float(option[name]) if name in option else default
    if option is not None and is_float:
        return float(option)
    return default


def _compare(
    name: str,
    expected: Any,
    actual: Any,
    rtol: Tolerance,
    atol: Tolerance,
    table: Mapping[str, tuple[float, float]] = _TOLERANCES,
) -> list[OutputComparison]:
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not (isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple))):
            return [OutputComparison(name, "sequence", None, None, False, message="kind differs")]
        if len(expected) != len(actual):
            msg = f"sequence of {len(actual)} elements, expected {len(expected)}"
            return [OutputComparison(name, "sequence", None, None, False, message=msg)]
        found: list[OutputComparison] = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            found += _compare(f"{name}[{i}]", e, a, rtol, atol, table)
        return found
    e, a = np.asarray(expected), np.asarray(actual)
    result = OutputComparison(name, e.dtype.name, list(e.shape), list(a.shape), True)
    is_float = _float_kind(e.dtype)
    d_atol, d_rtol = _default_tolerance(e.dtype, table)
    result.atol = _pick(atol, name, is_float, d_atol)
    result.rtol = _pick(rtol, name, is_float, d_rtol)
    if e.dtype != a.dtype:
        result.ok, result.message = False, f"dtype {a.dtype.name}, expected {e.dtype.name}"
        return [result]
    if e.shape != a.shape:
        result.ok, result.message = False, "shapes differ"
        return [result]
    if e.size == 0:
        return [result]
    if e.dtype == np.object_:
        bad = e != a
        result.mismatches = int(np.count_nonzero(bad))
    else:
        wide = np.complex128 if e.dtype.kind == "c" else np.float64
        ef, af = e.astype(wide), a.astype(wide)
        nan_e, nan_a = np.isnan(ef), np.isnan(af)
        both = nan_e & nan_a
        # the same infinity, or both NaN, is a match; elsewhere the tolerance decides
        same = (ef == af) | both
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(same, 0.0, np.abs(ef - af))
            diff = np.where(np.isnan(diff), np.inf, diff)
            bad = diff > result.atol + result.rtol * np.abs(ef)
            bad |= nan_e != nan_a
            result.max_abs_err = float(diff.max())
            big = np.abs(ef) > max(result.atol, np.finfo(np.float64).tiny)
            rel = diff[big] / np.abs(ef[big])
            result.max_rel_err = float(rel.max()) if rel.size else 0.0
        result.mismatches = int(np.count_nonzero(bad))
        nonfinite = int(np.count_nonzero(np.isfinite(ef) & ~np.isfinite(af)))
        if nonfinite:
            # An overflow (fp16) or a NaN the original does not have: say so, not just "off".
            result.ok = False
            result.message = (
                f"{nonfinite} of {e.size} elements are NaN/inf where the original's are finite"
            )
            return [result]
    if result.mismatches:
        flat = np.asarray(bad).reshape(-1)
        where = int(np.argmax(diff.reshape(-1))) if e.dtype != np.object_ else int(np.argmax(flat))
        index = list(np.unravel_index(where, e.shape)) if e.shape else []
        result.ok = False
        result.message = (
            f"{result.mismatches} of {e.size} elements off; worst at {[int(i) for i in index]}: "
            f"{_scalar(e.reshape(-1)[where])} expected, got {_scalar(a.reshape(-1)[where])}"
        )
    return [result]


def _scalar(x: Any) -> str:
    value = x.item() if hasattr(x, "item") else x
    return f"{value:.7g}" if isinstance(value, float) else repr(value)


def _describe(array: np.ndarray) -> str:
    return f"{array.dtype.name}[{', '.join(map(str, array.shape))}]"


def _label(model: ModelLike) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    if isinstance(model, _C.Model):
        return f"<fastopt.Model of {model.path}>" if model.path else "<fastopt.Model>"
    return "<onnx.ModelProto>"


def _compare_outputs(
    want: Mapping[str, Any],
    got: Mapping[str, Any],
    rtol: Tolerance,
    atol: Tolerance,
    table: Mapping[str, tuple[float, float]],
    subject: str = "optimized",
) -> list[OutputComparison]:
    """Every output of `want` against `got` by name; missing and extra outputs fail."""
    found: list[OutputComparison] = []
    for name, expected in want.items():
        if name not in got:
            found.append(
                OutputComparison(name, "-", None, None, False, message=f"missing from {subject}")
            )
            continue
        found += _compare(name, expected, got[name], rtol, atol, table)
    for name in got:
        if name not in want:
            found.append(
                OutputComparison(name, "-", None, None, False, message="not in the original")
            )
    return found
