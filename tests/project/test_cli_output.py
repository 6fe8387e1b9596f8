"""What the command line says to a new user (issue 28, "misleading or rough"): bench compares
like with like and says what each side computed; optimize prints a short summary (tables with
-v), plain text in pipes, progress on stderr for long runs; unknown --explain names, non-ONNX
files, encoders given a KV cache and internal --option names get one clear line; help lists
what it should; the public API's docstrings list parameters."""

from __future__ import annotations

import json
import os
import pydoc
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import fastopt
import fastopt.bench
import fastopt.cli.main
import pytest
from fastopt.bench import report
from fastopt.bench.result import BenchResult
from fastopt.bench.timing import Stats
from support.bench_models import DECODER, ENCODER, cached_decoder
from support.paths import ROOT

if TYPE_CHECKING:
    from types import ModuleType

LLAMA = DECODER
BOX = re.compile("[\u2500-\u257f\u2800-\u28ff]")  # box drawing, braille spinners


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = fastopt.cli.main.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run(*args: object, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "fastopt", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def cli_progress() -> ModuleType:
    import fastopt.cli.progress

    return fastopt.cli.progress


@pytest.fixture(scope="module")
def standard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_decoder(tmp_path_factory.mktemp("cached"), "standard")


# --- bench: like for like, the speed-up column, argument order ---------------------------------


def test_bench_decode_of_cached_and_uncached_times_the_prefill(
    standard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's demo: a no-cache original against a cached output, --phase decode. The
    decode steps are different work (129 tokens recomputed vs one token): by default both
    models run the same prefill, and the output says so."""
    out = tmp_path / "b.json"
    code, text, err = cli(capsys, "bench", LLAMA, "--against", standard, "--phase", "decode",
                          "--seq", "16", "--runs", "3", "--warmup", "1", "--provider", "cpu",
                          "--json", out)  # fmt: skip
    assert code == 0, err
    assert "has no KV cache" in text and "timing the prefill" in text, text
    rows = [line for line in text.splitlines() if "model.onnx" in line and " CPU " in line]
    assert len(rows) == 2 and all(" 16 tokens " in row for row in rows), rows
    assert "(prefill: 16 tokens each, median latency)" in text, text
    assert [r["phase"] for r in json.loads(out.read_text())["results"]] == ["prefill"] * 2


def _result(model: str, median_s: float, **kw: object) -> BenchResult:
    stats = Stats(10, median_s, median_s, median_s, median_s, median_s, median_s, 0.0)
    fields: dict[str, object] = {"provider": "CPUExecutionProvider", "kind": "decoder"}
    fields |= {"phase": "prefill", "batch": 1, "seq": 128, "tokens": 128, **kw}
    return BenchResult(model=model, stats=stats, **fields)  # type: ignore[arg-type]


def test_speed_up_column_reads_the_speed_up() -> None:
    """The ratio column read 0.01 for a model 175x faster (and 0.00 past 200x)."""
    results = [_result("a/m.onnx", 0.175), _result("b/m.onnx", 0.001), _result("c/m.onnx", 0.35)]
    table = report.table(results)
    assert table.columns[-1].header == "speed-up"
    assert list(table.columns[-1].cells) == ["1.00x", "175x", "0.50x"]
    assert report.times(17.55) == "17.6x" and report.times(0.004) == "0.004x"


def test_work_says_what_each_run_computes() -> None:
    cached = _result("c", 1e-4, phase="decode", kind="decoder_inplace", tokens=1)
    recompute = _result("r", 1e-3, phase="decode", kind="decoder", tokens=1)
    assert report.work(cached) == "1 token after 128 cached"
    assert report.work(recompute) == "129 tokens, no cache (recompute)"
    assert report.work(_result("p", 1e-3)) == "128 tokens"
    assert not report.same_work([cached, recompute])


def test_bench_vs_recompute_names_both_sides(
    standard: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text, err = cli(capsys, "bench", standard, "--against", LLAMA, "--phase", "decode",
                          "--seq", "16", "--runs", "2", "--warmup", "1", "--provider", "cpu",
                          "--vs-recompute")  # fmt: skip
    assert code == 0, err
    line = text.strip().splitlines()[-1]
    assert "17 tokens, no cache (recompute) against 1 token after 16 cached" in line, text


def test_bench_takes_the_model_after_against(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --against X M` failed with "model required" (--against took M too)."""
    code, text, err = cli(capsys, "bench", "--against", ENCODER, LLAMA, "--seq", "4",
                          "--runs", "1", "--warmup", "0", "--provider", "cpu")  # fmt: skip
    assert code == 0, err
    rows = [line for line in text.splitlines() if "model.onnx" in line and " CPU " in line]
    assert rows[0].startswith("llama_ts_float32/model.onnx") and rows[0].endswith("1.00x")
    code, _, err = cli(capsys, "bench", "--against", LLAMA)
    assert code == 2 and "bench needs MODEL" in one_line_error(err)


# --- optimize and quantize output -----------------------------------------------------------------


def test_optimize_prints_a_short_summary_and_tables_with_verbose(tmp_path: Path) -> None:
    args = [LLAMA, "-o", tmp_path / "o.onnx", "--preset", "llm", "--quantize", "int4"]
    short = run("optimize", *args)
    assert short.returncode == 0, short.stderr
    lines = short.stdout.strip().splitlines()
    assert len(lines) <= 6, short.stdout  # ~90 lines (154 at 80 columns) before
    assert lines[-1].endswith("KB)") and "wrote" in lines[-1]
    assert re.match(r"quantized \d+ weights, kept 1 ", lines[0]) and "passes: " in lines[1]
    assert not BOX.search(short.stdout + short.stderr)

    verbose = run("optimize", *args, "-v")
    assert verbose.returncode == 0, verbose.stderr
    text = verbose.stdout
    assert "fuse_attention" in text and "operators (changed)" in text
    # the weights table: plain text in a pipe at 80 columns, every name whole
    assert not BOX.search(text) and "…" not in text, text
    for name in ("m.model.embed_tokens.weight", "onnx::MatMul_732", "onnx::MatMul_769"):
        assert re.search(rf"^{re.escape(name)}\s", text, re.M), name
    assert "kept: embedding table" in text


def test_print_quantization_goes_through_print_table(capsys: pytest.CaptureFixture[str]) -> None:
    weights = [
        fastopt.WeightQuantization(
            weight="onnx::MatMul_" + "9" * 40, node="n", op="MatMul", action="quantized",
            reason="", dtype_before="float", dtype_after="int4", bytes_before=4096,
            bytes_after=640, max_rel_error=0.07, mean_rel_error=0.09,
        )
    ]  # fmt: skip
    from fastopt.cli.common import print_quantization
    from fastopt.cli.output import console

    print_quantization(weights, console(), verbose=True)
    out = capsys.readouterr().out
    assert "onnx::MatMul_" + "9" * 40 in out and not BOX.search(out)


def test_a_table_wider_than_the_terminal_crops_nothing() -> None:
    """On a terminal, rich cropped a table whose unwrappable columns passed the width (bench's
    at 80 columns lost "p99 ms" and everything after it)."""
    import io

    from fastopt.cli.output import print_table
    from rich.console import Console
    from rich.table import Table

    buffer = io.StringIO()
    out = Console(file=buffer, force_terminal=True, width=60)
    table = Table()
    headers = [f"column_{i}" for i in range(8)]
    for header in headers:
        table.add_column(header)
    table.add_row("llama_ts_float32/model.onnx", *[f"cell_{i}" for i in range(1, 8)])
    print_table(out, table)
    text = buffer.getvalue()
    for cell in [*headers, "llama_ts_float32/model.onnx", "cell_7"]:
        assert cell in text, cell


def test_optimize_without_output_says_nothing_was_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = cli(capsys, "optimize", LLAMA)
    assert code == 0, err
    assert "nothing written (a dry run: give -o FILE" in out.strip().splitlines()[-1]


def test_progress_lines_in_a_pipe(
    cli_progress: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No progress in pipes before (gemma3-270m: 8.7 s silent): a long run prints plain lines
    on stderr (here after 0 s instead of 2, with one pass made slow), stdout stays the
    summary."""
    monkeypatch.setattr(cli_progress, "DELAY_S", 0.0)
    monkeypatch.setattr(cli_progress, "EVERY_S", 0.0)
    real = fastopt.optimize

    def slow_optimize(*args: object, **kwargs: object) -> object:
        progress = kwargs["progress"]

        def slowly(i: int, n: int, name: str) -> None:
            progress(i, n, name)  # type: ignore[operator]
            if name == "fuse_attention":
                time.sleep(0.8)

        kwargs["progress"] = slowly
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fastopt, "optimize", slow_optimize)
    code, out, err = cli(capsys, "optimize", LLAMA, "-o", tmp_path / "o.onnx")
    assert code == 0, err
    assert re.search(r"^optimize: fuse_attention \(pass \d+ of \d+\), \d+\.\d s$", err, re.M), err
    assert "optimize:" not in out and not BOX.search(err)


def test_bench_progress_lines_in_a_pipe(
    cli_progress: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_progress, "DELAY_S", 0.0)
    monkeypatch.setattr(cli_progress, "EVERY_S", 0.0)
    monkeypatch.setattr(cli_progress, "_TICK_S", 0.01)
    code, _, err = cli(capsys, "bench", LLAMA, "--seq", "64", "--runs", "30", "--provider", "cpu")
    assert code == 0, err
    assert re.search(r"^bench: (setting up|session and warm-up|timing)", err, re.M), err


def test_progress_waits_then_paces_its_lines(cli_progress: ModuleType) -> None:
    now = [0.0]
    lines: list[str] = []
    with cli_progress.CommandProgress(
        "optimize", clock=lambda: now[0], write=lines.append, terminal=False
    ) as p:
        p.update("fold_shapes", 1, 30, unit="pass")
        now[0] = 1.9
        p.tick()
        assert lines == []  # a quick run prints nothing
        now[0] = 2.1
        p.tick()
        assert lines == ["optimize: fold_shapes (pass 2 of 30), 2.1 s"]
        p.update("fuse_attention", 27, 30, unit="pass")
        now[0] = 3.0
        p.tick()  # a new step, but within EVERY_S of the last line
        now[0] = 4.2
        p.tick()
        now[0] = 9.0
        p.tick()  # the same step: quiet until STILL_S
        now[0] = 14.3
        p.tick()
        p.update("quantizing", 50, 200)
        now[0] = 16.4
        p.tick()
    assert lines[1:] == [
        "optimize: fuse_attention (pass 28 of 30), 4.2 s",
        "optimize: fuse_attention (pass 28 of 30), 14.3 s",
        "optimize: quantizing 25%, 16.4 s",
    ]


# --- one clear line for a wrong name or a wrong file ------------------------------------------


def test_explain_of_an_unknown_name_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "optimize", LLAMA, "-o", tmp_path / "o.onnx", "--explain",
                       "fuse_attn")  # fmt: skip
    assert code == 2
    assert "no pass or rule named 'fuse_attn' (did you mean 'fuse_attention'" in one_line_error(err)
    assert not (tmp_path / "o.onnx").exists()
    with pytest.raises(fastopt.UnknownNameError):
        fastopt.optimize(LLAMA, explain="fuse_attn")


def test_explain_takes_a_pass_or_a_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """A pass's name explains each of its rules (fold_reshapes' are named otherwise); a rule's
    name (listed by `fastopt passes`) still explains that rule alone."""
    report = fastopt.optimize(LLAMA, explain="fold_reshapes")
    assert any(line.startswith("fold_unsqueeze_chain @") for line in report.explain)
    report = fastopt.optimize(LLAMA, explain="fold_unsqueeze_chain")
    assert report.explain and all(
        line.startswith("fold_unsqueeze_chain @") for line in report.explain
    )
    code, out, _ = cli(capsys, "passes")
    assert code == 0 and "fold_unsqueeze_chain" in out


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_every_explanation_names_an_askable_name(target: str) -> None:
    """Each line of --explain '*' starts with a name --explain accepts, so that no rule's
    explanations are out of reach of the check on names."""
    from fastopt.pipeline.registry import explain_names

    known = set(explain_names())
    for fixture in (LLAMA, ENCODER):
        report = fastopt.optimize(fixture, explain="*", target=target)  # type: ignore[arg-type]
        assert report.explain
        for line in report.explain:
            m = re.match(r"([\w.]+)( @ |: )", line)
            assert m and m.group(1) in known, line


def test_info_of_a_text_file_says_it_is_not_onnx(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = ROOT / "README.md"
    code, _, err = cli(capsys, "info", readme)
    line = one_line_error(err)
    assert code == 2 and "is not an ONNX model: it starts with text ('# fastopt')" in line
    assert "wire type" not in line
    png = tmp_path / "image.onnx"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(fastopt.ModelError, match=r"not an ONNX model: its first bytes \(89 50 4e"):
        fastopt.load(png)


def test_kv_cache_for_an_encoder_says_encoder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "optimize", ENCODER, "-o", tmp_path / "o.onnx", "--kv-cache",
                       "standard")  # fmt: skip
    line = one_line_error(err)
    assert code == 2 and "looks like an encoder" in line and "has no decoder cache" in line
    assert not (tmp_path / "o.onnx").exists()


def test_option_takes_exactly_what_passes_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fastopt passes` lists the options --option takes; the internal ones (set from flags)
    are refused, naming the flag."""
    code, listing, _ = cli(capsys, "passes")
    assert code == 0
    from fastopt.cli.common import parse_options

    for name, spec in fastopt.OPTIONS.items():
        value = spec.default if spec.default is not None else (spec.choices or [(1, "")])[0][0]
        if spec.internal:
            assert not re.search(rf"^{name}\s", listing, re.M), name
            with pytest.raises(fastopt.OptionError, match="is set by fastopt itself"):
                parse_options([f"{name}={value}"])
        else:
            assert re.search(rf"^{name}\s", listing, re.M), name
            assert name in parse_options([f"{name}={value}"])
    code, _, err = cli(capsys, "optimize", LLAMA, "--option", "kv_cache=1")
    assert code == 2 and "(use --kv-cache)" in one_line_error(err)


# --- help and --version -----------------------------------------------------------------------


def test_preset_help_lists_the_presets() -> None:
    text = " ".join(run("optimize", "--help", columns=200).stdout.split())
    for name, description in fastopt.PRESET_DESCRIPTIONS.items():
        assert f"{name}: {description}" in text, name
    assert "default: default:" not in text


def test_every_option_has_help() -> None:
    parser = fastopt.cli.main.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = [
        f"{command} {'/'.join(action.option_strings) or action.dest}"
        for command, p in sub.choices.items()  # type: ignore[union-attr]
        for action in p._actions
        if not action.help and action.dest != "help"
    ]
    assert missing == [], missing


def test_version_names_the_runtime_and_onnx() -> None:
    import onnx
    import onnxruntime

    proc = run("--version")
    assert proc.returncode == 0
    line = proc.stdout.strip()
    assert line.startswith(f"fastopt {fastopt.__version__}, ")
    assert f"onnxruntime {onnxruntime.__version__}" in line and f"onnx {onnx.__version__}" in line


# --- docstrings ---------------------------------------------------------------------------------

PUBLIC = [
    fastopt.optimize,
    fastopt.quantize,
    fastopt.check,
    fastopt.verify,
    fastopt.load,
    fastopt.load_bytes,
    fastopt.from_onnx,
    fastopt.bench.run,
    fastopt.bench.compare,
]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_help_lists_parameters_without_alias_names(fn: object) -> None:
    text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    for alias in ("ModelOrPath", "ModelLike", "Target", "KvCache", "PathLike", "_C.Model"):
        assert not re.search(rf"(?<![\w.]){re.escape(alias)}\b", text), alias
    for section in ("Parameters\n", "Returns\n", "Raises\n"):
        assert section in text, section
    import inspect

    for name in inspect.signature(fn).parameters:  # type: ignore[arg-type]
        assert re.search(rf"\b{name}\b", text.split("Parameters", 1)[1]), name
