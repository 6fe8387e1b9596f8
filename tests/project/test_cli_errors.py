"""The command line for a new user: bad input is one line `error: ...` with exit 2 (1 stays a
mismatch or a failing check), never a traceback, for every subcommand; Ctrl-C is exit 130;
misspelled names and bad option values are errors that list the known ones; tables stay
readable in pipes; the default preset is the LLM one, and the summary says so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import fastopt
import fastopt.cli.main
import onnx
import pytest
from onnx import TensorProto, helper
from support.hostile_models import HOSTILE
from support.paths import ROOT, TESTS

LLAMA = TESTS / "fixtures" / "models" / "llama_ts_float32" / "model.onnx"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = fastopt.cli.main.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hostile_cli")
    for name, make in HOSTILE.items():
        (d / f"{name}.onnx").write_bytes(make())
    return d


@pytest.mark.parametrize("name", list(HOSTILE))
def test_every_subcommand_on_hostile_input(
    name: str, hostile_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = hostile_dir / f"{name}.onnx"
    runs = {
        "info": ["info", p],
        "optimize": ["optimize", p, "-o", tmp_path / "o.onnx", "--verify"],
        "check": ["check", p],
        "bench": ["bench", p, "--runs", "1", "--warmup", "0", "--seq", "4", "--provider", "cpu"],
    }
    for sub, args in runs.items():
        code, out, err = cli(capsys, *args)
        assert "Traceback" not in out + err, (sub, err)
        if code == 2:
            assert_one_line_error(err)
        else:
            # 0: handled; 1: check / verify found the model failing, which they report
            assert code in (0, 1) and (code == 0 or sub in ("check", "optimize")), (sub, code, err)


def test_bench_of_a_model_ort_refuses_is_exit_2(
    hostile_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "bench", hostile_dir / "type_mismatch.onnx", "--runs", "1")
    assert code == 2
    assert_one_line_error(err)
    assert "ONNX Runtime session creation" in err


def test_keyboard_interrupt_is_130_without_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fastopt, "optimize", interrupted)
    code, out, err = cli(capsys, "optimize", LLAMA, "-o", tmp_path / "o.onnx")
    assert code == 130
    assert "Traceback" not in out + err and "interrupted" in err


def test_sigint_in_a_real_process_is_130(tmp_path: Path) -> None:
    code = (
        "import signal, os, fastopt, fastopt.cli.main, sys\n"
        # a shell's background job starts with SIGINT ignored; Python then installs no handler
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "def slow(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "fastopt.optimize = slow\n"
        f"args = ['optimize', {str(LLAMA)!r}, '-o', {str(tmp_path / 'o.onnx')!r}]\n"
        "sys.exit(fastopt.cli.main.main(args))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr


# --- misspelled names, option declarations ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (
            ["--option", "fold_max_byte=5"],
            r"no option named 'fold_max_byte' \(did you mean 'fold_max_bytes'",
        ),
        (["--option", "packed_attention=5"], r"packed_attention must be 0 \(off\), 1 .* or 2"),
        (
            ["--option", "rotary_max_positions=-3"],
            r"rotary_max_positions must be an integer in \[1, 1048576\]",
        ),
        (["--option", "strict_shapes=maybe"], r"strict_shapes must be a boolean"),
        (["--option", "opset"], r"--option takes KEY=VALUE"),
        (
            ["--passes", "eliminate_identiy"],
            r"no pass named 'eliminate_identiy' \(did you mean 'eliminate_identity'",
        ),
        (
            ["--preset", "lm"],
            r"no preset named 'lm' \(did you mean 'llm'.*known: classic, cleanup, default, llm",
        ),
    ],
)
def test_misspellings_are_errors_listing_the_known(
    args: list[str], pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "o.onnx"
    code, _, err = cli(capsys, "optimize", LLAMA, "-o", out_path, *args)
    assert code == 2
    assert_one_line_error(err)
    assert re.search(pattern, err), err
    if "option named" in err:
        assert "known: " in err and "fold_max_bytes" in err and "pack_matmuls" in err
    assert not out_path.exists()  # refused before any work


def test_python_api_checks_options_too() -> None:
    with pytest.raises(fastopt.OptionError, match="no option named 'nope'"):
        fastopt.optimize(str(LLAMA), options={"nope": 1})
    with pytest.raises(ValueError, match="packed_attention must be"):  # also a ValueError
        fastopt.optimize(str(LLAMA), options={"packed_attention": 5})
    with pytest.raises(KeyError, match="no pass named"):  # also a KeyError
        fastopt.optimize(str(LLAMA), passes=["eliminate_identity", "nope"])


def test_every_option_a_pass_reads_is_declared() -> None:
    """Grep the passes for option reads: each name must be in fastopt.OPTIONS, and each
    declared option must be read somewhere (no stale declarations)."""
    root = ROOT
    patterns = [
        r'options\.(?:find|count|at)\("([a-z_]+)"\)',
        r'option\(ctx, "([a-z_]+)"',
        r'options\.get\("([a-z_]+)"',
        r'options\["([a-z_]+)"\]',
    ]
    read: set[str] = set()
    for folder in (
        root / "csrc" / "passes",
        root / "csrc" / "quant",
        root / "python" / "fastopt" / "passes",
    ):
        for f in folder.rglob("*"):
            if f.suffix in (".cc", ".h", ".py"):
                text = f.read_text()
                for pat in patterns:
                    read.update(re.findall(pat, text))
    assert read, "the option reads were not found: update the patterns"
    assert read <= set(fastopt.OPTIONS), read - set(fastopt.OPTIONS)
    assert set(fastopt.OPTIONS) <= read, set(fastopt.OPTIONS) - read


def test_register_option_for_a_new_pass() -> None:
    spec = fastopt.register_option(
        "test_block_size", "int", "rows per block", passes=("nothing",), minimum=16, default=32
    )
    try:
        assert spec.check("64") == 64
        with pytest.raises(fastopt.OptionError, match="test_block_size must be an integer >= 16"):
            spec.check(8)
        with pytest.raises(ValueError, match="already registered"):
            fastopt.register_option("test_block_size", "int", "again", passes=())
    finally:
        fastopt.unregister_option("test_block_size")


# --- output for pipes and CI logs ---------------------------------------------------------------


def test_passes_through_a_pipe_at_60_columns() -> None:
    env = {**os.environ, "COLUMNS": "60"}
    proc = subprocess.run(
        [sys.executable, "-m", "fastopt", "passes"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    out = proc.stdout
    for p in fastopt.all_passes():
        assert re.search(rf"(^|\s){re.escape(p.name)}(\s|$)", out, re.M), p.name
    assert "…" not in out
    assert not re.search("[\u2500-\u257f]", out), "box-drawing characters in a pipe"
    assert "\x1b[" not in out
    for name in fastopt.OPTIONS:
        if not fastopt.OPTIONS[name].internal:
            assert name in out
    # Long descriptions wrap instead of running on: only lines holding an unbreakable word
    # (a long pass name and its columns) may pass 60 columns.
    long_lines = [line for line in out.splitlines() if len(line) > 60]
    assert len(long_lines) < len(out.splitlines()) / 4, long_lines[:5]


def test_optimize_through_a_pipe_is_plain_text(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fastopt", "optimize", str(LLAMA), "-o", str(tmp_path / "o.onnx")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "60"},
    )
    assert not re.search("[\u2500-\u257f\u2800-\u28ff]", proc.stdout + proc.stderr)
    assert "preset default" in proc.stdout


# --- the default preset -------------------------------------------------------------------------


def test_default_preset_runs_the_llm_fusions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "o.onnx"
    code, out, err = cli(capsys, "optimize", LLAMA, "-o", out_path)
    assert code == 0, err
    summary = out.strip().splitlines()[-1]
    assert "preset default" in summary and "GroupQueryAttention" in summary, summary
    ops = {n.op_type for n in onnx.load(str(out_path)).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    report = fastopt.optimize(str(LLAMA))  # the Python default is the CLI's
    assert report.preset == "default"
    assert report.ops_after == fastopt.optimize(str(LLAMA), preset="default").ops_after
    fastopt.verify(LLAMA, out_path)


def test_default_preset_still_fuses_conv_bn_relu(tmp_path: Path) -> None:
    c = 4
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])
    weights = [0.01 * i for i in range(c * c * 9)]
    w = helper.make_tensor("w", TensorProto.FLOAT, [c, c, 3, 3], weights)
    bn = [
        helper.make_tensor(n, TensorProto.FLOAT, [c], v)
        for n, v in (("s", [1.5] * c), ("b", [0.1] * c), ("m", [0.2] * c), ("v", [0.9] * c))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "cnn", [x], [y], initializer=[w, *bn]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    src = tmp_path / "cnn.onnx"
    onnx.save(model, src)
    report = fastopt.optimize(src, output=tmp_path / "o.onnx")
    assert report.ops_after == {"com.microsoft::FusedConv": 1}, report.ops_after
    fastopt.verify(src, tmp_path / "o.onnx")


# --- values beyond int64 or a declared maximum, file names that are not UTF-8 -------------------


@pytest.mark.parametrize(
    ("option", "pattern"),
    [
        # pybind's TypeError converting to int64_t before
        ("opset=99999999999999999999", r"opset must be an integer in \[1, 1000\]"),
        (
            "fold_max_bytes=99999999999999999999",
            r"fold_max_bytes must be an integer >= 0 \(and <= 9223372036854775807\)",
        ),
        ("fold_max_expand_bytes=-99999999999999999999", r"fold_max_expand_bytes must be"),
        # std::bad_alloc making a billion-row cos/sin cache before
        ("rotary_max_positions=1000000000", r"rotary_max_positions must be an integer in \[1, "),
    ],
)
def test_option_values_beyond_their_range_are_one_line(
    option: str, pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "optimize", LLAMA, "-o", tmp_path / "o.onnx", "--option", option)
    assert code == 2, err
    assert_one_line_error(err)
    assert re.search(pattern, err), err
    assert not (tmp_path / "o.onnx").exists()


def test_every_integer_option_has_a_range_within_int64() -> None:
    """Each integer option refuses what int64_t cannot hold, whatever range it declares."""
    for spec in fastopt.OPTIONS.values():
        if spec.kind != "int":
            continue
        for value in (2**63, -(2**63) - 1, 10**30):
            with pytest.raises(fastopt.OptionError, match=f"{spec.name} must be"):
                spec.check(str(value))
            with pytest.raises(fastopt.OptionError):
                spec.check(value)


def test_quantize_threads_beyond_int64_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = "99999999999999999999"  # pybind's TypeError passing it to the pass before
    code, _, err = cli(capsys, "quantize", LLAMA, "-o", tmp_path / "q.onnx", "--mode", "int4",
                       "--threads", big)  # fmt: skip
    assert code == 2, err
    assert_one_line_error(err)
    assert "threads must be 0 (all cores) up to 4096" in err


BAD = os.fsdecode(b"bad-\xff\xfe.onnx")  # what Python makes of a non-UTF-8 file name


@pytest.mark.parametrize(
    "args",
    [
        ["optimize", LLAMA, "-o", "{tmp}/" + BAD],  # pybind's RuntimeError before
        ["optimize", "{tmp}/" + BAD, "-o", "{tmp}/o.onnx"],
        ["optimize", LLAMA, "-o", "{tmp}/o.onnx", "--report", "{tmp}/" + BAD],
        ["quantize", LLAMA, "-o", "{tmp}/" + BAD, "--mode", "int8"],
        ["info", "{tmp}/" + BAD],
        ["check", "{tmp}/" + BAD],
        ["check", LLAMA, "--json", "{tmp}/" + BAD],
        ["bench", "{tmp}/" + BAD, "--runs", "1"],
        ["genai-whisper", "{tmp}/" + BAD, "{tmp}/d.onnx", "-o", "{tmp}/w", "--config", "c.json"],
    ],
)
def test_non_utf8_paths_are_one_line_errors(
    args: list[object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file name that is not UTF-8 is refused naming its bytes, before any work, by every
    subcommand: it reached onnx, ORT and pybind as a string they cannot encode."""
    (tmp_path / BAD).write_bytes(LLAMA.read_bytes())  # an input by that name exists
    argv = [str(a).replace("{tmp}", str(tmp_path)) for a in args]
    code, _, err = cli(capsys, *argv)
    assert code == 2, err
    assert_one_line_error(err)
    assert "is not valid UTF-8" in err and "\\xff\\xfe" in err, err
    assert sorted(os.listdir(tmp_path)) == [BAD]


def test_non_utf8_output_in_a_real_process(tmp_path: Path) -> None:
    out = os.fsencode(tmp_path) + b"/\xff.onnx"
    proc = subprocess.run(
        [sys.executable, "-m", "fastopt", "optimize", os.fsencode(LLAMA), "-o", out],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc.stderr)
    assert os.listdir(tmp_path) == []


def test_python_api_refuses_non_utf8_paths(tmp_path: Path) -> None:
    model = fastopt.load(LLAMA)
    for call in (
        lambda: model.save(str(tmp_path / BAD)),
        lambda: model.save(os.fsencode(tmp_path) + b"/\xff.onnx"),
        lambda: fastopt.load(tmp_path / BAD),
    ):
        with pytest.raises(fastopt.ModelError, match="is not valid UTF-8"):
            call()
    assert os.listdir(tmp_path) == []
