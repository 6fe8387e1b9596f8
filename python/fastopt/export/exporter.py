"""torch.onnx exports of a checkpoint's graphs, with the inputs, names and dynamic axes
fastopt's fusions and its KV-cache rewrite expect (tests/fixtures/make_fixtures.py exports the
same way):

- decoder: input_ids, attention_mask, position_ids (where the model takes them), no cache ->
  logits; axes batch_size, sequence_length (add_kv_cache then gives it a cache);
- encoder: input_ids, attention_mask -> last_hidden_state;
- encoder-decoder: encoder.onnx as the encoder, decoder.onnx: input_ids,
  encoder_hidden_states, encoder_attention_mask (not whisper) -> logits, without a cache.

Dynamo (torch.export) is the default: its ONNX program refers to the model's own tensors and
saves them straight to one external data file, so the export holds the weights once.
TorchScript is the fallback the user may pick (it builds the whole protobuf in memory)."""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastopt.export.errors import ExportError, one_line

Exporter = Literal["dynamo", "torchscript"]
EXPORTERS = ("dynamo", "torchscript")
TORCHSCRIPT_OPSET = 17  # the fixtures' opset: sdpa exports, Attention-free standard ops
DATA_SUFFIX = ".data"


@dataclass
class GraphSpec:
    """One graph to export: `module(*example.values())` returns the outputs."""

    name: str  # the file stem: model, encoder, decoder
    module: Any  # torch.nn.Module
    example: dict[str, Any]  # input name -> torch tensor (the export's example)
    axes: dict[str, dict[int, str]]  # input name -> {axis: dim name}
    output: str
    output_axes: dict[int, str] = field(default_factory=dict)


def takes(module: Any, arg: str) -> bool:
    return arg in inspect.signature(module.forward).parameters


def decoder_graph(model: Any) -> GraphSpec:
    import torch

    positions = takes(model, "position_ids")

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, position_ids=None):
            kw: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
            if position_ids is not None:
                kw["position_ids"] = position_ids
            return self.m(**kw, use_cache=False).logits

    example = token_feeds(model.config, 2, 8, positions)
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in example}
    return GraphSpec("model", Decoder().eval(), example, axes, "logits", axes["input_ids"])


def encoder_graph(model: Any) -> GraphSpec:
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    example = token_feeds(model.config, 2, 8, False)
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in example}
    return GraphSpec(
        "model", Encoder().eval(), example, axes, "last_hidden_state", axes["input_ids"]
    )


def seq2seq_graphs(model: Any) -> list[GraphSpec]:
    """The encoder and the decoder (cross-attending to encoder_hidden_states), as
    tests/fixtures/make_seq2seq_fixtures.py splits them."""
    import torch

    whisper = model.config.model_type == "whisper"
    enc_module = model.get_encoder()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = enc_module

        def forward(self, x, attention_mask=None):
            if whisper:
                return self.m(input_features=x).last_hidden_state
            return self.m(input_ids=x, attention_mask=attention_mask).last_hidden_state

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask=None):
            extra: dict[str, Any] = {}
            if whisper:  # all ones: what whisper's decoder means (its packed-sequence check
                # over positions does not export)
                extra["decoder_attention_mask"] = torch.ones_like(input_ids)
            return self.m(
                encoder_outputs=(encoder_hidden_states,),
                attention_mask=encoder_attention_mask,
                decoder_input_ids=input_ids,
                use_cache=False,
                **extra,
            ).logits

    encoder, decoder = Encoder().eval(), Decoder().eval()
    enc_example = encoder_feeds(model.config, 2, 8)
    if whisper:
        enc_axes = {"input_features": {0: "batch_size"}}
    else:
        enc_axes = {n: {0: "batch_size", 1: "encoder_sequence_length"} for n in enc_example}
    with torch.no_grad():
        hidden = encoder(*enc_example.values())
    dec_example = {"input_ids": token_feeds(model.config, 2, 5, False)["input_ids"]}
    dec_example["encoder_hidden_states"] = hidden
    dec_axes = {
        "input_ids": {0: "batch_size", 1: "decoder_sequence_length"},
        "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"},
    }
    if not whisper:
        dec_example["encoder_attention_mask"] = enc_example["attention_mask"]
        dec_axes["encoder_attention_mask"] = {0: "batch_size", 1: "encoder_sequence_length"}
    enc_out_axes = {0: "batch_size"} if whisper else {0: "batch_size", 1: "encoder_sequence_length"}
    return [
        GraphSpec("encoder", encoder, enc_example, enc_axes, "last_hidden_state", enc_out_axes),
        GraphSpec("decoder", decoder, dec_example, dec_axes, "logits", dec_axes["input_ids"]),
    ]


