"""``fastopt.verify``: does an optimized model compute what the original computes? Verification in
ONNX Runtime: ``core`` (verify(), compare_providers(), the module documentation), ``compare``,
``generation``, ``inputs``, ``report``, ``quantized``, ``run_check``, ``check``. The public names
of ``core`` are re-exported here: ``from fastopt.verify import verify, make_inputs`` works."""

from fastopt.verify.core import (
    BATCH,
    PAST,
    SEQUENCE,
    UNKNOWN_DIM,
    InputRejectedError,
    OutputComparison,
    OutputRejectedError,
    ProviderComparison,
    ProviderRun,
    Tolerance,
    VerifyError,
    VerifyReport,
    compare_providers,
    make_inputs,
    verify,
)

__all__ = [
    "BATCH",
    "PAST",
    "SEQUENCE",
    "UNKNOWN_DIM",
    "InputRejectedError",
    "OutputComparison",
    "OutputRejectedError",
    "ProviderComparison",
    "ProviderRun",
    "Tolerance",
    "VerifyError",
    "VerifyReport",
    "compare_providers",
    "make_inputs",
    "verify",
]
