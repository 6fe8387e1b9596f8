"""The export's own refusals: each names the folder and what is wrong with it."""

from __future__ import annotations

from fastopt.errors import UnsupportedModelError

EXTRA_HINT = "pip install 'fastopt[export]'"


class ExportError(UnsupportedModelError):
    """The checkpoint folder, its architecture, the exporter or the output folder refused the
    export (the message names which)."""


class MissingExtraError(ExportError):
    """torch or transformers is not installed: the export is an optional extra."""


def one_line(e: BaseException, limit: int = 400) -> str:
    """A foreign exception on one line, "Type: message", its message cut at `limit`."""
    text = " ".join(str(e).split())
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: " + (text if len(text) <= limit else text[:limit] + "...")


def require_extra() -> None:
    """torch and transformers, or one line saying what to install."""
    missing = []
    for module in ("torch", "transformers"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingExtraError(
            f"fastopt export needs {' and '.join(missing)}, which are not installed: {EXTRA_HINT}"
        )
