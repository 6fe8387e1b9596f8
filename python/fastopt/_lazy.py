"""Modules imported on first use, so that ``import fastopt`` stays cheap for the commands that
never need them: numpy took 0.1-0.2 s of every process (half of fastopt's import time,
``python -X importtime -c "import fastopt"``), though quantize, optimize and info never touch it.

    if TYPE_CHECKING:
        import numpy as np
    else:
        np = lazy_module("numpy")
"""

from __future__ import annotations

import importlib
from typing import Any


class _LazyModule:
    """Stands for a module until one of its attributes is read; then imports it."""

    def __init__(self, name: str) -> None:
        self._lazy_name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._lazy_name), attr)
        self.__dict__[attr] = value  # later reads skip __getattr__
        return value

    def __repr__(self) -> str:
        return f"<module {self._lazy_name!r}, imported on first use>"


def lazy_module(name: str) -> Any:
    return _LazyModule(name)
