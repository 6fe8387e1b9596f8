"""The file-backed resident memory (RssFile) of quantizing a model in a fresh process: before the
pass, its peak while the pass runs (sampled by a thread every 2 ms: the pass releases the GIL), and
what is left mapped afterwards. The quantizers release the pages they read from the weights'
mapping (csrc/quant/weight_source.cc); these numbers show whether they did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The child processes' reader of their own file-backed resident memory.
RSS_FILE_SOURCE = """
def rss_file():
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
"""

_CHILD = (
    """
import json, sys, threading, time, fastopt
"""
    + RSS_FILE_SOURCE
    + """
m = fastopt.load(sys.argv[1])
before = rss_file()
peak, done = [before], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_file())
        time.sleep(0.002)
t = threading.Thread(target=sample)
t.start()
fastopt.quantize(m, mode=sys.argv[2], threads=int(sys.argv[3]))
done.set()
t.join()
print(json.dumps({"before": before, "peak": max(peak[0], rss_file()), "after": rss_file()}))
"""
)


def quantize_rss_file(model: Path, mode: str, threads: int) -> dict[str, int]:
    """{"before", "peak", "after"} RssFile bytes of `fastopt.quantize(model, mode, threads)`."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), mode, str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
