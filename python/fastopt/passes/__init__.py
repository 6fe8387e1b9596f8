"""Passes written in Python; importing this package registers them."""

from fastopt.passes import convert_version, fold_constants_ort, infer_shapes

__all__ = ["convert_version", "fold_constants_ort", "infer_shapes"]
