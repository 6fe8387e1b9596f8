"""``fastopt.verify``: does an optimized model compute what the original computes? Verification in
ONNX Runtime: ``core`` (verify(), compare_providers(), the module documentation), ``compare``,
``generation``, ``inputs``, ``report``, ``quantized``, ``run_check``, ``check``. The public names
of ``core`` are re-exported here: ``from fastopt.verify import verify, make_inputs`` works."""

from fastopt.verify import core
from fastopt.verify.core import *  # noqa: F403 (core's public names, its __all__)

__all__ = core.__all__
