"""One decode step of a causal language model in ONNX Runtime, as fastopt's decode loops feed it
(greedy generation against the original, the real-text check, the calibration sampler): token
ids after ``past`` cached tokens, a mask of ones over the past and the new tokens, positions
past..past+T-1; and the present output that carries each past input to the next step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastopt import _C

if TYPE_CHECKING:
    import numpy as np
else:
    from fastopt._lazy import lazy_module

    np = lazy_module("numpy")


def step_feeds(ids: np.ndarray, past: int) -> dict[str, np.ndarray]:
    """input_ids, attention_mask and position_ids (int64) for ``ids`` [B, T] after ``past``
    cached tokens; callers keep the ones their model takes."""
    batch, seq = ids.shape
    return {
        "input_ids": np.asarray(ids, np.int64),
        "attention_mask": np.ones((batch, past + seq), np.int64),
        "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),
    }


def present_name(past: str) -> str:
    """The output that holds ``past`` (a past_key_values.* input) after the step."""
    return _C.KV_PRESENT_PREFIX + past[len(_C.KV_PAST_PREFIX) :]
