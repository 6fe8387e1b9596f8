#!/usr/bin/env python3
"""Generate an LLM-shaped (llama-like) decoder ONNX model with all weights as external data.

The weights are streamed to ``model.onnx.data`` chunk by chunk, so a multi-GB model is written
with a few MB of RAM; ``model.onnx`` only holds the graph and the external-data references.

    python bench/models/make_llm_model.py OUT_DIR               # default: ~4.8 GB fp32
    python bench/models/make_llm_model.py OUT_DIR --tiny --check-ort
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

# numpy dtype used to fill the weights, ONNX enum, bytes per element
_DTYPES: dict[str, tuple[int, int]] = {
    "float32": (TensorProto.FLOAT, 4),
    "float16": (TensorProto.FLOAT16, 2),
    "bfloat16": (TensorProto.BFLOAT16, 2),
}


@dataclass(frozen=True)
class LLMConfig:
    hidden: int = 2048
    layers: int = 16
    vocab: int = 32000
    intermediate: int = 8192
    heads: int = 16
    dtype: str = "float32"
    seed: int = 0
    opset: int = 17
    align: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if min(self.hidden, self.layers, self.vocab, self.intermediate, self.heads) <= 0:
            raise ValueError("sizes must be positive")


TINY = LLMConfig(hidden=64, layers=2, vocab=128, intermediate=128, heads=4)
# ~200 MB fp32: for pytest-benchmark runs
MEDIUM = LLMConfig(hidden=1024, layers=3, vocab=8192, intermediate=2816, heads=16)


def weight_shapes(cfg: LLMConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Name and shape of every weight, in data-file order."""
    h, i = cfg.hidden, cfg.intermediate
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab, h))]
    for layer in range(cfg.layers):
        p = f"model.layers.{layer}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (h, h)),
            (f"{p}.self_attn.v_proj.weight", (h, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (h, i)),
            (f"{p}.mlp.up_proj.weight", (h, i)),
            (f"{p}.mlp.down_proj.weight", (i, h)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (h, cfg.vocab))]
    return shapes


