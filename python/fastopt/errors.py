"""fastopt's exceptions, and the boundary where other libraries' exceptions become ours.

Every public entry point raises :class:`ModelError` (or one of the subclasses below) for a model
it cannot handle, never onnx's ``InferenceError`` / ``ValidationError``, protobuf's
``DecodeError`` / ``ValueError("Unable to parse proto")`` or an ONNX Runtime exception. The
original exception is kept as ``__cause__``. Programming errors (``TypeError`` for an argument
of the wrong type, ``AttributeError``, ``AssertionError``, ...) are not converted.

Hierarchy (all importable from ``fastopt``):

``ModelError``
    the model (or a setting applied to it) cannot be handled; raised by the C++ core too.
``RejectedModelError(ModelError)``
    a library fastopt calls (onnx, protobuf, ONNX Runtime) rejected the model; ``stage`` names
    the step (e.g. "shape inference (onnx)").
``UnsupportedModelError(ModelError, ValueError)``
    a model fastopt reads but this operation cannot handle: no inputs can be made for an input
    of an unknown type (``verify``, ``bench``), a decode benchmark of an encoder, ...
``OptionError(ModelError, ValueError)``
    an unknown pass, preset or option name, or an option value of the wrong type or out of
    range; the message lists the known names. ``UnknownNameError`` (also a ``KeyError``) is the
    unknown-name case.
``VerifyError(ModelError)``, ``CheckError(ModelError)``
    the optimized model's outputs differ / a check stage failed (``fastopt.verify.core``,
    ``fastopt.verify.check``); ``OutputRejectedError(VerifyError)``: ONNX Runtime loads or runs the
    original but not the model fastopt produced, a fastopt bug (please report it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, TypeVar, cast

from fastopt import _C

ModelError = _C.ModelError

# Packages whose exceptions are "foreign": their type's module, or the innermost frame of the
# traceback, lies in one of these.
_FOREIGN_ROOTS = ("onnx", "onnxruntime", "google", "onnxruntime_genai")
# Built-in exception types those libraries raise for a model they refuse (protobuf's "Unable to
# parse proto" and onnx's "Invalid tensor data type" are ValueErrors; ORT's are RuntimeErrors).
_REFUSALS = (ValueError, RuntimeError, OverflowError, MemoryError, IndexError)
_MESSAGE_LIMIT = 600


class RejectedModelError(ModelError):
    """onnx, protobuf or ONNX Runtime rejected the model at ``stage``; ``__cause__`` is their
    exception."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        text = " ".join((str(cause) or type(cause).__name__).split())
        if len(text) > _MESSAGE_LIMIT:
            text = text[:_MESSAGE_LIMIT].rstrip() + f"... ({len(text) - _MESSAGE_LIMIT} more)"
        super().__init__(f"{stage}: {type(cause).__name__}: {text}")
        self.stage = stage


class UnsupportedModelError(ModelError, ValueError):
    """A model fastopt reads but this operation cannot handle (also a ValueError)."""


class OptionError(ModelError, ValueError):
    """An unknown pass / preset / option name or a bad option value (also a ValueError)."""


class UnknownNameError(OptionError, KeyError):
    """An unknown pass, preset or option name (also a KeyError); the message lists the known
    ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _root(module: object) -> str:
    return str(module or "").split(".")[0]


def is_foreign(e: BaseException) -> bool:
    """True when `e` is one of the exceptions onnx / protobuf / ORT raise for a model they
    refuse: an exception type of theirs, or a built-in refusal raised inside their code."""
    if isinstance(e, ModelError):
        return False
    if _root(type(e).__module__) in _FOREIGN_ROOTS:
        return True
    if not isinstance(e, _REFUSALS):
        return False
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _root(tb.tb_frame.f_globals.get("__name__")) in _FOREIGN_ROOTS


@contextmanager
def foreign_errors(stage: str) -> Iterator[None]:
    """Around a call into onnx / protobuf / ONNX Runtime: what they raise for a model they
    refuse (their own types, or ValueError / RuntimeError from their C code) becomes a
    :class:`RejectedModelError` naming `stage`. Put it around the foreign call only, so that a
    ValueError of fastopt's own code is not mistaken for one."""
    try:
        yield
    except ModelError:
        raise
    except _REFUSALS as e:
        raise RejectedModelError(stage, e) from e
    except Exception as e:
        if not is_foreign(e):
            raise
        raise RejectedModelError(stage, e) from e


F = TypeVar("F", bound=Callable[..., Any])


def entry_point(stage: str) -> Callable[[F], F]:
    """Decorates a public entry point: a foreign exception that no :func:`foreign_errors`
    converted on its way out (see :func:`is_foreign`) becomes a :class:`RejectedModelError`."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not is_foreign(e):
                    raise
                raise RejectedModelError(stage, e) from e

        return cast(F, wrapper)

    return decorate
