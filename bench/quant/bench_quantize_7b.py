"""int4 of a 7B-shaped fp16 decoder (hidden 4096, 32 layers, intermediate 11008, vocab 32000;
13.5 GB, made by make_llm_model.py): fastopt.quant.quantize against onnxruntime's
MatMulNBitsQuantizer, and int8-dynamic: fastopt against quantize_dynamic. One tool at a time,
each in a fresh process, the model's files read into the page cache before each. The peers load
the whole model, so they run under an address-space cap (``prlimit --as``, default 14 GB: on a
shared 24 GB machine they must fail with MemoryError rather than take everyone's memory) and a
watchdog that kills a process whose RSS passes the cap; what happened is reported.

    python bench/quant/bench_quantize_7b.py [--dir /tmp/fastopt-bench/llm_7b_fp16] [--delete]
                                      [--out bench/results/quantize_7b.md] [--recipe q4m]
                                      [--modes int4,int8-dynamic] [--skip-peers]

``--recipe q4m`` adds a row: fastopt int4 with that recipe (fastopt quantize --recipe q4m).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import _benchlib as bl

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
MAKE_MODEL = BENCH / "models" / "make_llm_model.py"
SHAPE = ["--hidden", "4096", "--layers", "32", "--intermediate", "11008", "--vocab", "32000",
         "--dtype", "float16"]  # fmt: skip


def _child_fastopt(mode: str, src: str, dst: str) -> dict[str, Any]:
    import resource

    import fastopt
    from fastopt.quant.recipe import recipe_settings

    mode, _, recipe = mode.partition(":")  # int4:q4m: the recipe's settings, as the CLI's
    extra: dict[str, Any] = {**recipe_settings(recipe), "recipe": recipe} if recipe else {}
    r = fastopt.quantize(src, dst, mode=mode, **extra)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    reasons: dict[str, int] = {}
    for w in r.kept:
        reasons[w.reason] = reasons.get(w.reason, 0) + 1
    return {
        "kept_reasons": reasons,
        "cpu_seconds": ru.ru_utime + ru.ru_stime,
        "quantized": r.summary.quantized,
        "kept": r.summary.kept,
        "call_seconds": r.seconds,
        "pass_seconds": sum(p.seconds for p in r.passes),
    }


def _folder_bytes(path: str) -> int:
    folder = Path(path).parent
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _warm(path: str) -> None:
    folder = Path(path).parent
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="/tmp/fastopt-bench/llm_7b_fp16")
    ap.add_argument("--cap-gb", type=float, default=14.0, help="peers' address-space cap")
    ap.add_argument("--delete", action="store_true", help="remove the model and outputs after")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--recipe", help="also fastopt int4 with this recipe (q4m)")
    ap.add_argument("--modes", default="int4,int8-dynamic", help="comma separated")
    ap.add_argument("--out", default=str(BENCH / "results" / "quantize_7b.md"))
    ap.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(bl.RESULT_TAG + json.dumps(_child_fastopt(*args.child)), flush=True)
        return
    src = os.path.join(args.dir, "model.onnx")
    env = bl.environment(["onnx", "onnxruntime", "numpy"])
    env["load_average"] = os.getloadavg()
    made: dict[str, Any] = {}
    if not os.path.exists(src):
        cmd = [sys.executable, str(MAKE_MODEL), args.dir, *SHAPE, "--no-check"]
        rc, wall, rss, _, err = bl.spawn(cmd, timeout=3600)
        made = {"rc": rc, "seconds": wall, "peak_rss": rss}
        if rc != 0:
            raise SystemExit(f"make_llm_model failed: {bl.error_text(rc, err)}")
    size = _folder_bytes(src)
    cap = int(args.cap_gb * 1e9)
    py = sys.executable
    prl = ["prlimit", f"--as={cap}"]
    int4_peer = [*prl, py, str(HERE / "bench_quantize.py"), "--child", "ort"]
    int8_peer = [*prl, py, str(HERE / "bench_quantize_dynamic.py"), "--child", "ort"]
    modes = args.modes.split(",")
    tools = [
        ("fastopt int4", [py, __file__, "--child", "int4"], False),
        ("MatMulNBitsQuantizer int4", int4_peer, True),
    ] * ("int4" in modes)
    if args.recipe:
        recipe_row = (
            f"fastopt int4 --recipe {args.recipe}",
            [py, __file__, "--child", f"int4:{args.recipe}"],
            False,
        )
        tools.append(recipe_row)
    tools += [
        ("fastopt int8-dynamic", [py, __file__, "--child", "int8-dynamic"], False),
        ("quantize_dynamic int8", int8_peer, True),
    ] * ("int8-dynamic" in modes)
    rows: list[dict[str, Any]] = []
    work = os.path.join(os.path.dirname(args.dir), "q7b-out")
    for name, cmd, peer in tools:
        if peer and args.skip_peers:
            continue
        shutil.rmtree(work, ignore_errors=True)
        dst = os.path.join(work, "model.onnx")
        os.makedirs(work)
        _warm(src)
        print(f"{name} ...", flush=True)
        load_before = os.getloadavg()[0]
        rc, wall, rss, out, err = bl.spawn([*cmd, src, dst], timeout=1800, max_rss=cap)
        row: dict[str, Any] = {
            "tool": name,
            "rc": rc,
            "seconds": wall,
            "peak_rss": rss,
            "load": (load_before, os.getloadavg()[0]),
        }
        if rc == 0:
            row["output_bytes"] = _folder_bytes(dst)
            with contextlib.suppress(ValueError):
                row.update(bl.result_line(out))
        else:
            text = (err + out).strip().splitlines()
            memory = [ln for ln in text if "MemoryError" in ln or "bad_alloc" in ln]
            if rc == -9:
                row["error"] = f"killed by the watchdog at {bl.fmt_mb(cap)} RSS"
            elif memory:
                row["error"] = f"out of memory at the {args.cap_gb:g} GB cap: {memory[-1][:160]}"
            else:
                row["error"] = bl.error_text(rc, err)
        print(f"  {row}", flush=True)
        rows.append(row)
    shutil.rmtree(work, ignore_errors=True)
    if args.delete:
        shutil.rmtree(args.dir, ignore_errors=True)
    md = [
        "# 7B-shaped fp16 decoder: int4 and int8-dynamic quantization",
        "",
        f"{env['date']}; {env['cpu']}, {env['cores']} cores, "
        f"{env['ram_bytes'] / bl.MB / 1024:.0f} GiB; onnxruntime {env['versions']['onnxruntime']}; "
        f"fastopt {env['fastopt_commit']}; load average at the start {env['load_average'][0]:.1f}",
        "",
        f"Model: make_llm_model.py {' '.join(SHAPE)} ({size / 1e9:.1f} GB, fp16 weights as "
        "external data). Defaults of each tool (int4: block 32, symmetric; int8: per tensor, "
        f"symmetric). Peers under `prlimit --as={cap}` (and killed past {bl.fmt_mb(cap)} RSS). "
        "Time: the process's wall time, Python start included; RSS: its peak (wait4).",
        "",
        "| tool | result | time | CPU (user+sys) | peak RSS | output | load avg (start, end) "
        "| notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        note = r.get("error", "")
        if "quantized" in r:
            top = max(r.get("kept_reasons", {}).items(), key=lambda kv: kv[1], default=None)
            note = (
                f"{r['quantized']} weights quantized, {r['kept']} kept"
                + (f" ({top[1]}: {top[0]})" if top else "")
                + f"; quantize() {bl.fmt_s(r['call_seconds'])} (the pass "
                f"{bl.fmt_s(r['pass_seconds'])})"
            )
        md.append(
            f"| {r['tool']} | {'ok' if r['rc'] == 0 else 'failed'} | {bl.fmt_s(r['seconds'])} | "
            f"{bl.fmt_s(r.get('cpu_seconds'))} | {bl.fmt_mb(r['peak_rss'])} | "
            f"{bl.fmt_mb(r.get('output_bytes'))} | {r['load'][0]:.1f}, {r['load'][1]:.1f} | "
            f"{note} |"
        )
    md += [
        "",
        "Command: `python bench/quant/bench_quantize_7b.py"
        + (f" --dir {args.dir}" if args.dir != ap.get_default("dir") else "")
        + (" --delete" if args.delete else "")
        + (f" --recipe {args.recipe}" if args.recipe else "")
        + (f" --modes {args.modes}" if args.modes != ap.get_default("modes") else "")
        + (" --skip-peers" if args.skip_peers else "")
        + "` (the machine is shared: 2 cores, other sessions' jobs running, so wall times "
        "depend on them; CPU time is what the tool itself used).",
        "",
    ]
    bl.write_results("\n".join(md), {"env": env, "made": made, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
