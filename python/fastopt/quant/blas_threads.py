"""OpenBLAS held to a number of threads inside a ``with`` (what threadpoolctl does, through the
libraries' own setters; nothing where none is loaded). After a call, OpenBLAS's idle threads
spin waiting for the next: beside a C++ loop that holds the core (the data-free importance's
column sums between small matrix products), that spin took 29 % of the process's CPU on the 7B
shape (perf). The libraries looked for are those already loaded (numpy's; scipy's only if
imported before)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Every loaded OpenBLAS at ``n`` threads inside, its setting restored after."""
    restore = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {ln.split()[-1] for ln in maps if "openblas" in ln.lower() and ".so" in ln}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for base in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{base}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{base}_set_num_threads{suffix}", None)
                if get is None or put is None:
                    continue
                get.restype = ctypes.c_int
                restore.append((put, int(get())))
                put(ctypes.c_int(n))
                break
            else:
                continue
            break
    try:
        yield
    finally:
        for put, was in restore:
            put(ctypes.c_int(was))
