"""What :func:`fastopt.verify.core.verify` reports: the comparisons per output and per provider
pair, the runs, and the errors a failed verification raises (the public names are importable
from ``fastopt.verify.core``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastopt import _C
from fastopt.runtime.providers import Placement
from fastopt.verify.check import format_table


class VerifyError(_C.ModelError):
    """The optimized model's outputs differ from the original's (or it could not be run);
    ``report`` holds the comparison. A subclass of :class:`fastopt.ModelError`."""

    def __init__(self, message: str, report: VerifyReport) -> None:
        super().__init__(message)
        self.report = report


class InputRejectedError(VerifyError):
    """ONNX Runtime cannot load or run the original model (on the inputs made for it): bad
    input, not a mismatch (the CLI exits 2)."""


class OutputRejectedError(VerifyError):
    """ONNX Runtime loads and runs the original but not the model fastopt produced: a fastopt
    bug, reported as a failed verification (the CLI exits 1). Please report it."""


@dataclass
class OutputComparison:
    name: str
    dtype: str
    shape: list[int] | None  # the original's; None when the original lacks the output
    optimized_shape: list[int] | None
    ok: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0  # over elements whose reference magnitude exceeds atol
    mismatches: int = 0  # elements outside the tolerance
    atol: float = 0.0
    rtol: float = 0.0
    message: str = ""  # why it failed, or where the worst element is


@dataclass
class ProviderComparison:
    """One run's outputs against a reference run's, e.g. optimized@cuda vs original@cuda."""

    kind: str  # "optimization", "provider" or "end-to-end" (see the module docstring)
    reference: str  # "original@cpu"
    subject: str  # "optimized@cuda"
    outputs: list[OutputComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def failed(self) -> list[OutputComparison]:
        return [o for o in self.outputs if not o.ok]


@dataclass
class ProviderRun:
    """One model run on one provider."""

    model: str  # "original" or "optimized"
    provider: str  # its label: "cpu", "cuda", "cpu#2"
    seconds: float = 0.0
    placement: Placement | None = None  # None when not profiled

    @property
    def name(self) -> str:
        return f"{self.model}@{self.provider}"


@dataclass
class VerifyReport:
    original: str
    optimized: str
    inputs: dict[str, str] = field(default_factory=dict)  # name -> "int64[2, 8]"
    # the optimization comparison on the first provider (empty for compare_providers)
    outputs: list[OutputComparison] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str = ""  # a model could not be loaded or run
    providers: list[str] = field(default_factory=list)  # labels of the runs' providers
    runs: list[ProviderRun] = field(default_factory=list)
    # with several providers: every comparison, the first provider's optimization one included
    comparisons: list[ProviderComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and all(o.ok for o in self.outputs)
            and all(c.ok for c in self.comparisons)
        )

    @property
    def failed(self) -> list[OutputComparison]:
        return [o for o in self.outputs if not o.ok]

    def output(self, name: str) -> OutputComparison:
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        for c, d in zip(self.comparisons, out["comparisons"]):
            d["ok"] = c.ok
        for r, d in zip(self.runs, out["runs"]):
            if r.placement is not None:
                d["placement"]["fallback_count"] = r.placement.fallback_count
        return out

    def comparison_table(self) -> str:
        """One row per cross-provider comparison: its worst output and verdict."""
        rows = []
        for c in self.comparisons:
            worst = max(c.outputs, key=lambda o: (not o.ok, o.max_abs_err), default=None)
            rows.append(
                (
                    c.kind,
                    c.subject,
                    c.reference,
                    f"{len(c.outputs) - len(c.failed)}/{len(c.outputs)}",
                    f"{worst.max_abs_err:.3g}" if worst else "-",
                    f"{worst.atol:g}/{worst.rtol:g}" if worst else "-",
                    "ok" if c.ok else "FAIL",
                    "" if worst is None or worst.ok else f"{worst.name}: {worst.message}",
                )
            )
        header = ("kind", "run", "reference", "outputs ok", "max_abs", "atol/rtol", "status")
        return format_table((*header, "note"), rows)

    def placement_table(self) -> str:
        """One row per profiled run: nodes per provider, CPU fallbacks by op type, transfers."""
        rows = []
        for r in self.runs:
            p = r.placement
            if p is None:
                continue
            nodes = ", ".join(f"{k} {v}" for k, v in sorted(p.nodes.items()))
            transfers = ", ".join(f"{k} {v}" for k, v in sorted(p.transfers.items()))
            rows.append(
                (r.name, nodes, str(p.fallback_count), transfers or "-", p.fallback_text() or "-")
            )
        header = ("run", "nodes by provider", "cpu fallbacks", "transfers", "fallback ops")
        return format_table(header, rows)

    def table(self, outputs: Sequence[OutputComparison] | None = None) -> str:
        rows = [
            (
                o.name,
                o.dtype,
                _shape_text(o.shape, o.optimized_shape),
                f"{o.max_abs_err:.3g}",
                f"{o.max_rel_err:.3g}",
                f"{o.atol:g}/{o.rtol:g}",
                "ok" if o.ok else "FAIL",
                o.message,
            )
            for o in (self.outputs if outputs is None else outputs)
        ]
        header = ("output", "dtype", "shape", "max_abs", "max_rel", "atol/rtol", "status", "note")
        return format_table(header, rows)

    def __str__(self) -> str:
        verdict = "passed" if self.ok else "FAILED"
        feeds = ", ".join(f"{k} {v}" for k, v in self.inputs.items())
        what = f"{self.optimized} vs {self.original}" if self.optimized else self.original
        text = f"verify {verdict}: {what}\ninputs: {feeds}\n"
        if len(self.providers) > 1:
            text += f"providers: {', '.join(self.providers)}\n"
        if self.error:
            text += f"error: {self.error}\n"
        parts = [self.table()] if self.outputs or not self.comparisons else []
        if self.comparisons:
            parts.append(self.comparison_table())
        if any(r.placement is not None for r in self.runs):
            parts.append(self.placement_table())
        return text + "\n\n".join(parts)


def _shape_text(a: list[int] | None, b: list[int] | None) -> str:
    def one(s: list[int] | None) -> str:
        return "-" if s is None else "[" + ", ".join(map(str, s)) + "]"

    return one(a) if a == b else f"{one(a)} vs {one(b)}"


def _failure_text(report: VerifyReport) -> str:
    """The VerifyError message: what differs, and a table of the failing outputs."""
    if report.optimized:
        text = f"{report.optimized} differs from {report.original}"
    else:
        text = f"{report.original} differs across providers"
    reasons = [report.error] if report.error else []
    failed = report.failed
    if failed:
        reasons.append(f"{len(failed)} of {len(report.outputs)} outputs fail")
    bad = [c for c in report.comparisons if not c.ok and c.outputs is not report.outputs]
    for c in bad:
        reasons.append(f"{c.subject} vs {c.reference} ({c.kind}): {len(c.failed)} outputs fail")
    text += ": " + "; ".join(reasons)
    if failed:
        text += "\n" + report.table(failed)
    for c in bad:
        text += f"\n{c.subject} vs {c.reference}:\n" + report.table(c.failed)
    return text
