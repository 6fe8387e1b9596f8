"""Greedy generation for encoder-decoder fixtures (tests/fixtures/make_seq2seq_fixtures.py) in
ONNX Runtime, with and without the decoder's KV cache: the proof harness of add_kv_cache's seq2seq
form (csrc/passes/kv_cache/kv_cache_cross.cc).

- ``encode``: the encoder, run once.
- ``greedy_no_cache``: the reference; every step runs the no-cache decoder on the whole decoder
  sequence (decoder_start_token_id + tokens so far) and takes the argmax of the last position.
- ``greedy_cached``: the first step feeds the whole encoder output and empty pasts (the cross
  cache is computed there), every later step one token, encoder_hidden_states with 0 rows and the
  presents as pasts.
- ``greedy_inplace``: the same steps for an in-place decoder (``--kv-cache inplace``): each
  self-attention cache is one zeroed (B, H, max_length, D) buffer bound as both past and present
  (IOBinding), past_sequence_length says how many tokens it holds; the cross cache is fed as in
  ``greedy_cached``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnxruntime as ort

from support import llm_fixtures
from support.kv_generation import session

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "models"
SEQ2SEQ_ARCHS = ("bart", "marian", "whisper", "t5")
# The version matrix's encoder-decoders in the default run (llm_fixtures.matrix_params'
# default_archs): every release's t5 (eager attention before 5.24, relative bias) and whisper
# (conv front-end, learned positions); bart under -m slow.
MATRIX_DEFAULT_ARCHS = ("t5", "whisper")


@dataclass(frozen=True)
class Seq2SeqFixture:
    folder: Path
    # version-matrix fixtures: the transformers release (the name gets ".tf<release>")
    release: str | None = None

    @property
    def meta(self) -> dict[str, Any]:
        return dict(json.loads((self.folder / "meta.json").read_text()))

    @property
    def name(self) -> str:
        """The folder's name; a matrix fixture's ends in .tf<transformers release>."""
        folder = self.meta.get("folder", self.folder.name)
        return f"{folder}.tf{self.release}" if self.release else str(folder)

    @property
    def arch(self) -> str:
        return str(self.meta["arch"])

    @property
    def dtype(self) -> str:
        return str(self.meta["dtype"])

    @property
    def encoder(self) -> Path:
        return self.folder / "encoder.onnx"

    @property
    def decoder(self) -> Path:
        return self.folder / "decoder.onnx"

    def __str__(self) -> str:
        return self.name


def seq2seq_fixtures(arch: str | None = None, dtype: str | None = None) -> list[Seq2SeqFixture]:
    out = []
    for meta in sorted(FIXTURE_DIR.glob("*/meta.json")):
        if json.loads(meta.read_text()).get("kind") != "encoder-decoder":
            continue
        fx = Seq2SeqFixture(meta.parent)
        if (arch is None or fx.arch == arch) and (dtype is None or fx.dtype == dtype):
            out.append(fx)
    return out


def matrix_seq2seq_fixtures(
    release: str | None = None, arch: str | None = None, exporter: str | None = None
) -> list[Seq2SeqFixture]:
    """The version matrix's encoder-decoders (tests/fixtures/matrix/<release>/<name>/, made by
    make_matrix.py: encoder.onnx.gz + decoder.onnx.gz with their weights as mean/std),
    materialized into a temporary folder; sorted by release, then name."""
    out = []
    for rel in llm_fixtures.matrix_releases() if release is None else [release]:
        for meta_path in sorted((llm_fixtures.MATRIX_DIR / rel).glob("*/meta.json")):
            meta = json.loads(meta_path.read_text())
            if meta["kind"] != "encoder-decoder":
                continue
            if (arch is not None and meta["arch"] != arch) or (
                exporter is not None and meta["exporter"] != exporter
            ):
                continue
            folder = llm_fixtures.materialize(meta_path.parent, ("encoder", "decoder")).parent
            out.append(Seq2SeqFixture(folder, release=rel))
    return out


def encoder_feeds(fx: Seq2SeqFixture, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of two: rows of 9 and 6 tokens, right-padded (whisper: two random spectrograms)."""
    rng = np.random.default_rng(seed)
    meta = fx.meta
    if fx.arch == "whisper":
        mel = int(meta["config"]["num_mel_bins"])
        return {
            "input_features": rng.standard_normal((2, mel, int(meta["whisper_frames"]))).astype(
                meta["dtype"]
            )
        }
    vocab = int(meta["config"]["vocab_size"])
    ids = rng.integers(3, vocab, (2, 9)).astype(np.int64)
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    ids[1, 6:] = int(meta["config"].get("pad_token_id") or 0)
    return {"input_ids": ids, "attention_mask": mask}


def cached_decoder(
    fx: Seq2SeqFixture,
    kv_cache: str,
    cross_attention_cache: int,
    output: str | os.PathLike[str] | None = None,
) -> fastopt.Model:
    """fx's decoder optimized with preset llm, a `kv_cache` self-attention cache and add_kv_cache's
    option cross_attention_cache (0 recompute, 1 cached, 2 from the encoder), saved to `output`
    when given."""
    report = fastopt.optimize(
        str(fx.decoder),
        output=None if output is None else str(output),
        preset="llm",
        kv_cache=kv_cache,  # type: ignore[arg-type]
        options={"cross_attention_cache": cross_attention_cache},
    )
    assert report.model is not None
    return report.model


def encode(
    fx: Seq2SeqFixture, feeds: dict[str, np.ndarray], model: str | os.PathLike[str] | None = None
) -> np.ndarray:
    sess = session(model or fx.encoder)
    return np.asarray(sess.run(["last_hidden_state"], feeds)[0])


