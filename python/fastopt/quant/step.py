"""The quantization step of ``optimize(quantize=...)``: its settings, checked before any pass
runs, and the step itself, run last (after the fusions, the KV cache and pack_matmuls): what the
quantization pass needs first, then the pass.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import replace

from fastopt import _C
from fastopt.pipeline.manager import PassReport, WorkProgressFn, run_pass
from fastopt.pipeline.registry import PassContext, all_passes, default_opset
from fastopt.quant import recipe as quant_recipe
from fastopt.quant.checks import extra_options
from fastopt.quant.fp16_ranges import RangeCheck, check_ranges, with_angles
from fastopt.quant.settings import QDQ_OPSET, Mode, QuantSettings


def quant_settings(
    quantize: QuantSettings | Mode, output: str | os.PathLike[str] | None
) -> QuantSettings:
    """The settings optimize() runs with, checked (an unknown mode or a bad value raises)."""
    settings = QuantSettings.of(quantize)
    _check_quantize(settings)
    if output is not None and not settings.tmpdir:
        # Quantized bytes written next to the output become its data file: no second copy.
        settings = replace(settings, tmpdir=os.path.dirname(os.path.abspath(os.fspath(output))))
    return settings


def quantize_step(
    ctx: PassContext, settings: QuantSettings, work_progress: WorkProgressFn | None
) -> tuple[list[PassReport], RangeCheck | None, quant_recipe.RecipeReport | None]:
    """The quantization step: target onnx's blocked DequantizeLinear needs opset 21 first; fp16
    measures the activations first (on the calibration text too when given) and keeps the ops
    that overflow float32 (fp16_ranges); bf16 keeps the ops computing Sin/Cos angles float32
    (fastopt.quant.angles);
    int4/int8 runs calibration, AWQ and the bits budget first when asked (quant_recipe)."""
    reports = []
    range_check = None
    recipe = None
    if (
        ctx.target == "onnx"
        and settings.pass_name == "quantize_weights"
        and default_opset(ctx.model) < QDQ_OPSET
    ):
        ctx.options["opset"] = QDQ_OPSET
        reports.append(run_pass("convert_version", ctx))
    given = dict(ctx.options)  # the caller's options, before the settings' own
    ctx.options.update(settings.options())
    ctx.options.update(extra_options(ctx.model, settings, ctx.target, given))
    # (convert_precision refuses control flow and local functions: its message, not the check's)
    if settings.mode in ("fp16", "bf16") and not _has_bodies(ctx.model):
        if settings.mode == "fp16" and settings.fp16_ranges:
            range_check = check_ranges(
                ctx.model,
                workdir=settings.tmpdir,
                calibration=settings.calibration,
                hf_config=settings.hf_config,
            )
        if settings.mode == "bf16":  # (fp16: measured harmless up to 1,024 positions)
            range_check = with_angles(range_check, ctx.model)
        if range_check is not None:
            ctx.options["precision_f32_values"] = range_check.option()
    ctx.progress = work_progress
    with ExitStack() as stack:  # the recipe's temporary files live until the pass is done
        if quant_recipe.needed(settings):
            recipe, recipe_options = quant_recipe.prepare(ctx.model, settings, stack)
            ctx.options.update(recipe_options)
        try:
            reports.append(run_pass(settings.pass_name, ctx))
        finally:
            ctx.progress = None
    if range_check is not None:
        range_check.newly_kept = reports[-1].counters.get("nodes_kept_range", 0)
    return reports, range_check, recipe


def not_for_cpu(ctx: PassContext, quantize: QuantSettings | None) -> str:
    """Why the output is not meant for ONNX Runtime's CPU provider (a run check that fails is
    then a note, not an error), or "". bf16: the CPU provider has bf16 kernels for data movement
    and the norms only (tests/ort_behaviour/test_bf16_cpu_kernels.py)."""
    if ctx.options.get("cuda"):
        return "made for CUDA (option cuda=1)"
    if quantize is not None and quantize.mode == "bf16":
        return "bf16 (ONNX Runtime's CPU provider has few bfloat16 kernels)"
    return ""


def _check_quantize(settings: QuantSettings) -> None:
    settings.validate()
    if not any(p.name == settings.pass_name for p in all_passes()):
        raise _C.ModelError(
            f"mode {settings.mode} is not available (its pass {settings.pass_name} is not "
            "registered in this build)"
        )


def _has_bodies(model: _C.Model) -> bool:
    return bool(model.functions) or any(n.subgraphs for n in model.graph.nodes)
