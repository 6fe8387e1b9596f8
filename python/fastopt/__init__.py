"""fastopt: a fast ONNX graph optimizer for large language models.

The model lives in a C++ IR whose weights are zero-copy views into memory-mapped files, so a
multi-GB export costs megabytes of RAM to load, inspect and save.

Main entry points (each documented with its parameters, return value and errors):

- :func:`load`, :func:`load_bytes`, :func:`from_onnx` read a model; ``Model.save`` writes one.
- :func:`optimize` runs a preset or a list of passes; :func:`quantize` quantizes.
- :func:`check` checks a model; :func:`verify` compares a model with its original in ONNX
  Runtime; :func:`compare_providers` compares one model across execution providers.
- :mod:`fastopt.bench` (``run``, ``compare``) measures latency in ONNX Runtime.

Every problem with an input raises a :class:`ModelError` subclass naming it (see
:mod:`fastopt.errors`).
"""

from __future__ import annotations

import os as _os
import sys as _sys

from fastopt import passes as _passes  # noqa: F401  (registers the Python passes)
from fastopt._C import (
    Function,
    Graph,
    Match,
    Model,
    ModelError,
    Node,
    Pattern,
    PatternNode,
    Rewriter,
    Rule,
    Tensor,
    Value,
    apply_rules,
)
from fastopt._io import from_onnx, load, load_bytes, verify_checksums
from fastopt._signatures import spell_out_aliases
from fastopt.errors import OptionError, RejectedModelError, UnknownNameError, UnsupportedModelError
from fastopt.export import ExportError, ExportReport, export
from fastopt.optimize import OptimizeReport, PassReport, optimize
from fastopt.pipeline.options import OPTIONS, OptionSpec, register_option, unregister_option
from fastopt.pipeline.registry import (
    PRESET_DESCRIPTIONS,
    PRESETS,
    PassContext,
    PassSpec,
    all_passes,
    get_pass,
    register_pass,
    register_rules,
    unregister_pass,
)
from fastopt.pipeline.shapes import infer_shapes
from fastopt.quant.quantize import QuantizeReport, quantize
from fastopt.quant.settings import QuantSettings, WeightQuantization
from fastopt.runtime.version import OnnxRuntimeTooOldError as _OnnxRuntimeTooOldError
from fastopt.runtime.version import require_floor as _require_ort_floor
from fastopt.verify.check import CheckError, CheckReport, check
from fastopt.verify.core import (
    InputRejectedError,
    OutputRejectedError,
    VerifyError,
    VerifyReport,
    compare_providers,
    make_inputs,
    verify,
)
from fastopt.verify.quantized import QuantVerifyReport

__version__ = "0.1.0"

spell_out_aliases(
    check,
    compare_providers,
    from_onnx,
    infer_shapes,
    load,
    load_bytes,
    make_inputs,
    optimize,
    quantize,
    verify,
    verify_checksums,
)


def _refuse_old_onnxruntime() -> None:
    """An onnxruntime older than the floor cannot load fastopt's outputs: refuse it here, in one
    line. The `fastopt` command imports this package before its own error handling exists, so
    there the line is printed and the process exits 2, as for any other bad setting."""
    try:
        _require_ort_floor()
    except _OnnxRuntimeTooOldError as e:
        if _os.path.basename(_sys.argv[0]) in ("fastopt", "fastopt.exe", "__main__.py"):
            _sys.stderr.write(f"error: {e}\n")
            raise SystemExit(2) from None
        raise


_refuse_old_onnxruntime()

__all__ = [
    "OPTIONS",
    "PRESETS",
    "PRESET_DESCRIPTIONS",
    "CheckError",
    "CheckReport",
    "ExportError",
    "ExportReport",
    "Function",
    "Graph",
    "InputRejectedError",
    "Match",
    "Model",
    "ModelError",
    "Node",
    "OptimizeReport",
    "OptionError",
    "OptionSpec",
    "OutputRejectedError",
    "PassContext",
    "PassReport",
    "PassSpec",
    "Pattern",
    "PatternNode",
    "QuantSettings",
    "QuantVerifyReport",
    "QuantizeReport",
    "RejectedModelError",
    "Rewriter",
    "Rule",
    "Tensor",
    "UnknownNameError",
    "UnsupportedModelError",
    "Value",
    "VerifyError",
    "VerifyReport",
    "WeightQuantization",
    "__version__",
    "all_passes",
    "apply_rules",
    "check",
    "compare_providers",
    "export",
    "from_onnx",
    "get_pass",
    "infer_shapes",
    "load",
    "load_bytes",
    "make_inputs",
    "optimize",
    "quantize",
    "register_option",
    "register_pass",
    "register_rules",
    "unregister_option",
    "unregister_pass",
    "verify",
    "verify_checksums",
]
