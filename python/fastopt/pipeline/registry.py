"""The pass registry: C++ passes (registered in csrc/passes) and Python passes, by name.

A Python pass is a function ``fn(ctx: PassContext) -> int`` (the number of rewrites) that
works on ``ctx.model`` and may replace it (a pass that rebuilds the model, such as version
conversion, sets ``ctx.model``). Register one with the decorator::

    @fastopt.register_pass("my_pass", "what it does in one line", tags=("cleanup",))
    def my_pass(ctx: fastopt.PassContext) -> int:
        ...

Tags are labels (``fastopt passes`` lists them); what the pass manager does for a pass it reads
from the pass's contract. A pass that requires the fact ``VALUE_TYPES``
(``requires_facts=(VALUE_TYPES,)``) gets value types first: unless the model's types are fresh
(a pass that ensures them, ``infer_shapes``, ran and no pass changed the graph since),
``fastopt.pipeline.shapes.infer_shapes`` (the C++ shape analysis, onnx's inference for what it does
not know) runs before it. A pass declared ``idempotent`` (the default) rewrites nothing when run
again on its own output: optimize() does not rerun it while nothing changed since it last ran.
Passes read their settings from ``ctx.options`` (``fastopt.optimize(options=...)``); C++ passes
see the integer ones.

Presets are data: ordered lists of pass names.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from fastopt import _C
from fastopt.errors import OptionError, UnknownNameError
from fastopt.pipeline.options import unknown_name

if TYPE_CHECKING:
    from fastopt.pipeline.shapes import ShapeRun

Target = Literal["ort", "onnx"]


@dataclass
class PassContext:
    """What a pass gets: the model, the target runtime, and where to report."""

    model: _C.Model
    target: Target = "ort"
    max_iterations: int = 10
    explain_rule: str = ""  # rule name, "*" for all, "" for none
    explain_lines: list[str] = field(default_factory=list)
    # What a pass counts (add to it). Under optimize() a pass sees only its own counters: the
    # pass manager gives each pass a fresh dict and merges it into the run's totals afterwards.
    counters: dict[str, int] = field(default_factory=dict)
    # Settings for passes, by name, e.g. {"opset": 18} for convert_version.
    options: dict[str, object] = field(default_factory=dict)
    # True while the model's value types are those of a shape inference run on its current graph.
    shapes_inferred: bool = False
    # (pass name, what ran) per shape inference of the run: the infer_shapes pass's, and those
    # a pass requiring VALUE_TYPES triggered (fastopt.pipeline.shapes.ShapeRun.describe() says
    # which ran).
    shape_runs: list[tuple[str, ShapeRun]] = field(default_factory=list)
    # One record per weight a quantization pass looked at (quantized or kept, and why).
    quant_records: list[_C.QuantRecord] = field(default_factory=list)
    # progress(done, total, what), called by long passes (quantization); may be None.
    progress: Callable[[int, int, str], None] | None = None


PassFunction = Callable[[PassContext], int]

# Facts of the pass contracts (csrc/passes/registry.h). VALUE_TYPES: the model's value types are
# those of a shape inference run on its current graph; the pass manager establishes it itself
# before a pass that requires it, so no pass of the list needs to ensure it.
VALUE_TYPES: str = _C.FACT_VALUE_TYPES
_MANAGER_FACTS = frozenset({VALUE_TYPES})


def default_opset(model: _C.Model) -> int:
    """The model's opset of the default domain ("" or "ai.onnx"); 0 when it imports none."""
    imports = model.opset_imports
    return int(imports.get("", imports.get("ai.onnx", 0)))


