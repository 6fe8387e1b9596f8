"""``fastopt.export``: a Hugging Face checkpoint folder -> ONNX -> the optimize pipeline -> a
folder onnxruntime-genai runs.

:func:`stage` does the part before ``optimize``: read the folder; in a child process
(:mod:`fastopt.export.child`) load the model, compute the check batch's PyTorch outputs and
export each graph into a scratch folder beside the output; once it has exited, check the export
in ONNX Runtime. Its caller optimizes the staged graphs into the
scratch folder (:func:`export` with ``fastopt.optimize``; the CLI with ``fastopt optimize``'s own
run, flags and report); when the block ends the checkpoint's tokenizer and generation files are
copied, the raw export is dropped and the folder renamed into place."""

from __future__ import annotations

import inspect
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastopt.errors import ModelError
from fastopt.export.check import GraphCheck, compare
from fastopt.export.errors import ExportError, require_extra
from fastopt.export.exporter import Exporter
from fastopt.export.folder import copy_side_files, staging
from fastopt.export.load import Checkpoint, Kind, load_tokenizer, read_checkpoint
from fastopt.export.torch_process import run_torch_export

StepFn = Callable[[str], None]
RAW = "export"  # the scratch folder's subfolder holding the raw export


@dataclass
class ExportReport:
    output: str
    kind: Kind
    model_type: str
    exporter: str
    dtype: str
    checkpoint_bytes: int
    graphs: list[str] = field(default_factory=list)  # the .onnx files written
    checks: list[GraphCheck] = field(default_factory=list)
    tokenizer: bool = False
    side_files: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # load, export, check, optimize
    optimize: list[Any] = field(default_factory=list)  # fastopt.OptimizeReport per graph
    torch_peak_rss: int = 0  # the PyTorch process's peak resident memory (load and export)

    def describe(self) -> str:
        steps = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return (
            f"{self.model_type} {self.kind} ({self.exporter}, {self.dtype}): "
            f"{', '.join(self.graphs)}; {steps}"
        )


def require_genai_config(folder: Path, notes: Sequence[str]) -> None:
    """A decoder exported with a cache is for onnxruntime-genai: without its config (a cache
    genai cannot hold) the export is refused with the reason, nothing written."""
    if not (folder / "genai_config.json").exists():
        why = next((n for n in notes if n.startswith("genai_config.json not written")), "")
        raise ExportError(
            f"{why or 'genai_config.json not written'}; --no-kv-cache exports the model "
            "without a cache (optimize --kv-cache gives it one for ONNX Runtime alone)"
        )


# The KV-cache rewrite's refusals begin with its pass name (the C++ pass's own errors) or with
# the option's name (optimize's checks of the cached result).
_KV_REFUSAL_PREFIXES = ("add_kv_cache:", "kv_cache:", "kv_cache=")
NO_KV_CACHE_HINT = (
    "--no-kv-cache exports the model without a cache (kv_cache=None; the export itself passed "
    "its check)"
)


def kv_refusal(error: BaseException) -> ExportError | None:
    """An export refused by the KV-cache rewrite alone (it passed its check against PyTorch, so
    it exports without a cache): the same line, naming --no-kv-cache; None for other errors."""
    text = " ".join(str(error).split())
    if not text.startswith(_KV_REFUSAL_PREFIXES):
        return None
    return ExportError(f"{text}; {NO_KV_CACHE_HINT}")


@dataclass
class Staged:
    """The exported graphs (name -> raw .onnx path) waiting to be optimized into `folder`."""

    checkpoint: Checkpoint
    folder: Path
    exported: dict[str, str]
    report: ExportReport

    def target(self, name: str) -> str:
        return str(self.folder / f"{name}.onnx")


@contextmanager
def stage(
    hf_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    exporter: Exporter = "dynamo",
    dtype: str = "fp32",
    opset: int | None = None,
    require_tokenizer: bool = True,
    progress: StepFn | None = None,
) -> Iterator[Staged]:
    """Exports and checks the checkpoint into a scratch folder beside `output`; the block
    writes the optimized graphs there (``staged.target(name)``); at its end the folder becomes
    `output`. Raises ExportError (nothing written) for a bad folder, an architecture
    transformers cannot load, a failed export or an export that disagrees with PyTorch."""
    require_extra()
    say = progress or (lambda _: None)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    say("reading the checkpoint")
    ckpt = read_checkpoint(hf_dir)
    tokenizer = load_tokenizer(ckpt, require_tokenizer)
    out = Path(output)
    with staging(out) as folder:
        raw = folder / RAW
        raw.mkdir()
        # PyTorch runs in a child process: torch.export keeps views of the checkpoint's
        # mapping alive after the model is freed, and the check must not hold both copies.
        request = {"hf_dir": str(ckpt.folder), "exporter": exporter, "dtype": dtype, "opset": opset}
        t1 = time.perf_counter()
        pt = run_torch_export(request, raw, say)
        seconds.update(pt.seconds)
        seconds["load"] += t1 - t0  # the parent's reading of the folder and tokenizer
        exported = {g.name: g.path for g in pt.graphs}
        t2 = time.perf_counter()
        say("checking the export against PyTorch")
        checks = [
            compare(g.name, g.output, g.path, g.feeds, g.what, g.expected, dtype) for g in pt.graphs
        ]
        del pt.graphs[:]  # PyTorch's outputs: not needed past the check
        seconds["check"] = time.perf_counter() - t2
        report = ExportReport(
            str(out),
            ckpt.kind,
            ckpt.model_type,
            exporter,
            dtype,
            ckpt.weight_bytes,
            graphs=[f"{n}.onnx" for n in exported],
            checks=checks,
            tokenizer=tokenizer is not None,
            seconds=seconds,
            torch_peak_rss=pt.peak_rss,
        )
        staged = Staged(ckpt, folder, exported, report)
        yield staged
        missing = [n for n in report.graphs if not (folder / n).is_file()]
        if missing:  # the caller stopped before writing every graph
            raise ExportError(f"export: {', '.join(missing)} not written; nothing was kept")
        shutil.rmtree(raw)
        report.side_files = copy_side_files(ckpt.folder, folder)


