"""``fastopt.optimize``: runs a preset or a list of passes and reports what each did."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Union

from fastopt import _C
from fastopt._io import check_output_path, load
from fastopt.errors import OptionError, UnsupportedModelError, entry_point
from fastopt.genai.config import (
    GENAI_CONFIG,
    PRESENT_KEY,
    GenaiConfigError,
    GenaiRunnerError,
    build_genai_config,
    genai_config_bytes,
    is_in_place,
)
from fastopt.genai.hf import (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    HfFiles,
    find_hf_files,
    hf_values,
)
from fastopt.pipeline.options import check_options
from fastopt.pipeline.registry import (
    NO_INTERNAL_OPS,
    PassContext,
    Target,
    all_passes,
    check_explain,
    default_opset,
    finishing_pass,
    get_pass,
    place,
    preset,
)
from fastopt.quant import recipe as quant_recipe
from fastopt.quant.checks import extra_options
from fastopt.quant.fp16_ranges import RangeCheck, check_ranges
from fastopt.quant.settings import QDQ_OPSET, Mode, QuantSettings, WeightQuantization
from fastopt.verify.run_check import run_check as check_runs

# An encoder-decoder's cached decoder (add_kv_cache's seq2seq form) has optimum's names.
SEQ2SEQ_PRESENT_KEY = "present.%d.decoder.key"

ModelOrPath = Union[_C.Model, str, "os.PathLike[str]"]
# Called before each pass with (index, count, pass name); for progress displays.
ProgressFn = Callable[[int, int, str], None]
# Called by long passes (quantization) with (done, total, what): source bytes quantized so far.
WorkProgressFn = Callable[[int, int, str], None]
KvCache = Literal["standard", "inplace"]
# ctx.options["kv_cache"] values read by add_kv_cache and the cache-aware lowerings.
_KV_CACHE_MODES: dict[str, int] = {"standard": 1, "inplace": 2}
KV_CACHE_PASS = "add_kv_cache"


@dataclass
class PassReport:
    name: str
    rewrites: int
    seconds: float
    nodes_after: int
    counters: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None  # why the pass did not run
    # Not rerun: the pass is idempotent and no pass changed the model since it last ran.
    unchanged: bool = False


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
        quantize = QuantSettings.of(quantize)
        _check_quantize(quantize)
        if output is not None and not quantize.tmpdir:
            # Quantized bytes written next to the output become its data file: no second copy.
            quantize = replace(quantize, tmpdir=os.path.dirname(os.path.abspath(os.fspath(output))))
    start = time.perf_counter()
    # Names and options first: a misspelling fails before any work, not after some passes ran.
    names = list(passes) if passes is not None else _preset_passes(preset)
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
        names = _with_kv_cache(names, kv_cache, target)
        pass_options["kv_cache"] = _KV_CACHE_MODES[kv_cache]
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
    reports: list[PassReport] = []
    range_check: RangeCheck | None = None
    recipe = None
    # An idempotent pass is not rerun while the model is as it left it: `changes` counts the
    # passes that rewrote something, `clean_at[name]` is that count when `name` last ran.
    changes = 0
    clean_at: dict[str, int] = {}
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        spec = get_pass(name)
        opset = default_opset(ctx.model)
        if not spec.applies_to(opset):
            reports.append(
                PassReport(name, 0, 0.0, ctx.model.node_count(), skipped=f"opset {opset}")
            )
            continue
        if clean_at.get(name) == changes:
            reports.append(PassReport(name, 0, 0.0, ctx.model.node_count(), unchanged=True))
            continue
        try:
            reports.append(_run_pass(name, ctx))
        except _C.ModelError as e:
            if name == KV_CACHE_PASS and _looks_like_encoder(ctx.model):
                raise UnsupportedModelError(_encoder_refusal(ctx.model, str(e))) from e
            raise
        changes += reports[-1].rewrites > 0
        if spec.idempotent:
            clean_at[name] = changes
    if any(op.startswith(_INTERNAL_DOMAIN + "::") for op in ctx.model.op_counts()):
        # A pass list that fused attention without lowering it: internal ops never leave.
        reports.append(_run_pass(finishing_pass(NO_INTERNAL_OPS), ctx))
        left = [op for op in ctx.model.op_counts() if op.startswith(_INTERNAL_DOMAIN + "::")]
        if left:  # a bug: no runtime knows these ops, so no output may hold one
            raise _C.ModelError(
                f"internal error: {', '.join(left)} could not be lowered (see --explain "
                "lower_attention); nothing was written"
            )
    if quantize is not None:
        if progress is not None:
            progress(len(names), len(names) + 1, quantize.pass_name)
        quant_reports, range_check, recipe = _quantize(ctx, quantize, work_progress)
        reports.extend(quant_reports)
    if progress is not None:
        progress(len(names), len(names), "")
    model = ctx.model
    model.verify()
    output_names = {v.name for v in model.graph.outputs if v is not None}
    # An encoder-decoder's decoder gets optimum's seq2seq names (present.0.decoder.key, ...).
    seq2seq = SEQ2SEQ_PRESENT_KEY % 0 in output_names
    if kv_cache is not None and PRESENT_KEY % 0 not in output_names and not seq2seq:
        # A safety net: add_kv_cache should refuse with its own reason; never hand back (or
        # write) a "cached" model without a cache.
        raise UnsupportedModelError(
            f"kv_cache: {KV_CACHE_PASS} added no KV cache (no present.0.key output)"
        )
    if kv_cache == "inplace":
        _check_inplace(model, seq2seq)
    ops_after = model.op_counts()
    out_path = None
    checked = ""
    if output is not None and run_check:
        result = check_runs(model, original, _not_for_cpu(ctx, quantize))
        checked = f"ran in {result.seconds:.2f} s" if result.ran else result.note
        if result.ran and result.note:
            checked = f"{result.note}, {result.seconds:.2f} s"
    genai_notes: list[str] = []
    if output is not None:
        out_path = os.fspath(output)
        side_files: dict[str, bytes] = {}
        if (
            kv_cache is None
            and hf_files is not None
            and hf_files.genai
            and _in_source_folder(hf_files, out_path)
        ):
            # Never replace the input's own genai_config.json unasked (it names the input).
            genai_notes = [
                f"genai_config.json not written: {hf_files.folder} holds the input's; write the "
                "output to another folder for a genai folder of its own"
            ]
        elif not seq2seq and (kv_cache is not None or hf_files is not None):
            # (onnxruntime-genai runs an encoder-decoder as a folder of encoder and decoder:
            # fastopt.genai.whisper writes one for whisper; a decoder alone gets no config.)
            # Before the model: a model without its config is of no use to onnxruntime-genai,
            # and a config that cannot be derived should leave nothing written (with kv_cache;
            # without it a model that is not genai's form just gets no config). Committed with
            # the model, so an old config never sits beside the new model.
            inplace = kv_cache == "inplace"
            if kv_cache is None:  # as the folder's genai_config.json binds it, else the graph
                inplace = is_in_place(model) if hf.share_buffer is None else hf.share_buffer
            try:
                config, notes = build_genai_config(
                    model, os.path.basename(out_path), inplace=inplace, hf=hf
                )
            except GenaiRunnerError as e:  # the cached model runs in ORT; genai cannot hold it
                genai_notes = [f"genai_config.json not written: {e}"]
            except GenaiConfigError as e:
                if kv_cache is not None:
                    raise
                assert hf_files is not None
                genai_notes = [
                    f"genai_config.json not written (checkpoint files {hf_files.how} in "
                    f"{hf_files.folder}): {e}; kv_cache / --kv-cache gives a decoder its cache"
                ]
            else:
                side_files[GENAI_CONFIG] = genai_config_bytes(config)
                genai_notes = _genai_notes(hf_files, notes, out_path)
                side_files |= _copies(hf_files, out_path)
        model.save(out_path, external_data, side_files=side_files, fsync=fsync)
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


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _in_source_folder(files: HfFiles, out_path: str) -> bool:
    return _same_folder(files.folder, os.path.dirname(os.path.abspath(out_path)))


def _copies(files: HfFiles | None, out_path: str) -> dict[str, bytes]:
    """The checkpoint files to write beside the output (none when it is their own folder)."""
    if files is None or _in_source_folder(files, out_path):
        return {}
    return {k: v for k, v in files.copies.items() if k != GENAI_CONFIG}


def _genai_notes(files: HfFiles | None, notes: list[str], out_path: str) -> list[str]:
    """The report's lines on a written genai_config.json: its sources, then build_genai_config's
    notes, then the tokenizer."""
    if files is None:
        lines = [
            "genai_config.json: no checkpoint files (config.json, generation_config.json, "
            "tokenizer) beside the model and no hf_config (--hf-config DIR)"
        ]
    else:
        lines = [f"genai_config.json from {files.describe()}"]
    lines += notes
    if files is not None and files.has_tokenizer:
        copied = _copies(files, out_path)
        names = [n for n in TOKENIZER_FILES if n in copied]
        also = [n for n in (GENERATION_CONFIG, CONFIG) if n in copied]
        lines.append(
            f"tokenizer: copied {', '.join(names)}"
            + (f" (and {', '.join(also)})" if also else "")
            + f" from {files.folder}"
            if names
            else f"tokenizer: the output's folder {files.folder} holds the tokenizer files"
        )
    else:
        where = f"in {files.folder}" if files is not None else "beside the model"
        lines.append(
            f"tokenizer: no {TOKENIZER_CONFIG} with tokenizer.json or a sentencepiece model "
            f"{where}: onnxruntime-genai's Tokenizer will not open the output's folder; pass "
            "hf_config (--hf-config DIR) with the checkpoint's tokenizer files, or copy them in"
        )
    return lines


def _not_for_cpu(ctx: PassContext, quantize: QuantSettings | None) -> str:
    """Why the output is not meant for ONNX Runtime's CPU provider (a run check that fails is
    then a note, not an error), or ""."""
    if ctx.options.get("cuda"):
        return "made for CUDA (option cuda=1)"
    if quantize is not None and quantize.mode == "bf16":
        return "bf16 (ONNX Runtime's CPU provider has few bfloat16 kernels)"
    return ""


def _run_pass(name: str, ctx: PassContext) -> PassReport:
    # The pass counts into a fresh dict, merged afterwards: its own counters without comparing
    # every counter of the run before and after each pass.
    spec = get_pass(name)
    totals, ctx.counters = ctx.counters, {}
    try:
        t0 = time.perf_counter()
        rewrites = spec.run(ctx)
        seconds = time.perf_counter() - t0
    finally:
        own, ctx.counters = ctx.counters, totals
        for k, v in own.items():
            totals[k] = totals.get(k, 0) + v
    return PassReport(
        name, rewrites, seconds, ctx.model.node_count(), {k: v for k, v in own.items() if v}
    )


def _looks_like_encoder(model: _C.Model) -> bool:
    """No logits out, hidden states instead (BERT and its kin): for the KV-cache refusal's
    wording only; a causal model of this shape (CLIP's text tower) still gets its cache."""
    outputs = {v.name for v in model.graph.outputs if v is not None}
    return "logits" not in outputs and bool(outputs & {"last_hidden_state", "pooler_output"})


def _encoder_refusal(model: _C.Model, reason: str) -> str:
    outputs = ", ".join(v.name for v in model.graph.outputs if v is not None)
    reason = reason.removeprefix(f"{KV_CACHE_PASS}: cannot add a KV cache: ")
    return (
        f"kv_cache: this model looks like an encoder (outputs {outputs}, no logits): an encoder "
        "reads every position at once and has no decoder cache; a KV cache is for a decoder "
        f"that generates token by token ({KV_CACHE_PASS}: {reason})"
    )


def _check_quantize(settings: QuantSettings) -> None:
    settings.validate()
    if not any(p.name == settings.pass_name for p in all_passes()):
        raise _C.ModelError(
            f"mode {settings.mode} is not available (its pass {settings.pass_name} is not "
            "registered in this build)"
        )


def _quantize(
    ctx: PassContext, settings: QuantSettings, work_progress: WorkProgressFn | None
) -> tuple[list[PassReport], RangeCheck | None, quant_recipe.RecipeReport | None]:
    """The quantization step: target onnx's blocked DequantizeLinear needs opset 21 first; fp16
    measures the activations first and keeps the ops that overflow float32 (fp16_ranges);
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
        reports.append(_run_pass("convert_version", ctx))
    given = dict(ctx.options)  # the caller's options, before the settings' own
    ctx.options.update(settings.options())
    ctx.options.update(extra_options(ctx.model, settings, ctx.target, given))
    # (convert_precision refuses control flow and local functions: its message, not the check's)
    if settings.mode == "fp16" and settings.fp16_ranges and not _has_bodies(ctx.model):
        range_check = check_ranges(ctx.model, workdir=settings.tmpdir)
        ctx.options["precision_f32_values"] = range_check.option()
    ctx.progress = work_progress
    with ExitStack() as stack:  # the recipe's temporary files live until the pass is done
        if quant_recipe.needed(settings):
            recipe, recipe_options = quant_recipe.prepare(ctx.model, settings, stack)
            ctx.options.update(recipe_options)
        try:
            reports.append(_run_pass(settings.pass_name, ctx))
        finally:
            ctx.progress = None
    if range_check is not None:
        range_check.newly_kept = reports[-1].counters.get("nodes_kept_range", 0)
    return reports, range_check, recipe


def _has_bodies(model: _C.Model) -> bool:
    return bool(model.functions) or any(n.subgraphs for n in model.graph.nodes)


# Ops that exist only between two passes (see csrc/passes/attention/internal_op.h).
_INTERNAL_DOMAIN = _C.INTERNAL_DOMAIN


def _with_kv_cache(names: list[str], kv_cache: str, target: str) -> list[str]:
    """The pass list with add_kv_cache placed by its contract (registry.place): after the pass
    that fuses attention, whose internal Attention ops it edits, before lower_attention."""
    if kv_cache not in _KV_CACHE_MODES:
        raise OptionError(f"kv_cache must be 'standard', 'inplace' or None, not {kv_cache!r}")
    if kv_cache == "inplace" and target != "ort":
        raise OptionError(
            "kv_cache='inplace' needs target 'ort' (GroupQueryAttention shares one buffer as "
            "past and present; no standard op does)"
        )
    try:
        return place(names, KV_CACHE_PASS)
    except OptionError as e:
        raise OptionError(f"kv_cache: {e}; the cache is added to the fused attention ops") from None


def _check_inplace(model: _C.Model, seq2seq: bool) -> None:
    """In place, each present must be written by an op that updates the past buffer it is bound
    to (GroupQueryAttention); a Concat allocates a new tensor that cannot alias its input. A
    seq2seq decoder's cross cache (present.<i>.encoder.*: filled at the first step, passed
    through after) keeps the standard form."""
    for v in model.graph.outputs:
        if v is None or not v.name.startswith(_C.KV_PRESENT_PREFIX):
            continue
        if seq2seq and ".encoder." in v.name:
            continue
        producer = v.producer
        op = producer.op_type if producer is not None else "a graph input"
        if op != "GroupQueryAttention":
            raise UnsupportedModelError(
                f"kv_cache='inplace': {v.name} is produced by {op}, not GroupQueryAttention: "
                "this model's attention was not lowered to the in-place form (use "
                "kv_cache='standard')"
            )


def _preset_passes(name: str) -> list[str]:
    return preset(name)
