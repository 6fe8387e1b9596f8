"""The input is sacred, outputs are complete or absent, and what load accepts, onnx can read.

Saving never replaces the loaded model's own files (compared by identity, however they are
named), nor anything that is not a regular file; a save killed at any step of its commit leaves
the old output, the new one or no model file, and no temporary; special files are refused
before they are opened; a mapped file that shrinks after the load is a ModelError, not SIGBUS;
bytes the reader keeps verbatim must parse as protobuf parses them, within its nesting limit.
Checks whose failure mode is a crash or a hang run in a child process with a timeout.
"""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from support.paths import TESTS
from support.wire import SGROUP_WT, f_len, f_str, f_varint, key
from support.wire_models import (
    add_model,
    make_model,
    model_from_graph,
    nested_graph_model,
    nested_group_model,
    nested_type_model,
    weights,
    wire_node,
)

HERE = TESTS
CORPUS = HERE / "fuzz" / "corpus"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),
        check=False,
    )


def report(proc: subprocess.CompletedProcess[str]) -> str:
    out, err = proc.stdout[-3000:], proc.stderr[-3000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


# ---------------------------------------------------------------------------------------------
# 1. The input is sacred: outputs compared with the loaded files by identity


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_model(tmp_path / "src")


def refused(model: fastopt.Model, path: Path | str, **kw: object) -> str:
    with pytest.raises(fastopt.ModelError) as exc:
        model.save(str(path), **kw)  # type: ignore[arg-type]
    return str(exc.value)


def test_save_refuses_every_name_of_the_input(tmp_path: Path, src: Path) -> None:
    before = snapshot(src.parent)
    m = fastopt.load(src)
    (tmp_path / "link").symlink_to(src.parent, target_is_directory=True)
    os.link(src, tmp_path / "hardlink.onnx")
    (tmp_path / "sym.onnx").symlink_to(src)
    cases: list[tuple[Path, dict[str, object]]] = [
        (src, {}),
        (src, {"external_data": True, "size_threshold": 0}),
        (tmp_path / "link" / "model.onnx", {"external_data": True}),  # through a symlinked folder
        (tmp_path / "hardlink.onnx", {}),
        (tmp_path / "sym.onnx", {}),
        (src.parent / "model.onnx.data", {}),  # -o <the input's data file>
        # A new model file beside the input whose data would take the input's data file's name.
        (src.parent / "other.onnx", {"external_data": "model.onnx.data", "size_threshold": 0}),
        (tmp_path / "link" / "other.onnx", {"external_data": True, "location": "model.onnx.data"}),
    ]
    for path, kw in cases:
        msg = refused(m, path, **kw)
        assert "loaded model's own file" in msg and "model.onnx" in msg, msg
    assert snapshot(src.parent) == before
    assert not (src.parent / "other.onnx").exists()
    w, _ = weights(0)
    np.testing.assert_array_equal(fastopt.load(src).graph.initializer("W").numpy(), w)


def test_optimize_and_cli_refuse_the_input(tmp_path: Path, src: Path) -> None:
    before = snapshot(src.parent)
    with pytest.raises(fastopt.ModelError, match="must differ from the input"):
        fastopt.optimize(str(src), output=str(src))
    with pytest.raises(fastopt.ModelError, match="own file"):
        fastopt.optimize(str(src), output=str(src.parent / "model.onnx.data"))
    (tmp_path / "link").symlink_to(src.parent, target_is_directory=True)
    for out, extra in (
        (tmp_path / "link" / "model.onnx", []),
        (src.parent / "model.onnx.data", []),
        (tmp_path / "link" / "model.onnx", ["--external-data", "always"]),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "fastopt", "optimize", str(src), "-o", str(out), *extra],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 2, report(proc)
        assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(src.parent) == before


def test_special_files_are_never_replaced(tmp_path: Path, src: Path) -> None:
    m = fastopt.load(src)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "fifo.onnx")
    (out / "dir.onnx").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(out / "sock.onnx"))
        for name in ("fifo.onnx", "dir.onnx", "sock.onnx"):
            refused(m, out / name)
        # A special file where a data file would go.
        os.mkfifo(out / "m.onnx.data")
        refused(m, out / "m.onnx", external_data=True)
        assert not (out / "m.onnx").exists()
        assert "FIFO, socket or device" in refused(m, "/dev/null")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
        assert stat.S_ISFIFO(os.stat(out / "fifo.onnx").st_mode)
        assert stat.S_ISSOCK(os.stat(out / "sock.onnx").st_mode)
    finally:
        sock.close()


