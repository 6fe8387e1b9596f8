"""Mode-specific pass options and checks that need Python (onnx's schemas, running onnxruntime),
applied by fastopt.optimize right before the quantization pass runs."""

from __future__ import annotations

from fastopt import _C, ort_kernels
from fastopt.precision import precision_options
from fastopt.quant_settings import QuantSettings


def extra_options(model: _C.Model, settings: QuantSettings, target: str) -> dict[str, object]:
    """Options for ``settings``' pass beyond QuantSettings.options(); ModelError when the
    installed onnxruntime cannot run what the settings ask for."""
    if settings.pass_name == "convert_precision":
        return dict(precision_options(model, settings.mode))
    if settings.pass_name == "quantize_dynamic" and settings.per_channel and target == "ort":
        refused = ort_kernels.dynamic_quantize_matmul_per_channel()
        if refused:
            raise _C.ModelError(
                "per_channel: this onnxruntime's DynamicQuantizeMatMul refuses per-column "
                f"scales ({refused}); use target onnx (MatMulInteger) or per-tensor scales"
            )
    return {}
