"""``--verify`` on an export made WITH a cache (issue 28): the original takes past_key_values.*
inputs too, so the reference run gets empty pasts (past length 0) and recomputes the sequence at
each step; the greedy-generation check and the quantization gates then compare as for an export
without a cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fastopt
import pytest
from fastopt.verify.generation import verify_generation
from fastopt.verify.quantized import verify_quantized
from support.llm_fixtures import FIXTURE_DIR

BLOOM_CACHE = FIXTURE_DIR / "bloom_ts_float32_cache" / "model.onnx"
MPT_CACHE = FIXTURE_DIR / "mpt_ts_float32_cache" / "model.onnx"


@pytest.mark.parametrize("kv", ["inplace", "standard"])
def test_generation_verify_feeds_the_originals_pasts(kv: str, tmp_path: Path) -> None:
    out = tmp_path / "opt.onnx"
    fastopt.optimize(BLOOM_CACHE, output=out, preset="llm", kv_cache=kv)  # type: ignore[arg-type]
    r = verify_generation(str(BLOOM_CACHE), str(out))
    assert r.ok and r.inplace == (kv == "inplace")
    assert len(r.tokens_original) == 8 and r.max_abs_err < 1e-4


def test_generation_verify_still_tells_models_apart(tmp_path: Path) -> None:
    """The empty pasts make the original run; they do not make any cached model pass: mpt's
    converted cache against bloom's original generates other tokens."""
    out = tmp_path / "mpt.onnx"
    fastopt.optimize(MPT_CACHE, output=out, preset="llm", kv_cache="inplace")
    with pytest.raises(fastopt.VerifyError) as e:
        verify_generation(str(BLOOM_CACHE), str(out))
    assert not isinstance(e.value, fastopt.InputRejectedError)
    assert "tokens DIFFER" in str(e.value)


@pytest.mark.parametrize("kv", ["inplace", "standard"])
def test_quantized_verify_of_a_cached_export(kv: str, tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    fastopt.optimize(
        BLOOM_CACHE, output=out, preset="llm", kv_cache=kv, quantize=fastopt.QuantSettings("int4")
    )  # type: ignore[arg-type]
    r = verify_quantized(BLOOM_CACHE, out, "int4")
    assert r.ok, str(r)
    assert [o.name for o in r.outputs] == ["logits"] and r.outputs[0].cosine > 0.95


def test_cli_verify_of_a_cached_export(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "fastopt", "optimize", str(BLOOM_CACHE), "-o",
         str(tmp_path / "o.onnx"), "--preset", "llm", "--kv-cache", "inplace", "--verify"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verify passed: greedy generation" in p.stdout and "tokens equal" in p.stdout


def test_original_with_a_cross_cache_is_refused(tmp_path: Path) -> None:
    """A seq2seq decoder exported with a cross-attention cache: empty cross pasts would make
    the original attend to nothing, so it is refused with the reason, not compared wrongly."""
    from support import seq2seq_generation as sg

    fx = sg.seq2seq_fixtures("whisper", "float32")[0]
    cached = tmp_path / "decoder.onnx"
    fastopt.optimize(str(fx.decoder), output=str(cached), preset="llm", kv_cache="standard")
    with pytest.raises(fastopt.UnsupportedModelError, match="cross-attention cache"):
        verify_generation(str(cached), str(cached))