def hf_config_kwargs(fn: Callable[..., Any], hf_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``hf_config=hf_dir`` where `fn` takes it (optimize and quantize read the checkpoint's
    config for genai_config.json once they do)."""
    return (
        {"hf_config": os.fspath(hf_dir)} if "hf_config" in inspect.signature(fn).parameters else {}
    )


def export(
    hf_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    exporter: Exporter = "dynamo",
    dtype: str = "fp32",
    opset: int | None = None,
    preset: str = "default",
    passes: Sequence[str] | None = None,
    target: str = "ort",
    kv_cache: str | None = "standard",
    quantize: Any = None,
    options: Mapping[str, object] | None = None,
    external_data: bool | None = None,
    run_check: bool = True,
    require_tokenizer: bool = True,
    progress: StepFn | None = None,
) -> ExportReport:
    """Export a Hugging Face checkpoint folder and optimize it into a new folder.

    Parameters
    ----------
    hf_dir : str or os.PathLike
        A folder as ``save_pretrained`` writes it: config.json, the weights, the tokenizer.
    output : str or os.PathLike
        The folder to write (new, or empty): model.onnx (+ model.onnx.data) for a decoder or
        an encoder, encoder.onnx and decoder.onnx for an encoder-decoder; for a decoder with a
        KV cache genai_config.json; the checkpoint's tokenizer and generation files.
    exporter : {"dynamo", "torchscript"}, default "dynamo"
        torch.onnx's exporter; TorchScript is the fallback (it holds the weights twice).
    dtype : {"fp32", "fp16", "bf16"}, default "fp32"
        The dtype the model is loaded and exported in.
    opset : int, optional
        The export's opset (default: dynamo's own, 17 for TorchScript).
    preset, passes, target, options, external_data, run_check, quantize
        As ``fastopt.optimize``, which runs on every exported graph.
    kv_cache : {"standard", "inplace"} or None, default "standard"
        A decoder's KV cache (onnxruntime-genai needs one); ignored for encoders and
        encoder-decoders.
    require_tokenizer : bool, default True
        Refuse a decoder checkpoint without a tokenizer (onnxruntime-genai reads one).
    progress : callable, optional
        ``progress(step)`` as each step starts.

    Returns
    -------
    ExportReport
        What was exported, the export's check against PyTorch, the optimize reports.

    Raises
    ------
    fastopt.export.ExportError
        The folder, its architecture, the exporter or the check refused the export; a
        MissingExtraError when torch or transformers is not installed. Nothing is written.
    fastopt.ModelError
        As ``fastopt.optimize``.
    """
    from fastopt.optimize import optimize

    say = progress or (lambda _: None)
    with stage(
        hf_dir,
        output,
        exporter=exporter,
        dtype=dtype,
        opset=opset,
        require_tokenizer=require_tokenizer,
        progress=progress,
    ) as staged:
        t0 = time.perf_counter()
        for name, path in staged.exported.items():

            def on_pass(i: int, n: int, pass_name: str, graph: str = name) -> None:
                if pass_name:
                    say(f"optimize {graph}: {pass_name} ({i + 1} of {n})")
                else:
                    say(f"optimize {graph}: run check and write")

            say(f"optimize {name}: loading the export")
            try:
                report = optimize(
                    path,
                    preset=preset,
                    passes=passes,
                    target=target,  # type: ignore[arg-type]
                    output=staged.target(name),
                    external_data=external_data,
                    progress=on_pass,
                    options=options,
                    kv_cache=kv_cache if staged.report.kind == "decoder" else None,  # type: ignore[arg-type]
                    quantize=quantize,
                    run_check=run_check,
                    **hf_config_kwargs(optimize, hf_dir),
                )
            except ModelError as e:
                hinted = kv_refusal(e) if kv_cache is not None else None
                if hinted is None:
                    raise
                raise hinted from e
            report.model = None  # the folder holds it; do not keep its mapping open
            if staged.report.kind == "decoder" and kv_cache is not None:
                require_genai_config(staged.folder, report.genai_notes)
            staged.report.optimize.append(report)
        staged.report.seconds["optimize"] = time.perf_counter() - t0
    return staged.report
