"""Load many corrupted copies of one model; every load must succeed or raise ModelError.

Run as a child process by tests/safety/test_bad_input.py (a crash or a hang then fails one test
instead of killing pytest). Mutants are written next to MODEL, so external data it refers to
still resolves. Before each load the mutant's description goes to `<dir>/current.txt` and its
bytes stay in `<dir>/mutant.onnx`: after a crash those two files say what crashed it.

    python tests/fuzz/mutate_loads.py MODEL --flips 2000 --truncations all --seed 0
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fastopt
from exercise import exercise


def mutants(data: bytes, flips: int, truncations: str, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = []
    for _ in range(flips):
        pos = rng.randrange(len(data))
        kind = rng.randrange(3)
        buf = bytearray(data)
        if kind == 0:  # one bit
            buf[pos] ^= 1 << rng.randrange(8)
            desc = f"bit flip at {pos}"
        elif kind == 1:  # one byte, any new value
            buf[pos] ^= rng.randrange(1, 256)
            desc = f"byte {pos} -> {buf[pos]:#04x}"
        else:  # a few bytes in a row set to an interesting value
            n = rng.randrange(1, 5)
            val = rng.choice([0x00, 0x7F, 0x80, 0xFF])
            buf[pos : pos + n] = bytes([val]) * len(buf[pos : pos + n])
            desc = f"{n} bytes at {pos} -> {val:#04x}"
        out.append((desc, bytes(buf)))
    if truncations == "all":
        cuts = range(len(data))
    else:
        cuts = sorted(rng.sample(range(len(data)), min(int(truncations), len(data))))
    out.extend((f"truncated to {n} bytes", data[:n]) for n in cuts)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--flips", type=int, default=2000)
    ap.add_argument("--truncations", default="all", help="'all' or a number of random cuts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-roundtrip", action="store_true", help="skip save + reload")
    args = ap.parse_args(argv)

    data = args.model.read_bytes()
    workdir = args.model.parent
    target = workdir / "mutant.onnx"
    current = workdir / "current.txt"
    loaded = rejected = 0
    findings: list[str] = []
    todo = mutants(data, args.flips, args.truncations, args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        for desc, blob in todo:
            current.write_text(desc)
            target.unlink(missing_ok=True)  # a new inode: no earlier mapping sees the change
            target.write_bytes(blob)
            try:
                m = fastopt.load(str(target))
            except fastopt.ModelError as e:
                rejected += 1
                if not str(e).strip():
                    findings.append(f"{desc}: ModelError with an empty message")
                continue
            except Exception as e:
                findings.append(f"{desc}: load raised {type(e).__name__}: {e}")
                continue
            loaded += 1
            try:
                exercise(m, None if args.no_roundtrip else scratch)
            except fastopt.ModelError:
                pass
            except Exception as e:
                tb = traceback.format_exc(limit=3).strip().splitlines()[-3:]
                where = " / ".join(tb)
                findings.append(f"{desc}: after load, {type(e).__name__}: {e} | {where}")
            del m
    current.unlink()
    target.unlink()
    print(f"mutants: {len(todo)} loaded: {loaded} rejected: {rejected} findings: {len(findings)}")
    for f in findings[:50]:
        print("FINDING", f)
    return 1 if findings else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    sys.exit(main())
