"""Hugging Face checkpoint folder -> ONNX -> fastopt's optimize pipeline -> a folder
onnxruntime-genai runs (``fastopt export``). Needs the optional extra ``fastopt[export]``
(torch and transformers); nothing here imports them until an export runs."""

from __future__ import annotations

from fastopt.export.check import GraphCheck
from fastopt.export.errors import ExportError, MissingExtraError
from fastopt.export.pipeline import ExportReport, Staged, export, stage

__all__ = [
    "ExportError",
    "ExportReport",
    "GraphCheck",
    "MissingExtraError",
    "Staged",
    "export",
    "stage",
]
