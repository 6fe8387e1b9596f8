"""Pass options: every setting a pass reads from ``ctx.options`` is declared here, once.

``fastopt.optimize(options=...)`` and ``fastopt optimize --option KEY=VALUE`` check each key and
value against these declarations before any pass runs: a misspelled key or a value out of range
is an :class:`fastopt.OptionError` (CLI: exit 2) that lists what is known, never a setting the
passes silently ignore. C++ passes see the integer values (``PassContext::options``); Python
passes see the checked values.

A C++ pass declares the options it reads with itself (``PassInfo::options`` in
csrc/passes/registry.h; exported through ``_C``, registered here at import). A Python pass that
reads a new option declares it with one call, next to the pass::

    fastopt.register_option(
        "quant_block_size", "int", "rows per quantization block", passes=("quantize",),
        default=32, minimum=16,
    )
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Union

from fastopt import _C
from fastopt.errors import OptionError, UnknownNameError

Kind = Literal["int", "bool"]
OptionValue = Union[int, bool]

# Every integer option reaches the passes as a C++ int64_t: a value outside it is refused here
# (it made pybind raise TypeError), whatever range the option declares.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class OptionSpec:
    """One option: its name, kind ("int" or "bool"), what it does, the passes that read it, its
    default (None: the pass's own behaviour when unset), and the values it takes: ``choices``
    (with a meaning each) or a ``minimum`` / ``maximum`` range. ``internal`` options are set by
    ``optimize`` itself (e.g. ``kv_cache`` from ``kv_cache=``)."""

    name: str
    kind: Kind
    help: str
    passes: tuple[str, ...]
    default: OptionValue | None = None
    choices: tuple[tuple[int, str], ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    internal: bool = False
    # A rule beyond the range, stated elsewhere (the C++ declaration): why a value breaks it, or
    # "" (its message is the option's error).
    problem: Callable[[int], str] | None = None

    def values_text(self) -> str:
        """What the option takes, in words: "0 (off), 1 (non-causal) or 2 (also causal)"."""
        if self.kind == "bool":
            return "a boolean (0/1, true/false)"
        if self.choices:
            items = [f"{v} ({meaning})" if meaning else str(v) for v, meaning in self.choices]
            return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else items[0]
        if self.minimum is not None and self.maximum is not None:
            return f"an integer in [{self.minimum}, {self.maximum}]"
        if self.minimum is not None:
            return f"an integer >= {self.minimum} (and <= {INT64_MAX})"
        if self.maximum is not None:
            return f"an integer <= {self.maximum} (and >= {INT64_MIN})"
        return f"an integer in [{INT64_MIN}, {INT64_MAX}]"

    def check(self, value: object) -> OptionValue:
        """`value` as the passes read it; :class:`OptionError` when it is not one this option
        takes. Strings (from the command line) are parsed."""
        parsed = _parse(self.kind, value)
        ok = parsed is not None
        if problem := self._rule_problem(parsed):  # its message, not the range's
            raise OptionError(problem)
        if ok and self.kind == "int":
            assert parsed is not None
            if self.choices and int(parsed) not in [v for v, _ in self.choices]:
                ok = False
            if self.minimum is not None and int(parsed) < self.minimum:
                ok = False
            if self.maximum is not None and int(parsed) > self.maximum:
                ok = False
            if not INT64_MIN <= int(parsed) <= INT64_MAX:
                ok = False
        if not ok or parsed is None:
            raise OptionError(f"{self.name} must be {self.values_text()}, not {value!r}")
        return parsed

    def _rule_problem(self, parsed: OptionValue | None) -> str:
        """What ``problem`` says of a parsed int64 value ("" without a rule, or when kept)."""
        if self.problem is None or self.kind != "int" or parsed is None:
            return ""
        return self.problem(int(parsed)) if INT64_MIN <= int(parsed) <= INT64_MAX else ""


def _parse(kind: Kind, value: object) -> OptionValue | None:
    if isinstance(value, str):
        text = value.strip().lower()
        if kind == "bool":
            return True if text in _TRUE else False if text in _FALSE else None
        try:
            return int(text)
        except ValueError:
            return None
    if kind == "bool":
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return None  # True is no opset number, 2.5 no byte count
    return value


OPTIONS: dict[str, OptionSpec] = {}


def register_option(
    name: str,
    kind: Kind,
    help: str,
    *,
    passes: Sequence[str],
    default: OptionValue | None = None,
    choices: Sequence[tuple[int, str]] = (),
    minimum: int | None = None,
    maximum: int | None = None,
    internal: bool = False,
    problem: Callable[[int], str] | None = None,
) -> OptionSpec:
    """Declares an option read by `passes` (see the module docstring); the name must be new."""
    if name in OPTIONS:
        raise ValueError(f"an option named '{name}' is already registered")
    if kind not in ("int", "bool"):
        raise ValueError(f"option kind must be 'int' or 'bool', not {kind!r}")
    spec = OptionSpec(
        name,
        kind,
        help,
        tuple(passes),
        default,
        tuple(choices),
        minimum,
        maximum,
        internal,
        problem,
    )
    OPTIONS[name] = spec
    return spec


def unregister_option(name: str) -> None:
    OPTIONS.pop(name, None)


def unknown_name(what: str, name: str, known: Sequence[str]) -> UnknownNameError:
    """The error for a misspelled name: the closest known ones first, then all of them."""
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return UnknownNameError(f"no {what} named '{name}'{hint}; known: {', '.join(sorted(known))}")


def check_options(options: Mapping[str, object]) -> dict[str, OptionValue]:
    """`options` checked against the declarations, values as the passes read them."""
    out: dict[str, OptionValue] = {}
    for key, value in options.items():
        spec = OPTIONS.get(key)
        if spec is None:
            raise unknown_name(
                "option", str(key), [n for n, s in OPTIONS.items() if not s.internal]
            )
        out[key] = spec.check(value)
    return out


# No opset of the default domain is near it (onnx's converter refuses any it does not know); a
# bound so that every integer option has one.
MAX_OPSET = 1000

# --- the built-in passes' options (grep for ctx.options / option(ctx, in csrc/passes and
# python/fastopt/passes; tests/project/test_cli_errors.py checks every name read is declared)

register_option(
    "opset",
    "int",
    "the opset convert_version converts the default domain to",
    passes=("convert_version",),
    minimum=1,
    maximum=MAX_OPSET,
)
register_option(
    "strict_shapes",
    "bool",
    "shape inference errors raise instead of leaving the node's outputs untyped",
    passes=("infer_shapes",),
    default=False,
)
register_option(
    "data_prop",
    "bool",
    "shape inference propagates constant shape values (Shape -> Gather -> Concat -> Reshape)",
    passes=("infer_shapes",),
    default=True,
)
register_option(
    "shape_engine",
    "int",
    "which shape inference infer_shapes runs",
    passes=("infer_shapes",),
    default=0,
    choices=(
        (0, "native analysis, onnx's for ops it does not know"),
        (1, "native only"),
        (2, "onnx only"),
    ),
)
register_option(
    "fold_max_bytes",
    "int",
    "largest constant (bytes) constant folding writes",
    passes=("fold_constants", "fold_constants_ort"),
    default=_C.FOLD_MAX_BYTES,
    minimum=0,
)
register_option(
    "fold_max_expand_bytes",
    "int",
    "largest constant (bytes) a fold may write that is bigger than its inputs (Expand, Tile, ...)",
    passes=("fold_constants", "fold_constants_ort"),
    default=_C.FOLD_MAX_EXPAND_BYTES,
    minimum=0,
)
register_option(
    "rotary_max_positions",
    "int",
    "rows of the cos/sin caches precomputed for on-the-fly RoPE (ORT rejects larger positions)",
    passes=("fuse_rotary",),
    default=4096,
    minimum=1,
    maximum=_C.ROTARY_MAX_POSITIONS_LIMIT,
)


def _declare_cpp_options() -> None:
    """The options C++ passes declare with themselves (PassInfo::options, csrc/passes/registry.h),
    one spec per name: the declaration with help text, read by every pass that lists it."""
    readers: dict[str, list[str]] = {}
    declared: dict[str, _C.OptionInfo] = {}
    for p in _C.cpp_passes():
        for o in p.options:
            readers.setdefault(o.name, []).append(p.name)
            if o.help:
                declared[o.name] = o
    for name, o in declared.items():
        register_option(
            name,
            "bool" if o.kind == "bool" else "int",
            o.help,
            passes=readers[name],
            default=o.default,
            choices=[(int(v), meaning) for v, meaning in o.choices],
            minimum=o.minimum,
            maximum=o.maximum,
            internal=o.internal,
        )


_declare_cpp_options()

# Quantization: set by optimize(quantize=QuantSettings(...)) / fastopt.quantize, read by the
# quant passes through quant::read_options (csrc/passes/quant/options.h), which checks them
# again. The text settings (quant_mode, quant_exclude, quant_lm_head, quant_embeddings,
# quant_tmpdir) travel as PassContext::text_options, outside this integer/boolean registry.
_QUANT_PASSES = ("quantize_weights", "quantize_dynamic", "convert_precision")
register_option(
    "quant_bits",
    "int",
    "weight-only bits",
    passes=_QUANT_PASSES,
    choices=((4, "int4"), (8, "int8")),
    internal=True,
)
register_option(
    "quant_block_size",
    "int",
    "rows per quantization block (a power of two)",
    passes=_QUANT_PASSES,
    default=32,
    minimum=_C.QUANT_BLOCK_SIZE_MIN,
    maximum=_C.QUANT_BLOCK_SIZE_MAX,
    internal=True,
    problem=_C.quant_block_size_problem,  # the rule: csrc/passes/quant/options.h
)
register_option(
    "quant_symmetric", "bool", "symmetric quantization", passes=_QUANT_PASSES, internal=True
)
register_option(
    "quant_accuracy_level",
    "int",
    "MatMulNBits accuracy_level (unset: 4 for fp32 weights, 0 for fp16/bf16 or cuda=1)",
    passes=_QUANT_PASSES,
    minimum=0,
    maximum=4,
    internal=True,
)
register_option(
    "quant_per_channel", "bool", "per-channel scales", passes=_QUANT_PASSES, internal=True
)
register_option(
    "quant_reduce_range",
    "bool",
    "int8-dynamic: 7-bit weights, as quantize_dynamic(reduce_range=True) (default: on for "
    "per-channel scales where this CPU's int8 GEMM saturates: x86 without VNNI)",
    passes=("quantize_dynamic",),
)
register_option(
    "quant_keep_io_types",
    "bool",
    "keep float32 graph inputs and outputs",
    passes=_QUANT_PASSES,
    internal=True,
)
register_option(
    "quant_threads",
    "int",
    "quantizing threads (0: all cores)",
    passes=_QUANT_PASSES,
    minimum=0,
    maximum=4096,
    internal=True,
)
