#!/usr/bin/env python3
"""onnxruntime-genai whisper decode: the cross cache computed by the encoder vs recomputed by
the decoder at every step (fastopt.genai.whisper's two forms), in one process.

A random-weight whisper from the seq2seq fixture generator (max_source_positions 1500: genai
feeds exactly 3000 frames), exported with TorchScript, written by whisper_for_genai in both
forms, then generated greedily by og.Generator: the median time of a decode step over --rounds
generations, the forms interleaved; the tokens must be equal.

    python bench/export/bench_genai_whisper.py                                  # the fixture's size
    python bench/export/bench_genai_whisper.py --config '{"d_model": 384, "encoder_layers": 4,
        "decoder_layers": 4, "encoder_attention_heads": 6, "decoder_attention_heads": 6,
        "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536}'              # whisper-tiny's shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

FORMS = ("encoder", "recompute")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="{}", help="JSON overrides of the whisper config")
    ap.add_argument("--kv-cache", choices=("standard", "inplace"), default="inplace")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import make_seq2seq_fixtures as make
    import onnxruntime_genai as og
    from fastopt.genai.whisper import whisper_for_genai
    from support import seq2seq_generation as sg

    work = Path(tempfile.mkdtemp(prefix="bench-genai-whisper-"))
    overrides = {"max_source_positions": 1500, **json.loads(a.config)}
    make.export("whisper", "ts", work / "export", overrides)
    fx = sg.Seq2SeqFixture(work / "export")
    features = sg.encoder_feeds(fx)["input_features"][:1]
    start = int(fx.meta["decoder_start_token_id"])
    models = {}
    for form in FORMS:
        folder = work / form
        r = whisper_for_genai(
            fx.encoder, fx.decoder, folder, fx.meta["config"], kv_cache=a.kv_cache, cross_cache=form
        )
        print(f"{form}: encoder {r.encoder.nodes_after} nodes, decoder {r.decoder.nodes_after}")
        models[form] = og.Model(str(folder))
    steps: dict[str, list[float]] = {f: [] for f in FORMS}
    tokens: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for form in FORMS:
            params = og.GeneratorParams(models[form])
            params.set_search_options(max_length=a.tokens + 1, do_sample=False)
            g = og.Generator(models[form], params)
            inputs = og.NamedTensors()
            inputs["input_features"] = features
            g.set_inputs(inputs)
            g.append_tokens(np.array([[start]], np.int32))
            t0, n = time.perf_counter(), 0
            while not g.is_done():
                g.generate_next_token()
                n += 1
            steps[form].append((time.perf_counter() - t0) / n)
            tokens[form] = list(g.get_sequence(0))
    config = {
        k: fx.meta["config"].get(k) for k in ("d_model", "decoder_layers", "max_source_positions")
    }
    print(
        f"config {config}; {a.kv_cache} self-attention cache; {a.tokens} tokens, {a.rounds} rounds"
    )
    for form in FORMS:
        runs = ", ".join(f"{s * 1e3:.2f}" for s in steps[form])
        print(
            f"- cross cache {form}: median step "
            f"{statistics.median(steps[form]) * 1e3:.2f} ms ({runs})"
        )
    ratio = statistics.median(steps["recompute"]) / statistics.median(steps["encoder"])
    print(
        f"- recompute / encoder: {ratio:.1f}x; "
        f"tokens equal: {tokens['encoder'] == tokens['recompute']}"
    )


if __name__ == "__main__":
    main()