@dataclass(frozen=True)
class PassSpec:
    name: str
    description: str
    tags: tuple[str, ...] = ()
    min_opset: int = 1
    max_opset: int | None = None
    idempotent: bool = True
    language: Literal["c++", "python"] = "python"
    function: PassFunction | None = None
    # Contracts (PassInfo in csrc/passes/registry.h): facts an earlier pass of the list must
    # establish, facts this pass establishes, passes it runs before when both are listed.
    requires_facts: tuple[str, ...] = ()
    ensures_facts: tuple[str, ...] = ()
    runs_before: tuple[str, ...] = ()
    # Names of its rules, which --explain takes beside the pass's own name (that one explains
    # them all).
    rule_names: tuple[str, ...] = ()

    def applies_to(self, opset: int) -> bool:
        return opset >= self.min_opset and (self.max_opset is None or opset <= self.max_opset)

    def run(self, ctx: PassContext) -> int:
        if VALUE_TYPES in self.requires_facts and not ctx.shapes_inferred:
            from fastopt.pipeline.shapes import infer_shapes_for_pass

            ctx.shape_runs.append((self.name, infer_shapes_for_pass(ctx.model, ctx.options)))
            ctx.shapes_inferred = True
        asked = ctx.explain_rule
        if asked == self.name and self.rule_names:
            ctx.explain_rule = "*"  # the pass's name explains each of its rules
        try:
            rewrites = self._run(ctx)
        finally:
            ctx.explain_rule = asked
        if VALUE_TYPES in self.ensures_facts:
            ctx.shapes_inferred = True  # what it changed is the value types themselves
        elif rewrites:
            ctx.shapes_inferred = False
            # Memoized C++ analyses recompute (attribute edits too). A C++ pass's run_pass did
            # that already, unless the pass kept its shape facts current across its edits.
            if self.function is not None:
                ctx.model.note_edit()
        return rewrites

    def _run(self, ctx: PassContext) -> int:
        if self.function is not None:
            return int(self.function(ctx))
        int_options = {k: int(v) for k, v in ctx.options.items() if isinstance(v, (int, bool))}
        text_options = {k: v for k, v in ctx.options.items() if isinstance(v, str)}
        rewrites, result = _C.run_pass(
            ctx.model,
            self.name,
            ctx.target,
            ctx.max_iterations,
            ctx.explain_rule,
            int_options,
            text_options,
            ctx.progress,
        )
        for key, n in result.counters.items():
            ctx.counters[key] = ctx.counters.get(key, 0) + n
        ctx.explain_lines.extend(result.explain_lines)
        ctx.quant_records.extend(result.quant_records)
        return int(rewrites)


_PYTHON_PASSES: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    description: str,
    *,
    tags: tuple[str, ...] = (),
    min_opset: int = 1,
    max_opset: int | None = None,
    idempotent: bool = True,
    requires_facts: tuple[str, ...] = (),
    ensures_facts: tuple[str, ...] = (),
    runs_before: tuple[str, ...] = (),
) -> Callable[[PassFunction], PassFunction]:
    """Registers a Python pass under ``name`` (which must be new). Its contract, as a C++ pass's
    (PassInfo): ``idempotent`` (a second run on its output rewrites nothing), the facts it
    requires and ensures (e.g. ``VALUE_TYPES``), the passes it runs before when placed."""

    def decorate(fn: PassFunction) -> PassFunction:
        if name in _PYTHON_PASSES or any(p.name == name for p in _C.cpp_passes()):
            raise ValueError(f"a pass named '{name}' is already registered")
        _PYTHON_PASSES[name] = PassSpec(
            name,
            description,
            tuple(tags),
            min_opset,
            max_opset,
            idempotent,
            "python",
            fn,
            tuple(requires_facts),
            tuple(ensures_facts),
            tuple(runs_before),
        )
        return fn

    return decorate


def register_rules(
    name: str,
    description: str,
    rules: list[_C.Rule],
    *,
    tags: tuple[str, ...] = (),
    min_opset: int = 1,
    max_opset: int | None = None,
) -> None:
    """Registers a pass that applies pattern rules (declared in Python, matched in C++) to a
    fixed point; explanations name each rule."""

    def run(ctx: PassContext) -> int:
        rewrites, per_rule, lines = _C.apply_rules(
            ctx.model, rules, ctx.max_iterations, ctx.explain_rule
        )
        for rule, n in per_rule.items():
            ctx.counters[rule] = ctx.counters.get(rule, 0) + n
        ctx.explain_lines.extend(lines)
        return int(rewrites)

    register_pass(name, description, tags=tags, min_opset=min_opset, max_opset=max_opset)(run)
    _PYTHON_PASSES[name] = replace(_PYTHON_PASSES[name], rule_names=tuple(r.name for r in rules))


