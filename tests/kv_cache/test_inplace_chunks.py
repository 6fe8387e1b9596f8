"""In-place caches fed a prompt in chunks with a batch of several rows: GroupQueryAttention runs a
multi-token step after a past for batch > 1 only with query_seqlens (ORT 1.32: "batch_size must be
1 when sequence_length > 1 and past context is given" without it). Each chunk's logits must be the
no-cache original's at those positions (equal-length rows: the contiguous layout in-place
runtimes feed)."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import pytest
from support import kv_generation as kg
from support.llm_fixtures import PARITY_ATOL, Fixture, fixtures, ids

CASES = [
    *fixtures(arch="llama", exporter="ts", dtype="float32"),
    *fixtures(arch="qwen2", exporter="dynamo", dtype="float32"),
    *fixtures(arch="gemma3", exporter="ts", dtype="float32"),  # sliding window: local_window_size
]
CHUNKS = (4, 3, 1, 2)  # prefill, a chunk after it, a decode step, another chunk


def _run_chunks(path: Path, ids_: np.ndarray, max_length: int) -> np.ndarray:
    sess = kg.session(path)
    names = {i.name for i in sess.get_inputs()}
    batch = ids_.shape[0]
    buffers = kg.inplace_buffers(sess, batch, max_length)
    logits, done = [], 0
    for size in CHUNKS:
        total = done + size
        feed = {
            "input_ids": ids_[:, done:total],
            "attention_mask": np.ones((batch, total), np.int64),
            "position_ids": np.tile(np.arange(done, total), (batch, 1)).astype(np.int64),
        }
        logits.append(kg.run_inplace_step(sess, names, buffers, feed))
        done = total
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize("fx", CASES, ids=ids(CASES))
def test_chunks_after_a_past_with_batch_2(fx: Fixture, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", kv_cache="inplace", output=out)
    seq = sum(CHUNKS)
    rng = np.random.default_rng(0)
    ids_ = rng.integers(1, int(fx.meta["config"]["vocab_size"]), (2, seq)).astype(np.int64)
    feed = {
        "input_ids": ids_,
        "attention_mask": np.ones((2, seq), np.int64),
        "position_ids": np.tile(np.arange(seq), (2, 1)).astype(np.int64),
    }
    sess = kg.session(fx.path)
    names = {i.name for i in sess.get_inputs()}
    expected = sess.run(["logits"], {k: v for k, v in feed.items() if k in names})[0]
    got = _run_chunks(out, ids_, max_length=seq + 2)
    diff = float(np.abs(expected.astype(np.float64) - got).max())
    assert diff <= PARITY_ATOL[fx.dtype], f"max abs diff {diff:.3g}"
