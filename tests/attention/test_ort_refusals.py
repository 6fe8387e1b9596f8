"""Outputs ONNX Runtime must never refuse (issue 25):

- old opsets: a real GPT-2 TorchScript export at opset 12 (tests/fixtures/old_opset, made by
  make_fixtures.py --arch gpt2 --exporter ts --opset 12 --out tests/fixtures/old_opset) gets
  no internal Attention op, whatever the target; before opset 13 a Softmax flattens from its
  axis (default 1), so only an axis on the last dim is the keys' softmax (synthetic graphs);
- multi-latent attention (tests/fixtures/mla: DeepSeek-V3 with Q/K heads of 48 and V heads of
  32, both exporters, made by make_fixtures.py --arch deepseek_v3 --out tests/fixtures/mla):
  MultiHeadAttention with 3-D K/V (ORT 1.32 refuses BNSH K/V of different head sizes), its
  standard KV cache as standard ops with the reason, greedy generation equal to the original's;
- the run check (fastopt/verify/run_check.py): an output ORT cannot load or run is not written.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt.verify.report import OutputRejectedError
from fastopt.verify.run_check import RunCheckError
from onnx import TensorProto, helper
from support import kv_generation as kg
from support.attention_models import run_sdpa, sdpa_feeds, sdpa_model
from support.fusion_util import ort_run
from support.llm_fixtures import Fixture, assert_parity, op_count
from support.paths import TESTS

FIXTURES = TESTS / "fixtures"
GPT2_OPSET12 = Fixture(FIXTURES / "old_opset" / "gpt2_ts_float32_opset12" / "model.onnx")
MLA = [Fixture(p) for p in sorted((FIXTURES / "mla").glob("*/model.onnx"))]
MLA_IDS = [fx.name for fx in MLA]
INTERNAL = fastopt._C.INTERNAL_DOMAIN
STEPS = 16


def _optimize(
    fx: Fixture, tmp_path: Path, **kw: object
) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", output=out, explain="*", **kw)  # type: ignore[arg-type]
    return report, onnx.load(out)


def _counters(report: fastopt.OptimizeReport, name: str) -> dict[str, int]:
    return next(p.counters for p in report.passes if p.name == name)


def test_fixtures_exist() -> None:
    assert GPT2_OPSET12.path.is_file()
    assert {fx.exporter for fx in MLA} == {"ts", "dynamo"}
    assert onnx.load(GPT2_OPSET12.path).opset_import[0].version == 12


# --- old opsets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_gpt2_opset12_no_internal_op(target: str, tmp_path: Path) -> None:
    """Attention fuses (the export's Softmax has axis 3, the last) and never stays internal:
    target ort keeps standard ops (its lowering needs opset 13) with the reason, target onnx
    converts to opset 23 and gets Attention-23; logits within the fp32 bound."""
    report, out = _optimize(GPT2_OPSET12, tmp_path, target=target)
    assert not [n for n in out.graph.node if n.domain == INTERNAL]
    assert _counters(report, "fuse_attention").get("attention") == GPT2_OPSET12.layers
    if target == "ort":
        kept = [line for line in report.explain if "kept as standard ops" in line]
        assert len(kept) == GPT2_OPSET12.layers and all("opset" in k for k in kept), kept
        assert op_count(out, "Softmax") == GPT2_OPSET12.layers
    else:
        assert op_count(out, "Attention") == GPT2_OPSET12.layers
    assert report.run_check.startswith("ran"), report.run_check
    assert_parity(GPT2_OPSET12, out)


@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize("axis", [3, -1])
def test_old_softmax_on_the_last_axis_fuses_and_decomposes(opset: int, axis: int) -> None:
    """Softmax-1/11 with axis = rank - 1 is the keys' softmax: fused, and the fallback writes
    standard ops of the model's opset (Unsqueeze's axes attribute, no LessOrEqual at 11)."""
    model = sdpa_model(axis=axis, opset=opset)
    report, out = run_sdpa(model, "ort")
    assert _counters(report, "fuse_attention").get("attention") == 1
    assert not [n for n in out.graph.node if n.domain == INTERNAL]
    feeds = sdpa_feeds()
    np.testing.assert_allclose(ort_run(out, feeds)[0], ort_run(model, feeds)[0], atol=1e-5)


@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize("axis", [None, 1, 2])
def test_old_softmax_flattening_must_not_fuse(opset: int, axis: int | None) -> None:
    """Softmax-1/11 with axis 1 (also its default) normalizes over H*S*T, axis 2 over S*T: not
    an attention's softmax, left as it is with the reason."""
    model = sdpa_model(axis=axis, opset=opset)  # type: ignore[arg-type]
    report, out = run_sdpa(model, "ort", explain="fuse_attention")
    assert _counters(report, "fuse_attention").get("attention", 0) == 0
    assert op_count(out, "Softmax") == 1
    want = f"Softmax (opset {opset}) with axis {1 if axis is None else axis} normalizes"
    assert any(want in line for line in report.explain), report.explain
    feeds = sdpa_feeds()
    np.testing.assert_allclose(ort_run(out, feeds)[0], ort_run(model, feeds)[0], atol=1e-6)