def unregister_pass(name: str) -> None:
    """Removes a Python pass (C++ passes stay)."""
    _PYTHON_PASSES.pop(name, None)


@functools.cache
def _cpp_passes() -> tuple[PassSpec, ...]:
    """The C++ passes (registered statically, so read from _C once)."""
    return tuple(
        PassSpec(
            p.name,
            p.description,
            tuple(p.tags),
            p.min_opset,
            None if p.max_opset >= 2**62 else p.max_opset,
            p.idempotent,
            "c++",
            None,
            tuple(p.requires_facts),
            tuple(p.ensures_facts),
            tuple(p.runs_before),
            tuple(getattr(p, "rule_names", ())),
        )
        for p in _C.cpp_passes()
    )


@functools.cache
def _cpp_by_name() -> dict[str, PassSpec]:
    return {p.name: p for p in _cpp_passes()}


def all_passes() -> list[PassSpec]:
    """Every registered pass: C++ ones first, in registration order, then Python ones."""
    return [*_cpp_passes(), *_PYTHON_PASSES.values()]


def place(names: list[str], name: str) -> list[str]:
    """`names` with the pass `name` inserted where its contract puts it: after the last listed
    pass that ensures a fact it requires, before the listed passes it runs before. (A copy of it
    already listed moves there.) :class:`fastopt.OptionError` when no listed pass ensures what it
    requires or the two constraints contradict."""
    spec = get_pass(name)
    out = [n for n in names if n != name]
    required = set(spec.requires_facts) - _MANAGER_FACTS  # the manager establishes those itself
    ensurers = [i for i, n in enumerate(out) if set(get_pass(n).ensures_facts) & required]
    if required and not ensurers:
        needed = " or ".join(p.name for p in all_passes() if set(p.ensures_facts) & required)
        raise OptionError(
            f"{name} needs the pass {needed} in the pass list (use preset 'llm'): "
            f"it requires {', '.join(sorted(required))}"
        )
    at = ensurers[-1] + 1 if ensurers else 0
    later = [i for i, n in enumerate(out) if n in spec.runs_before]
    if later and later[0] < at:
        raise OptionError(f"{name} must run after {out[at - 1]} and before {out[later[0]]}")
    return [*out[:at], name, *out[at:]]


# The fact a pass list must leave established (csrc/passes/registry.h, kNoInternalOps).
NO_INTERNAL_OPS = _C.FACT_NO_INTERNAL_OPS


def finishing_pass(fact: str) -> str:
    """The pass that establishes `fact` (e.g. no internal ops left), for the pass manager to run
    when a list leaves it unestablished."""
    for p in all_passes():
        if fact in p.ensures_facts:
            return p.name
    raise KeyError(f"no pass ensures {fact!r}")


def get_pass(name: str) -> PassSpec:
    """The pass named `name`; :class:`fastopt.UnknownNameError` (a KeyError) listing the known
    ones otherwise."""
    # A dict lookup: the pass manager asks for every pass it runs (names are unique: C++ ones
    # cannot be re-registered from Python).
    spec = _cpp_by_name().get(name) or _PYTHON_PASSES.get(name)
    if spec is not None:
        return spec
    raise unknown_name("pass", name, [p.name for p in all_passes()])


def explain_names() -> list[str]:
    """The names ``explain`` takes: every pass (all its rules) and every rule of a pass."""
    names = dict.fromkeys(p.name for p in all_passes())
    for p in all_passes():
        names.update(dict.fromkeys(p.rule_names))
    return list(names)


def check_explain(name: str) -> None:
    """:class:`fastopt.UnknownNameError` (with the closest names) unless `name` is "*", a pass
    or a rule: a misspelled name would explain nothing."""
    if name == "*":
        return
    known = explain_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise UnknownNameError(
            f"no pass or rule named '{name}'{hint}; explain takes a pass (all its rules), a "
            "rule or '*' (`fastopt passes` lists the passes and their rules)"
        )