def test_missing_output_folders_are_created_and_removed_on_failure(
    tmp_path: Path, src: Path
) -> None:
    m = fastopt.load(src)
    m.save(str(tmp_path / "new" / "deeper" / "m.onnx"), external_data=True, size_threshold=0)
    assert sorted(os.listdir(tmp_path / "new" / "deeper")) == ["m.onnx", "m.onnx.data"]
    w, _ = weights(0)
    loaded = fastopt.load(tmp_path / "new" / "deeper" / "m.onnx")
    np.testing.assert_array_equal(loaded.graph.initializer("W").numpy(), w)
    # A save that fails after creating folders removes them again.
    with pytest.raises(fastopt.ModelError, match="model file itself"):
        m.save(str(tmp_path / "gone" / "sub" / "m.onnx"), external_data="m.onnx")
    assert not (tmp_path / "gone").exists()
    # The CLI creates them too.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastopt",
            "optimize",
            str(src),
            "-o",
            str(tmp_path / "c" / "m.onnx"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, report(proc)
    assert (tmp_path / "c" / "m.onnx").is_file()


def test_outputs_get_umask_permissions(tmp_path: Path, src: Path) -> None:
    from fastopt.genai.config import write_genai_config

    old = os.umask(0o027)
    try:
        m = fastopt.load(src)
        m.save(str(tmp_path / "m.onnx"), external_data=True, side_files={"side.json": b"{}\n"})
        write_genai_config({"a": 1}, tmp_path / "genai_config.json")
    finally:
        os.umask(old)
    for name in ("m.onnx", "m.onnx.data", "side.json", "genai_config.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640, name
    assert json.loads((tmp_path / "genai_config.json").read_text()) == {"a": 1}
    assert (tmp_path / "side.json").read_bytes() == b"{}\n"


# ---------------------------------------------------------------------------------------------
# 2. Complete or absent: a save killed after each step of its commit

KILL_CHILD = """
    import json, os, sys
    import fastopt
    src, kind, outs = sys.argv[1], sys.argv[2], sys.argv[3:]
    kw = {
        "inline": dict(external_data=False),
        "external": dict(external_data=True, size_threshold=0),
        "split": dict(external_data=True, size_threshold=0, max_file_bytes=8192),
    }[kind]
    status = []
    for step, out in enumerate(outs, 1):
        pid = os.fork()  # one save per step, killed by the hook right after that step
        if pid == 0:
            os.environ["FASTOPT_TEST_KILL_AT_STEP"] = str(step)
            m = fastopt.load(src)
            m.save(out, side_files={"genai_config.json": b'{"new": true}'}, **kw)
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        status.append("killed" if os.WIFSIGNALED(st) and os.WTERMSIG(st) == 9
                      else "finished" if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
                      else f"status {st}")
        if status[-1] != "killed":
            break
    print(json.dumps(status))
"""


def folder_state(folder: Path, old: tuple[np.ndarray, ...], new: tuple[np.ndarray, ...]) -> str:
    """'old', 'new' or 'absent'; fails on anything else (a mix, a temporary, a partial file)."""
    names = set(os.listdir(folder))
    allowed = {"model.onnx", "model.onnx.data", "model.onnx.data.1", "genai_config.json"}
    assert names <= allowed, f"unexpected files (temporaries?): {sorted(names - allowed)}"
    if "model.onnx" not in names:
        return "absent"
    m = fastopt.load(folder / "model.onnx")
    onnx.load(str(folder / "model.onnx"))  # onnx reads it too
    got = (m.graph.initializer("W").numpy(), m.graph.initializer("B").numpy())
    for label, want in (("old", old), ("new", new)):
        if all(np.array_equal(g, w) for g, w in zip(got, want)):
            if label == "new":
                config = (folder / "genai_config.json").read_bytes()
                assert config == b'{"new": true}', "the new model beside an old genai_config.json"
            return label
    raise AssertionError("the folder holds a mix of the old and new outputs (wrong weights)")


@pytest.mark.parametrize("kind", ["inline", "external", "split"])
def test_killed_save_leaves_old_new_or_nothing(tmp_path: Path, kind: str) -> None:
    """FASTOPT_TEST_KILL_AT_STEP=k: SIGKILL right after step k of the commit, for every k, over
    an earlier output with the same file names (and an old genai_config.json)."""
    src = make_model(tmp_path / "src", seed=1)
    old, new = weights(0), weights(1)
    outs = []
    for step in range(1, 16):
        out = tmp_path / f"out{step}"
        make_model(out, seed=0)
        (out / "genai_config.json").write_bytes(b'{"old": true}')
        outs.append(out)
    proc = run_child(KILL_CHILD, str(src), kind, *(str(o / "model.onnx") for o in outs))
    assert proc.returncode == 0, report(proc)
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status[-1] == "finished" and set(status[:-1]) == {"killed"}, status
    states = [folder_state(out, old, new) for out in outs[: len(status)]]
    # Killed before any name changed: old; in the middle: absent; once named: new.
    assert states[0] == "old" and "absent" in states and states[-1] == "new", states
    assert states == sorted(states, key=["old", "absent", "new"].index), states


def test_failed_save_leaves_no_temporary(tmp_path: Path, src: Path) -> None:
    m = fastopt.load(src)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "x.onnx.data.1")  # the second data file cannot be written
    with pytest.raises(fastopt.ModelError):
        m.save(str(out / "x.onnx"), external_data=True, size_threshold=0, max_file_bytes=8192)
    assert os.listdir(out) == ["x.onnx.data.1"]


# ---------------------------------------------------------------------------------------------
# 3. Special files as inputs: refused before they are opened (opening a FIFO blocks)

FIFO_CHILD = """
    import json, os, subprocess, sys
    import fastopt
    fifo_model, fifo_data = sys.argv[1], sys.argv[2]
    out = {}
    for name, path in (("model", fifo_model), ("data", fifo_data)):
        try:
            fastopt.load(path)
            out[name] = "OK"
        except fastopt.ModelError as e:
            out[name] = "ModelError: " + str(e)
    try:
        fastopt.optimize(fifo_data, output=os.path.join(os.path.dirname(fifo_data), "o.onnx"))
        out["optimize"] = "OK"
    except fastopt.ModelError as e:
        out["optimize"] = "ModelError: " + str(e)
    proc = subprocess.run([sys.executable, "-m", "fastopt", "info", fifo_model],
                          capture_output=True, text=True, timeout=60)
    out["info"] = [proc.returncode, proc.stderr]
    print(json.dumps(out))
"""


def test_fifo_as_model_or_data_is_refused_not_a_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.onnx")
    d = tmp_path / "d"
    make_model(d)
    (d / "model.onnx.data").unlink()
    os.mkfifo(d / "model.onnx.data")
    proc = run_child(FIFO_CHILD, str(tmp_path / "fifo.onnx"), str(d / "model.onnx"), timeout=90)
    assert proc.returncode == 0, report(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for k in ("model", "data", "optimize"):
        assert out[k].startswith("ModelError") and "not a regular file" in out[k], out
    assert out["info"][0] == 2 and out["info"][1].startswith("error:"), out


# ---------------------------------------------------------------------------------------------
# 4. A mapped file that shrinks or changes after the load

SHRINK_CHILD = """
    import json, os, sys
    import numpy as np
    import fastopt
    src, out_dir, how = sys.argv[1], sys.argv[2], sys.argv[3]
    data = src + ".data"
    m = fastopt.load(src)
    size = os.path.getsize(data)
    if how == "truncate":
        os.truncate(data, 100)
    elif how == "empty":
        open(data, "wb").close()
    else:  # rewritten in place, same size, other bytes
        with open(data, "r+b") as f:
            f.write(b"\\x01" * size)
    result = {}
    for name, call in (
        ("numpy", lambda: m.graph.initializer("W").numpy()),
        ("raw_bytes", lambda: bytes(m.graph.initializer("B").raw_bytes())),
        ("save_inline", lambda: m.save(os.path.join(out_dir, "a.onnx"), external_data=False)),
        ("save_external", lambda: m.save(os.path.join(out_dir, "b.onnx"), external_data=True,
                                         size_threshold=0)),
    ):
        try:
            call()
            result[name] = "OK"
        except fastopt.ModelError as e:
            result[name] = "ModelError: " + str(e)
    print(json.dumps(result))
"""


@pytest.mark.parametrize("how", ["truncate", "empty", "rewrite"])
def test_mapped_file_changed_after_load(tmp_path: Path, src: Path, how: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = run_child(SHRINK_CHILD, str(src), str(out), how)
    assert proc.returncode == 0, report(proc)  # SIGBUS would be -7
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for k, v in result.items():
        assert v.startswith("ModelError") and ("shrank" in v or "modified" in v), (k, v)
    assert os.listdir(out) == []


# ---------------------------------------------------------------------------------------------
# 5. What the reader keeps verbatim must parse; nesting within protobuf's limit


def onnx_parses(data: bytes) -> bool:
    try:
        onnx.load_model_from_string(data)
    except Exception:
        return False
    return True


GRAPH = add_model().graph.SerializeToString()
TYPE_F = f_len(1, f_varint(1, TensorProto.FLOAT))  # TypeProto{tensor_type{elem_type: FLOAT}}
BAD = b"\x0a\x05ab"  # a field whose length runs past the end of its message


def node_with(extra: bytes) -> bytes:
    return model_from_graph(f_len(1, wire_node("Identity", ["X"], ["Y"], extra)) + IO)


IO = f_len(11, f_str(1, "X") + f_len(2, TYPE_F)) + f_len(12, f_str(1, "Y") + f_len(2, TYPE_F))


def io_type(typ: bytes) -> bytes:
    """A model whose input and output have TypeProto `typ`."""
    return model_from_graph(
        f_len(1, wire_node("Identity", ["X"], ["Y"]))
        + f_len(11, f_str(1, "X") + f_len(2, typ))
        + f_len(12, f_str(1, "Y") + f_len(2, typ))
    )


# Files onnx cannot parse because of bytes inside fields fastopt does not decode.
CORRUPT_KEPT = {
    "node_metadata_props": node_with(f_len(9, BAD)),
    "node_device_configuration": node_with(f_len(10, f_len(2, f_len(2, b"\x80")))),
    "attribute_type_proto": node_with(f_len(5, f_str(1, "a") + f_len(14, BAD))),
    "attribute_sparse_tensor": node_with(f_len(5, f_str(1, "a") + f_len(22, f_len(1, BAD)))),
    "graph_quantization_annotation": model_from_graph(GRAPH + f_len(14, f_len(2, BAD))),
    "graph_metadata_props": model_from_graph(GRAPH + f_len(16, BAD)),
    "model_training_info": model_from_graph(GRAPH) + f_len(20, f_len(1, f_len(1, BAD))),
    "model_configuration": model_from_graph(GRAPH) + f_len(26, BAD),
    "model_metadata_extra_field": model_from_graph(GRAPH) + f_len(14, f_str(1, "k") + BAD),
    "sequence_type": io_type(f_len(4, f_len(1, BAD))),
    "map_type": io_type(f_len(5, f_varint(1, 7) + f_len(2, BAD))),
    "optional_type": io_type(f_len(9, BAD)),
    "dim_denotation_sibling": io_type(f_len(1, f_len(2, f_len(1, f_varint(1, 3)) + BAD))),
    "tensor_segment": model_from_graph(
        GRAPH + f_len(5, f_str(8, "S") + f_varint(2, 1) + f_len(3, BAD) + f_len(4, bytes(4)))
    ),
    "value_info_metadata": model_from_graph(GRAPH + f_len(13, f_str(1, "Y") + f_len(4, BAD))),
    "packed_sharding_devices": node_with(f_len(10, f_len(2, f_len(2, b"\xff")))),
    "packed_floats_not_multiple_of_4": node_with(
        f_len(5, f_str(1, "a") + f_len(7, b"\x00\x00\x00"))
    ),
    "overlong_varint_in_unknown_field": model_from_graph(GRAPH)
    + key(900, 0)
    + b"\xff" * 10
    + b"\x01",
    "unbalanced_group_in_node": node_with(key(900, SGROUP_WT) + f_varint(1, 1)),
}

# Unknown fields (numbers onnx.proto does not define) hold opaque bytes: protobuf keeps them.
VALID_UNKNOWN = {
    "unknown_len_field_with_garbage": model_from_graph(GRAPH + f_len(900, b"\xff\xff\xff")),
    "unknown_field_in_type": io_type(TYPE_F + f_len(77, BAD)),
    "known_message_field_with_other_wire_type": node_with(f_varint(9, 5)),
    "balanced_groups": model_from_graph(GRAPH) + key(900, SGROUP_WT) + key(900, 4),
}


@pytest.mark.parametrize("name", sorted(CORRUPT_KEPT))
def test_corrupt_bytes_in_kept_fields_are_refused(tmp_path: Path, name: str) -> None:
    data = CORRUPT_KEPT[name]
    assert not onnx_parses(data), "the crafted file should be one onnx refuses"
    with pytest.raises(fastopt.ModelError, match=r"corrupt|varint|nest|length|group|multiple"):
        fastopt.load_bytes(data)


@pytest.mark.parametrize("name", sorted(VALID_UNKNOWN))
def test_unknown_fields_protobuf_keeps_still_load(name: str) -> None:
    data = VALID_UNKNOWN[name]
    assert onnx_parses(data)
    out = fastopt.load_bytes(data).serialize()
    assert onnx_parses(out)


def test_varint_whose_tenth_byte_overflows() -> None:
    # int64 max is 9 bytes of 0xff then 0x00/0x01; a 10th byte of 2 or more does not fit.
    ok = model_from_graph(GRAPH) + key(5, 0) + b"\xff" * 9 + b"\x01"
    fastopt.load_bytes(ok)
    with pytest.raises(fastopt.ModelError, match="varint overflows 64 bits"):
        fastopt.load_bytes(model_from_graph(GRAPH) + key(5, 0) + b"\xff" * 9 + b"\x02")
    with pytest.raises(fastopt.ModelError, match="overflows 64 bits"):
        packed = f_len(1, b"\xff" * 9 + b"\x7f")  # TensorProto.dims, packed
        fastopt.load_bytes(model_from_graph(GRAPH + f_len(5, packed + f_str(8, "T"))))


@pytest.mark.parametrize(
    "make, ok_depth",
    [(nested_graph_model, 33), (nested_type_model, 48), (nested_group_model, 100)],
    ids=["if_bodies", "types", "groups"],
)
def test_nesting_limit_matches_protobuf(make: object, ok_depth: int) -> None:
    build = make  # type: ignore[assignment]
    deepest = build(ok_depth)  # type: ignore[operator]
    assert onnx_parses(deepest) and not onnx_parses(build(ok_depth + 1))  # type: ignore[operator]
    assert onnx_parses(fastopt.load_bytes(deepest).serialize())
    with pytest.raises(fastopt.ModelError, match="nesting deeper than 100 levels"):
        fastopt.load_bytes(build(ok_depth + 1))  # type: ignore[operator]


def mutants(seed_bytes: bytes, n: int, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(n):
        b = bytearray(seed_bytes)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] = rng.choice([0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        out.append(bytes(b))
    return out


def test_whatever_load_accepts_onnx_can_read_after_save() -> None:
    """Property: for every input load accepts, onnx parses what save writes (fuzz seeds, their
    mutants and the crafted cases above)."""
    rng = random.Random(14)
    inputs = list(CORRUPT_KEPT.values()) + list(VALID_UNKNOWN.values())
    for seed in sorted(CORPUS.glob("*.onnx")):
        data = seed.read_bytes()
        inputs.append(data)
        inputs += mutants(data, 150, rng)
    accepted = 0
    for i, data in enumerate(inputs):
        try:
            m = fastopt.load_bytes(data, str(CORPUS))
            out = m.serialize()
        except fastopt.ModelError:
            continue
        accepted += 1
        assert onnx_parses(out), f"input {i}: fastopt loaded it, onnx cannot read the saved file"
    assert accepted >= 20, accepted


# ---------------------------------------------------------------------------------------------
# 6. Sizes

W = numpy_helper.from_array(np.zeros((2, 3), np.float32), "W")


@pytest.mark.parametrize(
    "dims, dtype",
    [
        ([0, 2**62], TensorProto.FLOAT),
        ([0, 2**61], TensorProto.FLOAT),
        ([2**61, 0, 8], TensorProto.INT8),
        ([0, 2**60], TensorProto.DOUBLE),
    ],
)
def test_sizes_overflowing_int64_with_the_item_size(dims: list[int], dtype: int) -> None:
    t = TensorProto(name="T", data_type=dtype, dims=dims)
    m = add_model(W, t)
    with pytest.raises(fastopt.ModelError, match=r"size in bytes|element count"):
        fastopt.load_bytes(m.SerializeToString())


def test_largest_empty_shape_still_loads() -> None:
    t = TensorProto(name="T", data_type=TensorProto.FLOAT, dims=[0, 2**60])
    m = fastopt.load_bytes(add_model(W, t).SerializeToString())
    assert m.graph.initializer("T").numpy().shape == (0, 2**60)


def test_checksum_key_is_verified_on_request(tmp_path: Path) -> None:
    """Load keeps the `checksum` key without reading the weights; verify_checksums compares it
    with the SHA-1 of the whole data file, as ONNX's external data spec defines it."""
    import hashlib

    d = tmp_path / "m"
    path = make_model(d)
    proto = onnx.load(str(path), load_external_data=False)
    digest = hashlib.sha1((d / "model.onnx.data").read_bytes()).hexdigest()
    for t in proto.graph.initializer:
        e = t.external_data.add()
        e.key, e.value = "checksum", digest
    onnx.save_model(proto, str(path))
    m = fastopt.load(path)
    assert fastopt.verify_checksums(m) == 2
    proto.graph.initializer[1].external_data[-1].value = "0" * 40
    onnx.save_model(proto, str(path))
    with pytest.raises(fastopt.ModelError, match=r"tensor 'B'.*SHA-1"):
        fastopt.verify_checksums(fastopt.load(path))


NAMED_TEMPS_CHILD = """
    import os, sys
    import fastopt
    src, out = sys.argv[1], sys.argv[2]
    m = fastopt.load(src)
    m.save(os.path.join(out, "model.onnx"), external_data=True, size_threshold=0,
           side_files={"genai_config.json": b'{"new": true}'})
    os.mkfifo(os.path.join(out, "x.onnx.data.1"))
    try:
        m.save(os.path.join(out, "x.onnx"), external_data=True, size_threshold=0,
               max_file_bytes=8192)
    except fastopt.ModelError:
        print("refused")
"""


def test_named_temporaries_where_the_filesystem_has_no_unnamed_files(tmp_path: Path) -> None:
    """The fallback for filesystems without O_TMPFILE: hidden temporaries renamed at commit, in
    the same order, removed when the save fails, with the usual permissions."""
    src = make_model(tmp_path / "src", seed=1)
    out = tmp_path / "out"
    make_model(out, seed=0)
    (out / "genai_config.json").write_bytes(b"old")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NAMED_TEMPS_CHILD), str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, FASTOPT_TEST_NAMED_TEMPS="1"),
        check=False,
    )
    assert proc.returncode == 0 and "refused" in proc.stdout, report(proc)
    assert sorted(os.listdir(out)) == [
        "genai_config.json",
        "model.onnx",
        "model.onnx.data",
        "x.onnx.data.1",
    ]
    (out / "x.onnx.data.1").unlink()
    assert folder_state(out, weights(0), weights(1)) == "new"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(out / "model.onnx").st_mode) == 0o666 & ~mask
