"""Shape inference as a step: fastopt's C++ shape analysis, with onnx's as the fallback.

The native analysis (csrc/analysis: symbolic dims, shape values through Shape -> Gather ->
Concat chains, Reshape with -1 and 0, the com.microsoft ops fastopt writes, If/Loop/Scan with
their bodies) types the main graph in one sweep. Where it has no rule for a node (an op it does
not know, in the main graph or a body; a function), or when asked for onnx's strict checks,
onnx's shape inference runs too, on the model's skeleton (``Model.skeleton``: the model
without its weights, so no 2 GB limit and no weights through protobuf), and fills what the
native analysis left open. Types are only ever refined: a value keeps what its type already
says. Which ran is reported (``ShapeRun.describe``, ``OptimizeReport.shape_inference``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fastopt import _C
from fastopt.errors import entry_point, foreign_errors

# What an onnx refusal is reported as ("shape inference (onnx): InferenceError: ...").
STAGE = "shape inference (onnx)"

# shape_engine option values.
AUTO, NATIVE, ONNX = 0, 1, 2


@dataclass
class ShapeRun:
    """What one inference step did: the engines that ran and the types they changed."""

    changed: int = 0
    engines: list[str] = field(default_factory=list)
    # {op: count} of nodes the native analysis has no rule for (why onnx ran, in auto mode).
    unknown_ops: dict[str, int] = field(default_factory=dict)
    # Nodes the native analysis gave facts to, and the If/Loop/Scan bodies among them.
    native_nodes: int = 0
    native_bodies: int = 0
    # Why onnx's inference ran ("" when it did not).
    onnx_reason: str = ""

    def counters(self) -> dict[str, int]:
        """The run as pass counters: ``engine:<name>`` per engine that ran, ``native_nodes`` /
        ``native_bodies``, ``native_unknown:<op>`` (the op types onnx's inference ran for),
        ``types_refined``."""
        out = {f"engine:{e}": 1 for e in self.engines}
        if self.changed:
            out["types_refined"] = self.changed
        if self.native_nodes:
            out["native_nodes"] = self.native_nodes
        if self.native_bodies:
            out["native_bodies"] = self.native_bodies
        for op, n in self.unknown_ops.items():
            out[f"native_unknown:{op}"] = n
        return out

    def describe(self) -> str:
        """One line: which inference ran, for what."""
        parts = []
        if "native" in self.engines:
            bodies = f" ({self.native_bodies} bodies)" if self.native_bodies else ""
            parts.append(f"native for {self.native_nodes} nodes{bodies}")
        if "onnx" in self.engines:
            parts.append(f"onnx {self.onnx_reason}")
        return "; ".join(parts) or "none"


@entry_point(STAGE)
def infer_shapes(
    model: _C.Model, *, strict: bool = False, data_prop: bool = True, engine: int = AUTO
) -> None:
    """Infers value types and applies them to ``model`` in place.

    Values without a type get the inferred one; values whose inferred type is more specific
    (known element type, a shape, numbers or symbolic expressions where dims were unknown) are
    refined; graph inputs keep their declared types. Refined values get value_info entries, so
    the types are saved with the model. ``engine``: AUTO (native analysis, onnx's for the nodes
    it does not know), NATIVE, ONNX. ``strict`` runs onnx's inference too and makes its errors
    raise; onnx's refusals (inference errors, a model onnx cannot parse or validate) raise
    :class:`fastopt.RejectedModelError` with onnx's exception as ``__cause__``. ``data_prop``
    False is onnx's inference without constant shape values (the native analysis always
    propagates them, so it does not run then).
    """
    run_inference(model, strict=strict, data_prop=data_prop, engine=engine)


@entry_point(STAGE)
def infer_shapes_for_pass(model: _C.Model, options: Mapping[str, object]) -> ShapeRun:
    """The inference a pass requiring VALUE_TYPES gets first (``shape_engine`` from its options)."""
    return run_inference(model, engine=int(options.get("shape_engine", AUTO)))  # type: ignore[call-overload]


def run_inference(
    model: _C.Model, *, strict: bool = False, data_prop: bool = True, engine: int = AUTO
) -> ShapeRun:
    """``infer_shapes``, reporting what ran."""
    run = ShapeRun()
    if engine != ONNX and data_prop:
        changed, unknown = _C.analyze_shapes(model)
        run.changed += changed
        run.engines.append("native")
        run.unknown_ops = dict(unknown)
        run.native_nodes, run.native_bodies = _C.shape_analysis_summary(model)
    needs_onnx = (
        engine == ONNX
        or not data_prop
        or strict
        # (the native analysis covers the graphs and their If/Loop/Scan bodies, not functions)
        or (engine == AUTO and (bool(run.unknown_ops) or bool(model.functions)))
    )
    if needs_onnx:
        run.changed += apply_inferred_types(model, strict=strict, data_prop=data_prop)
        run.engines.append("onnx")
        run.onnx_reason = _onnx_reason(run, engine, strict, data_prop, model)
    return run


def _onnx_reason(run: ShapeRun, engine: int, strict: bool, data_prop: bool, model: _C.Model) -> str:
    if engine == ONNX:
        return "(asked for)"
    if not data_prop:
        return "(data_prop off)"
    if strict:
        return "(strict checks)"
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(run.unknown_ops.items()))
    if model.functions:
        ops = ", ".join(filter(None, (ops, "functions")))
    return f"fallback for {ops}"


def apply_inferred_types(model: _C.Model, *, strict: bool = False, data_prop: bool = True) -> int:
    """onnx's shape inference on the skeleton, applied; returns the values whose type changed."""
    import onnx.shape_inference  # here: `import fastopt` should not pay for onnx

    skeleton = model.skeleton()
    with foreign_errors(STAGE):
        inferred = onnx.shape_inference.infer_shapes(
            skeleton, check_type=False, strict_mode=strict, data_prop=data_prop
        ).SerializeToString()
    return model.apply_types(inferred)
