"""What `fastopt quantize` costs beyond the quantization itself (bench/results/quantize.md): the
CLI's imports, the run check's session and run, and the save into a folder that does not exist
yet. Each of these once cost more than the quantization on the 2.4 GB 0.5B export."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.verify import run_check as rc
from onnx import numpy_helper
from support.paths import TESTS

QWEN = TESTS / "fixtures" / "models" / "qwen2_ts_float32" / "model.onnx"
IO = Path("/proc/self/io")


def _written() -> int:
    for line in IO.read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def test_cli_import_loads_no_heavy_modules() -> None:
    """Every `fastopt` command imports fastopt.cli.main (all subcommands' parsers): numpy, onnx
    and onnxruntime wait until a command needs them (numpy came in through `bench`'s modules:
    0.1-0.2 s of every `fastopt quantize`)."""
    code = (
        "import sys, fastopt.cli.main; "
        "print([m for m in ('numpy', 'onnx', 'onnxruntime') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_run_bytes_counts_what_matmulnbits_makes(tmp_path: Path) -> None:
    """Without prepacking ORT's MatMulNBits dequantizes its whole weight to float32 on every
    run: the run's cost is K x N x 4 bytes per node, 8x the int4 bytes, on top of what it reads.
    A Gather's table is read by rows and not counted."""
    r = fastopt.quantize(QWEN, tmp_path / "q" / "model.onnx", mode="int4", run_check=False)
    model = r.model
    assert model is not None
    made = sum(
        4 * n.attributes["K"] * n.attributes["N"]
        for n in model.graph.nodes
        if n.op_type == "MatMulNBits"
    )
    assert made > 0
    gathered = {
        n.inputs[0].name
        for n in model.graph.nodes
        if n.op_type == "Gather" and n.inputs[0].initializer is not None
    }
    assert gathered  # the fixture's embedding table
    read = sum(
        t.nbytes
        for t in model.graph.initializers
        if t.nbytes >= rc._SKELETON_THRESHOLD and t.name not in gathered
    )
    assert rc.run_bytes(model) == read + made
    assert rc.run_bytes(model) > model.self_contained_size()


def test_quantized_output_over_the_run_limit_is_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit is on what a run reads and makes, not on the file's size: an int4 output whose
    file is under the limit but whose run dequantizes more gets the session only (the 0.5B
    int4 output's run cost 3 s of CPU and 1 GB of RSS against 1.5 s for its quantization)."""
    monkeypatch.setattr(rc, "_SERIALIZE_LIMIT", 0)  # the skeleton with zeros, as for big models
    probe = fastopt.quantize(QWEN, tmp_path / "p" / "model.onnx", mode="int4", run_check=False)
    assert probe.model is not None
    size = probe.model.self_contained_size()
    monkeypatch.setattr(rc, "_RUN_LIMIT", size)  # the file fits; its run does not
    out = tmp_path / "a" / "model.onnx"
    report = fastopt.optimize(QWEN, passes=[], output=out, quantize="int4")
    assert report.run_check.startswith("session created, not run"), report.run_check
    assert "MiB of weights" in report.run_check
    assert out.exists()
    monkeypatch.setattr(rc, "_RUN_LIMIT", rc.run_bytes(probe.model))
    report = fastopt.optimize(
        QWEN, passes=[], output=tmp_path / "b" / "model.onnx", quantize="int4"
    )
    assert report.run_check.startswith("ran in"), report.run_check


def test_zeros_skeleton_runs_as_the_model_with_zero_weights(tmp_path: Path) -> None:
    """Model.zeros_skeleton (C++) points every tensor of at least the threshold at its own
    page-aligned range of one zeros file; ORT runs it exactly as the model whose large tensors
    are zeros, and the small ones (shapes, indices) keep their values."""
    model = fastopt.load(str(QWEN))
    threshold = 4096
    skeleton, size = model.zeros_skeleton(threshold, "zeros.data")
    proto = onnx.ModelProto()
    proto.ParseFromString(skeleton)
    spans = []
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] == "zeros.data"
            offset, length = int(info["offset"]), int(info["length"])
            assert offset % 4096 == 0 and length >= threshold
            spans.append((offset, length))
        else:
            assert len(t.raw_data) < threshold or t.data_type == onnx.TensorProto.STRING
    assert spans
    ordered = sorted(spans)
    for (a, n), (b, _) in zip(ordered, ordered[1:]):
        assert a + n <= b  # no two tensors share bytes
    assert ordered[-1][0] + ordered[-1][1] <= size < ordered[-1][0] + ordered[-1][1] + 4096
    (tmp_path / "model.onnx").write_bytes(skeleton)
    with open(tmp_path / "zeros.data", "wb") as f:
        f.truncate(size)
    zeroed = onnx.load(str(QWEN))
    for i, t in enumerate(zeroed.graph.initializer):
        a = numpy_helper.to_array(t)
        if a.nbytes >= threshold:
            zeroed.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.zeros_like(a), t.name))
    feeds = fastopt.make_inputs(str(QWEN), seed=0)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    got = ort.InferenceSession(str(tmp_path / "model.onnx"), so).run(None, feeds)
    want = ort.InferenceSession(zeroed.SerializeToString(), so).run(None, feeds)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_run_check_skeleton_needs_no_onnx() -> None:
    """The check's skeleton is written in C++: the forked check imports onnxruntime only (onnx
    took 0.4 s of CPU, as much as the session)."""
    code = (
        "import sys, fastopt\n"
        "from contextlib import ExitStack\n"
        "from fastopt.verify import run_check as rc\n"
        "with ExitStack() as stack:\n"
        "    path = rc._zero_weights(fastopt.load(sys.argv[1]), stack)\n"
        "    import os; assert os.path.getsize(path) > 0\n"
        "print('onnx' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(QWEN)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not IO.exists(), reason="needs /proc/self/io")
def test_output_folder_made_by_the_save_is_written_once(tmp_path: Path) -> None:
    """`-o new/dir/model.onnx` (the README's own examples): the quantized bytes wait in an
    unnamed file of the nearest existing folder, on the output's filesystem, and the save links
    that file in as the model file: every byte written once, as into an existing folder (the
    pass used to put them in $TMPDIR and the save copied them: the quantized bytes twice)."""
    out = tmp_path / "new" / "dir" / "model.onnx"
    before = _written()
    r = fastopt.quantize(QWEN, out, mode="int4")
    written = _written() - before
    assert r.summary.quantized > 0
    size = out.stat().st_size
    assert size <= written < size + 4096, (written, size)
    assert os.listdir(out.parent) == ["model.onnx"]
    assert os.listdir(tmp_path) == ["new"]
    # the same model as the save into an existing folder
    there = tmp_path / "there" / "model.onnx"
    there.parent.mkdir()
    fastopt.quantize(QWEN, there, mode="int4")
    assert out.read_bytes() == there.read_bytes()


def test_failed_save_into_new_folder_leaves_nothing(tmp_path: Path) -> None:
    """The unnamed file made in the nearest existing folder leaves no trace when the save does
    not happen (a dry run: no output) or fails (the output path is a folder)."""
    r = fastopt.quantize(QWEN, None, mode="int4")
    assert r.output is None
    (tmp_path / "new" / "model.onnx").mkdir(parents=True)
    with pytest.raises(fastopt.ModelError):
        fastopt.quantize(QWEN, tmp_path / "new" / "model.onnx", mode="int4")
    assert os.listdir(tmp_path / "new") == ["model.onnx"]
    assert os.listdir(tmp_path / "new" / "model.onnx") == []


def test_existing_folder_setting() -> None:
    from fastopt.quant.settings import existing_folder

    assert existing_folder("") == ""
    assert existing_folder(str(TESTS / "no" / "such" / "dir")) == str(TESTS)
    assert existing_folder(str(TESTS)) == str(TESTS)


def test_run_check_runs_beside_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run check's forked child (ORT's import and session: 0.2-0.4 s of CPU on the 0.5B)
    works while this process writes the output: the save starts before the check ends, and
    names its files only after it passed."""
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    run_once = rc._run_once

    def slow_check(model: fastopt.Model) -> str:
        time.sleep(1.0)
        left_out = run_once(model)
        (stamps / "check_end").write_text(repr(time.time()))
        return left_out

    save = fastopt.Model.save

    def timed_save(self: fastopt.Model, *a: object, **k: object) -> None:
        (stamps / "save_start").write_text(repr(time.time()))
        save(self, *a, **k)

    monkeypatch.setattr(rc, "_run_once", slow_check)
    monkeypatch.setattr(fastopt.Model, "save", timed_save)
    out = tmp_path / "q" / "model.onnx"
    report = fastopt.quantize(QWEN, out, mode="int4")
    assert report.run_check.startswith("ran in"), report.run_check
    assert float((stamps / "save_start").read_text()) < float((stamps / "check_end").read_text())
    assert out.exists()


def test_check_beside_the_save_refuses_and_leaves_the_old_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output ORT cannot run is refused by the check that ran beside the save: its files were
    written unnamed and go; the output it would have replaced stays as it was; no folder the
    save made is left; no child is left running."""
    run_once = rc._run_once

    def refuses_int4(model: fastopt.Model) -> str:
        if any(
            n.op_type == "MatMulNBits" for n in model.graph.nodes
        ):  # the output, not the original
            time.sleep(0.5)  # so that the save has written its files by now
            raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : no kernel (test)")
        return run_once(model)

    monkeypatch.setattr(rc, "_run_once", refuses_int4)
    old = tmp_path / "old" / "model.onnx"
    old.parent.mkdir()
    old.write_bytes(b"the old output")
    with pytest.raises(rc.RunCheckError, match=r"no kernel.*the original runs"):
        fastopt.quantize(QWEN, old, mode="int4")
    assert os.listdir(old.parent) == ["model.onnx"] and old.read_bytes() == b"the old output"
    new = tmp_path / "new" / "dir" / "model.onnx"
    with pytest.raises(rc.RunCheckError):
        fastopt.quantize(QWEN, new, mode="int4", external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["old"]
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # every child reaped


def test_failed_save_ends_the_check_beside_it(tmp_path: Path) -> None:
    """A save that fails before the check's answer is wanted (the output is a folder) kills and
    reaps the check's child."""
    (tmp_path / "model.onnx").mkdir()
    with pytest.raises(fastopt.ModelError):
        fastopt.quantize(QWEN, tmp_path / "model.onnx", mode="int4")
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_save_before_commit_sees_the_files_written_but_unnamed(tmp_path: Path) -> None:
    """Model.save(before_commit=f): f runs once, after every byte is written and before any
    file is named; its exception is raised by the save, which then leaves nothing."""
    model = fastopt.load(str(QWEN))
    out = tmp_path / "new" / "model.onnx"
    seen: list[list[str]] = []

    def ready() -> None:
        seen.append(sorted(os.listdir(out.parent)))

    model.save(out, True, before_commit=ready)
    assert seen == [[]]
    assert sorted(os.listdir(out.parent)) == ["model.onnx", "model.onnx.data"]

    class Refused(Exception):
        pass

    def refuse() -> None:
        raise Refused("no")

    again = tmp_path / "again" / "model.onnx"
    with pytest.raises(Refused):
        model.save(again, True, before_commit=refuse)
    assert not again.parent.exists()
    with pytest.raises(Refused):
        model.save(out, False, before_commit=refuse)  # over the earlier output: it stays
    assert sorted(os.listdir(out.parent)) == ["model.onnx", "model.onnx.data"]
    assert fastopt.load(str(out)).graph.nodes[0].op_type == model.graph.nodes[0].op_type


def test_forked_cancel_kills_and_reaps() -> None:
    from fastopt.forked import Forked

    start = time.perf_counter()
    child = Forked(time.sleep, 30)
    child.cancel()
    assert time.perf_counter() - start < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)
    with pytest.raises(RuntimeError, match="cancelled"):
        child.result()
    assert Forked(pow, 2, 10).result() == 1024
