"""Quantization settings and the per-weight report records, shared by ``fastopt.quant.quantize`` and
``fastopt.optimize(quantize=...)`` (kept apart from both so neither imports the other).

A mode maps to one C++ pass; the settings reach it as PassContext options (``quant_*``, see
csrc/passes/quant/options.h):

==============  ====================  ==================================================
mode            pass                  what it emits (target ort / target onnx)
==============  ====================  ==================================================
int4, int8      ``quantize_weights``  MatMulNBits / DequantizeLinear(block_size) + MatMul
int8-dynamic    ``quantize_dynamic``  DynamicQuantizeMatMul / DynamicQuantizeLinear +
                                      MatMulInteger (+ ConvInteger)
fp16, bf16      ``convert_precision`` weights and compute in the new type
==============  ====================  ==================================================
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from fastopt import _C
from fastopt.errors import OptionError

Mode = Literal["int4", "int8", "int8-dynamic", "fp16", "bf16"]
MODES: dict[str, str] = {
    "int4": "quantize_weights",
    "int8": "quantize_weights",
    "int8-dynamic": "quantize_dynamic",
    "fp16": "convert_precision",
    "bf16": "convert_precision",
}
WEIGHT_POLICIES = ("keep", "int4", "int8")
# int4/int8 rounding (pass option quant_method, declared by quantize_weights): "search" picks each
# block's scale (and zero point) for the least weighted squared error (csrc/quant/search.cc);
# "rtn" is onnxruntime's round-to-nearest, byte for byte; "gptq" feeds each row's rounding error
# into the rows after it along K (csrc/quant/gptq.h, with calibration's X^T X: needs calibration).
METHODS = ("rtn", "search", "gptq")
# importance="norms": the data-free estimate of fastopt.quant.norm_importance, not a file
NORMS = "norms"
DEFAULT_METHOD = "rtn"
# Opset of the blocked DequantizeLinear (block_size attribute, int4 types).
QDQ_OPSET = 21


def existing_folder(folder: str) -> str:
    """`folder` if it exists, else its nearest existing parent ("" for "")."""
    if not folder:
        return ""
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


@dataclass(frozen=True)
class QuantSettings:
    """What ``fastopt quantize`` / ``--quantize MODE`` asks for; ``options()`` are the pass
    options. Validated again in C++ (csrc/passes/quant/options.h), so a pass run alone is safe
    too."""

    mode: Mode
    block_size: int = 32
    symmetric: bool = True
    method: str | None = None  # None: "search" with calibration (it reads the importance), else rtn
    # path of an importance file ("" for uniform weights), or NORMS: estimated from the weights
    # (fastopt.quant.norm_importance)
    importance: str = ""
    accuracy_level: int | None = None  # None: 4 for fp32 weights; 0 for fp16/bf16 or cuda=1
    exclude: Sequence[str] = ()
    lm_head: str | None = None  # None: as the rest
    embeddings: str = "keep"
    per_channel: bool = False
    keep_io_types: bool = False
    threads: int = 0
    tmpdir: str = ""
    # fp16: keep the ops whose activations reach float16's range float32 (fastopt.quant.fp16_ranges)
    fp16_ranges: bool = True
    # int4/int8 (fastopt.quant.recipe): calibration text (a file or "builtin"), the folder of
    # the model's tokenizer when not beside it, AWQ scaling, the average bits per weight of the
    # int4/int8 mix, and where to keep the importance file
    calibration: str | None = None
    hf_config: str | None = None
    awq: bool = False
    bits_budget: float | None = None
    importance_output: str | None = None
    # the recipe these settings came from (fastopt.quant.recipe.RECIPES): its bits budget is a
    # ceiling for the int8 choices, not a refusal where int4 alone is over it (tiny K)
    recipe: str | None = None

    @property
    def rounding(self) -> str:
        """The int4/int8 rounding method: the one asked, else search where calibration gives the
        importance it weights, else rtn (onnxruntime's bytes)."""
        if self.method is not None:
            return self.method
        return "search" if self.calibration else DEFAULT_METHOD

    @classmethod
    def of(cls, quantize: QuantSettings | str) -> QuantSettings:
        """``quantize`` as settings: a QuantSettings as given, a mode name (what ``--quantize``
        takes) with the default settings; OptionError for an unknown mode, TypeError for
        anything else."""
        if isinstance(quantize, QuantSettings):
            return quantize
        if isinstance(quantize, str):
            settings = cls(mode=cast(Mode, quantize))  # checked by validate()
            settings.validate()
            return settings
        raise TypeError(
            f"quantize must be a mode name ({', '.join(MODES)}) or a QuantSettings, not "
            f"{type(quantize).__name__}"
        )

    @property
    def pass_name(self) -> str:
        return MODES[self.mode]

    def validate(self) -> None:
        """ModelError for a bad setting (before anything is loaded or run)."""
        if self.mode not in MODES:
            raise OptionError(
                f"unknown quantization mode {self.mode!r}; choose one of {', '.join(MODES)}"
            )
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int):
            raise _C.ModelError(f"block size must be an integer, not {bs!r}")
        if not -(2**63) <= bs < 2**63:
            bs = -(2**63)  # C++ reads int64: any value out of it fails the rule
        if problem := _C.quant_block_size_problem(bs):  # the rule: csrc/passes/quant/options.h
            raise _C.ModelError(problem)
        if self.method is not None and self.method not in METHODS:
            raise _C.ModelError(
                f"method must be {', '.join(METHODS[:-1])} or {METHODS[-1]}, not {self.method!r}"
            )
        if self.method == "gptq" and self.mode != "int4":
            raise _C.ModelError(f"method gptq rounds int4 weights, not {self.mode}")
        if self.method == "gptq" and not self.calibration:
            raise _C.ModelError(
                "method gptq needs calibration (--calibration FILE|builtin|sampled): it reads each "
                "weight's input statistics X^T X"
            )
        if self.importance and self.mode not in ("int4", "int8"):
            raise _C.ModelError(f"importance applies to int4/int8, not to {self.mode}")
        # (norms with rtn: a recipe's default that --method rtn overrides; nothing to weight)
        if self.importance and self.importance != NORMS and self.rounding not in ("search", "gptq"):
            raise _C.ModelError("importance weights the search: it needs method search")
        if self.importance and self.importance != NORMS and not os.path.isfile(self.importance):
            raise _C.ModelError(f"importance file {self.importance!r} does not exist")
        if self.accuracy_level is not None and self.accuracy_level not in range(5):
            raise _C.ModelError(
                "accuracy level must be 0 (unset), 1 (fp32), 2 (fp16), 3 (bf16) or 4 (int8), "
                f"not {self.accuracy_level!r}"
            )
        if self.lm_head is not None and self.lm_head not in WEIGHT_POLICIES:
            raise _C.ModelError(f"lm_head must be keep, int4 or int8, not {self.lm_head!r}")
        if self.embeddings not in WEIGHT_POLICIES:
            raise _C.ModelError(f"embeddings must be keep, int4 or int8, not {self.embeddings!r}")
        if self.embeddings != "keep" and self.mode not in ("int4", "int8"):
            raise _C.ModelError(
                f"embeddings {self.embeddings} applies to weight-only int4/int8 "
                f"(GatherBlockQuantized), not to {self.mode}"
            )
        if self.per_channel and self.mode != "int8-dynamic":
            raise _C.ModelError(
                "per_channel applies to int8-dynamic; int4/int8 weights are blockwise (choose "
                "the block size)"
            )
        if self.keep_io_types and self.mode not in ("fp16", "bf16"):
            raise _C.ModelError("keep_io_types applies to fp16 and bf16")
        if not 0 <= self.threads <= 4096:  # csrc/passes/quant/options.cc's bound (and int64's)
            raise _C.ModelError(f"threads must be 0 (all cores) up to 4096, not {self.threads}")
        self._validate_recipe()
        for g in self.exclude:
            if not g or "," in g:
                raise _C.ModelError(f"exclude patterns must be non-empty, without ',': {g!r}")

    def _validate_calibration(self, weight_only: bool) -> None:
        """Calibration weights int4/int8 and measures fp16's ranges (fastopt.quant.fp16_ranges);
        bf16 keeps float32's exponent range, so there is nothing for it to decide there."""
        if self.calibration is None:
            return
        if not weight_only and self.mode != "fp16":
            raise _C.ModelError(
                f"calibration applies to int4/int8 (importance) and fp16 (ranges), not to "
                f"{self.mode}"
                + (
                    ": bf16 has float32's range, no activation overflows it"
                    if self.mode == "bf16"
                    else ""
                )
            )
        if self.mode == "fp16" and not self.fp16_ranges:
            raise _C.ModelError(
                "calibration with fp16 measures the ranges: it needs the range check "
                "(fp16_ranges on)"
            )
        if self.mode == "fp16" and self.importance_output is not None:
            raise _C.ModelError("importance_output applies to int4/int8, not to fp16")

    def _validate_recipe(self) -> None:
        weight_only = self.mode in ("int4", "int8")
        for name, given in (
            ("awq", self.awq),
            ("bits_budget", self.bits_budget is not None),
        ):
            if given and not weight_only:
                raise _C.ModelError(f"{name} applies to weight-only int4/int8, not to {self.mode}")
        self._validate_calibration(weight_only)
        if self.calibration not in (None, "builtin", "sampled") and not os.path.isfile(
            self.calibration
        ):
            raise _C.ModelError(
                f"calibration: no file {self.calibration!r} (give a text file, 'builtin' or "
                "'sampled')"
            )
        if self.awq and not self.calibration:
            raise _C.ModelError("awq needs calibration (--calibration FILE|builtin|sampled)")
        if self.hf_config is not None and not os.path.isdir(self.hf_config):
            raise _C.ModelError(f"hf_config: {self.hf_config!r} is not a folder")
        if self.bits_budget is not None:
            b = self.bits_budget
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 4 <= b <= 16:
                raise _C.ModelError(
                    f"bits budget must be a number of bits per weight from 4 to 16, not {b!r}"
                )
            if self.mode != "int4":
                raise _C.ModelError("bits_budget mixes int4 and int8: use it with mode int4")
        if (self.importance_output is not None) and not (
            self.calibration or self.importance == NORMS
        ):
            raise _C.ModelError("importance_output needs calibration (or importance norms)")
        if self.recipe is not None:
            from fastopt.quant.recipe import recipe_settings

            recipe_settings(self.recipe)  # ModelError naming the recipes

    def options(self) -> dict[str, object]:
        o: dict[str, object] = {
            "quant_mode": self.mode,
            "quant_block_size": self.block_size,
            "quant_symmetric": int(self.symmetric),
            "quant_exclude": ",".join(self.exclude),
            "quant_lm_head": self.lm_head or "",
            "quant_embeddings": self.embeddings,
            "quant_per_channel": int(self.per_channel),
            "quant_keep_io_types": int(self.keep_io_types),
            "quant_threads": self.threads,
            # A folder that does not exist yet (the save makes it): its nearest existing
            # parent, on the same filesystem, so the save can still link the file in.
            "quant_tmpdir": existing_folder(self.tmpdir),
        }
        if self.mode in ("int4", "int8"):
            o["quant_bits"] = 4 if self.mode == "int4" else 8
            o["quant_method"] = METHODS.index(self.rounding)
            if self.importance and self.importance != NORMS:  # (norms: the recipe step's file)
                o["quant_importance"] = os.path.abspath(self.importance)
        if self.accuracy_level is not None:
            o["quant_accuracy_level"] = self.accuracy_level
        return o


