"""Saves under faults: two saves to one output at once, and an I/O error on the folder's fsync.

Both run real processes under strace, which stops or fails a chosen system call: a save stopped
right after naming its data file is the barrier at which another save can interleave, and an
injected EIO on the folder's fsync is the disk error the commit must not hide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support.wire_models import make_model, weights

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

SAVE = """
import os, sys
import fastopt
src, out = sys.argv[1], sys.argv[2]
m = fastopt.load(src)
try:
    m.save(out, external_data=True, size_threshold=0)
except fastopt.ModelError as e:
    print("ModelError:", e, file=sys.stderr)
    sys.exit(2)
"""


def traced(trace: Path, inject: str, *args: str) -> subprocess.Popen[str]:
    """A save in a child Python under strace -f, with `inject` (strace's -e inject=...)."""
    strace = ["strace", "-f", "-qq", "-y", "-e", "trace=linkat,fsync", "-e", inject]
    return subprocess.Popen(
        [*strace, "-o", str(trace), sys.executable, "-c", SAVE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(what: str, ready: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def stopped_pid(trace: Path) -> int | None:
    """The pid strace reports stopped by SIGSTOP, once it is (its -f lines start with the pid)."""
    if not trace.exists():
        return None
    for line in trace.read_text().splitlines():
        if "--- stopped by SIGSTOP ---" in line:
            return int(line.split()[0])
    return None


def reversed_initializers(path: Path) -> Path:
    """The model at `path` with its initializers in the other order: B before W in the data
    file, so that the other model's file beside this data reads wrong bytes (a mix shows)."""
    m = onnx.load(str(path))
    inits = list(m.graph.initializer)[::-1]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)
    for f in path.parent.iterdir():
        f.unlink()
    onnx.save_model(
        m, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0
    )
    return path


def outputs_of(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": x})[0]


def test_two_saves_to_one_output_never_mix(tmp_path: Path) -> None:
    """Save A stops right after naming its data file (strace: SIGSTOP on its first linkat);
    save B to the same output then runs. Without a lock B removes A's data and names its own,
    and A, resumed, names its model file beside B's data: ORT runs it with B's weights, A exits
    0. With the lock, B fails at once naming the output, and the folder holds A's save."""
    src_a = make_model(tmp_path / "a", seed=1)
    src_b = reversed_initializers(make_model(tmp_path / "b", seed=2))
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    stop_after_first_link = "inject=linkat:signal=SIGSTOP:when=1"
    a = traced(tmp_path / "trace_a", stop_after_first_link, str(src_a), str(out))
    b: subprocess.Popen[str] | None = None
    try:
        wait_for(
            "save A to stop", lambda: stopped_pid(tmp_path / "trace_a") or a.poll() is not None
        )
        if a.poll() is not None:
            _, err = a.communicate()
            if "ptrace" in err:
                pytest.skip("strace cannot trace here: " + err.strip())
            raise AssertionError(f"save A ended before its barrier: {a.returncode} {err}")
        b = traced(tmp_path / "trace_b", stop_after_first_link, str(src_b), str(out))
        # B either fails (the lock) or reaches the same barrier (no lock).
        wait_for(
            "save B to stop or end",
            lambda: stopped_pid(tmp_path / "trace_b") or b.poll() is not None,
        )
        os.kill(stopped_pid(tmp_path / "trace_a") or 0, signal.SIGCONT)
        _, err_a = a.communicate(timeout=60)
        b_pid = stopped_pid(tmp_path / "trace_b")
        if b_pid is not None and b.poll() is None:
            os.kill(b_pid, signal.SIGCONT)
        _, err_b = b.communicate(timeout=60)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    assert b is not None
    codes = (a.returncode, b.returncode)
    # Whatever happened, the folder holds one save's model with that save's own data.
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    saved = onnx.load(str(out))
    got = outputs_of(saved, x)
    expected = {}
    for label, seed in (("a", 1), ("b", 2)):
        w, bias = weights(seed)
        expected[label] = x @ w + bias
    matches = [k for k, want in expected.items() if np.allclose(got, want, rtol=1e-5, atol=1e-5)]
    assert matches, f"the output mixes both saves (exit codes {codes})\n{err_a}\n{err_b}"
    # The lock: A (holding it) finished, B failed before writing, naming the output.
    assert codes == (0, 2), (codes, err_a, err_b)
    assert matches == ["a"]
    assert f"output '{out}' is being written by another save" in err_b, err_b
    assert sorted(os.listdir(out.parent)) == ["model.onnx", "model.onnx.data"]


def test_the_lock_is_per_output_and_leaves_nothing(tmp_path: Path) -> None:
    """While save A holds its output's lock (stopped at its barrier), a save to another file in
    the same folder runs; a save killed holding the lock leaves no file behind (the lock is an
    abstract socket name, freed with the process), and the next save to that output runs."""
    import fastopt

    src = make_model(tmp_path / "src", seed=1)
    out = tmp_path / "out"
    out.mkdir()
    a = traced(
        tmp_path / "trace_a",
        "inject=linkat:signal=SIGSTOP:when=1",
        str(src),
        str(out / "model.onnx"),
    )
    try:
        wait_for(
            "save A to stop", lambda: stopped_pid(tmp_path / "trace_a") or a.poll() is not None
        )
        assert a.poll() is None, a.communicate()
        fastopt.load(src).save(str(out / "other.onnx"), external_data=True, size_threshold=0)
        pid = stopped_pid(tmp_path / "trace_a")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # killed holding the lock; strace ends with it
        a.wait(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
    fastopt.load(src).save(str(out / "model.onnx"), external_data=True, size_threshold=0)
    names = sorted(os.listdir(out))
    assert names == ["model.onnx", "model.onnx.data", "other.onnx", "other.onnx.data"], names


@pytest.mark.parametrize("external", [False, True])
def test_eio_from_the_folder_fsync_is_an_error(tmp_path: Path, external: bool) -> None:
    """strace fails the last fsync (the folder's, after the files are named) with EIO: the save
    must say that the commit is uncertain, not exit 0."""
    src = make_model(tmp_path / "src", seed=1)
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    code = SAVE.replace("external_data=True, size_threshold=0", f"external_data={external}")
    # Self-contained: fsync model, folder. External: data, model, folder.
    when = 3 if external else 2
    trace = tmp_path / "trace"
    strace = ["strace", "-f", "-qq", "-y", "-e", "trace=fsync", "-e"]
    strace += [f"inject=fsync:error=EIO:when={when}", "-o", str(trace)]
    done = subprocess.run(
        [*strace, sys.executable, "-c", code, str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip("strace cannot trace here: " + done.stderr.strip())
    injected = [line for line in trace.read_text().splitlines() if "INJECTED" in line]
    assert len(injected) == 1 and f"<{out.parent}>" in injected[0], trace.read_text()
    assert done.returncode == 2, done.stderr
    assert "cannot sync the output folder" in done.stderr, done.stderr
    assert "Input/output error" in done.stderr and "uncertain" in done.stderr, done.stderr
