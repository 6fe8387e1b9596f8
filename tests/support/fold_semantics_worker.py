"""Runs every case of fold_semantics_cases through ONNX Runtime and each folding pipeline, each
run in a forked child (a SIGFPE kills the child, not the worker), and pickles the results to
argv[1]. Started by tests/fold/test_fold_semantics.py in a subprocess of its own."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from support.fold_semantics_cases import CASES, PIPELINES


def forked(fn: Callable[[Callable[[str], None]], dict[str, Any]]) -> dict[str, Any]:
    """fn(mark) in a child: its result, or {'status': 'signal', 'stage': last mark}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write marks, then the pickled result
        os.close(r)
        code = 0
        with os.fdopen(w, "wb") as f:

            def mark(stage: str) -> None:
                pickle.dump(("stage", stage), f)
                f.flush()

            try:
                pickle.dump(("result", fn(mark)), f)
            except BaseException as e:
                pickle.dump(("result", {"status": "raised", "detail": repr(e)}), f)
                code = 1
        os._exit(code)
    os.close(w)
    stage, result = "start", None
    with os.fdopen(r, "rb") as f:
        while True:
            try:
                kind, value = pickle.load(f)
            except EOFError:
                break
            if kind == "stage":
                stage = value
            else:
                result = value
    _, status = os.waitpid(pid, 0)
    if result is None:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return {"status": "signal", "detail": f"signal {sig}", "stage": stage}
    result.setdefault("stage", stage)
    return result


def run_ort(data: bytes) -> dict[str, Any]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        values = sess.run(None, {})
    except Exception as e:
        return {"status": "error", "detail": str(e).splitlines()[0][:300]}
    return {"status": "ok", "outputs": {n: np.asarray(v) for n, v in zip(names, values)}}


def reference(model: onnx.ModelProto) -> dict[str, Any]:
    return forked(lambda mark: run_ort(model.SerializeToString()))


def optimized(model: onnx.ModelProto, passes: list[str]) -> dict[str, Any]:
    def go(mark: Callable[[str], None]) -> dict[str, Any]:
        mark("optimize")
        m = fastopt.from_onnx(model)
        if passes == ["cleanup"]:
            report = fastopt.optimize(m, preset="cleanup")
        else:
            report = fastopt.optimize(m, passes=passes)
        assert report.model is not None
        report.model.verify()
        counters: dict[str, int] = {}
        for p in report.passes:
            for k, v in p.counters.items():
                counters[k] = counters.get(k, 0) + v
        ops = {k: v for k, v in report.model.op_counts().items() if k != "Constant"}
        data = report.model.serialize()
        mark("done")  # fastopt is through; what follows is ONNX Runtime's
        return {**run_ort(data), "ops": ops, "counters": counters, "stage": "done"}

    return forked(go)


def main() -> None:
    results: dict[str, Any] = {}
    for case in CASES:
        model = case.model()
        results[case.name] = {"reference": reference(model)}
        for name, passes in PIPELINES.items():
            results[case.name][name] = optimized(model, passes)
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