def test_opset_10_does_not_fuse() -> None:
    """Below opset 11 the standard-ops fallback has no Range: nothing is fused."""
    report, _ = run_sdpa(sdpa_model(opset=10), "ort", explain="fuse_attention")
    assert _counters(report, "fuse_attention").get("attention", 0) == 0
    assert any("opset 10" in line for line in report.explain), report.explain


def test_an_internal_op_that_cannot_be_lowered_is_an_error(tmp_path: Path) -> None:
    """The last line of defence: an internal op that no lowering or decomposition removes (here
    at opset 9, given in the input) is an error, never an output."""
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 3, 4]) for n in "qkvy"]
    node = helper.make_node(
        "Attention", ["q", "k", "v"], ["y"], domain=INTERNAL, scale=0.5, is_causal=0,
        q_num_heads=2, kv_num_heads=2,
    )  # fmt: skip
    graph = helper.make_graph([node], "g", vi[:3], vi[3:])
    opsets = [helper.make_opsetid("", 9), helper.make_opsetid(INTERNAL, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    out = tmp_path / "model.onnx"
    with pytest.raises(fastopt.ModelError, match="could not be lowered"):
        fastopt.optimize(fastopt.from_onnx(model), passes=[], output=out)
    assert not out.exists()


# --- multi-latent attention ---------------------------------------------------------------------


@pytest.mark.parametrize("fx", MLA, ids=MLA_IDS)
def test_mla_lowers_to_mha_with_3d_kv(fx: Fixture, tmp_path: Path) -> None:
    report, out = _optimize(fx, tmp_path, target="ort")
    mha = [n for n in out.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(mha) == fx.layers
    # K and V enter as (B, T, H*D): BNSH K/V must have one shape in ORT 1.32.
    inferred = onnx.shape_inference.infer_shapes(out)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in inferred.graph.value_info}
    assert all(ranks.get(n.input[1]) == 3 and ranks.get(n.input[2]) == 3 for n in mha), ranks
    assert report.run_check.startswith("ran")
    assert_parity(fx, out)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in (9, 5)]


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", MLA, ids=MLA_IDS)
def test_mla_standard_cache_generates_as_the_original(
    fx: Fixture, target: str, tmp_path: Path
) -> None:
    """Target ort: MultiHeadAttention's past_value must have K's head size, so the cached
    attention stays standard ops, with the reason; target onnx: Attention-23 takes it. 16
    greedy tokens of a right-padded batch equal the original's."""
    report, _ = _optimize(fx, tmp_path, target=target, kv_cache="standard")
    if target == "ort":
        kept = [line for line in report.explain if "one head size for K and V (48 and 32)" in line]
        assert len(kept) == fx.layers, report.explain
    # The cache runs in ORT; onnxruntime-genai 0.18 holds K and V with one head size: no config.
    assert not (tmp_path / "genai_config.json").exists()
    assert any("one num_key_value_heads and head_size" in n for n in report.genai_notes)
    prompts = _prompts()
    ref = kg.greedy_no_cache_as_cached(fx.path, prompts, STEPS)
    got = kg.greedy_cached(tmp_path / "model.onnx", prompts, STEPS)
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= 1e-4


def test_mla_inplace_cache_is_refused(tmp_path: Path) -> None:
    """In place needs GroupQueryAttention, which takes one head size: refused, nothing written."""
    with pytest.raises(fastopt.ModelError, match="not GroupQueryAttention"):
        _optimize(MLA[0], tmp_path, target="ort", kv_cache="inplace")
    assert not (tmp_path / "model.onnx").exists()


# --- the run check ------------------------------------------------------------------------------


def _relu_model(domain_op: tuple[str, str] | None = None) -> onnx.ModelProto:
    """x (2, 3) -> [custom op] -> Relu -> y."""
    vi = helper.make_tensor_value_info
    nodes = []
    x = "x"
    if domain_op:
        nodes.append(helper.make_node(domain_op[1], ["x"], ["c"], domain=domain_op[0]))
        x = "c"
    nodes.append(helper.make_node("Relu", [x], ["y"]))
    graph = helper.make_graph(
        nodes, "g", [vi("x", TensorProto.FLOAT, [2, 3])], [vi("y", TensorProto.FLOAT, [2, 3])]
    )
    opsets = [helper.make_opsetid("", 17)]
    if domain_op:
        opsets.append(helper.make_opsetid(domain_op[0], 1))
    return helper.make_model(graph, opset_imports=opsets)


def _breaker(ctx: fastopt.PassContext) -> int:
    """Puts an op ORT does not know before each Relu."""
    g = ctx.model.graph
    relus = [n for n in g.nodes if n.op_type == "Relu"]
    for relu in relus:
        bad = g.add_node("NoSuchOp", [relu.inputs[0]], [relu.name + "_bad"], before=relu)
        relu.set_input(0, bad.outputs[0])
    return len(relus)


@pytest.fixture
def breaker() -> Iterator[str]:
    """The pass test_run_check_breaker, registered for one test (others list every pass)."""
    fastopt.register_pass("test_run_check_breaker", "an op ORT does not know")(_breaker)
    yield "test_run_check_breaker"
    fastopt.unregister_pass("test_run_check_breaker")


def test_run_check_refuses_an_output_ort_cannot_load(tmp_path: Path, breaker: str) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_relu_model(), src)
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    out.write_bytes(b"old")
    with pytest.raises(RunCheckError, match=r"NoSuchOp.*the original runs") as e:
        fastopt.optimize(src, passes=["test_run_check_breaker"], output=out)
    assert isinstance(e.value, OutputRejectedError)
    assert out.read_bytes() == b"old"  # left as it was
    report = fastopt.optimize(src, passes=["test_run_check_breaker"], output=out, run_check=False)
    assert report.run_check == "" and onnx.load(out).graph.node[0].op_type == "NoSuchOp"


