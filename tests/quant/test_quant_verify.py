"""``--verify`` of quantized models (fastopt.verify.quantized, issue 28): bf16 models ONNX
Runtime's CPU provider cannot run are reported as not verified in one line, never a traceback; the
top-1 measure leaves out the original's near-ties; the README's int8 example passes its gate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fastopt
import numpy as np
import pytest
from fastopt.verify.quantized import THRESHOLDS, _accuracy, verify_quantized
from support.llm_fixtures import fixtures

LLAMA = fixtures(arch="llama", exporter="ts", dtype="float32")[0]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastopt", *args], capture_output=True, text=True, timeout=300
    )


def test_bf16_verify_says_why_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "bf.onnx"
    p = _cli("quantize", str(LLAMA.path), "-o", str(out), "--mode", "bf16", "--verify")
    assert "Traceback" not in p.stdout + p.stderr
    r = verify_quantized(LLAMA.path, out, "bf16")
    if r.skipped is None:  # an onnxruntime whose CPU provider runs bfloat16 Mul, MatMul, ...
        assert r.ok and p.returncode == 0, str(r)
        return
    assert not r.ok and not r.outputs
    assert "no bfloat16" not in r.skipped  # ORT's own words, not a guess
    assert "could not find an implementation for" in r.skipped.lower()
    assert "bf16 models are for GPU providers" in r.skipped
    lines = [ln for ln in p.stdout.splitlines() if "quantization accuracy" in ln]
    assert lines == [f"quantization accuracy (bf16): not verified: {r.skipped}"]
    assert p.returncode == 0, p.stderr  # nothing was measured: not a failed verification
    assert r.to_dict()["skipped"] == r.skipped and r.to_dict()["ok"] is False


def test_readme_int8_asymmetric_block_128_example_passes(tmp_path: Path) -> None:
    """README: quantize --mode int8 --asymmetric --block-size 128 --verify. Its top-1 was 0.844
    (gate 0.90) from 5 swaps among 32 positions, 4 of them between logits closer than 1 % of
    the logit scale: ties any rounding swaps (test_near_ties_are_left_out_of_top1)."""
    out = tmp_path / "q.onnx"
    p = _cli(
        "quantize", str(LLAMA.path), "-o", str(out), "--mode", "int8", "--asymmetric",
        "--block-size", "128", "--verify",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    # A causal LM: judged on text sampled from the model (no tokenizer beside the fixture).
    assert "quantization accuracy (int8): ok" in p.stdout, p.stdout
    assert "real-text check (int8; 4 sequences" in p.stdout
    assert "sampled from the original" in p.stdout


def test_near_ties_are_left_out_of_top1() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 40, 64))
    ref[0, :, 0] = ref[0].max(-1) + 1.0  # decisive: token 0 leads by 1 / scale
    ref[0, :10, 1] = ref[0, :10, 0] - 1e-3  # 10 near-ties: token 1 a hair below
    scale = np.abs(ref).max()
    got = ref.copy()
    got[0, :10, 1] += 2e-3  # the ties swap
    a = _accuracy("logits", ref, got)
    assert a.top1_agreement == 1.0 and a.near_ties == 10
    got[0, 10:14, 2] = ref[0, 10:14, 0] + 0.05 * scale  # 4 decisive positions change their pick
    b = _accuracy("logits", ref, got)
    assert b.top1_agreement == pytest.approx(26 / 30) and b.near_ties == 10
    # Every position a tie: no top-1 measure (the other gates still apply).
    flat = np.zeros((1, 4, 8))
    assert _accuracy("logits", flat, flat).top1_agreement is None


def test_a_wrong_weight_still_fails_the_int8_gate(tmp_path: Path) -> None:
    """The tie rule does not hide real errors: a quantized model whose lm_head reads another
    weight fails."""
    import onnx
    from onnx import numpy_helper

    out = tmp_path / "q.onnx"
    fastopt.quantize(LLAMA.path, out, mode="int8")
    m = onnx.load(str(out))
    scales = [t for t in m.graph.initializer if t.name.endswith("_scales")]
    big = max(scales, key=lambda t: int(np.prod(t.dims)))
    arr = numpy_helper.to_array(big).copy()
    arr[::2] *= -1  # half the output columns flip sign
    big.CopyFrom(numpy_helper.from_array(arr, big.name))
    onnx.save(m, str(out))
    r = verify_quantized(LLAMA.path, out, "int8")
    assert not r.ok
    cos, _, top1 = THRESHOLDS["int8"]
    o = r.outputs[0]
    assert o.cosine < cos and o.top1_agreement is not None and o.top1_agreement < top1
