#!/usr/bin/env python3
"""Atheris harness for the model reader: fastopt.load_bytes on arbitrary bytes.

An input must either load or raise fastopt.ModelError. A model that loads must then be fully
usable (tests/fuzz/exercise.py walks every accessor and reads every tensor's bytes). Any other
exception is reported by atheris as a crash, and so is a segfault, an abort or a timeout.

    python tests/fuzz/fuzz_reader.py -runs=20000 CORPUS_DIR...   # libFuzzer flags, as usual
    python tests/fuzz/run_fuzz.py --runs 20000                    # the bounded runner

External data resolves against a private folder holding weights.bin and export.bin
(make_seeds.write_data_files()), which the seeds in tests/fuzz/corpus/ point into.
FASTOPT_FUZZ_ROUNDTRIP=1 also saves each model that verifies and loads it back.

The C++ core is a prebuilt extension without coverage instrumentation, so atheris gets no
coverage feedback from it: this harness mutates around the seeds mostly blind. The libFuzzer
target (fuzz_reader.cc, built with -fsanitize=fuzzer) is the coverage-guided counterpart.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports():
    import fastopt
    from exercise import exercise
from make_seeds import write_data_files

BASE_DIR = tempfile.mkdtemp(prefix="fastopt-atheris-")
write_data_files(Path(BASE_DIR))
SCRATCH = tempfile.mkdtemp(prefix="fastopt-atheris-out-")
ROUNDTRIP = os.environ.get("FASTOPT_FUZZ_ROUNDTRIP") == "1"


def TestOneInput(data: bytes) -> None:
    try:
        m = fastopt.load_bytes(data, base_dir=BASE_DIR)
    except fastopt.ModelError as e:
        if not str(e).strip():
            raise AssertionError("ModelError with an empty message") from e
        return
    with contextlib.suppress(fastopt.ModelError):
        exercise(m, SCRATCH if ROUNDTRIP else None)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