@dataclass
class WeightQuantization:
    """One weight: quantized or kept (and why), bytes, reconstruction error relative to the
    weight's scale (max |w - w'| / max |w|, mean |w - w'| / mean |w|) and the relative weighted
    mean squared error (sum imp (w - w')^2 / sum imp w^2; imp = 1 without an importance file)."""

    weight: str
    node: str
    op: str
    action: Literal["quantized", "kept"]
    reason: str
    dtype_before: str
    dtype_after: str
    bytes_before: int
    bytes_after: int
    max_rel_error: float
    mean_rel_error: float
    rel_mse: float = 0.0

    @classmethod
    def from_record(cls, r: _C.QuantRecord) -> WeightQuantization:
        return cls(
            weight=r.weight,
            node=r.node,
            op=r.op,
            action="quantized" if r.quantized else "kept",
            reason=r.reason,
            dtype_before=r.dtype_before,
            dtype_after=r.dtype_after,
            bytes_before=int(r.bytes_before),
            bytes_after=int(r.bytes_after),
            max_rel_error=float(r.max_rel_error),
            mean_rel_error=float(r.mean_rel_error),
            rel_mse=float(r.rel_mse),
        )


@dataclass
class QuantSummary:
    quantized: int = 0
    kept: int = 0
    bytes_before: int = 0  # of the weights looked at
    bytes_after: int = 0
    kept_reasons: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, weights: Sequence[WeightQuantization]) -> QuantSummary:
        s = cls()
        for w in weights:
            s.bytes_before += w.bytes_before
            s.bytes_after += w.bytes_after
            if w.action == "quantized":
                s.quantized += 1
            else:
                s.kept += 1
                # Reasons name globs or ranks; group by their first words.
                key = w.reason.split(" (")[0].split(" '")[0]
                s.kept_reasons[key] = s.kept_reasons.get(key, 0) + 1
        return s

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
