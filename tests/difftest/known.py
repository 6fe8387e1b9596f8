"""Findings expected on main, each in a class another part of issue 25 is fixing:
(mutation kind, mode pattern) -> (reason, strict). A pattern is an fnmatch pattern over the
mode's text, ``preset/target/kv=K/q=Q``. The tests mark a matching case xfail; ``strict`` entries
are the ones the default run hits (tests/test_difftest.py): once the fix merges the case
passes, the strict xfail fails loudly, and the entry goes. Non-strict entries are the same
class on kinds the default sample does not reach in that class (the long run and campaigns).
Delete entries as the fixes land."""

from __future__ import annotations

from fnmatch import fnmatch

from .cases import Case

_C_SOFTMAX = "issue 25 part C: a Softmax before opset 13 (flattened from axis 1) fused as last-axis"
_C_LEAK = "issue 25 part C: opset-11/12 attention leaves ai.fastopt.internal::Attention (ort)"
_KV = "*/kv=[si]*/q=none"  # greedy generation judges the cached forms without quantization

# Left by part A: the proof accepts this (K/V stay position-wise), but the odd layer fuses with its
# repeated K/V as the cache: 4 kv heads where the other layers have 2, which the tester's feeds
# and genai_config.json (one num_key_value_heads) assume uniform.
_A_LAYOUT = "issue 25 part A (left): one layer's cache has another kv-head count"

KNOWN: dict[tuple[str, str], tuple[str, bool]] = {
    ("repeat_kv_grouping", _KV): (_A_LAYOUT + " (repeat_kv with another grouping)", True),
    ("repeat_kv_grouping", "*/kv=[si]*/q=[!n]*"): (_A_LAYOUT + " (repeat_kv, quantized)", False),
    # with a KV cache, add_kv_cache's proof refuses it (part A): only kv=none still converts
    ("opset_12_softmax_default_axis", "llm/*/kv=none/q=none"): (_C_SOFTMAX, True),
    ("opset_12", "*/ort/kv=none/*"): (_C_LEAK, False),
    ("opset_12_softmax_default_axis", "*/ort/kv=none/*"): (_C_LEAK, False),
}


def known_reason(case: Case) -> tuple[str, bool] | None:
    for (kind, pattern), entry in KNOWN.items():
        if kind == case.mutation and fnmatch(str(case.mode), pattern):
            return entry
    return None
