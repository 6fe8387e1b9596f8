"""``fastopt genai-whisper``: an onnxruntime-genai whisper folder (fastopt.genai.whisper)."""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape

from fastopt.cli.output import console
from fastopt.cli.progress import CommandProgress
from fastopt.errors import OptionError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "genai-whisper",
        help="write an onnxruntime-genai whisper folder (encoder, cached decoder, "
        "genai_config.json) from optimum's encoder.onnx and no-cache decoder.onnx",
    )
    p.add_argument("encoder", help="encoder.onnx (input_features -> last_hidden_state)")
    p.add_argument("decoder", help="decoder.onnx (input_ids, encoder_hidden_states -> logits)")
    p.add_argument("-o", "--output", required=True, help="the folder to write")
    p.add_argument("--config", help="the model's transformers config.json")
    p.add_argument(
        "--hf-config",
        metavar="DIR",
        help="the Hugging Face checkpoint's folder: its config.json (unless --config), "
        "generation_config.json's token ids, and its tokenizer files copied into the output",
    )
    p.add_argument(
        "--kv-cache",
        choices=("standard", "inplace"),
        default="inplace",
        help="the decoder's self-attention cache (default inplace: one max-length buffer)",
    )
    p.add_argument(
        "--cross-cache",
        choices=("encoder", "recompute"),
        default="encoder",
        help="encoder (default): the encoder also computes the cross-attention cache, which every "
        "decoder step reads; recompute: the decoder projects encoder_hidden_states at every step",
    )
    p.add_argument("--max-length", type=int, default=None, help="search.max_length")
    p.set_defaults(func=_cmd_genai_whisper)


def _cmd_genai_whisper(args: Any) -> int:
    from fastopt.genai.whisper import whisper_for_genai

    if args.config is None and args.hf_config is None:
        raise OptionError("genai-whisper needs --config FILE or --hf-config DIR")
    config = None
    if args.config is not None:
        with open(args.config) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise OptionError(f"{args.config} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise OptionError(f"{args.config} is not a JSON object")
    with CommandProgress("genai-whisper") as progress:
        progress.update("optimizing the encoder and the decoder, writing the folder")
        report = whisper_for_genai(
            args.encoder,
            args.decoder,
            args.output,
            config,
            kv_cache=args.kv_cache,
            max_length=args.max_length,
            cross_cache=args.cross_cache,
            hf_config=args.hf_config,
        )
    out = console()
    for line in report.notes:
        out.print(line, markup=False, highlight=False)
    out.print(
        f"wrote {escape(report.folder)}: encoder {report.encoder.nodes_before} -> "
        f"{report.encoder.nodes_after} nodes, decoder {report.decoder.nodes_before} -> "
        f"{report.decoder.nodes_after} nodes ({args.kv_cache} self-attention cache, "
        + (
            "cross-attention cache computed by the encoder)"
            if args.cross_cache == "encoder"
            else "cross-attention recomputed from encoder_hidden_states each step)"
        )
    )
    return 0
