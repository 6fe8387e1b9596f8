"""The inputs a calibration run feeds a language model: its token ids input, and the rest as
fastopt.verify makes them (masks of ones, positions from 0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastopt import _C
from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")


def ids_input(model: _C.Model) -> str:
    from fastopt.verify.inputs import _is_ids_name

    for v in model.graph.inputs:
        if v is not None and _is_ids_name(v.name) and v.dtype in (6, 7):  # int32, int64
            return v.name
    raise _C.ModelError(
        "calibration: the model has no token ids input (an input named *ids of int32/int64)"
    )


def token_feeds(
    model: _C.Model, ids_name: str, ids: np.ndarray, wanted: set[str]
) -> dict[str, np.ndarray]:
    """Inputs for one run: ``ids`` [B, T] and the rest as fastopt.verify makes them for batch
    B, T tokens, no past (masks of ones, positions 0..T-1)."""
    from fastopt.verify.inputs import make_inputs

    b, t = (int(d) for d in ids.shape)
    dims = {"batch": b, "batch_size": b, "sequence_length": t, "past_sequence_length": 0}
    feeds = make_inputs(model, dims=dims, seed=0)
    dtype = feeds[ids_name].dtype if ids_name in feeds else np.int64
    feeds[ids_name] = ids.astype(dtype)
    return {k: np.asarray(v) for k, v in feeds.items() if k in wanted}
