"""``fastopt check``: checks a model (onnx.checker, strict shape inference, ONNX Runtime load)
and compares its outputs across execution providers or with an original."""

from __future__ import annotations

import argparse
import json
from typing import Any

import fastopt
from fastopt.cli.common import parse_providers
from fastopt.cli.progress import CommandProgress


def _parse_dims(items: list[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            dims[key] = int(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"--dims takes NAME=INTEGER, not {item!r}")
    return dims


def _adds_cache(model: str, original: str) -> bool:
    """Whether MODEL takes past_key_values.* inputs ORIGINAL lacks (a KV-cache rewrite): such a
    pair is compared by greedy generation, not output by output."""
    from fastopt import _C
    from fastopt._io import load

    def pasts(path: str) -> set[str]:
        inputs = load(path).graph.inputs
        return {v.name for v in inputs if v is not None and v.name.startswith(_C.KV_PAST_PREFIX)}

    return bool(pasts(model) - pasts(original))


def _cmd_check(args: argparse.Namespace) -> int:
    from fastopt.verify.check import CheckError, check_providers
    from fastopt.verify.core import VerifyError, compare_providers, verify
    from fastopt.verify.generation import verify_generation

    providers = parse_providers(args.providers)
    if providers:
        check_providers(providers)  # an unavailable provider is bad input, before any work
    dims = _parse_dims(args.dims)
    result: dict[str, object] = {}
    code = 0
    with CommandProgress("check") as progress:
        progress.update("onnx.checker, shape inference, ONNX Runtime load")
        try:
            creport = fastopt.check(args.model, providers=providers[:1] if providers else None)
        except CheckError as e:
            creport, code = e.report, 1
    print(creport)
    result["check"] = creport.to_dict()
    # A checker complaint (e.g. ORT's SimplifiedLayerNormalization in the default domain) does
    # not stop ORT from running the model: compare unless ORT could not load it.
    runs = creport.stage("onnxruntime").status == "ok"
    if runs and (providers or args.against):
        vreport: Any
        try:
            with CommandProgress("check") as progress:
                progress.update("comparing outputs")
                if args.against and _adds_cache(args.model, args.against):
                    # The cached model takes pasts the original lacks: compare generations (CPU).
                    vreport = verify_generation(args.against, args.model)
                elif args.against:
                    vreport = verify(args.against, args.model, dims=dims, providers=providers)
                else:
                    assert providers is not None
                    vreport = compare_providers(args.model, providers, dims=dims)
        except VerifyError as e:
            vreport, code = e.report, 1
        print()
        print(vreport)
        result["verify"] = vreport.to_dict()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return code


def add_parser(sub: Any) -> None:
    chk = sub.add_parser(
        "check",
        help="check a model (onnx.checker, strict shape inference, ONNX Runtime load) and "
        "compare its outputs across execution providers",
    )
    chk.add_argument("model", help=".onnx file to check")
    chk.add_argument(
        "--providers",
        metavar="LIST",
        help="comma-separated execution providers (cpu, cuda, tensorrt, dml, ... or ORT names): "
        "run MODEL on each, compare with the first, and report nodes placed on CPU",
    )
    chk.add_argument(
        "--against",
        metavar="ORIGINAL",
        help="also verify MODEL against ORIGINAL (on every provider with --providers); a MODEL "
        "with a KV cache ORIGINAL lacks is compared by greedy generation on CPU",
    )
    chk.add_argument("--json", metavar="FILE", help="write a JSON report here")
    chk.add_argument(
        "--dims",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=VALUE",
        help="values for symbolic input dims, e.g. --dims batch_size=1 sequence_length=16",
    )
    chk.set_defaults(func=_cmd_check)
