"""ONNX Runtime sessions for benchmarking, and a :class:`Runner` that binds a workload once so
that each timed step is one ``run`` call and nothing else.

CPU: a plain ``session.run`` on numpy feeds, as users call it; with an in-place cache, IO
binding, the one buffer per layer bound as both past input and present output.
CUDA: IO binding with every input copied to the device once, outputs pre-allocated on the
device where their shapes follow from the workload's dims (ORT allocates the others there),
optionally CUDA graphs (``enable_cuda_graph``: every output pre-allocated, shapes fixed).
CUDA is used only when asked for or, with "auto", when ONNX Runtime has its provider; asking for
it where it is absent is an error, never a quiet CPU run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastopt._lazy import lazy_module
from fastopt.bench.inputs import Port, Workload, make_workload, resolve_shape
from fastopt.errors import foreign_errors
from fastopt.verify.check import ModelLike, onnxruntime, open_source

if TYPE_CHECKING:
    import numpy as np
else:  # (the CLI imports this module for every command; only bench needs numpy)
    np = lazy_module("numpy")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")

# ORT type -> numpy dtype name, for pre-allocating outputs (others are left to ORT)
_NUMPY_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


class ProviderUnavailableError(ValueError):
    """The execution provider asked for is not in this onnxruntime (or failed to load)."""


def resolve_device(device: str, available: Sequence[str]) -> str:
    """ "cpu" or "cuda" for a request of "auto", "cpu" or "cuda", given ORT's available
    providers. "auto" takes CUDA when ORT has it."""
    if device not in DEVICES:
        raise ValueError(f"provider must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "auto":
        return "cuda" if CUDA in available else "cpu"
    if device == "cuda" and CUDA not in available:
        raise ProviderUnavailableError(
            f"provider 'cuda' was asked for, but this onnxruntime has no {CUDA} (available: "
            f"{', '.join(available)}); install onnxruntime-gpu on a machine with an NVIDIA GPU, "
            "or use provider 'cpu' or 'auto'"
        )
    return device


@dataclass(frozen=True)
class OutputPlan:
    """How one output is bound: ``shared`` with the past input named ``past`` (in-place cache),
    ``preallocated`` with ``shape`` and ``dtype``, or ``allocated`` by ORT at run time."""

    name: str
    how: str
    shape: tuple[int, ...] | None = None
    dtype: Any = None
    past: str | None = None


def plan_outputs(
    outputs: Sequence[Port], workload: Workload, preallocate: bool
) -> list[OutputPlan]:
    """The binding of every output: in-place presents share their past's buffer; with
    `preallocate` (CUDA), outputs whose shapes and dtypes are known are allocated up front."""
    plans = []
    for o in outputs:
        if o.name in workload.shared:
            plans.append(OutputPlan(o.name, "shared", past=workload.shared[o.name]))
            continue
        shape = resolve_shape(o.shape, workload.dims)
        dtype = _NUMPY_TYPES.get(o.type)
        if preallocate and shape is not None and dtype is not None:
            plans.append(OutputPlan(o.name, "preallocated", tuple(shape), np.dtype(dtype)))
        else:
            plans.append(OutputPlan(o.name, "allocated"))
    return plans


def make_session(
    source: str | bytes,
    device: str,
    *,
    threads: int | None = None,
    optimization: str = "all",
    cuda_graph: bool = False,
    device_id: int = 0,
    spinning: bool = True,
) -> Any:
    """An InferenceSession on `device` ("cpu" or "cuda", see :func:`resolve_device`). ORT's
    graph optimizations default to all on, as users run models. Without `spinning`, the
    intra-op threads stop spinning when a run ends (they still spin inside it): sessions run in
    turn in one process then do not steal each other's cores."""
    ort = onnxruntime()
    if optimization not in OPTIMIZATION_LEVELS:
        raise ValueError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}")
    if cuda_graph and device != "cuda":
        raise ValueError("cuda_graph needs provider 'cuda'")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization]
    if threads:
        so.intra_op_num_threads = threads
    if not spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    providers: list[Any] = [CPU]
    if device == "cuda":
        options = {"device_id": str(device_id)}
        if cuda_graph:
            options["enable_cuda_graph"] = "1"
        # CPU after CUDA places the nodes CUDA has no kernel for, as ORT does by default
        providers = [(CUDA, options), CPU]
    with foreign_errors("ONNX Runtime session creation"):
        session = ort.InferenceSession(source, so, providers=providers)
    if device == "cuda" and CUDA not in session.get_providers():
        # ORT drops a provider that fails to load (missing CUDA/cuDNN libraries) with a warning
        raise ProviderUnavailableError(
            f"onnxruntime could not start {CUDA} (session providers: "
            f"{', '.join(session.get_providers())}); check the CUDA and cuDNN libraries"
        )
    return session