@dataclass
class Generation:
    tokens: np.ndarray  # (B, steps)
    logits: np.ndarray  # (steps, B, vocab)


def _decoder_feeds(
    sess: ort.InferenceSession, ids: np.ndarray, hidden: np.ndarray, mask: np.ndarray | None
) -> dict[str, np.ndarray]:
    names = {i.name for i in sess.get_inputs()}
    feeds = {"input_ids": ids}
    if "encoder_hidden_states" in names:  # not when the encoder computes the cross cache
        feeds["encoder_hidden_states"] = hidden
    if mask is not None and "encoder_attention_mask" in names:
        feeds["encoder_attention_mask"] = mask
    return feeds


def greedy_no_cache(
    decoder: str | os.PathLike[str] | ort.InferenceSession,
    hidden: np.ndarray,
    mask: np.ndarray | None,
    start: int,
    steps: int,
) -> Generation:
    sess = session(decoder)
    ids = np.full((hidden.shape[0], 1), start, np.int64)
    picked = []
    for _ in range(steps):
        logits = np.asarray(sess.run(["logits"], _decoder_feeds(sess, ids, hidden, mask))[0])
        last = logits[:, -1].astype(np.float32)
        picked.append(last)
        ids = np.concatenate([ids, last.argmax(-1)[:, None].astype(np.int64)], axis=1)
    return Generation(ids[:, 1:], np.stack(picked))


def greedy_cached(
    decoder: str | os.PathLike[str] | bytes | ort.InferenceSession,
    hidden: np.ndarray,
    mask: np.ndarray | None,
    start: int,
    steps: int,
    cross: dict[str, np.ndarray] | None = None,
) -> Generation:
    """`cross`: the cross cache an encoder computed (past_key_values.<i>.encoder.*, bound at
    every step), for a decoder without encoder_hidden_states."""
    sess = session(decoder)
    batch = hidden.shape[0]
    cross = cross or {}
    pasts: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values.") and i.name not in cross:
            heads, dim = int(i.shape[1]), int(i.shape[3])
            pasts[i.name] = np.zeros((batch, heads, 0, dim), hidden.dtype)
    outputs = [o.name for o in sess.get_outputs()]
    ids = np.full((batch, 1), start, np.int64)
    tokens, picked = [], []
    states = hidden
    for _ in range(steps):
        outs = sess.run(outputs, {**_decoder_feeds(sess, ids, states, mask), **cross, **pasts})
        got = dict(zip(outputs, outs))
        last = np.asarray(got["logits"])[:, -1].astype(np.float32)
        picked.append(last)
        ids = last.argmax(-1)[:, None].astype(np.int64)
        tokens.append(ids[:, 0])
        pasts = {
            n.replace("present.", "past_key_values.", 1): got[n]
            for n in got
            if n.startswith("present.")
        }
        if any(".encoder." in n for n in pasts):  # the cross cache holds them now
            states = hidden[:, :0]
    return Generation(np.stack(tokens, axis=1), np.stack(picked))


def greedy_inplace(
    decoder: str | os.PathLike[str] | bytes | ort.InferenceSession,
    hidden: np.ndarray,
    mask: np.ndarray | None,
    start: int,
    steps: int,
    max_length: int | None = None,
    encoder_cross: dict[str, np.ndarray] | None = None,
) -> Generation:
    """`encoder_cross` as greedy_cached's `cross`."""
    sess = session(decoder)
    batch = hidden.shape[0]
    max_length = max_length or steps
    buffers: dict[str, ort.OrtValue] = {}  # self-attention: one buffer, past and present
    cross: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if not i.name.startswith("past_key_values.") or i.name in (encoder_cross or {}):
            continue
        heads, dim = int(i.shape[1]), int(i.shape[3])
        if ".decoder." in i.name:
            zeros = np.zeros((batch, heads, max_length, dim), hidden.dtype)
            buffers[i.name] = ort.OrtValue.ortvalue_from_numpy(zeros)
        else:
            cross[i.name] = np.zeros((batch, heads, 0, dim), hidden.dtype)
    cross_presents = [n.replace("past_key_values.", "present.", 1) for n in cross]
    # One binding for the whole generation: the buffers stay bound, each step rebinds only what
    # changes (the token, the length, the cross cache as the last step's OrtValues: no copy).
    io = sess.io_binding()
    io.bind_output("logits")  # get_outputs() returns in binding order
    for n in cross_presents:
        io.bind_output(n)
    for n, buf in buffers.items():
        io.bind_ortvalue_input(n, buf)
        io.bind_ortvalue_output(n.replace("past_key_values.", "present.", 1), buf)
    names = {i.name for i in sess.get_inputs()}
    fixed = {**cross, **(encoder_cross or {})}
    if "encoder_hidden_states" in names:
        fixed["encoder_hidden_states"] = hidden
    if mask is not None and "encoder_attention_mask" in names:
        fixed["encoder_attention_mask"] = mask
    for k, v in fixed.items():
        io.bind_cpu_input(k, np.ascontiguousarray(v))
    ids = np.full((batch, 1), start, np.int64)
    tokens, picked = [], []
    for past in range(steps):
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("past_sequence_length", np.array([past], np.int32))
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        last = outs[0].numpy()[:, -1].astype(np.float32)
        picked.append(last)
        ids = last.argmax(-1)[:, None].astype(np.int64)
        tokens.append(ids[:, 0])
        if past == 0 and cross:  # the cross cache holds the encoder's keys and values now
            io.bind_cpu_input("encoder_hidden_states", np.ascontiguousarray(hidden[:, :0]))
        for n, value in zip(cross, outs[1:]):
            io.bind_ortvalue_input(n, value)
    return Generation(np.stack(tokens, axis=1), np.stack(picked))
