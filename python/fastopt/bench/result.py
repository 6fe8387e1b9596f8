"""The outcome of benchmarking one model on one workload."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fastopt.bench.timing import Stats


@dataclass
class BenchResult:
    """Latency of one model, phase and size, and what ran it.

    provider: the execution provider that ran the session (e.g. "CPUExecutionProvider").
    kind: what the model was taken for (see :mod:`fastopt.bench.inputs`). tokens: new tokens
    per run (batch * seq for prefill, batch for decode). memory_bytes: see ``memory``, which
    says what was measured, or "not reported".
    """

    model: str
    provider: str
    kind: str
    phase: str
    batch: int
    seq: int
    tokens: int
    stats: Stats
    memory_bytes: int | None = None
    memory: str = "not reported"
    io_binding: bool = False
    cuda_graph: bool = False
    threads: int | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second at the median latency."""
        return self.tokens / self.stats.median if self.stats.median > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = self.tokens_per_s
        return out
