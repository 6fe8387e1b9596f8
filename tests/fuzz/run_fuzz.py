#!/usr/bin/env python3
"""Run a fuzzer for a bounded number of executions; report executions and findings.

    python tests/fuzz/run_fuzz.py --runs 20000                     # atheris (fuzz_reader.py)
    python tests/fuzz/run_fuzz.py --runs 2000000 --seed 7
    python tests/fuzz/run_fuzz.py --libfuzzer build/fuzz-san/fuzz_reader --max-time 600
    python tests/fuzz/run_fuzz.py --libfuzzer build/fuzz-san/fuzz_pipeline --runs 100000 \
        --max-len 131072 --exports --corpus /tmp/fastopt-corpus-pipeline

The fuzzer runs in a child process on a scratch copy of tests/fuzz/corpus/ (the committed seeds
are never written), or on --corpus DIR, kept between runs of a campaign (filled with the
committed seeds when empty); --exports adds a seed per real export found (make_seeds.py).
When the child stops on a finding (a crash, an exception other than
ModelError, a timeout, an out-of-memory), the input is kept in --artifacts and fuzzing resumes
with a new seed until the execution budget is spent, so one run can report several distinct
findings. Prints `executions: N`, libFuzzer's last `coverage: cov C ft F` counts, and
`findings: K` (then one line per distinct finding), and exits 1 when there was any finding.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "fuzz_reader.py"
CORPUS = HERE / "corpus"
DICT = HERE / "onnx.dict"

DONE_RE = re.compile(r"^Done (\d+) runs", re.MULTILINE)
STAT_RE = re.compile(r"^#(\d+)\s", re.MULTILINE)
EXEC_STAT_RE = re.compile(r"^stat::number_of_executed_units:\s*(\d+)", re.MULTILINE)
ARTIFACT_RE = re.compile(r"Test unit written to (\S+)")
COV_RE = re.compile(r"\bcov: (\d+) ft: (\d+)")


def signature(log: str) -> str:
    """A one-line description of what the child died of, for de-duplication."""
    m = re.search(
        r"=== Uncaught Python exception: ===\n(?:.*\n)*?(\w+(?:Error|Exception)\b.*)", log
    )
    if m:
        return m.group(1).strip()[:200]
    m = re.search(
        r"ERROR: (AddressSanitizer|UndefinedBehaviorSanitizer|libFuzzer|LeakSanitizer)"
        r": ([^\n]*)",
        log,
    )
    if m:
        frame = re.search(r"#\d+ 0x[0-9a-f]+ in (\S+)[^\n]*(?:csrc|tests)/", log)
        where = f" in {frame.group(1)}" if frame else ""
        return f"{m.group(1)}: {m.group(2).strip()[:160]}{where}"
    m = re.search(r"runtime error: [^\n]*", log)
    if m:
        return m.group(0)[:200]
    m = re.search(r"terminate called after throwing[^\n]*\n[^\n]*", log)
    if m:
        return " ".join(m.group(0).split())[:200]
    m = re.search(r"==\d+== ERROR: libFuzzer: ([^\n]*)", log)
    if m:
        return m.group(1)[:200]
    tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["?"]
    return f"unknown: {tail[0][:200]}"


def executions(log: str) -> int:
    for rx in (EXEC_STAT_RE, DONE_RE):
        m = rx.search(log)
        if m:
            return int(m.group(1))
    stats = STAT_RE.findall(log)
    return int(stats[-1]) if stats else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20000, help="total executions to run")
    ap.add_argument("--max-time", type=int, default=0, help="also stop after this many seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--libfuzzer", type=Path, help="a libFuzzer binary instead of atheris")
    ap.add_argument("--harness", type=Path, default=HARNESS, help="the atheris script")
    ap.add_argument("--artifacts", type=Path, help="where crash inputs go (default: a temp dir)")
    ap.add_argument("--max-findings", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--timeout", type=int, default=10, help="seconds per input")
    ap.add_argument("--roundtrip", action="store_true", help="atheris: also save and reload")
    ap.add_argument("--verbose", action="store_true", help="echo the fuzzer's output")
    ap.add_argument("--corpus", type=Path, help="a corpus folder kept between runs")
    ap.add_argument("--exports", action="store_true", help="seed with the real exports too")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="fastopt-fuzz-"))
    corpus = args.corpus or (work / "corpus")
    if not corpus.is_dir() or not any(corpus.iterdir()):
        shutil.copytree(CORPUS, corpus, dirs_exist_ok=True)
    if args.exports:
        sys.path.insert(0, str(HERE))
        from make_seeds import export_models, export_seed

        for name, path in export_models().items():
            seed = corpus / f"export_{name}.onnx"
            if not seed.exists():
                seed.write_bytes(export_seed(path))
    artifacts = args.artifacts or (work / "artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    base = [str(args.libfuzzer)] if args.libfuzzer else [sys.executable, str(args.harness)]
    env = dict(os.environ, FASTOPT_FUZZ_ROUNDTRIP="1") if args.roundtrip else None

    total = 0
    cov = ""
    findings: dict[str, str] = {}
    seed = args.seed
    started = time.monotonic()
    stalls = 0
    while total < args.runs and len(findings) < args.max_findings:
        cmd = [
            *base,
            f"-runs={args.runs - total}",
            f"-seed={seed}",
            f"-max_len={args.max_len}",
            f"-timeout={args.timeout}",
            "-rss_limit_mb=4096",
            f"-artifact_prefix={artifacts}/",
            f"-dict={DICT}",
            "-print_final_stats=1",
        ]
        if args.libfuzzer:
            cmd.append("-malloc_limit_mb=1024")
        if args.max_time:
            left = args.max_time - int(time.monotonic() - started)
            if left <= 0:
                break
            cmd.append(f"-max_total_time={left}")
        cmd.append(str(corpus))
        proc = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", env=env, check=False
        )
        log = proc.stdout + proc.stderr
        if args.verbose:
            print(log)
        ran = executions(log)
        total += ran
        if args.libfuzzer and COV_RE.findall(log):
            c, f = COV_RE.findall(log)[-1]
            cov = f"cov {c} ft {f}"
        if proc.returncode == 0:
            if ran == 0:
                print(log[-3000:], file=sys.stderr)
                print("error: the fuzzer exited without running", file=sys.stderr)
                return 2
            if args.max_time:
                break  # -max_total_time reached (or runs done)
            continue
        sig = signature(log)
        artifact = ", ".join(ARTIFACT_RE.findall(log)) or "(no artifact)"
        if sig in findings:
            stalls += 1
        else:
            findings[sig] = artifact
            (artifacts / f"finding-{len(findings)}.log").write_text(log[-20000:])
        if ran == 0 or stalls > 10:
            break  # the same finding again and again right at the start: stop
        seed += 1

    print(f"engine: {'libFuzzer ' + str(args.libfuzzer) if args.libfuzzer else 'atheris'}")
    print(f"executions: {total}")
    if cov:
        print(f"coverage: {cov}")
    print(f"findings: {len(findings)}")
    for sig, artifact in findings.items():
        print(f"finding: {sig} -> {artifact}")
    print(f"artifacts: {artifacts}")
    if not args.artifacts and not findings:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
