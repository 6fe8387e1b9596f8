"""Models and runs that more than one test file uses (from test_cached_exports)."""

from __future__ import annotations

import numpy as np

from support import kv_generation as kg
from support.llm_fixtures import Fixture


def original(fx: Fixture, prompts: list[list[int]], steps: int, mode: str) -> kg.Generation:
    """The original cached export's greedy run, fed its own presents as pasts. standard: the
    batch as the converted model sees it (a short row's padding stays a hole the mask marks 0);
    inplace: each row alone (an in-place cache holds each row contiguously)."""
    if mode == "standard":
        return kg.greedy_cached(fx.path, prompts, steps)
    rows = [kg.greedy_cached(fx.path, [p], steps) for p in prompts]
    return kg.Generation(
        np.concatenate([r.tokens for r in rows]), np.concatenate([r.logits for r in rows], axis=1)
    )
