"""Signatures that ``help()`` can read: the public functions' annotations are strings (``from
__future__ import annotations``) naming module-level aliases such as ``ModelOrPath``, which mean
nothing to a reader of ``help(fastopt.optimize)``. This spells the aliases out."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

ALIASES = {
    "ModelOrPath": "str | os.PathLike | fastopt.Model",
    "ModelLike": "str | os.PathLike | fastopt.Model | onnx.ModelProto",
    "PathLike": "str | os.PathLike",
    "Target": "Literal['ort', 'onnx']",
    "KvCache": "Literal['standard', 'inplace']",
    "ProgressFn": "Callable[[int, int, str], None]",
    "WorkProgressFn": "Callable[[int, int, str], None]",
    "Tolerance": "float | Mapping[str, float] | None",
    "_C.Model": "fastopt.Model",
}
_ALIAS = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, ALIASES)) + r")\b")


def _spelled(annotation: object) -> object:
    if isinstance(annotation, str):
        return _ALIAS.sub(lambda m: ALIASES[m.group(1)], annotation)
    return annotation


def spell_out_aliases(*functions: Callable[..., object]) -> None:
    """Sets each function's ``__signature__`` to its signature with the aliases spelled out."""
    for fn in functions:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a C++ function: pybind writes its own
            continue
        params = [p.replace(annotation=_spelled(p.annotation)) for p in sig.parameters.values()]
        fn.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=params, return_annotation=_spelled(sig.return_annotation)
        )
