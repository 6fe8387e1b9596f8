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

_A = "issue 25 part A: KV rewrite converts a decoder with an unconverted token-mixing op"
_A_ATTN = "issue 25 part A: KV rewrite converts a decoder with an attention layer left unfused"
_C_SOFTMAX = "issue 25 part C: a Softmax before opset 13 (flattened from axis 1) fused as last-axis"
_C_LEAK = "issue 25 part C: opset-11/12 attention leaves ai.fastopt.internal::Attention (ort)"
_KV = "*/kv=[si]*/q=none"  # greedy generation judges the cached forms without quantization

KNOWN: dict[tuple[str, str], tuple[str, bool]] = {
    ("cumsum_over_sequence", _KV): (_A + " (running CumSum)", True),
    ("norm_over_sequence", _KV): (_A + " (a norm over the sequence axis)", True),
    ("sequence_mean", _KV): (_A + " (mean over the sequence)", True),
    ("token_shift", _KV): (_A + " (token shift)", False),
    ("sequence_conv", _KV): (_A + " (causal conv over the sequence)", False),
    ("repeat_kv_grouping", _KV): (_A_ATTN + " (repeat_kv with another grouping)", True),
    ("repeat_kv_grouping", "*/kv=[si]*/q=[!n]*"): (_A_ATTN + " (repeat_kv, quantized)", False),
    ("scale_after_softmax", _KV): (_A_ATTN + " (probabilities scaled after the softmax)", True),
    ("softmax_manual", _KV): (_A_ATTN + " (softmax written out)", True),
    ("softmax_axis", _KV): (_A_ATTN + " (softmax over the queries)", True),
    ("softmax_in_double", _KV): (_A_ATTN + " (softmax in float64)", True),
    ("softcap_mismatch", _KV): (_A_ATTN + " (soft-cap constants differ)", True),
    ("softcap_other_constant", _KV): (_A_ATTN + " (one layer with another soft-cap)", False),
    ("opset_12_softmax_default_axis", "llm/*/q=none"): (_C_SOFTMAX, True),
    ("opset_12", "*/ort/kv=none/*"): (_C_LEAK, False),
    ("opset_12_softmax_default_axis", "*/ort/kv=none/*"): (_C_LEAK, False),
}


def known_reason(case: Case) -> tuple[str, bool] | None:
    for (kind, pattern), entry in KNOWN.items():
        if kind == case.mutation and fnmatch(str(case.mode), pattern):
            return entry
    return None