def token_feeds(
    config: Any, batch: int, seq: int, positions: bool, seed: int = 0
) -> dict[str, Any]:
    """Seeded token ids (all unmasked) and, when taken, their positions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = int(config.vocab_size)
    feeds: dict[str, Any] = {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
        "attention_mask": torch.ones(batch, seq, dtype=torch.int64),
    }
    if positions:
        feeds["position_ids"] = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    return feeds


def encoder_feeds(config: Any, batch: int, seq: int, seed: int = 0) -> dict[str, Any]:
    """An encoder's inputs: token ids, or whisper's log-mel frames (2 * max_source_positions,
    the length its encoder takes)."""
    import torch

    if config.model_type != "whisper":
        return token_feeds(config, batch, seq, False, seed)
    g = torch.Generator().manual_seed(seed)
    frames = 2 * int(config.max_source_positions)
    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return {
        "input_features": torch.randn(batch, config.num_mel_bins, frames, generator=g).to(dtype)
    }


def export_graph(
    spec: GraphSpec,
    path: str,
    exporter: Exporter,
    opset: int | None,
    say: Callable[[str], None] | None = None,
) -> None:
    """Writes spec's graph to `path` (weights in path + ".data" for dynamo). Raises ExportError
    with the exporter's own words when torch cannot export the model. `say(step)` as the
    dynamo export's save starts."""
    import torch

    if exporter not in EXPORTERS:
        raise ExportError(f"--exporter must be dynamo or torchscript, not {exporter!r}")
    names = list(spec.example)
    try:
        # torch and transformers warn about their own internals (renamed axes, deprecated
        # tree specs): nothing the user can act on
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            if exporter == "torchscript":
                _torchscript(spec, names, path, opset or TORCHSCRIPT_OPSET)
            else:
                _dynamo(spec, names, path, opset, say or (lambda _: None))
    except ExportError:
        raise
    except Exception as e:  # torch's exporters raise every kind of exception
        other = "torchscript" if exporter == "dynamo" else "dynamo"
        raise ExportError(
            f"torch.onnx ({exporter}) failed to export the {spec.name} graph: "
            f"{one_line(e)} (try --exporter {other})"
        ) from e


def _torchscript(spec: GraphSpec, names: list[str], path: str, opset: int) -> None:
    import torch

    axes = dict(spec.axes)
    axes[spec.output] = spec.output_axes
    torch.onnx.export(
        spec.module,
        tuple(spec.example.values()),
        path,
        input_names=names,
        output_names=[spec.output],
        dynamic_axes=axes,
        opset_version=opset,
        dynamo=False,
    )


def _dynamo(
    spec: GraphSpec, names: list[str], path: str, opset: int | None, say: Callable[[str], None]
) -> None:
    import torch

    dims: dict[str, Any] = {}
    shapes = tuple(
        {a: dims.setdefault(d, torch.export.Dim(d)) for a, d in spec.axes[n].items()} for n in names
    )
    kwargs: dict[str, Any] = {} if opset is None else {"opset_version": opset}
    prog = torch.onnx.export(
        spec.module,
        tuple(spec.example.values()),
        input_names=names,
        output_names=[spec.output],
        dynamic_shapes=shapes,
        dynamo=True,
        verbose=False,
        **kwargs,
    )
    assert prog is not None  # dynamo=True always returns a program
    _drop_stack_traces(prog)
    say(f"saving the {spec.name} graph")
    # Straight from the model's tensors to one data file: no second copy of the weights.
    prog.save(path, external_data=True)


def _drop_stack_traces(prog: Any) -> None:
    """The dynamo exporter records each node's Python stack (this machine's paths)."""
    try:
        nodes = prog.model.graph.all_nodes()
    except AttributeError:
        return
    for node in nodes:
        for key in [k for k in node.metadata_props if "stack_trace" in k]:
            del node.metadata_props[key]


def data_files(path: str) -> list[str]:
    """The files an export wrote beside `path` (its external data), by name."""
    folder = os.path.dirname(path)
    return sorted(n for n in os.listdir(folder) if n != os.path.basename(path))
