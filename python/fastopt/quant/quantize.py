"""``fastopt.quant.quantize``: weight-only int4/int8, int8 dynamic and fp16/bf16, in C++ over the
mapped weights, with a per-weight report.

Interface (shared by the quantization passes; keep it stable):

- ``fastopt.quantize(model_or_path, output=None, *, mode, block_size=32, symmetric=True,
  accuracy_level=None, exclude=(), lm_head=None, embeddings="keep", per_channel=False,
  keep_io_types=False, target="ort", threads=0, verify=False) -> QuantizeReport``.
- ``mode`` -> pass (fastopt.quant.settings.MODES): int4 / int8 -> ``quantize_weights``;
  int8-dynamic -> ``quantize_dynamic``; fp16 / bf16 -> ``convert_precision``. A mode whose pass
  is not registered raises ModelError "mode X is not available".
- The settings reach the pass as PassContext options (``QuantSettings.options()``): quant_mode,
  quant_bits, quant_block_size, quant_symmetric, quant_accuracy_level, quant_exclude (comma
  separated globs), quant_lm_head, quant_embeddings, quant_per_channel, quant_keep_io_types,
  quant_threads, quant_tmpdir; C++ passes read them with quant::read_options
  (csrc/passes/quant/options.h).
- Each pass appends one ``quant::QuantRecord`` per weight it looked at to
  ``PassContext::quant_records`` (csrc/quant/quant_record.h: weight, node, op, quantized or kept
  with a reason, dtype and bytes before/after, max and mean relative reconstruction error);
  they surface as ``OptimizeReport.quantization`` and ``QuantizeReport.weights``
  (fastopt.quant.settings.WeightQuantization). Long passes report progress through
  ``PassContext::progress(done, total, what)``.
- ``fastopt optimize ... --quantize MODE`` runs the same pass after the preset (fusions, KV
  cache, pack_matmuls), so packed QKV / gate-up are quantized packed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt.optimize import ModelOrPath, OptimizeReport, PassReport, WorkProgressFn, optimize
from fastopt.pipeline.options import check_options
from fastopt.pipeline.registry import Target
from fastopt.quant.checks import reduce_range
from fastopt.quant.fp16_ranges import RangeCheck
from fastopt.quant.recipe import RecipeReport, recipe_settings, recipe_untouched
from fastopt.quant.settings import (
    Mode,
    QuantSettings,
    QuantSummary,
    WeightQuantization,
)
from fastopt.verify.quantized import QuantVerifyReport, verify_quantized
from fastopt.verify.text_tokens import check_text_inputs

if TYPE_CHECKING:
    from fastopt.verify.real_text import TextReport


@dataclass
class QuantizeReport:
    mode: str
    settings: dict[str, Any]
    weights: list[WeightQuantization]
    summary: QuantSummary
    passes: list[PassReport]
    seconds: float
    output: str | None = None
    verify: QuantVerifyReport | None = None
    # fp16: ops kept float32 because their activations reach float16's range (fp16_ranges)
    range_check: RangeCheck | None = None
    # With a genai_config.json written: its sources and fallbacks (OptimizeReport.genai_notes).
    genai_notes: list[str] = field(default_factory=list)
    # int4/int8: calibration, AWQ and the bits allocation (fastopt.quant.recipe), when asked
    recipe: RecipeReport | None = None
    # The run check before the save (OptimizeReport.run_check): "ran in N s", "session created,
    # not run (...)", "skipped: why", or "" (no output, or run_check=False)
    run_check: str = ""
    model: _C.Model | None = field(default=None, repr=False, compare=False)

    @property
    def accuracy(self) -> TextReport | None:
        """The real-text measures of `verify` (perplexity ratio, KL, top-1), when it ran them."""
        return self.verify.text if self.verify else None

    @property
    def quantized(self) -> list[WeightQuantization]:
        return [w for w in self.weights if w.action == "quantized"]

    @property
    def kept(self) -> list[WeightQuantization]:
        return [w for w in self.weights if w.action == "kept"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "settings": self.settings,
            "summary": self.summary.to_dict(),
            "seconds": self.seconds,
            "output": self.output,
            "passes": [asdict(p) for p in self.passes],
            "weights": [asdict(w) for w in self.weights],
            "verify": self.verify.to_dict() if self.verify else None,
            "accuracy": _accuracy_dict(self.accuracy),
            "range_check": self.range_check.to_dict() if self.range_check else None,
            "genai_notes": self.genai_notes,
            "recipe": self.recipe.to_dict() if self.recipe else None,
            "run_check": self.run_check,
        }


def _accuracy_dict(text: TextReport | None) -> dict[str, Any] | None:
    if text is None:
        return None
    return {
        "perplexity_original": text.perplexity_original,
        "perplexity_output": text.perplexity_output,
        "perplexity_ratio": text.perplexity_ratio,
        "kl": text.kl_mean,
        "top1": text.top1,
        "ok": text.ok,
        "tokens": text.source,
    }


def quantize(
    model_or_path: ModelOrPath,
    output: str | os.PathLike[str] | None = None,
    *,
    mode: Mode,
    block_size: int = 32,
    symmetric: bool = True,
    method: str | None = None,
    importance: str | os.PathLike[str] | None = None,
    accuracy_level: int | None = None,
    exclude: Sequence[str] = (),
    lm_head: str | None = None,
    embeddings: str = "keep",
    per_channel: bool = False,
    keep_io_types: bool = False,
    fp16_ranges: bool = True,
    target: Target = "ort",
    threads: int = 0,
    verify: bool = False,
    verify_text: Sequence[str | os.PathLike[str]] = (),
    tokenizer: str | os.PathLike[str] | None = None,
    options: Mapping[str, object] | None = None,
    external_data: bool | str | None = None,
    progress: WorkProgressFn | None = None,
    run_check: bool = True,
    hf_config: str | os.PathLike[str] | None = None,
    calibration: str | None = None,
    awq: bool = False,
    bits_budget: float | None = None,
    importance_output: str | os.PathLike[str] | None = None,
    recipe: str | None = None,
) -> QuantizeReport:
    """Quantize a model's weights (int4/int8 weight-only, int8 dynamic) or its precision
    (fp16/bf16).

    Parameters
    ----------
    model_or_path : str, os.PathLike or fastopt.Model
        A path (never modified) or a Model (changed in place).
    output : str or os.PathLike, optional
        Where to save the result (atomically).
    mode : {"int4", "int8", "int8-dynamic", "fp16", "bf16"}
        int4/int8: blockwise round-to-nearest along K (target ort: com.microsoft MatMulNBits;
        target onnx: opset-21 blocked DequantizeLinear + MatMul).
    block_size : int, default 32
        int4/int8: rows per block, a power of two in 16..256.
    symmetric : bool, default True
        int4/int8: False adds a zero point per block.
    method : {"rtn", "search", "gptq"}, optional
        int4/int8 rounding: "search" picks each block's scale (and zero point) for the least
        (importance-weighted) squared error, as llama.cpp's k-quants; "rtn" rounds to nearest,
        byte for byte onnxruntime's MatMulNBitsQuantizer; "gptq" (int4, needs `calibration`)
        codes each weight row by row along K, feeding each row's rounding error into the rows
        after it through the calibration's X^T X (GPTQ), each block's scale chosen by the
        search. Default: "search" with `calibration` (it weights the search by the
        importance), else "rtn".
    importance : str or os.PathLike, optional
        int4/int8 search: an ONNX file whose float32 1-D initializers, named as the MatMul
        weights and of length K, weight each input channel's squared error (mean x^2 of the
        MatMul's input); weights without an entry are weighted uniformly.
    accuracy_level : int, optional
        MatMulNBits' accuracy_level 0..4 (default 4 for fp32, 0 for fp16/bf16 or option cuda=1).
    exclude : sequence of str, default ()
        Globs on node or weight names kept in float.
    lm_head : {"keep", "int4", "int8"}, optional
        The output projection (default: as the rest).
    embeddings : {"keep", "int4", "int8"}, default "keep"
        Gather tables, per row (com.microsoft GatherBlockQuantized; target onnx:
        DequantizeLinear + Gather).
    per_channel : bool, default False
        int8-dynamic: a scale per output column.
    keep_io_types : bool, default False
        fp16/bf16: keep float32 graph inputs and outputs.
    fp16_ranges : bool, default True
        fp16: run the float model on sample inputs first and keep in float32 the ops whose
        values reach a quarter of float16's range (``report.range_check`` lists them).
    target : {"ort", "onnx"}, default "ort"
    threads : int, default 0
        Quantizing threads (0: all cores).
    verify : bool, default False
        Compare the output with the original (needs a path and `output`); a causal LM on real
        text (perplexity ratio, KL, top-1: ``report.accuracy``, fastopt.verify.real_text).
    verify_text : sequence of paths, default ()
        With `verify`: UTF-8 text files scored besides the built-in prose (needs a tokenizer).
    tokenizer : str or os.PathLike, optional
        With `verify`: a tokenizer.json or a folder with one (default: beside the model).
    options : mapping, optional
        Pass settings, as for :func:`fastopt.optimize`.
    external_data : bool or None, default None
        As ``Model.save``.
    progress : callable, optional
        ``progress(done, total, what)``: bytes quantized so far.
    run_check : bool, default True
        ONNX Runtime loads the output before it is written, and runs it once where that reads
        or makes at most 256 MiB of weights (``report.run_check`` says which;
        fastopt.verify.run_check).
    hf_config : str or os.PathLike, optional
        The Hugging Face checkpoint folder, as for :func:`fastopt.optimize`: a decoder with
        genai's cache gets a genai_config.json from it (or from the files beside the input) and
        its tokenizer files beside the output (``report.genai_notes``).
    calibration : str, optional
        int4/int8: a text file, or "builtin" (prose shipped with fastopt), run through the float
        model in ONNX Runtime to measure each weight's input importance (mean x^2 per channel,
        fastopt.quant.calibration); tokenized with the model's tokenizer (tokenizer.json beside
        the model or in `hf_config`). "sampled", or no tokenizer: the model samples its own
        text (4,096 tokens, batched through a KV cache; fastopt.quant.sampled_text), which needs
        no data. fp16: the range check
        measures the activations on this text as well as on the random inputs, in one ONNX
        Runtime session (``report.range_check`` gives each kept op's maximum per source).
    awq : bool, default False
        int4/int8 with calibration: AWQ per-channel scaling folded into the norms that precede
        the weights (fastopt.quant.awq).
    bits_budget : float, optional
        int4: the average bits per weight of the quantized MatMul weights (scales and zero
        points included); the weights whose error drops most per extra bit go to int8
        (fastopt.quant.budget). ``report.recipe.allocation`` lists each weight's bits and error.
    importance_output : str or os.PathLike, optional
        With calibration: keep the importance file here (float32 1-D initializers named as the
        weights).
    recipe : str, optional
        A named recipe (fastopt.quant.recipe.RECIPES, e.g. "q4m"). Given alone (block size,
        symmetry, method, importance and bits budget at their defaults) it brings its settings
        (GPTQ with calibration); to change one of them, pass ``**recipe_settings(name)`` with
        yours. Its bits budget leaves all weights int4 where int4 alone is over it, instead of
        refusing.

    Returns
    -------
    QuantizeReport
        Per weight what was done and why (``weights``), a ``summary``, the passes, and the
        verification when asked for.

    Raises
    ------
    fastopt.OptionError
        A bad mode or setting.
    fastopt.ModelError
        A problem with the input or the output path (`verify` without paths too).
    """
    if recipe is not None and recipe_untouched(
        block_size=block_size,
        symmetric=symmetric,
        method=method,
        importance=importance,
        bits_budget=bits_budget,
    ):  # recipe="q4m" alone: its settings (the command line resolves its own flags first)
        chosen = recipe_settings(recipe, bool(calibration))
        block_size = chosen.get("block_size", block_size)
        symmetric = chosen.get("symmetric", symmetric)
        method = chosen.get("method", method)
        importance = chosen.get("importance", importance)
        bits_budget = chosen.get("bits_budget", bits_budget)
    settings = QuantSettings(
        mode=mode,
        block_size=block_size,
        symmetric=symmetric,
        method=method,
        importance=os.fspath(importance) if importance else "",
        accuracy_level=accuracy_level,
        exclude=tuple(exclude),
        lm_head=lm_head,
        embeddings=embeddings,
        per_channel=per_channel,
        keep_io_types=keep_io_types,
        fp16_ranges=fp16_ranges,
        threads=threads,
        # Quantized bytes wait beside the output: the save then copies within one filesystem.
        tmpdir=os.path.dirname(os.path.abspath(os.fspath(output))) if output else "",
        calibration=calibration,
        hf_config=os.fspath(hf_config) if hf_config is not None else None,
        awq=awq,
        bits_budget=bits_budget,
        importance_output=os.fspath(importance_output) if importance_output is not None else None,
        recipe=recipe,
    )
    settings.validate()
    if verify and (isinstance(model_or_path, _C.Model) or output is None):
        raise _C.ModelError("verify needs the input as a path and an output path")
    if tokenizer is None and hf_config is not None:  # the checkpoint's tokenizer scores --verify
        tokenizer = hf_config
    if verify:  # a bad text file or tokenizer fails before any work
        check_text_inputs(verify_text, tokenizer)
    if (
        output is not None
        and not isinstance(model_or_path, _C.Model)
        and os.path.abspath(os.fspath(output)) == os.path.abspath(os.fspath(model_or_path))
    ):
        raise _C.ModelError("the output path must differ from the input (it is never modified)")
    start = time.perf_counter()
    report: OptimizeReport = optimize(
        model_or_path,
        passes=[],
        target=target,
        output=output,
        external_data=external_data,
        options=options,
        quantize=settings,
        work_progress=progress,
        run_check=run_check,
        hf_config=hf_config,
    )
    seconds = time.perf_counter() - start
    vreport = None
    if verify:
        assert output is not None and not isinstance(model_or_path, _C.Model)
        vreport = verify_quantized(
            model_or_path, output, mode, tokenizer=tokenizer, texts=verify_text
        )
    shown = {k: v for k, v in asdict(settings).items() if k != "tmpdir"}
    shown["target"] = target
    if settings.pass_name == "quantize_dynamic":
        shown["reduce_range"] = reduce_range(settings, check_options(options or {}))
    return QuantizeReport(
        mode=mode,
        settings=shown,
        weights=report.quantization,
        summary=QuantSummary.of(report.quantization),
        passes=report.passes,
        seconds=seconds,
        output=report.output,
        verify=vreport,
        range_check=report.range_check,
        genai_notes=report.genai_notes,
        recipe=report.quant_recipe,
        run_check=report.run_check,
        model=report.model,
    )
