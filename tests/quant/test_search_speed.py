"""q4m's cost without a change in what it writes. The search (csrc/quant/search.cc,
search_steps.cc): its bytes pinned to those of the version before the speed-up (dff19ff), over the
shapes its loops split differently (column groups of 16 and their remainder, spans of columns, a
partial last block, float32 / float16 / bfloat16 scales, int4 / int8, symmetric / asymmetric,
importance, zero and constant columns); its CPU time against round to nearest's is a benchmark
(bench/quant/bench_search_kernel.py: timed assertions are flaky on shared machines). The
data-free importance: OpenBLAS held to one thread while it runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

# sha256 of each case's MatMulNBits initializers (codes, scales, zero points) as dff19ff wrote
# them (the search before its loops were regrouped and vectorized).
PINNED = {
    "f32-int4-b32-sym": "fd2a119882015442b528fae3e0640c7a895f4fae42b64c77bbe89600ffefd120",
    "f32-int4-b64-asym-imp": "a7778d86a4c60fd1d79907b2a0725f6a59106911071817cd3f4570f460723a49",
    "f16-int4-b64-asym": "9bb73aa932e20ac45474b7f1c9917573be3e4da1da57811e4ad02b8d77d2344b",
    "f16-int4-b16-sym-imp": "1b540707f9bb90383dfda0d5bd7fd8ba1a7d682ebf8e87aa7c67bcd7274a6ced",
    "bf16-int4-b32-asym": "593a2141e75176d8a3586117e5914eb278becdd1da8e2dedb054f983d95eea96",
    "f32-int8-b128-asym": "751bb02ef049ab1a5c7a653a5555e7bc7c6fbf6f82ea1f69121529a70c00f9e5",
    "f16-int8-b32-sym-imp": "db5a998b7eec78585af875e17c427ccc74e7adb886979d986f559ff72ff22e43",
}


def _weights(k: int, n: int, seed: int) -> np.ndarray:
    """Heavy-tailed, lopsided columns, and a zero and a constant column (exact cases)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, (k, n)) * 0.02 + rng.uniform(-0.02, 0.02, n)
    w[:, 3] = 0.0
    w[:, 7] = 0.125
    return w.astype(np.float32)


def _model(w: np.ndarray, path: Path) -> Path:
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _digest(r: fastopt.QuantizeReport) -> str:
    assert r.model is not None
    h = hashlib.sha256()
    for node in r.model.graph.nodes:
        if node.op_type == "MatMulNBits":
            for v in node.inputs[1:]:
                if v is not None and v.initializer is not None:
                    h.update(v.initializer.numpy().tobytes())
    return h.hexdigest()


def _case(name: str, tmp_path: Path) -> str:
    dtype, mode, block, sym = name.split("-")[:4]
    # K 200: three blocks of 64 and a partial one; N 200 (12 groups of 16 and 8) at block 16-64
    # spans 64-256 columns wide; N 600 at block 128: spans of 32.
    k, n = (200, 600) if block == "b128" else (200, 200)
    w = _weights(k, n, seed=len(name))
    src = _model(w, tmp_path / "f32.onnx")
    if dtype != "f32":
        low = tmp_path / f"{dtype}.onnx"
        fastopt.quantize(src, low, mode="bf16" if dtype == "bf16" else "fp16", run_check=False)
        src = low
    kw = {}
    if name.endswith("-imp"):
        imp = np.random.default_rng(3).uniform(0.05, 20.0, k).astype(np.float32)
        g = helper.make_graph([], "importance", [], [], [numpy_helper.from_array(imp, "w")])
        onnx.save(helper.make_model(g), tmp_path / "imp.onnx")
        kw["importance"] = tmp_path / "imp.onnx"
    r = fastopt.quantize(
        src,
        mode=mode,
        block_size=int(block[1:]),
        symmetric=sym == "sym",
        method="search",
        run_check=False,
        **kw,
    )
    return _digest(r)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_search_bytes_pinned(tmp_path: Path, name: str) -> None:
    assert _case(name, tmp_path) == PINNED[name]


def _openblas_threads() -> set[int]:
    """The thread counts of the OpenBLAS libraries loaded in this process."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = sorted({ln.split()[-1] for ln in maps if "openblas" in ln.lower() and ".so" in ln})
    out = set()
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                     "scipy_openblas_get_num_threads", "openblas_get_num_threads"):  # fmt: skip
            if (get := getattr(lib, name, None)) is not None:
                get.restype = ctypes.c_int
                out.add(int(get()))
                break
    return out


def test_norm_importance_holds_openblas_to_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """q4m's data-free importance: between its small matrix products (_silu_square) OpenBLAS's
    idle threads spun beside the C++ column sums, 29 % of that step's CPU on the 7B shape."""
    import fastopt.quant.norm_importance as ni
    from support.paths import TESTS

    before = _openblas_threads()
    if not before or before == {1}:
        pytest.skip("no OpenBLAS with more than one thread is loaded")
    seen: list[set[int]] = []
    real = ni._silu_square

    def spy(var: np.ndarray, alpha: float = 1.0) -> np.ndarray:
        seen.append(_openblas_threads())
        return real(var, alpha)

    monkeypatch.setattr(ni, "_silu_square", spy)
    model = fastopt.load(TESTS / "fixtures" / "models" / "llama_dynamo_float32" / "model.onnx")
    assert ni.norm_importance(model)
    assert seen and all(s == {1} for s in seen), seen
    assert _openblas_threads() == before  # restored