class Runner:
    """A session of `model` with one workload bound; :meth:`step` runs it once.

    model: a path, :class:`fastopt.Model` or ``onnx.ModelProto``. provider: "auto", "cpu" or
    "cuda". The remaining arguments are those of :func:`fastopt.bench.run`. Use it as a
    context manager, or call :meth:`close`, to release temporary files of in-memory models.
    """

    def __init__(
        self,
        model: ModelLike,
        *,
        provider: str = "auto",
        phase: str = "prefill",
        batch: int = 1,
        seq: int = 128,
        threads: int | None = None,
        cuda_graph: bool = False,
        max_length: int | None = None,
        optimization: str = "all",
        device_id: int = 0,
        seed: int = 0,
        spinning: bool = True,
    ) -> None:
        self._stack = ExitStack()
        try:
            ort = onnxruntime()
            self.device = resolve_device(provider, ort.get_available_providers())
            source = open_source(model, self._stack, in_memory="bytes")
            self.label = source.label
            self.session = make_session(
                source.for_ort(),
                self.device,
                threads=threads,
                optimization=optimization,
                cuda_graph=cuda_graph,
                device_id=device_id,
                spinning=spinning,
            )
            self.provider = str(self.session.get_providers()[0])
            self.inputs = [Port.of(a) for a in self.session.get_inputs()]
            self.outputs = [Port.of(a) for a in self.session.get_outputs()]
            self.workload = make_workload(
                source.path if source.path is not None else model,
                self.inputs,
                self.outputs,
                phase=phase,
                batch=batch,
                seq=seq,
                max_length=max_length,
                seed=seed,
            )
            self.cuda_graph = cuda_graph
            self.io_binding = self.device == "cuda" or bool(self.workload.shared)
            self.step: Callable[[], Any] = self._bind(device_id)
        except BaseException:
            self._stack.close()
            raise

    def _bind(self, device_id: int) -> Callable[[], Any]:
        feeds = self.workload.feeds
        names = [o.name for o in self.outputs]
        if not self.io_binding:
            self._fetch: Callable[[], list[Any]] = lambda: self.session.run(names, feeds)
            return self._fetch
        ort = onnxruntime()
        on_device = self.device == "cuda"
        plans = plan_outputs(self.outputs, self.workload, preallocate=on_device)
        if self.cuda_graph:
            loose = [p.name for p in plans if p.how == "allocated"]
            if loose:
                raise ValueError(
                    "cuda_graph needs every output pre-allocated; the shapes of "
                    f"{', '.join(loose)} do not follow from the inputs' dims"
                )
        place = ("cuda", device_id) if on_device else ("cpu", 0)
        io = self.session.io_binding()
        self._buffers: dict[str, Any] = {}  # keeps bound OrtValues alive
        for name, array in feeds.items():
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), *place)
            self._buffers[name] = value
            io.bind_ortvalue_input(name, value)
        for plan in plans:
            if plan.how == "shared":
                assert plan.past is not None
                io.bind_ortvalue_output(plan.name, self._buffers[plan.past])
            elif plan.how == "preallocated":
                value = ort.OrtValue.ortvalue_from_shape_and_type(
                    list(plan.shape or ()), plan.dtype, *place
                )
                self._buffers[plan.name] = value
                io.bind_ortvalue_output(plan.name, value)
            elif on_device:
                io.bind_output(plan.name, *place)
            else:
                io.bind_output(plan.name)

        def run() -> None:
            self.session.run_with_iobinding(io)

        def fetch() -> list[Any]:
            run()
            return list(io.copy_outputs_to_cpu())

        self._fetch = fetch
        return run

    def run_outputs(self) -> dict[str, np.ndarray]:
        """Runs once and returns every output (on the CPU) by name."""
        return dict(zip((o.name for o in self.outputs), self._fetch()))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
