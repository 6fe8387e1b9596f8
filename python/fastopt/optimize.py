"""``fastopt.optimize``: runs a preset or a list of passes and reports what each did."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Union

from fastopt import _C
from fastopt._io import check_output_path, load
from fastopt.errors import OptionError, entry_point
from fastopt.genai.folder import genai_side_files
from fastopt.genai.hf import find_hf_files, hf_values
from fastopt.pipeline import kv_cache as kv
from fastopt.pipeline.kv_cache import KvCache
from fastopt.pipeline.manager import PassReport, ProgressFn, WorkProgressFn, run_passes
from fastopt.pipeline.options import check_options
from fastopt.pipeline.registry import PassContext, Target, check_explain, get_pass
from fastopt.pipeline.registry import preset as preset_passes
from fastopt.quant.fp16_ranges import RangeCheck
from fastopt.quant.settings import Mode, QuantSettings, WeightQuantization
from fastopt.quant.step import not_for_cpu, quant_settings, quantize_step
from fastopt.verify.run_check import start_run_check

ModelOrPath = Union[_C.Model, str, "os.PathLike[str]"]
# What callers of optimize() name (its report, its callbacks), wherever they are defined.
__all__ = [
    "DEFAULT_PRESET",
    "ModelOrPath",
    "OptimizeReport",
    "PassReport",
    "ProgressFn",
    "WorkProgressFn",
    "optimize",
]


@dataclass
class OptimizeReport:
    passes: list[PassReport]
    nodes_before: int
    nodes_after: int
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    seconds: float
    target: str
    output: str | None = None
    preset: str | None = None  # the preset that ran; None when `passes` was given
    explain: list[str] = field(default_factory=list)
    # One line per shape inference of the run: "<pass>: native for N nodes (B bodies); onnx
    # fallback for <op types>" (the pass is infer_shapes, or the pass that needed types).
    shape_inference: list[str] = field(default_factory=list)
    # One entry per weight a quantization pass looked at (empty without quantize=...).
    quantization: list[WeightQuantization] = field(default_factory=list)
    # The run check before the save (fastopt.verify.run_check): "ran in N s", "skipped: why", or ""
    # when it did not apply (no output, or run_check=False).
    run_check: str = ""
    # fp16: the range check's findings (ops kept float32 because their values overflow).
    range_check: RangeCheck | None = None
    # With a genai_config.json written: where its values and the copied tokenizer files came
    # from, the values no file told (genai's defaults written), and what genai will not do.
    genai_notes: list[str] = field(default_factory=list)
    # int4/int8 with calibration, AWQ or a bits budget: fastopt.quant.recipe's report.
    quant_recipe: Any = None
    # The optimized model (not part of to_dict()).
    model: _C.Model | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        d["passes"] = [asdict(p) for p in self.passes]
        d["quantization"] = [asdict(w) for w in self.quantization]
        d["range_check"] = self.range_check.to_dict() if self.range_check else None
        d["quant_recipe"] = self.quant_recipe.to_dict() if self.quant_recipe else None
        return d

    @property
    def rewrites(self) -> int:
        return sum(p.rewrites for p in self.passes)

    def op_delta(self) -> dict[str, tuple[int, int]]:
        """op -> (before, after) for every op whose count changed."""
        ops = sorted(set(self.ops_before) | set(self.ops_after))
        return {
            op: (self.ops_before.get(op, 0), self.ops_after.get(op, 0))
            for op in ops
            if self.ops_before.get(op, 0) != self.ops_after.get(op, 0)
        }


DEFAULT_PRESET = "default"


@entry_point("optimize")
def optimize(
    model_or_path: ModelOrPath,
    preset: str = DEFAULT_PRESET,
    passes: Sequence[str] | None = None,
    target: Target = "ort",
    output: str | os.PathLike[str] | None = None,
    *,
    external_data: bool | str | None = None,
    fsync: bool = True,
    explain: str | None = None,
    max_iterations: int = 10,
    progress: ProgressFn | None = None,
    options: Mapping[str, object] | None = None,
    kv_cache: KvCache | None = None,
    quantize: QuantSettings | Mode | None = None,
    work_progress: WorkProgressFn | None = None,
    run_check: bool = True,
    hf_config: str | os.PathLike[str] | None = None,
) -> OptimizeReport:
    """Optimize a model: run a preset (or a list of passes) and report what each pass did.

    Parameters
    ----------
    model_or_path : str, os.PathLike or fastopt.Model
        A path (loaded here; the file is never modified) or a Model (optimized in place).
    preset : str, default "default"
        The passes to run: "default" (cleanup, the LLM fusions and the classic CNN fusions where
        they match), "llm", "classic" or "cleanup" (``fastopt.PRESETS``).
    passes : list of str, optional
        Exactly these passes, in this order (overrides `preset`).
    target : {"ort", "onnx"}, default "ort"
        "ort": ONNX Runtime's contrib ops allowed; "onnx": standard ONNX ops only.
    output : str or os.PathLike, optional
        Where to save the result (atomically; without it nothing is written).
    external_data : bool or None, default None
        As ``Model.save``: None puts weights in a data file only when the model is over 2 GB.
    fsync : bool, default True
        False returns before the bytes reach the disk (``Model.save(fsync=False)``).
    explain : str, optional
        A pass (all its rules), a rule, or "*": why it did or did not apply at each candidate
        node, in ``report.explain``.
    max_iterations : int, default 10
        Rounds of a rule pass before it stops at a fixed point.
    progress : callable, optional
        ``progress(index, count, pass_name)`` before each pass (name "" at the end).
    options : mapping, optional
        Settings for the passes, e.g. ``{"opset": 18}`` or ``{"fold_max_bytes": 1 << 16}``,
        checked against ``fastopt.OPTIONS``.
    kv_cache : {"standard", "inplace"}, optional
        Give a decoder exported without a KV cache one: "standard" (growing past/present) or
        "inplace" (one max-length buffer per layer, target "ort"). With `output`, a
        ``genai_config.json`` for onnxruntime-genai is written next to it (see `hf_config`).
    quantize : str or fastopt.QuantSettings, optional
        Quantize last, after the fusions, the cache and pack_matmuls: a mode name as
        ``--quantize`` takes ("int4", "int8", "int8-dynamic", "fp16", "bf16", default settings)
        or a QuantSettings. ``report.quantization`` lists every weight it looked at.
    work_progress : callable, optional
        ``work_progress(done, total, what)`` from long passes (quantization).
    run_check : bool, default True
        Before `output` is written, ONNX Runtime loads the result and runs it once on small
        inputs.
    hf_config : str or os.PathLike, optional
        The Hugging Face checkpoint folder (config.json, generation_config.json, tokenizer
        files); without it they are looked for beside the input model. genai_config.json takes
        token ids, model type, context length and search defaults from them, and the files are
        copied beside `output`. A genai_config.json is written with `kv_cache`, or when these
        files are known and the output already has genai's cache inputs and outputs.
        ``report.genai_notes`` says where each value came from and which fell back to genai's
        defaults.

    Returns
    -------
    OptimizeReport
        Per pass: rewrites, time, nodes after and counters; op counts before and after;
        ``explain`` lines; ``quantization`` (one entry per weight); ``model``.

    Raises
    ------
    fastopt.OptionError
        An unknown pass, preset, option or explain name, or a bad option value (before any
        pass runs).
    fastopt.UnsupportedModelError
        A rewrite asked for cannot be made (e.g. a KV cache for an encoder), with the reason.
    fastopt.RejectedModelError
        onnx, protobuf or ONNX Runtime refused the model.
    fastopt.verify.run_check.RunCheckError
        ONNX Runtime cannot run the result (nothing is written).
    fastopt.ModelError
        Any other problem with the input or the output path.
    """
    if target not in ("ort", "onnx"):
        raise OptionError(f"target must be 'ort' or 'onnx', not {target!r}")
    if quantize is not None:
        quantize = quant_settings(quantize, output)
    start = time.perf_counter()
    # Names and options first: a misspelling fails before any work, not after some passes ran.
    names = list(passes) if passes is not None else preset_passes(preset)
    for name in names:
        get_pass(name)
    if explain:
        check_explain(explain)
    pass_options: dict[str, object] = dict(check_options(options or {}))
    source = model_or_path.path if isinstance(model_or_path, _C.Model) else model_or_path
    # Before any work: a bad hf_config fails first. A dry run writes no folder to describe.
    hf_files = find_hf_files(hf_config, os.fspath(source) if source and output else None)
    hf = hf_values(hf_files)
    if hf.context_length is not None and "rotary_max_positions" not in pass_options:
        # The rotary caches fuse_rotary builds cover the model's context, not its default 4096.
        pass_options["rotary_max_positions"] = min(hf.context_length, _C.ROTARY_MAX_POSITIONS_LIMIT)
    if kv_cache is not None:
        names = kv.with_kv_cache(names, kv_cache, target)
        pass_options["kv_cache"] = kv.KV_CACHE_MODES[kv_cache]
    model = model_or_path if isinstance(model_or_path, _C.Model) else load(model_or_path)
    # The original as the run check may need it (only if the output fails): the file it was
    # loaded from (a Model edited in place has no other copy; making one would cost its size).
    original = model.path or None
    if output is not None and model.path:
        check_output_path(model.path, output)  # before the work; save checks the data files
    ops_before = model.op_counts()
    ctx = PassContext(
        model=model,
        target=target,
        max_iterations=max_iterations,
        explain_rule=explain or "",
        options=pass_options,
    )
    reports = run_passes(names, ctx, progress, explain_failure=kv.refusal)
    range_check: RangeCheck | None = None
    recipe = None
    if quantize is not None:
        if progress is not None:
            progress(len(names), len(names) + 1, quantize.pass_name)
        quant_reports, range_check, recipe = quantize_step(ctx, quantize, work_progress)
        reports.extend(quant_reports)
    if progress is not None:
        progress(len(names), len(names), "")
    model = ctx.model
    model.verify()
    seq2seq = kv.is_seq2seq(model)
    kv.check_cache(model, kv_cache, seq2seq)
    ops_after = model.op_counts()
    out_path = None
    checked = ""
    genai_notes: list[str] = []
    if output is not None:
        out_path = os.fspath(output)
        # The run check's child works while this process saves; the save names its files only
        # after the check passed (before_commit), so a refused output is never written.
        check = start_run_check(model, original, not_for_cpu(ctx, quantize)) if run_check else None
        try:
            side_files, genai_notes = genai_side_files(
                model, out_path, kv_cache=kv_cache, hf_files=hf_files, hf=hf, seq2seq=seq2seq
            )
            before_commit = check.finish if check is not None else None
            model.save(
                out_path, external_data, side_files=side_files, fsync=fsync,
                before_commit=before_commit,
            )  # fmt: skip
            if check is not None:
                checked = check.finish().line()
        finally:
            if check is not None:
                check.cancel()  # a child the save did not wait for (it failed first)
    return OptimizeReport(
        passes=reports,
        nodes_before=sum(ops_before.values()),
        nodes_after=sum(ops_after.values()),
        ops_before=ops_before,
        ops_after=ops_after,
        seconds=time.perf_counter() - start,
        target=target,
        output=out_path,
        preset=None if passes is not None else preset,
        explain=list(ctx.explain_lines),
        shape_inference=[f"{name}: {run.describe()}" for name, run in ctx.shape_runs],
        quantization=[WeightQuantization.from_record(r) for r in ctx.quant_records],
        run_check=checked,
        range_check=range_check,
        genai_notes=genai_notes,
        quant_recipe=recipe,
        model=model,
    )
