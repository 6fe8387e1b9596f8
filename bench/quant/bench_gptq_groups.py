"""GPTQ with the X^T X collected in groups (fastopt.quant.gptq.MAX_HESSIAN_BYTES lowered) against
the one-pass collection: `fastopt quantize SRC --mode int4 --recipe q4m --calibration builtin`
as a user runs it, once per limit, each under /usr/bin/time -v (wall, CPU, peak RSS), the limit
set in the child before the command's main (the CLI has no flag for it); then whether the
outputs are byte-identical to the first run's, and with --hf the KL / perplexity / top-1 on
bench_quantize_accuracy.py's prose against --ref (fp32 logits).

    flock /tmp/heavy.lock nice python bench/quant/bench_gptq_groups.py \
        /tmp/q2/qwen2_0.5b_dynamo/model.onnx --limits 3 1 --tokenizer /work/cache/smollm2 \
        --extra=--no-run-check
    nice python bench/quant/bench_gptq_groups.py /tmp/q1-recipes/fp16/model.onnx \
        --limits 3 0.125 --tokenizer /work/cache/smollm2 \
        --ref /tmp/qsearch-smollm2/fp32/model.onnx --hf /work/cache/smollm2

Limits in GiB (3 is the default limit: the one pass where everything fits under it).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

_CHILD = """
import sys
import fastopt.quant.gptq as gptq
gptq.MAX_HESSIAN_BYTES = int(float(sys.argv[1]) * 2**30)
from fastopt.cli.main import main
raise SystemExit(main(sys.argv[2:]))
"""


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def timed(cmd: list[str]) -> tuple[str, dict[str, float]]:
    """The command under /usr/bin/time -v, not _benchlib.spawn: this parent holds ONNX Runtime
    sessions (the reference logits), whose RSS high-water mark an exec'd child's ru_maxrss
    would inherit (_benchlib's docstring); time's own child starts from time's."""
    got = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"failed ({got.returncode}): {got.stderr[-2000:]}")
    err = got.stderr

    def field(name: str) -> str:
        m = re.search(rf"{re.escape(name)}: (.+)", err)
        return m.group(1).strip() if m else "0"

    wall = field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")
    secs = sum(float(x) * 60**i for i, x in enumerate(reversed(wall)))
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    rss = float(field("Maximum resident set size (kbytes)")) / 1024
    return got.stdout, {"wall": secs, "cpu": cpu, "rss_mb": rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("--limits", type=float, nargs="+", default=[3.0, 1.0])
    ap.add_argument("--tokenizer", help="--hf-config for the calibration's tokenizer")
    ap.add_argument("--extra", action="append", default=[], help="more quantize flags")
    ap.add_argument("--work", help="output folder (default: a temporary one)")
    ap.add_argument("--ref", help="fp32 model whose logits are the reference (with --hf)")
    ap.add_argument("--hf", help="tokenizer folder for the evaluation prose")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="gptq-groups-"))
    ids = ref = None
    if args.ref and args.hf:
        from bench_quantize_accuracy import PROSE, logits_of
        from transformers import AutoTokenizer

        ids = np.array([AutoTokenizer.from_pretrained(args.hf)(PROSE)["input_ids"]], np.int64)
        ref = logits_of(Path(args.ref), ids)
    first = ""
    cols = ("limit GiB", "passes", "wall s", "CPU s", "peak RSS MB", "bytes as the first")
    print("| " + " | ".join((*cols, "KL", "ppl", "top-1")) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for limit in args.limits:
        out = work / f"limit{limit:g}" / "model.onnx"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", _CHILD, str(limit), "quantize", args.src, "-o", str(out)]
        cmd += ["--mode", "int4", "--recipe", "q4m", "--calibration", "builtin", *args.extra]
        if args.tokenizer:
            cmd += ["--hf-config", args.tokenizer]
        text, cost = timed(cmd)
        m = re.search(r"collected in (\d+) calibration passes", text)
        passes = int(m.group(1)) if m else (1 if "gptq: X^T X factors" in text else 0)
        dig = digest(out.parent)
        first = first or dig
        scores = ["", "", ""]
        if ids is not None and ref is not None:
            from bench_quantize_accuracy import logits_of, metrics

            s = metrics(ref, logits_of(out, ids).astype(np.float32), ids)
            scores = [f"{s['kl']:.4f}", f"{s['ppl']:.2f}", f"{s['top1']:.3f}"]
        print(
            f"| {limit:g} | {passes} | {cost['wall']:.1f} | {cost['cpu']:.1f} | "
            f"{cost['rss_mb']:.0f} | {'yes' if dig == first else 'NO'} ({dig}) | "
            + " | ".join(scores)
            + " |",
            flush=True,
        )
        for line in text.splitlines():
            if line.startswith(("gptq", "calibration", "importance")):
                print(f"    {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