def test_run_check_cli_exits_1_and_writes_nothing(tmp_path: Path, breaker: str) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_relu_model(), src)
    out = tmp_path / "model.onnx"
    # The test pass is registered in this process only: run the CLI in-process.
    from fastopt.cli.main import main

    assert main(["optimize", str(src), "-o", str(out), "--passes", "test_run_check_breaker"]) == 1
    assert not out.exists()
    argv = ["optimize", str(src), "-o", str(out), "--passes", "test_run_check_breaker"]
    assert main([*argv, "--no-run-check"]) == 0
    assert out.exists()


def test_run_check_skips_when_the_original_cannot_run_either(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_relu_model(("my.custom", "Thing")), src)
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(src, preset="cleanup", output=out)
    assert report.run_check.startswith("skipped: ONNX Runtime (CPU) cannot run the original")
    assert out.exists()


def test_run_check_cli_prints_one_line(tmp_path: Path) -> None:
    """Through the real CLI (its own process): an output written, the check's line printed."""
    src = tmp_path / "in.onnx"
    onnx.save(_relu_model(), src)
    out = tmp_path / "model.onnx"
    r = subprocess.run(
        [sys.executable, "-m", "fastopt", "optimize", str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "run check: ran in" in r.stdout


@pytest.mark.parametrize("fx", MLA[:1], ids=MLA_IDS[:1])
def test_run_check_large_model_paths(
    fx: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breaker: str
) -> None:
    """Past the in-memory limit ORT loads the skeleton with zeros for the large tensors (a sparse
    file): it runs; past the run limit only the session is created. Both still refuse an
    output ORT cannot run (here the BNSH K/V of different head sizes main used to write)."""
    from fastopt.verify import run_check as rc

    monkeypatch.setattr(rc, "_SERIALIZE_LIMIT", 0)
    report = fastopt.optimize(fx.path, preset="llm", output=tmp_path / "a" / "model.onnx")
    assert report.run_check.startswith("ran in"), report.run_check
    monkeypatch.setattr(rc, "_RUN_LIMIT", 0)
    report = fastopt.optimize(fx.path, preset="llm", output=tmp_path / "b" / "model.onnx")
    assert report.run_check.startswith("session created, not run"), report.run_check
    src = tmp_path / "in.onnx"
    onnx.save(_relu_model(), src)
    with pytest.raises(RunCheckError, match="NoSuchOp"):
        fastopt.optimize(src, passes=["test_run_check_breaker"], output=tmp_path / "c.onnx")


def test_run_check_bf16_output_is_a_note(tmp_path: Path) -> None:
    """ORT 1.32's CPU provider has no bfloat16 Add / MatMul: a bf16 output is for GPU
    providers, so its failing run is a note, and the output is written."""
    from fastopt.quant.settings import QuantSettings

    fx = MLA[0]
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", output=out, quantize=QuantSettings("bf16"))
    assert report.run_check.startswith("skipped: bf16"), report.run_check
    assert out.exists()


@pytest.mark.parametrize("name", ["bart_ts_float32", "t5_dynamo_float32"])
def test_seq2seq_cached_decoder_target_onnx_runs_several_tokens(name: str, tmp_path: Path) -> None:
    """Found by the run check: ORT 1.32's Attention-23 wants the mask's query axis to be S, so the
    cross-attention's (B, 1, 1, T) encoder mask failed any decoder step of 2+ tokens (a forced
    prefix) while the original runs it; lower_attention_onnx expands it over the queries."""
    from fastopt.verify.inputs import _synthesize

    src = FIXTURES / "models" / name / "decoder.onnx"
    out = tmp_path / "decoder.onnx"
    report = fastopt.optimize(src, preset="llm", target="onnx", kv_cache="standard", output=out)
    assert report.run_check.startswith("ran"), report.run_check
    dims = {"batch": 2, "decoder_sequence_length": 3, "encoder_sequence_length": 5, "past": 0}
    feeds = _synthesize(fastopt.load(out), dims, 0)
    kg.session(out).run(None, feeds)
