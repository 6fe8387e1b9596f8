"""ALiBi attention (issue 13): bloom and mpt add slopes[h] * key_position to the scores besides
the causal/padding mask. Both export with transformers 5.24 through both torch.onnx exporters
(eager attention: neither family has an sdpa path), fp32 and fp16; fixtures bloom_* and mpt_*.

- fuse_attention recognises bloom's flat (B*H, S, T) heads (baddbmm) and mpt's masked_fill, and
  keeps the bias as the export computes it (bloom's from cumsum(attention_mask)), added into the
  internal op's additive mask; both targets lower it (MultiHeadAttention / GroupQueryAttention
  attention_bias, Attention-23 attn_mask). test_llm_preset.py checks counts, residue and parity
  (unpadded, right- and left-padded) for every fixture, these among them.
- Here: the bias counters, parity on masks with holes (where bloom's positions are not the key
  index, so a bias folded to slopes * j would differ), and the KV-cache refusal: the cached form
  does not carry a score bias yet, so --kv-cache standard and inplace refuse, naming ALiBi, and
  write nothing.
"""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import pytest
from llm_fixtures import ALIBI_ARCHS, PARITY_ATOL, Fixture, feeds, fixtures, ids, op_count, optimize
from llm_fixtures import run as ort_run

ALIBI = fixtures(arch=ALIBI_ARCHS)
FP32 = fixtures(arch=ALIBI_ARCHS, dtype="float32")
CASES = [(fx, t) for fx in ALIBI for t in ("ort", "onnx")]


def counters(report: fastopt.OptimizeReport, name: str) -> dict[str, int]:
    return next(p.counters for p in report.passes if p.name == name)


def test_fixtures_present() -> None:
    """Both families, both exporters, fp32 and fp16 (a missing export would skip silently)."""
    assert {(fx.arch, fx.exporter, fx.dtype) for fx in ALIBI} == {
        (a, e, d) for a in ALIBI_ARCHS for e in ("ts", "dynamo") for d in ("float32", "float16")
    }


def holed_feeds(fx: Fixture) -> dict[str, np.ndarray]:
    """Row 0 full; row 1 with a hole of two pads in the middle and one at the end: bloom's
    positions (cumsum(mask) - 1) then lag the key index by 2 after the hole."""
    out = feeds(fx, batch=2, seq=11, padding=None, seed=3)
    out["attention_mask"][1, 4:6] = 0
    out["attention_mask"][1, -1] = 0
    return out


@pytest.mark.parametrize(("fx", "target"), CASES, ids=[f"{fx}-{t}" for fx, t in CASES])
def test_alibi_fused(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="llm", target=target)
    fused = counters(report, "fuse_attention")
    assert fused.get("attention") == fx.layers, fused
    assert fused.get("attention bias (ALiBi)") == fx.layers, fused
    assert fused.get("flat heads", 0) == (fx.layers if fx.arch == "bloom" else 0), fused
    assert op_count(out, "Softmax") == 0
    attention = ("MultiHeadAttention", "GroupQueryAttention") if target == "ort" else ("Attention",)
    assert sum(op_count(out, t) for t in attention) == fx.layers
    # The bias stays computed from the graph's inputs: bloom's reads the mask's cumsum.
    assert op_count(out, "CumSum") == (1 if fx.arch == "bloom" else 0)
    inputs = holed_feeds(fx)
    expected = np.asarray(ort_run(fx.path, inputs)[0], dtype=np.float64)
    got = np.asarray(ort_run(out, inputs)[0], dtype=np.float64)
    keep = inputs["attention_mask"].astype(bool)
    diff = float(np.max(np.abs(expected[keep] - got[keep])))
    assert diff <= PARITY_ATOL[fx.dtype], f"{fx} {target}: max abs diff {diff:.3g} with holes"


def test_holes_change_bloom_bias() -> None:
    """The holed mask is a real test: bloom's logits after the hole differ from those of the same
    tokens with the hole's keys kept (the positions, not only the masked keys, change)."""
    (fx,) = fixtures(arch="bloom", exporter="dynamo", dtype="float32")
    holed = holed_feeds(fx)
    full = {k: v.copy() for k, v in holed.items()}
    full["attention_mask"][1, 4:6] = 1
    a = np.asarray(ort_run(fx.path, holed)[0])
    b = np.asarray(ort_run(fx.path, full)[0])
    assert np.max(np.abs(a[1, 6:-1] - b[1, 6:-1])) > 1e-3


@pytest.mark.parametrize("kv", ["standard", "inplace"])
@pytest.mark.parametrize("fx", FP32, ids=ids(FP32))
def test_kv_cache_refused(fx: Fixture, kv: str, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    with pytest.raises(fastopt.ModelError, match=r"score bias .*ALiBi"):
        fastopt.optimize(fx.path, output=out, preset="llm", kv_cache=kv)  # type: ignore[arg-type]
    assert not out.exists()