# Presets: ordered pass lists (data, not code). Every name must be a registered pass.
# Cleanup: value types first (shape folding needs them), then folding (shapes, then constants,
# natively and then through ONNX Runtime), then cleanup of what folding left dead.
_CLEANUP = [
    "infer_shapes",
    "fold_shapes",
    "fold_constants",
    "fold_constants_ort",
    "eliminate_identity",
    "eliminate_cast",
    "eliminate_noop",
    "fold_transposes",
    "fold_reshapes",
    "eliminate_noop",  # again: a folded chain can leave a no-op Reshape or Transpose
    "eliminate_neutral_arithmetic",
    "eliminate_common_subexpressions",
    "eliminate_unused_function_inputs",
    "eliminate_dead_nodes",
]
# Classic fusions, after cleanup. fuse_conv_bn before fuse_conv_activation, so that
# Conv + BatchNormalization + Relu ends as one FusedConv.
_CONV = ["fuse_conv_bn", "fuse_conv_activation"]
_MATMUL_ADD = ["fuse_matmul_add", "eliminate_dead_nodes"]  # the weights the fusions replaced
# The LLM fusions, after cleanup. Order matters: norms and activations first (they do not
# depend on one another); rotary before attention (the attention lowering reads Q and K through
# the RotaryEmbedding op on the 3-D projection); the skip norms after the attention lowering (the
# residual Adds read the attention's merged output); packing last (it packs the projections a
# GroupQueryAttention reads). Target onnx converts to opset 23 before the fusions
# (RMSNormalization, RotaryEmbedding, Attention).
_LLM = [
    "target_opset",  # after cleanup: the version converter's time grows with the node count
    "fuse_layer_norm",
    "fuse_rms_norm",
    "fuse_norm_casts",  # after the norm fusions, before fuse_skip_norm reads the residual Add
    "fuse_gelu",
    "fuse_bias_gelu",
    "fuse_silu",
    "fuse_rotary",
    "eliminate_dead_nodes",  # the cos/sin subgraphs
    "fuse_attention",
    "lower_attention",
    "fuse_skip_norm",
    "fold_transposes",  # head split/merge pairs around the lowered attention
    "fold_reshapes",
    "eliminate_noop",
    # The attention subgraphs the lowering replaced still read Q/K/V until they are removed,
    # and pack_matmuls packs only projections that GroupQueryAttention alone reads.
    "eliminate_dead_nodes",
    "pack_matmuls",
    "eliminate_common_subexpressions",
    "eliminate_dead_nodes",
]
PRESETS: dict[str, list[str]] = {
    # What `fastopt optimize` runs without --preset: the LLM fusions, and the classic CNN fusions
    # where they match (a decoder has no Conv; a CNN has no attention: each costs the other a
    # few milliseconds of matching).
    "default": [*_CLEANUP, *_CONV, *_MATMUL_ADD, *_LLM],
    "llm": [*_CLEANUP, *_MATMUL_ADD, *_LLM],
    "classic": [*_CLEANUP, *_CONV, *_MATMUL_ADD],  # cleanup + Conv/BN/activation, MatMul+Add
    "cleanup": list(_CLEANUP),
}
# One line each, for `fastopt passes` and the optimize summary.
PRESET_DESCRIPTIONS: dict[str, str] = {
    "default": "cleanup, LLM fusions and the classic fusions (Conv+BN, Conv+activation, "
    "MatMul+Add)",
    "llm": "cleanup, MatMul+Add and the LLM fusions (norms, activations, rotary, attention)",
    "classic": "cleanup and the classic fusions (Conv+BN, Conv+activation, MatMul+Add)",
    "cleanup": "shape inference, constant and shape folding, cleanup; no fusions",
}


def preset(name: str) -> list[str]:
    try:
        return list(PRESETS[name])
    except KeyError:
        raise unknown_name("preset", name, list(PRESETS)) from None
