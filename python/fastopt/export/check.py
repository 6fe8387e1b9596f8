"""The export against the PyTorch model, before anything else runs on it: both run on the same
batch (real text through the checkpoint's tokenizer when it has one, at another shape than the
export's example) and their outputs must agree to the dtype's precision.

The PyTorch outputs are computed while the model is loaded, in the export's child process;
ONNX Runtime runs in the parent after it has exited, so the check never holds two copies of the
weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastopt._lazy import lazy_module
from fastopt.export.errors import ExportError
from fastopt.export.exporter import GraphSpec, encoder_feeds, token_feeds
from fastopt.verify.check import run_once_options

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

# Two lines of English prose: the batch is two rows of the same length, cut from these.
TEXT = (
    "The river ran fast and cold after the spring rains, and the old mill by the bridge "
    "turned again for the first time in years while children watched from the bank.",
    "She opened the letter slowly, read the first line twice, and then sat down by the "
    "window to think about what her brother had written from the city.",
)
CHECK_TOKENS = 24
# max |ONNX Runtime - PyTorch| / max |PyTorch| beyond this: the export is wrong.
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 6e-2}


@dataclass
class GraphCheck:
    graph: str
    inputs: str  # what the batch was: "real text (tokenizer)", "random ids (no tokenizer)"
    shape: tuple[int, ...]
    max_abs: float = 0.0
    scale: float = 0.0  # max |PyTorch output|
    top1: float | None = None  # logits: share of positions with the same argmax
    skipped: str = ""

    @property
    def relative(self) -> float:
        return self.max_abs / self.scale if self.scale else self.max_abs

    def describe(self) -> str:
        if self.skipped:
            return f"{self.graph}: skipped ({self.skipped})"
        top1 = f", top-1 agreement {self.top1:.3f}" if self.top1 is not None else ""
        return (
            f"{self.graph}: max |ORT - PyTorch| {self.max_abs:.2e} ({self.relative:.1e} of the "
            f"output's scale {self.scale:.3g}){top1} on {self.inputs} {list(self.shape)}"
        )


def text_ids(tokenizer: Any, vocab: int) -> Any | None:
    """(2, n) token ids of TEXT, or None when the tokenizer does not fit the model."""
    import torch

    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][:CHECK_TOKENS] for t in TEXT]
    n = min(len(r) for r in rows)
    if n < 2 or any(i >= vocab or i < 0 for r in rows for i in r[:n]):
        return None
    return torch.tensor([r[:n] for r in rows], dtype=torch.int64)


def check_feeds(spec: GraphSpec, config: Any, ids: Any, encoder: dict[str, Any]) -> dict[str, Any]:
    """The check batch of one graph: `ids` (text, or seeded ids at another shape than the
    export's); a seq2seq decoder reads the `encoder` graph's batch and result."""
    import torch

    if "input_features" in spec.example:
        return encoder_feeds(config, int(ids.shape[0]), 0, seed=1)  # the decoder reads its batch
    if spec.name == "decoder":
        feeds: dict[str, Any] = {
            "input_ids": ids[:, :7],
            "encoder_hidden_states": encoder["hidden"],
        }
        if "encoder_attention_mask" in spec.example:
            feeds["encoder_attention_mask"] = encoder["attention_mask"]
        return feeds
    feeds = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "position_ids" in spec.example:
        b, n = ids.shape
        feeds["position_ids"] = torch.arange(n).unsqueeze(0).expand(b, n).contiguous()
    return feeds


Expected = tuple[dict[str, Any], str, "np.ndarray"]


def torch_outputs(specs: list[GraphSpec], config: Any, tokenizer: Any) -> list[Expected]:
    """Per graph: (feeds, what they are, PyTorch's output as float32), while the model lives."""
    import torch

    vocab = int(config.vocab_size)
    ids = text_ids(tokenizer, vocab) if tokenizer is not None else None
    what = "real text (tokenizer)" if ids is not None else "random token ids (no tokenizer)"
    if ids is None:
        ids = token_feeds(config, 3, 13, False, seed=1)["input_ids"]
    out = []
    encoder: dict[str, Any] = {}
    for spec in specs:
        feeds = check_feeds(spec, config, ids, encoder)
        with torch.no_grad():
            result = spec.module(*feeds.values())
        if spec.name == "encoder":
            encoder = {"hidden": result, "attention_mask": feeds.get("attention_mask")}
        kind = "random log-mel frames" if "input_features" in feeds else what
        out.append((feeds, kind, result.float().numpy()))
    return out


def _numpy(tensor: Any) -> np.ndarray:
    import torch

    return tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def compare(
    spec_name: str,
    output_name: str,
    path: str,
    feeds: dict[str, Any],
    what: str,
    expected: np.ndarray,
    dtype: str,
) -> GraphCheck:
    """ONNX Runtime on the export against PyTorch's outputs; raises ExportError beyond the
    dtype's tolerance."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    logits = output_name == "logits"
    result = GraphCheck(spec_name, what, tuple(next(iter(feeds.values())).shape))
    np_feeds = {k: v if isinstance(v, np.ndarray) else _numpy(v) for k, v in feeds.items()}
    try:
        # Graph optimizations and MLAS weight prepacking off: either would copy weights (a
        # folded transpose, a packed MatMul B) for one run of the check.
        sess = ort.InferenceSession(path, run_once_options(), providers=["CPUExecutionProvider"])
        got = sess.run(None, np_feeds)[0]
        del sess
    except Exception as e:
        if dtype == "bf16":  # ORT's CPU provider lacks most bfloat16 kernels
            result.skipped = (
                f"ONNX Runtime's CPU provider cannot run this bf16 export: {type(e).__name__}"
            )
            return result
        raise ExportError(
            f"the exported {spec_name} graph does not run in ONNX Runtime: "
            f"{' '.join(str(e).split())[:400]}"
        ) from e
    got = np.asarray(got, dtype=np.float32)
    if got.shape != expected.shape:
        raise ExportError(
            f"the exported {spec_name} graph returns shape {list(got.shape)}, PyTorch "
            f"{list(expected.shape)} (on {what})"
        )
    result.max_abs = float(np.max(np.abs(got - expected))) if got.size else 0.0
    result.scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    if logits:
        result.top1 = float(np.mean(got.argmax(-1) == expected.argmax(-1)))
    if not np.isfinite(result.max_abs) or result.relative > TOLERANCE[dtype]:
        raise ExportError(
            f"the export does not match PyTorch: {result.describe()}, over the {dtype} "
            f"tolerance {TOLERANCE[dtype]:.0e}"
        )
    return result
