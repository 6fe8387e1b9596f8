"""The export's own refusals: each names the folder and what is wrong with it."""

from __future__ import annotations

from fastopt.errors import UnsupportedModelError

EXTRA_HINT = "pip install 'fastopt[export]'"


class ExportError(UnsupportedModelError):
    """The checkpoint folder, its architecture, the exporter or the output folder refused the
    export (the message names which)."""


class MissingExtraError(ExportError):
    """torch or transformers is not installed: the export is an optional extra."""


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