def _aligned(offset: int, align: int) -> int:
    return offset if align <= 1 else -(-offset // align) * align


def model_bytes(cfg: LLMConfig) -> int:
    """Size of the external data file (weights plus alignment padding)."""
    itemsize = _DTYPES[cfg.dtype][1]
    offset = 0
    for _, shape in weight_shapes(cfg):
        offset = _aligned(offset, cfg.align) + int(np.prod(shape)) * itemsize
    return offset


def num_parameters(cfg: LLMConfig) -> int:
    return sum(int(np.prod(shape)) for _, shape in weight_shapes(cfg))


def _random_block(cfg: LLMConfig, nbytes: int) -> bytes:
    """A seeded random block of weights (std 0.02, like LLM init) in the target dtype."""
    rng = np.random.default_rng(cfg.seed)
    n = nbytes // _DTYPES[cfg.dtype][1]
    f32 = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
    if cfg.dtype == "float16":
        return f32.astype(np.float16).tobytes()
    if cfg.dtype == "bfloat16":
        # truncate to the high 16 bits: bf16 without needing ml_dtypes
        return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return f32.tobytes()


def _ones(cfg: LLMConfig, n: int) -> bytes:
    if cfg.dtype == "bfloat16":
        return np.full(n, 0x3F80, dtype=np.uint16).tobytes()
    return np.ones(n, dtype=cfg.dtype).tobytes()


def _write_repeated(f: BinaryIO, block2: memoryview, block_len: int, start: int, n: int) -> None:
    """Write n bytes of the random block, rotated by `start` so tensors differ from each other."""
    while n > 0:
        k = min(n, block_len)
        f.write(block2[start : start + k])
        n -= k


def _external_tensor(
    name: str, data_type: int, shape: tuple[int, ...], offset: int, length: int
) -> TensorProto:
    t = TensorProto()
    t.name = name
    t.data_type = data_type
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key = key
        entry.value = value
    return t


def write_weights(cfg: LLMConfig, data_path: str, block_bytes: int = 8 << 20) -> list[TensorProto]:
    """Stream all weights into data_path; return external-data TensorProtos pointing into it."""
    data_type, itemsize = _DTYPES[cfg.dtype]
    block_bytes -= block_bytes % 4096
    raw = _random_block(cfg, block_bytes)
    block2 = memoryview(raw + raw)  # doubled so every rotation is one contiguous slice
    tensors: list[TensorProto] = []
    offset = 0
    with open(data_path, "wb") as f:
        for index, (name, shape) in enumerate(weight_shapes(cfg)):
            aligned = _aligned(offset, cfg.align)
            if aligned > offset:
                f.write(b"\0" * (aligned - offset))
            length = int(np.prod(shape)) * itemsize
            if len(shape) == 1:  # norm weights: ones, as in a freshly initialised llama
                f.write(_ones(cfg, shape[0]))
            else:
                start = (index * 4099 * itemsize) % block_bytes
                _write_repeated(f, block2, block_bytes, start, length)
            tensors.append(_external_tensor(name, data_type, shape, aligned, length))
            offset = aligned + length
    return tensors


def _const(name: str, dtype: int, values: list[float] | list[int], dims: list[int]) -> TensorProto:
    if dtype == TensorProto.BFLOAT16:
        # make_tensor has no bf16 float path in every onnx version: pass raw bytes
        f32 = np.asarray(values, dtype=np.float32)
        raw = (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        return helper.make_tensor(name, dtype, dims, raw, raw=True)
    return helper.make_tensor(name, dtype, dims, values)


def build_graph(cfg: LLMConfig, weights: list[TensorProto]) -> onnx.ModelProto:
    """The decoder graph (no KV cache, no causal mask): a realistic op mix, not a real LLM."""
    dt = _DTYPES[cfg.dtype][0]
    h, heads = cfg.hidden, cfg.heads
    head_dim = h // heads
    nodes: list[onnx.NodeProto] = []
    consts = [
        _const("const.two", dt, [2.0], []),
        _const("const.eps", dt, [1e-6], []),
        _const("const.attn_scale", dt, [1.0 / float(np.sqrt(head_dim))], []),
        _const("const.shape_bshd", TensorProto.INT64, [0, 0, heads, head_dim], [4]),
        _const("const.shape_bsh", TensorProto.INT64, [0, 0, h], [3]),
    ]

    def node(op: str, inputs: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=f"/{out}/{op}", **attrs))
        return out

    def rms_norm(x: str, weight: str, p: str) -> str:
        sq = node("Pow", [x, "const.two"], f"{p}/pow")
        mean = node("ReduceMean", [sq], f"{p}/mean", axes=[-1], keepdims=1)
        var = node("Add", [mean, "const.eps"], f"{p}/add_eps")
        std = node("Sqrt", [var], f"{p}/sqrt")
        normed = node("Div", [x, std], f"{p}/div")
        return node("Mul", [normed, weight], f"{p}/mul")

    def heads_first(x: str, p: str, perm: list[int]) -> str:
        r = node("Reshape", [x, "const.shape_bshd"], f"{p}/reshape")
        return node("Transpose", [r], f"{p}/transpose", perm=perm)

    x = node("Gather", ["model.embed_tokens.weight", "input_ids"], "embed", axis=0)
    for layer in range(cfg.layers):
        w = f"model.layers.{layer}"
        p = f"layers.{layer}"
        y = rms_norm(x, f"{w}.input_layernorm.weight", f"{p}/input_layernorm")
        q = node("MatMul", [y, f"{w}.self_attn.q_proj.weight"], f"{p}/attn/q_proj")
        k = node("MatMul", [y, f"{w}.self_attn.k_proj.weight"], f"{p}/attn/k_proj")
        v = node("MatMul", [y, f"{w}.self_attn.v_proj.weight"], f"{p}/attn/v_proj")
        qh = heads_first(q, f"{p}/attn/q", [0, 2, 1, 3])  # [B, heads, S, d]
        kh = heads_first(k, f"{p}/attn/k", [0, 2, 3, 1])  # [B, heads, d, S]
        vh = heads_first(v, f"{p}/attn/v", [0, 2, 1, 3])
        scores = node("MatMul", [qh, kh], f"{p}/attn/qk")
        scaled = node("Mul", [scores, "const.attn_scale"], f"{p}/attn/scale")
        probs = node("Softmax", [scaled], f"{p}/attn/softmax", axis=-1)
        ctx = node("MatMul", [probs, vh], f"{p}/attn/pv")
        ctx_t = node("Transpose", [ctx], f"{p}/attn/ctx_transpose", perm=[0, 2, 1, 3])
        ctx_r = node("Reshape", [ctx_t, "const.shape_bsh"], f"{p}/attn/ctx_reshape")
        o = node("MatMul", [ctx_r, f"{w}.self_attn.o_proj.weight"], f"{p}/attn/o_proj")
        x = node("Add", [x, o], f"{p}/attn_residual")
        y = rms_norm(x, f"{w}.post_attention_layernorm.weight", f"{p}/post_attention_layernorm")
        gate = node("MatMul", [y, f"{w}.mlp.gate_proj.weight"], f"{p}/mlp/gate_proj")
        sig = node("Sigmoid", [gate], f"{p}/mlp/sigmoid")
        silu = node("Mul", [gate, sig], f"{p}/mlp/silu")
        up = node("MatMul", [y, f"{w}.mlp.up_proj.weight"], f"{p}/mlp/up_proj")
        act = node("Mul", [silu, up], f"{p}/mlp/act_mul")
        down = node("MatMul", [act, f"{w}.mlp.down_proj.weight"], f"{p}/mlp/down_proj")
        x = node("Add", [x, down], f"{p}/mlp_residual")
    y = rms_norm(x, "model.norm.weight", "norm")
    nodes.append(helper.make_node("MatMul", [y, "lm_head.weight"], ["logits"], name="/lm_head"))

    graph = helper.make_graph(
        nodes,
        "llm_decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", dt, ["batch", "seq", cfg.vocab])],
        initializer=[*weights, *consts],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", cfg.opset)],
        producer_name="fastopt-bench",
        producer_version="1",
    )
    # pin an IR version onnxruntime accepts whatever onnx wrote by default
    model.ir_version = 8
    return model


