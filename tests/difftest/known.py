"""Findings expected on main, each in a class another part of issue 25 is fixing:
(mutation kind, mode pattern) -> (reason, strict). A pattern is an fnmatch pattern over the
mode's text, ``preset/target/kv=K/q=Q``. The tests mark a matching case xfail; ``strict`` entries
are the ones the default run hits (tests/verify/test_difftest.py): once the fix merges the case
passes, the strict xfail fails loudly, and the entry goes. Non-strict entries are the same
class on kinds the default sample does not reach in that class (the long run and campaigns).
Delete entries as the fixes land."""

from __future__ import annotations

from fnmatch import fnmatch

from .cases import Case

KNOWN: dict[tuple[str, str], tuple[str, bool]] = {
    # Every class issue 25 listed is fixed on main: parts A (the whole-decoder proof and one
    # cache layout per layer), B (folding as ORT), C (old Softmax, no internal op, MLA) and E.
}


def known_reason(case: Case) -> tuple[str, bool] | None:
    for (kind, pattern), entry in KNOWN.items():
        if kind == case.mutation and fnmatch(str(case.mode), pattern):
            return entry
    return None
