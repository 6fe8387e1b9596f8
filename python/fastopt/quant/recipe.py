"""The steps before weight quantization that settings ask for, run by fastopt.optimize right
before the quantize_weights pass, on the model about to be quantized:

1. ``calibration``: importance vectors from ONNX Runtime runs (fastopt.quant.calibration),
   written to an importance file the pass reads (option ``quant_importance``);
   or, with ``importance="norms"`` and no calibration, the data-free estimate from the weights
   (fastopt.quant.norm_importance);
2. ``awq``: per-channel scaling of norms into the weights that read them (fastopt.quant.awq);
3. ``bits_budget``: the int4/int8 choice per weight (fastopt.quant.budget), given to the pass as
   ``quant_int8_weights``; without a budget the errors are still measured when calibrated, for
   the report;
4. ``method gptq``: the calibration collects each input's X^T X too, and the factors GPTQ reads
   (fastopt.quant.gptq, after AWQ's scaling) go to a file the pass reads (``quant_hessian``).

``RECIPES`` names settings that go together (``fastopt quantize --recipe NAME``), measured on a
real model in bench/results/quantize_accuracy.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from fastopt import _C
from fastopt.quant.awq import AwqReport, apply_awq
from fastopt.quant.budget import BitsAllocation, allocate
from fastopt.quant.calibration import Importance, collect_importance
from fastopt.quant.gptq import FactorReport, FactorWriter, awq_input_scales, write_factors
from fastopt.quant.importance_file import write_importance_file
from fastopt.quant.norm_importance import norm_importance
from fastopt.quant.settings import METHODS, NORMS, QuantSettings, existing_folder

# name -> QuantSettings fields (fastopt.quantize's keyword arguments). Flags given explicitly win.
RECIPES: dict[str, dict[str, Any]] = {
    # int4 at <= 4.6 bits per weight, scales and zero points included: asymmetric blocks of 64
    # rounded by the search (4.31 bits with float16 scales, 4.56 with float32 ones), and int8
    # for the weights whose error drops most per extra bit with what is left. Block 64 so that
    # float32 models fit too (block 32's float32 scales alone make 5 bits). Measured on
    # SmolLM2-135M: bench/results/quantize_accuracy.md, "Recipes at <= 4.6 bits per weight".
    # The search is weighted by the data-free importance (importance="norms"): KL 0.299 -> 0.214
    # on SmolLM2, 0.329 -> 0.246 on its grid-broken copy.
    "q4m": {
        "symmetric": False,
        "block_size": 64,
        "method": "search",
        "bits_budget": 4.6,
        "importance": NORMS,
    },
}
# What a recipe changes when calibration is given: q4m rounds by GPTQ (KL on SmolLM2-135M
# 0.106 against the search's 0.187, 0.144 against 0.207 with its grid broken; quantize_accuracy.md,
# "GPTQ").
CALIBRATED: dict[str, dict[str, Any]] = {"q4m": {"method": "gptq"}}


def recipe_settings(name: str, calibrated: bool = False) -> dict[str, Any]:
    """The settings of recipe ``name`` (``calibrated``: with calibration given); ModelError
    naming the recipes for an unknown one."""
    if name not in RECIPES:
        raise _C.ModelError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return {**RECIPES[name], **(CALIBRATED.get(name, {}) if calibrated else {})}


# quantize()'s defaults of the settings a recipe sets.
_API_DEFAULTS: dict[str, Any] = {
    "block_size": 32,
    "symmetric": True,
    "method": None,
    "importance": None,
    "bits_budget": None,
}


def recipe_untouched(**given: Any) -> bool:
    """Whether quantize() was called with every setting a recipe sets at its default (the
    recipe's name alone): then the recipe's settings apply."""
    return all(given.get(k, v) == v for k, v in _API_DEFAULTS.items())


@dataclass
class RecipeReport:
    calibration: Importance | None = None
    norm_importance: int = 0  # weights given the data-free importance (importance="norms")
    importance_file: str | None = None  # kept only when the settings named one
    awq: AwqReport | None = None
    allocation: BitsAllocation | None = None
    gptq: FactorReport | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "calibration": self.calibration.to_dict() if self.calibration else None,
            "norm_importance": self.norm_importance,
            "importance_file": self.importance_file,
            "awq": self.awq.to_dict() if self.awq else None,
            "allocation": self.allocation.to_dict() if self.allocation else None,
            "gptq": self.gptq.to_dict() if self.gptq else None,
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


def _gptq_fits(model: _C.Model, settings: QuantSettings, report: RecipeReport) -> bool:
    """Whether GPTQ can collect the model's X^T X under fastopt.quant.gptq's limit (in one
    pass or in groups; not in groups with AWQ, whose scaling needs them at once); a note in
    the report if not."""
    from fastopt.quant import gptq
    from fastopt.quant.calibration import weight_matmuls

    uses = weight_matmuls(model)
    too_big = gptq.oversized(uses)
    if too_big:
        report.notes.append(f"gptq: {too_big}: the recipe rounds by the search")
        return False
    groups = gptq.hessian_groups(uses)
    if len(groups) > 1 and settings.awq:
        report.notes.append(
            f"gptq: {_awq_over_limit(len(groups))}: the recipe rounds by the search"
        )
        return False
    return True


def _awq_over_limit(passes: int) -> str:
    from fastopt.quant import gptq

    return (
        f"the X^T X pass the {gptq.MAX_HESSIAN_BYTES / 2**30:.1f} GiB limit ({passes} "
        "calibration passes), and awq's scaling needs them all at once"
    )


def _factor_sink(
    model: _C.Model, settings: QuantSettings, stack: ExitStack
) -> tuple[str, FactorWriter | None]:
    """Where GPTQ's factors go, and the writer that takes each group's Hessians as the
    calibration collects them when they do not fit at once (None: one pass, factored after)."""
    from fastopt.quant import gptq
    from fastopt.quant.calibration import weight_matmuls

    folder = stack.enter_context(
        tempfile.TemporaryDirectory(
            prefix="fastopt-gptq-", dir=existing_folder(settings.tmpdir) or None
        )
    )
    path = os.path.join(folder, "hessian.onnx")
    passes = len(gptq.hessian_groups(weight_matmuls(model)))
    if passes == 1:
        return path, None
    if settings.awq:
        raise _C.ModelError(f"gptq: {_awq_over_limit(passes)}; drop --awq")
    return path, stack.enter_context(FactorWriter(path))


def needed(settings: QuantSettings) -> bool:
    # (fp16's calibration measures its ranges instead: fastopt.quant.fp16_ranges)
    weight_only = settings.mode in ("int4", "int8")
    return weight_only and bool(
        settings.calibration
        or settings.awq
        or settings.bits_budget is not None
        or settings.importance == NORMS
    )


def prepare(
    model: _C.Model, settings: QuantSettings, stack: ExitStack
) -> tuple[RecipeReport, dict[str, object]]:
    """Runs the steps on ``model`` (AWQ edits it) and returns their report and the pass options
    they add. Temporary files live as long as ``stack``."""
    start = time.perf_counter()
    report = RecipeReport()
    options: dict[str, object] = {}
    bits = 8 if settings.mode == "int8" else 4
    # the rounding the pass will use (part of the settings where the search exists); GPTQ's
    # errors are estimated with the search, which chooses its blocks' parameters
    gptq = settings.rounding == "gptq"
    if gptq and settings.recipe is not None:
        gptq = _gptq_fits(model, settings, report)
        if not gptq:  # the recipe's choice, not the user's: the search instead
            options["quant_method"] = METHODS.index("search")
    method = "search" if settings.rounding == "gptq" else settings.rounding
    importance = None
    hessian_path, writer = "", None
    if gptq and settings.calibration:
        hessian_path, writer = _factor_sink(model, settings, stack)
    if settings.calibration:
        report.calibration = collect_importance(
            model,
            settings.calibration,
            settings.hf_config,
            workdir=settings.tmpdir,
            hessians=gptq,
            hessian_sink=writer.add if writer is not None else None,
        )
        importance = report.calibration.vectors
    elif settings.importance == NORMS and method != "rtn":  # (calibration's importance wins)
        importance = norm_importance(model)
        report.norm_importance = len(importance)
    if settings.awq:
        if importance is None:
            raise _C.ModelError("awq needs calibration (--calibration FILE|builtin|sampled)")
        report.awq, importance = apply_awq(
            model,
            importance,
            bits=bits,
            block_size=settings.block_size,
            symmetric=settings.symmetric,
            method=method,
        )
    if writer is not None:  # (factored group by group as the calibration went)
        report.gptq = writer.finish()
        options["quant_hessian"] = hessian_path
    elif gptq and report.calibration is not None:
        calibrated = report.calibration
        scales = awq_input_scales(calibrated.vectors, importance or {})
        report.gptq = write_factors(calibrated.hessians, hessian_path, scales)
        calibrated.hessians = {}  # the file holds what the pass needs
        options["quant_hessian"] = hessian_path
    if importance is not None:
        path = settings.importance_output
        if not path:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-imp-"))
            path = os.path.join(folder, "importance.onnx")
        write_importance_file(importance, path)
        report.importance_file = settings.importance_output
        if method != "rtn":  # (rtn's bytes are onnxruntime's: no weights)
            options["quant_importance"] = os.fspath(path)
    if settings.bits_budget is not None or report.calibration is not None:
        report.allocation = allocate(
            model,
            settings.bits_budget,
            block_size=settings.block_size,
            symmetric=settings.symmetric,
            importance=importance,
            exclude=settings.exclude,
            lm_head=settings.lm_head,
            method=method,
            over_floor_ok=settings.recipe is not None,
        )
        if settings.bits_budget is not None:
            options["quant_int8_weights"] = ",".join(report.allocation.int8_weights)
    report.seconds = time.perf_counter() - start
    return report, options
