"""fastopt: a fast ONNX graph optimizer for large language models.

The model lives in a C++ IR whose weights are zero-copy views into memory-mapped files, so a
multi-GB export costs megabytes of RAM to load, inspect and save.
"""

from __future__ import annotations

from fastopt._C import Function, Graph, Model, ModelError, Node, Tensor, Value
from fastopt._io import from_onnx, load, load_bytes
from fastopt.optimize import OptimizeReport, PassReport, optimize
from fastopt.registry import (
    PRESETS,
    PassContext,
    PassSpec,
    all_passes,
    get_pass,
    register_pass,
    unregister_pass,
)

__version__ = "0.1.0"

__all__ = [
    "Function",
    "Graph",
    "Model",
    "ModelError",
    "Node",
    "OptimizeReport",
    "PRESETS",
    "PassContext",
    "PassReport",
    "PassSpec",
    "Tensor",
    "Value",
    "__version__",
    "all_passes",
    "from_onnx",
    "get_pass",
    "load",
    "load_bytes",
    "optimize",
    "register_pass",
    "unregister_pass",
]
