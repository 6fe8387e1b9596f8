"""Mode-specific pass options and checks that need Python (onnx's schemas, running onnxruntime),
applied by fastopt.optimize right before the quantization pass runs."""

from __future__ import annotations

from collections.abc import Mapping

from fastopt import _C
from fastopt.quant.precision import precision_options
from fastopt.quant.settings import QuantSettings
from fastopt.runtime import kernels as ort_kernels

REDUCE_RANGE = "quant_reduce_range"


def reduce_range(settings: QuantSettings, given: Mapping[str, object]) -> bool:
    """int8-dynamic's 7-bit weights: as ``given`` (the caller's options) says, else on for
    per-channel scales where this machine's ONNX Runtime int8 GEMM saturates (x86 without VNNI,
    ort_kernels.int8_matmul_saturates). There every per-channel column reaches +-127 and pairs
    of products overflow int16: the llama fixture's logits measured cosine 0.981, top-1 0.70
    (gate 0.99 / 0.80) through an emulation of that kernel (tests/support/int8_saturation.py),
    0.998 / 0.89 with 7-bit weights; per-tensor scales measured the same with and without
    saturation."""
    if settings.pass_name != "quantize_dynamic":
        return False
    if REDUCE_RANGE in given:
        return bool(given[REDUCE_RANGE])
    return settings.per_channel and ort_kernels.int8_matmul_saturates()


def extra_options(
    model: _C.Model, settings: QuantSettings, target: str, given: Mapping[str, object]
) -> dict[str, object]:
    """Options for ``settings``' pass beyond QuantSettings.options() and ``given`` (the
    caller's options); ModelError when the installed onnxruntime cannot run what the settings
    ask for."""
    if settings.pass_name == "convert_precision":
        return dict(precision_options(model, settings.mode))
    if settings.pass_name != "quantize_dynamic":
        return {}
    out: dict[str, object] = {REDUCE_RANGE: int(reduce_range(settings, given))}
    if settings.per_channel and target == "ort":
        refused = ort_kernels.dynamic_quantize_matmul_per_channel()
        if refused:
            seven = ""
            if ort_kernels.int8_matmul_saturates():
                seven = "; keep its 7-bit weights, the default here: quant_reduce_range=1"
            raise _C.ModelError(
                "per_channel: this onnxruntime's DynamicQuantizeMatMul refuses per-column "
                f"scales ({refused}); use --target onnx (MatMulInteger{seven}) or per-tensor "
                "scales"
            )
    return out
