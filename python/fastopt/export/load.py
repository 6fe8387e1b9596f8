"""Reads a Hugging Face checkpoint folder: its config, its kind, its weights.

The kind decides what is exported: a decoder (``*ForCausalLM``: one graph, logits), an encoder
(``*Model`` of bert and its kin: last_hidden_state) or an encoder-decoder (t5, bart, whisper: an
encoder graph and a decoder graph, as optimum splits them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastopt.export.errors import ExportError
from fastopt.export.folder import has_tokenizer

Kind = Literal["decoder", "encoder", "seq2seq"]
DTYPES = ("fp32", "fp16", "bf16")
# The files a checkpoint's weights come in (transformers reads the first it finds).
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_ENCODER_TYPES = {
    "albert",
    "bert",
    "clip_text_model",
    "deberta",
    "deberta-v2",
    "distilbert",
    "electra",
    "modernbert",
    "mpnet",
    "roberta",
    "xlm-roberta",
}
# Mixture-of-experts families whose default experts (grouped_mm) neither exporter takes.
_MOE_TYPES = {"mixtral", "qwen2_moe", "olmoe", "gpt_oss", "qwen3_moe", "deepseek_v3"}


@dataclass
class Checkpoint:
    folder: Path
    config: Any  # transformers.PretrainedConfig
    kind: Kind
    weight_bytes: int  # the weight files' size on disk

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "") or "")


def read_checkpoint(folder: str | os.PathLike[str]) -> Checkpoint:
    """The config of `folder` and its kind; no weights are read yet."""
    import transformers

    path = Path(folder)
    if not path.is_dir():
        raise ExportError(f"{path}: not a folder (fastopt export takes a Hugging Face folder)")
    if not (path / "config.json").is_file():
        raise ExportError(
            f"{path}: no config.json (a Hugging Face checkpoint folder holds config.json and "
            "the weights, as save_pretrained writes them)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as e:
        raise ExportError(
            f"{path}/config.json: transformers {transformers.__version__} cannot read it "
            f"({_one_line(e)})"
        ) from e
    weights = [path / n for n in _WEIGHT_FILES if (path / n).is_file()]
    if not weights:
        raise ExportError(
            f"{path}: no weights ({', '.join(_WEIGHT_FILES[::2])}); save the model with "
            "save_pretrained"
        )
    size = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin"))
    return Checkpoint(path, config, _kind(config), size)


def _kind(config: Any) -> Kind:
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    archs = list(getattr(config, "architectures", None) or [])
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "decoder"
    if archs:
        return "encoder"
    # No architectures recorded: the model type says (bert and its kin also have an LM head
    # class, but a checkpoint of theirs without one is the bare encoder).
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    causal = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    encoder = getattr(config, "model_type", "") in _ENCODER_TYPES
    return "decoder" if causal and not encoder else "encoder"


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def load_model(ckpt: Checkpoint, dtype: str, opset: int) -> Any:
    """The PyTorch model in `dtype`, in eval mode, with the attention the exporters turn into
    graphs fastopt fuses (sdpa where the family has it and the opset allows, else eager)."""
    import transformers

    cls = _model_class(ckpt)
    attn = "sdpa" if getattr(cls, "_supports_sdpa", False) and opset >= 14 else "eager"
    extra: dict[str, Any] = {"attn_implementation": attn}
    if ckpt.model_type in _MOE_TYPES:
        extra["experts_implementation"] = "batched_mm"
    transformers.utils.logging.disable_progress_bar()  # the command shows its own progress
    try:
        model = cls.from_pretrained(str(ckpt.folder), dtype=torch_dtype(dtype), **extra)
    except (ValueError, KeyError, OSError, RuntimeError, TypeError) as e:
        raise ExportError(
            f"{ckpt.folder}: transformers {transformers.__version__} cannot load this "
            f"{ckpt.model_type} checkpoint with {cls.__name__} ({_one_line(e)})"
        ) from e
    return model.eval()


def _model_class(ckpt: Checkpoint) -> Any:
    import transformers

    auto: Any = {
        "decoder": transformers.AutoModelForCausalLM,
        "encoder": transformers.AutoModel,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[ckpt.kind]
    if ckpt.kind == "seq2seq" and ckpt.model_type == "whisper":
        auto = transformers.AutoModelForSpeechSeq2Seq
    try:
        return auto._model_mapping[type(ckpt.config)]
    except KeyError:
        raise ExportError(
            f"{ckpt.folder}: transformers {transformers.__version__} has no {ckpt.kind} model "
            f"for {type(ckpt.config).__name__} (model type {ckpt.model_type!r})"
        ) from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def load_tokenizer(ckpt: Checkpoint, required: bool) -> Any:
    """The checkpoint's tokenizer, None without one; a decoder needs one (onnxruntime-genai
    reads it beside the model) unless `required` is False."""
    if not has_tokenizer(ckpt.folder):
        if required and ckpt.kind == "decoder":
            raise ExportError(
                f"{ckpt.folder}: no tokenizer (tokenizer.json or tokenizer.model); "
                "onnxruntime-genai needs one beside the model: copy the checkpoint's tokenizer "
                "files into the folder, or pass --no-tokenizer (require_tokenizer=False)"
            )
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(ckpt.folder))
    except Exception as e:  # tokenizers and sentencepiece raise their own types
        raise ExportError(
            f"{ckpt.folder}: its tokenizer does not load ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]})"
        ) from e