def make_llm_model(
    out_dir: str | os.PathLike[str],
    hidden: int = LLMConfig.hidden,
    layers: int = LLMConfig.layers,
    vocab: int = LLMConfig.vocab,
    intermediate: int = LLMConfig.intermediate,
    dtype: str = LLMConfig.dtype,
    *,
    heads: int | None = None,
    seed: int = 0,
    opset: int = 17,
    align: int = 64,
    check: bool = True,
) -> str:
    """Write OUT_DIR/model.onnx + OUT_DIR/model.onnx.data; return the model.onnx path.

    heads defaults to hidden // 128 (llama's head size), at least 1.
    """
    if heads is None:
        heads = max(1, hidden // 128) if hidden % 128 == 0 else 1
    cfg = LLMConfig(hidden, layers, vocab, intermediate, heads, dtype, seed, opset, align)
    return make_from_config(cfg, out_dir, check=check)


def make_from_config(cfg: LLMConfig, out_dir: str | os.PathLike[str], *, check: bool = True) -> str:
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    model_path = os.path.join(out, MODEL_FILE)
    weights = write_weights(cfg, os.path.join(out, DATA_FILE))
    model = build_graph(cfg, weights)
    # the graph proto is small (weights are references), so plain serialisation is fine
    with open(model_path, "wb") as f:
        f.write(model.SerializeToString())
    if check:
        onnx.checker.check_model(model_path)  # by path: also validates the external data refs
    return model_path


def run_ort(
    model_path: str, input_ids: np.ndarray | None = None, batch: int = 2, seq: int = 5
) -> np.ndarray:
    """Run the model once in onnxruntime (only sensible for small configs)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    if input_ids is None:
        vocab = sess.get_outputs()[0].shape[-1]
        input_ids = np.random.default_rng(0).integers(0, vocab, (batch, seq), dtype=np.int64)
    (logits,) = sess.run(None, {"input_ids": input_ids})
    return np.asarray(logits)


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out_dir")
    d = LLMConfig()
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--intermediate", type=int, default=d.intermediate)
    ap.add_argument("--heads", type=int, default=None, help="default: hidden // 128")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=d.dtype)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--tiny", action="store_true", help="tiny config for tests (overrides sizes)")
    ap.add_argument("--medium", action="store_true", help="~200 MB config (overrides sizes)")
    ap.add_argument("--no-check", action="store_true", help="skip onnx.checker")
    ap.add_argument("--check-ort", action="store_true", help="run once in onnxruntime")
    ap.add_argument("--dry-run", action="store_true", help="only print the size")
    args = ap.parse_args(argv)

    if args.tiny or args.medium:
        base = TINY if args.tiny else MEDIUM
        cfg = LLMConfig(**{**asdict(base), "dtype": args.dtype, "seed": args.seed})
    else:
        heads = args.heads or (max(1, args.hidden // 128) if args.hidden % 128 == 0 else 1)
        cfg = LLMConfig(
            args.hidden, args.layers, args.vocab, args.intermediate, heads, args.dtype, args.seed
        )
    print(
        f"config: {cfg}\nparameters: {num_parameters(cfg):,}\n"
        f"external data: {model_bytes(cfg):,} bytes ({_fmt_bytes(model_bytes(cfg))})"
    )
    if args.dry_run:
        return 0
    path = make_from_config(cfg, args.out_dir, check=not args.no_check)
    print(f"wrote {path} (+ {DATA_FILE})")
    if args.check_ort:
        logits = run_ort(path)
        print(f"onnxruntime ok: logits {logits.shape}, finite={bool(np.isfinite(logits).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
