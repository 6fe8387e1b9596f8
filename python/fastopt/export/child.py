"""The export's PyTorch half, run in a process of its own (``python -m fastopt.export.child
REQUEST.json``): read the checkpoint, load the model, compute PyTorch's outputs on the check
batch, export every graph into the raw folder, exit.

It runs apart because torch.export keeps tensors that view the checkpoint's safetensors mapping
alive from C++ after the model is freed (no Python referrer; neither torch._dynamo.reset nor the
fake-tensor cache clear frees them): in one process the check in ONNX Runtime then mapped the
raw export beside the whole checkpoint. When this process exits the OS takes back all of it.

What crosses back, into the raw folder: PyTorch's feeds and outputs (numpy, FEEDS_FILE), the
graphs and timings (RESULT_FILE); a refusal as ERROR_FILE. Progress goes to stdout, one line a
step, each prefixed with STEP (stray prints of torch and transformers go to stderr)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastopt.export.check import torch_outputs
from fastopt.export.errors import ExportError, one_line
from fastopt.export.exporter import (
    Exporter,
    decoder_graph,
    encoder_graph,
    export_graph,
    seq2seq_graphs,
)
from fastopt.export.load import Kind, load_model, load_tokenizer, read_checkpoint

STEP = "fastopt-export-step: "
REQUEST_FILE = "request.json"
RESULT_FILE = "torch_result.json"
FEEDS_FILE = "torch_outputs.npz"
ERROR_FILE = "torch_error.json"

StepFn = Callable[[str], None]


def _graphs(model: Any, kind: Kind) -> list[Any]:
    if kind == "decoder":
        return [decoder_graph(model)]
    if kind == "encoder":
        return [encoder_graph(model)]
    return seq2seq_graphs(model)


def _export_all(
    specs: list[Any], raw: Path, exporter: Exporter, opset: int | None, say: StepFn
) -> dict[str, str]:
    """Exports each graph into `raw`: name -> .onnx path."""
    exported: dict[str, str] = {}
    for spec in specs:
        say(f"torch.onnx ({exporter}): {spec.name} graph")
        path = str(raw / f"{spec.name}.onnx")
        export_graph(spec, path, exporter, opset, say)
        exported[spec.name] = path
    return exported


def _as_numpy(value: Any) -> Any:
    import torch

    return value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()


def export_torch(request: dict[str, Any], say: StepFn) -> None:
    """The PyTorch half of :func:`fastopt.export.stage`, writing its results into the raw
    folder (the parent has already read the folder for errors)."""
    import numpy as np

    t0 = time.perf_counter()
    raw = Path(request["raw"])
    ckpt = read_checkpoint(request["hf_dir"])
    tokenizer = load_tokenizer(ckpt, required=False)
    say(f"loading {ckpt.model_type} ({ckpt.weight_bytes / 1e6:.0f} MB)")
    model = load_model(ckpt, request["dtype"], request["opset"] or 18)
    specs = _graphs(model, ckpt.kind)
    say("running PyTorch on the check batch")
    expected = torch_outputs(specs, ckpt.config, tokenizer)
    arrays: dict[str, Any] = {}
    graphs = []
    for i, (spec, (feeds, what, want)) in enumerate(zip(specs, expected)):
        names = [k for k, v in feeds.items() if v is not None]
        arrays.update({f"{i}.feed.{k}": _as_numpy(feeds[k]) for k in names})
        arrays[f"{i}.expected"] = want
        graphs.append({"name": spec.name, "output": spec.output, "what": what, "feeds": names})
    np.savez(raw / FEEDS_FILE, **arrays)
    del arrays, expected
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    exported = _export_all(specs, raw, request["exporter"], request["opset"], say)
    for g in graphs:
        g["path"] = exported[g["name"]]
    result = {"graphs": graphs, "seconds": {"load": load_s, "export": time.perf_counter() - t1}}
    (raw / RESULT_FILE).write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    request_path = Path(argv[0])
    request = json.loads(request_path.read_text())
    progress = sys.stdout
    sys.stdout = sys.stderr  # stdout carries the steps alone

    def say(step: str) -> None:
        progress.write(STEP + " ".join(step.split()) + "\n")
        progress.flush()

    try:
        export_torch(request, say)
    except ExportError as e:
        error = {"export_error": True, "message": str(e)}
    except Exception as e:  # anything else: the parent names it in one line
        error = {"export_error": False, "message": one_line(e)}
    else:
        return 0
    (Path(request["raw"]) / ERROR_FILE).write_text(json.dumps(error))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
