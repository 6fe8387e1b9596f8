"""The mutation kinds: small semantic edits of a real export, each a named function
``kind(e: Edit, rng) -> str | None`` that edits the model in place and returns what it did (the
site, for the report), or None where the export has no site for it.

A mutant is a model ONNX Runtime runs (the runner checks; one it refuses is "invalid", not a
finding) whose meaning differs from the export's, or is the same written another way. fastopt
must refuse it with a reason or optimize it into a model that computes the mutant's outputs.
Kinds are grouped by what they aim at (``TAGS``): fusions' constants and forms, masks, KV-cache
proofs (sequence-mixing ops, an attention left unfused), folding semantics (probes: a new graph
output computed by the integer ops whose folding must match ONNX Runtime), opsets, dtypes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, version_converter

from .graph_edit import INT64_MAX, INT64_MIN, Edit

Mutation = Callable[[Edit, np.random.Generator], "str | None"]
MUTATIONS: dict[str, Mutation] = {}
TAGS: dict[str, str] = {}


def mutation(tag: str) -> Callable[[Mutation], Mutation]:
    def register(fn: Mutation) -> Mutation:
        MUTATIONS[fn.__name__] = fn
        TAGS[fn.__name__] = tag
        return fn

    return register


def apply(model: onnx.ModelProto, kind: str, seed: int) -> str | None:
    """Mutates `model` in place by `kind`, sites drawn from `seed`; what was done, or None."""
    e = Edit(model)
    what = MUTATIONS[kind](e, np.random.default_rng(seed))
    if what is not None:
        e.finish()
    return what


# --- sites shared by several kinds -----------------------------------------------------------


def _pick(rng: np.random.Generator, items: list) -> object:  # type: ignore[type-arg]
    return items[int(rng.integers(len(items)))] if items else None


def _embedding(e: Edit) -> str | None:
    """The token embedding's output (B, S, D): Gather(table, input_ids), the ids maybe
    reshaped or cast on the way."""
    for n in e.nodes("Gather"):
        table = e.inits.get(n.input[0])
        if table is None or len(table.dims) != 2:
            continue
        if n.input[1] == "input_ids" or any(
            "input_ids" in p.input for p in e.upstream(n.input[1], 2)
        ):
            return str(n.output[0])
    return None


def _scalar(c: np.ndarray | None) -> float:
    assert c is not None
    return float(c.reshape(-1)[0])


def _splice(e: Edit, value: str, make: Callable[[str], str]) -> str:
    """Inserts make(value) between `value` and its consumers."""
    start = len(e.graph.node)
    new = make(value)
    e.rewire(value, new, keep=e.outputs_since(start))
    return new


def _residual_mix(e: Edit, make: Callable[[str], str], scale: float) -> str | None:
    """h' = h + scale * make(h) on the embedding output: an op that mixes positions before the
    first layer (what a KV cache must carry or refuse)."""
    h = _embedding(e)
    if h is None:
        return None
    dt = e.input_dtype()

    def mixed(v: str) -> str:
        m = e.add_node("Mul", [make(v), e.add_const(np.array(scale, dt))])
        return e.add_node("Add", [v, m])

    _splice(e, h, mixed)
    return f"on {h}"


def _softmaxes(e: Edit) -> list[onnx.NodeProto]:
    """The attention softmaxes (scores of rank >= 3 behind a MatMul within a few steps)."""
    out = []
    for s in e.nodes("Softmax"):
        if any(p.op_type == "MatMul" for p in e.upstream(s.input[0], 7)):
            out.append(s)
    return out


def _mask_fill(e: Edit) -> list[onnx.NodeProto]:
    """Where(cond, 0, very negative) nodes: additive attention masks."""
    out = []
    for n in e.nodes("Where"):
        c = e.const(n.input[2]) if len(n.input) == 3 else None
        if c is not None and c.size == 1 and c.dtype.kind == "f" and _scalar(c) < -1e4:
            out.append(n)
    return out


def _scalar_operand(e: Edit, n: onnx.NodeProto) -> int | None:
    """Index of a scalar float constant input of `n`, or None."""
    for i, v in enumerate(n.input):
        c = e.const(v)
        if c is not None and c.size == 1 and c.dtype.kind == "f":
            return i
    return None


# --- constants ------------------------------------------------------------------------------


@mutation("fusion")
def attention_scale(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's score scale (a Mul/Div by a scalar on Q, K or the scores) times 1.25."""
    sites = []
    for s in _softmaxes(e):
        for p in e.upstream(s.input[0], 7):
            if p.op_type in ("Mul", "Div") and _scalar_operand(e, p) is not None:
                sites.append(p)
    n = _pick(rng, sites)
    if not isinstance(n, onnx.NodeProto):
        return None
    i = _scalar_operand(e, n)
    assert i is not None
    c = e.const(n.input[i])
    assert c is not None
    e.set_input_const(n, i, (c * 1.25).astype(c.dtype))
    return f"{n.op_type} {n.name}: {_scalar(c)} -> {_scalar(c) * 1.25}"


@mutation("fusion")
def norm_epsilon(e: Edit, rng: np.random.Generator) -> str | None:
    """One norm's epsilon times 1000 (Add(ReduceMean(x^2), eps) or LayerNormalization's)."""
    sites: list[onnx.NodeProto] = []
    for n in e.nodes("Add"):
        p = e.producer(n.input[0])
        if p is not None and p.op_type == "ReduceMean" and _scalar_operand(e, n) == 1:
            sites.append(n)
    sites += e.nodes("LayerNormalization")
    n = _pick(rng, sites)
    if not isinstance(n, onnx.NodeProto):
        return None
    if n.op_type == "LayerNormalization":
        eps = float(e.attr(n, "epsilon", 1e-5))  # type: ignore[arg-type]
        e.set_attr(n, "epsilon", eps * 1000)
        return f"LayerNormalization {n.name} epsilon {eps} -> {eps * 1000}"
    c = e.const(n.input[1])
    assert c is not None
    e.set_input_const(n, 1, (c * 1000).astype(c.dtype))
    return f"{n.name}: eps {_scalar(c)} -> {_scalar(c) * 1000}"


@mutation("fusion")
def rotary_frequencies(e: Edit, rng: np.random.Generator) -> str | None:
    """The rotary inverse frequencies (a small float constant behind Cos) times 1.1."""
    for cos in e.nodes("Cos"):
        for p in e.upstream(cos.input[0], 5):
            for i, v in enumerate(p.input):
                c = e.const(v)
                if c is not None and c.dtype.kind == "f" and 1 < c.size <= 512:
                    e.set_input_const(p, i, (c * 1.1).astype(c.dtype))
                    return f"{p.op_type} {p.name} input {i} ({c.size} values) x 1.1"
    return None


@mutation("fusion")
def gelu_constant(e: Edit, rng: np.random.Generator) -> str | None:
    """The tanh-GELU's 0.044715 (Mul after Pow(x, 3)) becomes 0.05."""
    for p in e.nodes("Pow"):
        c = e.const(p.input[1])
        if c is None or c.size != 1 or _scalar(c) != 3.0:
            continue
        for m in e.consumers(p.output[0]):
            i = _scalar_operand(e, m) if m.op_type == "Mul" else None
            if i is not None:
                e.set_input_const(m, i, np.array(0.05, e.const(m.input[i]).dtype))  # type: ignore[union-attr]
                return f"{m.name}: 0.044715 -> 0.05"
    return None


@mutation("fusion")
def silu_beta(e: Edit, rng: np.random.Generator) -> str | None:
    """One SiLU becomes swish-beta: x * sigmoid(1.5 x)."""
    sites = [
        s
        for s in e.nodes("Sigmoid")
        if any(s.input[0] in m.input for m in e.consumers(s.output[0]))
    ]
    s = _pick(rng, sites)
    if not isinstance(s, onnx.NodeProto):
        return None
    x = s.input[0]
    s.input[0] = e.add_node("Mul", [x, e.add_const(np.array(1.5, e.input_dtype()))])
    return f"Sigmoid {s.name} reads 1.5 x"


@mutation("fusion")
def activation_swap(e: Edit, rng: np.random.Generator) -> str | None:
    """One Sigmoid becomes HardSigmoid (x * hardsigmoid(x) is no SiLU)."""
    s = _pick(rng, e.nodes("Sigmoid"))
    if not isinstance(s, onnx.NodeProto):
        return None
    s.op_type = "HardSigmoid"
    return f"{s.name}: Sigmoid -> HardSigmoid"


@mutation("fusion")
def gelu_approximation(e: Edit, rng: np.random.Generator) -> str | None:
    """A Gelu op's approximate flips between 'none' and 'tanh'."""
    g = _pick(rng, e.nodes("Gelu"))
    if not isinstance(g, onnx.NodeProto):
        return None
    old = e.attr(g, "approximate", b"none")
    new = "none" if old in (b"tanh", "tanh") else "tanh"
    e.set_attr(g, "approximate", new)
    return f"{g.name}: approximate {old!r} -> {new}"


@mutation("fusion")
def embedding_scale(e: Edit, rng: np.random.Generator) -> str | None:
    """The embeddings scaled by sqrt(hidden) (gemma's normalizer) where the export has none."""
    return _residual_mix(e, lambda v: v, 7.0)


# --- softmax and attention forms -----------------------------------------------------------


@mutation("attention")
def scale_after_softmax(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's probabilities scaled by 0.9 after the softmax (no attention any more)."""
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto):
        return None
    dt = e.input_dtype()
    _splice(e, s.output[0], lambda v: e.add_node("Mul", [v, e.add_const(np.array(0.9, dt))]))
    return f"after {s.name}"


@mutation("attention")
def scores_extra_scale(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's scores times 1.3 before the mask is added (a different softmax scale)."""
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto):
        return None
    dt = e.input_dtype()
    x = s.input[0]
    p = e.producer(x)
    if p is not None and p.op_type == "Add":  # scale the scores, not the mask
        p.input[0] = e.add_node("Mul", [p.input[0], e.add_const(np.array(1.3, dt))])
        return f"Add {p.name} input 0 x 1.3"
    s.input[0] = e.add_node("Mul", [x, e.add_const(np.array(1.3, dt))])
    return f"{s.name} input x 1.3"


@mutation("attention")
def softmax_axis(e: Edit, rng: np.random.Generator) -> str | None:
    """One attention softmax over the queries (axis -2) instead of the keys."""
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto):
        return None
    e.set_attr(s, "axis", -2)
    return f"{s.name}: axis -2"


@mutation("attention")
def softmax_manual(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's Softmax written out: Exp(x - ReduceMax(x)) / ReduceSum (an attention the
    fusion may not recognise: the KV rewrite must then refuse)."""
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto) or e.opset < 18:
        return None
    x = s.input[0]
    axes = e.add_const(np.array([-1], np.int64))
    mx = e.add_node("ReduceMax", [x, axes], keepdims=1)
    ex = e.add_node("Exp", [e.add_node("Sub", [x, mx])])
    out = e.add_node("Div", [ex, e.add_node("ReduceSum", [ex, axes], keepdims=1)])
    e.rewire(s.output[0], out)
    return f"{s.name} written out"


@mutation("attention")
def softmax_in_double(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's softmax computed in float64 (Cast around it)."""
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto):
        return None
    et = int(onnx.helper.np_dtype_to_tensor_dtype(e.input_dtype()))
    s.input[0] = e.add_node("Cast", [s.input[0]], to=TensorProto.DOUBLE)
    _splice(e, s.output[0], lambda v: e.add_node("Cast", [v], to=et))
    return f"{s.name} in double"


@mutation("dtype")
def scores_fp16_island(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's scores cast to float16 and back before the softmax (precision that a
    fusion must not drop)."""
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto) or e.input_dtype() != np.float32:
        return None
    half = e.add_node("Cast", [s.input[0]], to=TensorProto.FLOAT16)
    s.input[0] = e.add_node("Cast", [half], to=TensorProto.FLOAT)
    return f"{s.name} input through float16"


@mutation("attention")
def repeat_kv_grouping(e: Edit, rng: np.random.Generator) -> str | None:
    """One layer's repeat_kv groups heads the other way (kv head h % Hkv instead of
    h // n_rep): Unsqueeze at axis 1 instead of 2, the Expand target's two axes swapped."""
    pairs = []
    for u in e.nodes("Unsqueeze"):
        axes = e.const(u.input[1]) if len(u.input) > 1 else None
        if axes is None or list(axes.reshape(-1)) != [2]:
            continue
        ex = e.consumers(u.output[0])
        if len(ex) != 1 or ex[0].op_type != "Expand":
            continue
        target = e.producer(ex[0].input[1])
        if target is None or target.op_type != "Concat" or len(target.input) != 5:
            continue
        pairs.append((u, ex[0], target))
    if len(pairs) < 2:
        return None
    layer = int(rng.integers(len(pairs) // 2))
    done = []
    for u, ex, target in pairs[2 * layer : 2 * layer + 2]:
        e.set_input_const(u, 1, np.array([1], np.int64))
        ins = list(target.input)
        ins[1], ins[2] = ins[2], ins[1]
        ex.input[1] = e.add_node("Concat", ins, axis=0)
        done.append(u.name)
    return f"layer {layer}: {done}"


@mutation("attention")
def softcap_other_constant(e: Edit, rng: np.random.Generator) -> str | None:
    """One soft-cap c * tanh(s / c) with another c (0.5 c, both places)."""
    sites = _softcaps(e)
    site = _pick(rng, sites)
    if site is None:
        return None
    div, mul = site  # type: ignore[misc]
    for n in (div, mul):
        i = _scalar_operand(e, n)
        c = e.const(n.input[i])  # type: ignore[index]
        e.set_input_const(n, i, (c * 0.5).astype(c.dtype))  # type: ignore[arg-type, union-attr]
    return f"softcap at {div.name}: c x 0.5"


@mutation("attention")
def softcap_mismatch(e: Edit, rng: np.random.Generator) -> str | None:
    """One soft-cap's outer constant differs from the inner one: 2c * tanh(s / c)."""
    site = _pick(rng, _softcaps(e))
    if site is None:
        return None
    _, mul = site  # type: ignore[misc]
    i = _scalar_operand(e, mul)
    c = e.const(mul.input[i])  # type: ignore[index]
    e.set_input_const(mul, i, (c * 2).astype(c.dtype))  # type: ignore[arg-type, union-attr]
    return f"softcap outer constant at {mul.name} x 2"


def _softcaps(e: Edit) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    out = []
    for t in e.nodes("Tanh"):
        d = e.producer(t.input[0])
        ms = e.consumers(t.output[0])
        if d is None or d.op_type not in ("Div", "Mul") or _scalar_operand(e, d) is None:
            continue
        if len(ms) == 1 and ms[0].op_type == "Mul" and _scalar_operand(e, ms[0]) is not None:
            out.append((d, ms[0]))
    return out


# --- masks ----------------------------------------------------------------------------------


@mutation("mask")
def mask_soft_fill(e: Edit, rng: np.random.Generator) -> str | None:
    """The additive mask's fill value -5 instead of the dtype's lowest (masked keys keep some
    weight)."""
    sites = _mask_fill(e)
    if not sites:
        return None
    for w in sites:
        c = e.const(w.input[2])
        e.set_input_const(w, 2, np.array(-5.0, c.dtype))  # type: ignore[union-attr]
    return f"{len(sites)} Where fills -> -5"


@mutation("mask")
def mask_flip_causal(e: Edit, rng: np.random.Generator) -> str | None:
    """The causal comparison's operands swapped: each query sees the keys after it."""
    n = next(iter(e.nodes("LessOrEqual") + e.nodes("GreaterOrEqual")), None)
    if n is None:
        return None
    n.input[0], n.input[1] = n.input[1], n.input[0]
    return f"{n.op_type} {n.name} operands swapped"


@mutation("mask")
def mask_strict_causal(e: Edit, rng: np.random.Generator) -> str | None:
    """The causal comparison strict (LessOrEqual -> Less): a query no longer sees itself."""
    n = next(iter(e.nodes("LessOrEqual")), None)
    if n is None:
        return None
    n.op_type = "Less"
    return f"{n.name}: LessOrEqual -> Less"


@mutation("mask")
def mask_ignore_padding(e: Edit, rng: np.random.Generator) -> str | None:
    """Every read of attention_mask reads ones of its shape (padding ignored)."""
    if not any(i.name == "attention_mask" for i in e.graph.input):
        return None
    ones = e.add_node(
        "Add",
        [
            e.add_node("Mul", ["attention_mask", e.add_const(np.array(0, np.int64))]),
            e.add_const(np.array(1, np.int64)),
        ],
    )
    start = len(e.graph.node)
    e.rewire("attention_mask", ones, keep=e.outputs_since(start - 2))
    return "attention_mask -> ones"


# --- sequence mixing outside attention (the KV rewrite must carry or refuse it) -------------


@mutation("mixing")
def cumsum_over_sequence(e: Edit, rng: np.random.Generator) -> str | None:
    """h + 0.1 * CumSum(h, axis=1) after the embedding: a running sum over positions."""
    axis = e.add_const(np.array(1, np.int64))
    return _residual_mix(e, lambda v: e.add_node("CumSum", [v, axis]), 0.1)


@mutation("mixing")
def token_shift(e: Edit, rng: np.random.Generator) -> str | None:
    """h + 0.5 * shift(h): each position reads the previous one's hidden state (RWKV)."""

    def shift(v: str) -> str:
        prev = e.add_node(
            "Slice",
            [
                v,
                e.add_const(np.array([0], np.int64)),
                e.add_const(np.array([-1], np.int64)),
                e.add_const(np.array([1], np.int64)),
            ],
        )
        return e.add_node("Pad", [prev, e.add_const(np.array([0, 1, 0, 0, 0, 0], np.int64))])

    return _residual_mix(e, shift, 0.5)


@mutation("mixing")
def sequence_conv(e: Edit, rng: np.random.Generator) -> str | None:
    """h + causal depthwise Conv over the sequence (kernel 3): LFM2's short convolutions."""
    h = _embedding(e)
    table = e.inits.get(e.producer(h).input[0]) if h else None  # type: ignore[union-attr]
    if h is None or table is None or e.input_dtype() != np.float32:
        return None
    width = int(table.dims[1])
    w = (rng.standard_normal((width, 1, 3)) * 0.3).astype(np.float32)

    def conv(v: str) -> str:
        t = e.add_node("Transpose", [v], perm=[0, 2, 1])
        c = e.add_node("Conv", [t, e.add_const(w)], group=width, pads=[2, 0], kernel_shape=[3])
        return e.add_node("Transpose", [c], perm=[0, 2, 1])

    return _residual_mix(e, conv, 1.0)


@mutation("mixing")
def sequence_mean(e: Edit, rng: np.random.Generator) -> str | None:
    """h + mean of h over the sequence (a layer that sees every position)."""

    def mean(v: str) -> str:
        if e.opset >= 18:
            return e.add_node("ReduceMean", [v, e.add_const(np.array([1], np.int64))], keepdims=1)
        return e.add_node("ReduceMean", [v], axes=[1], keepdims=1)

    return _residual_mix(e, mean, 1.0)


@mutation("mixing")
def norm_over_sequence(e: Edit, rng: np.random.Generator) -> str | None:
    """One RMSNorm's ReduceMean over axis 1 (the sequence) instead of the hidden axis."""
    sites = []
    for r in e.nodes("ReduceMean"):
        p = e.producer(r.input[0])
        if p is not None and p.op_type == "Pow":
            sites.append(r)
    r = _pick(rng, sites)
    if not isinstance(r, onnx.NodeProto):
        return None
    if len(r.input) > 1 and r.input[1]:
        e.set_input_const(r, 1, np.array([1], np.int64))
    else:
        e.set_attr(r, "axes", [1])
    return f"{r.name}: axes [1]"


# --- rotary forms ---------------------------------------------------------------------------


def _rotate_half(e: Edit) -> list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]:
    """(Concat, Slice x1, Slice x2) of each rotate_half: Concat(Neg(Slice x2), Slice x1)."""
    out = []
    for c in e.nodes("Concat"):
        if len(c.input) != 2:
            continue
        neg, x1 = e.producer(c.input[0]), e.producer(c.input[1])
        x2 = e.producer(neg.input[0]) if neg is not None and neg.op_type == "Neg" else None
        if x1 is not None and x2 is not None and x1.op_type == x2.op_type == "Slice":
            out.append((c, x1, x2))
    return out


@mutation("rotary")
def rotary_swap_halves(e: Edit, rng: np.random.Generator) -> str | None:
    """One rotate_half's Concat operands swapped: Concat(x1, -x2) (no rotation any more)."""
    site = _pick(rng, _rotate_half(e))
    if site is None:
        return None
    c = site[0]  # type: ignore[index]
    c.input[0], c.input[1] = c.input[1], c.input[0]
    return f"{c.name} operands swapped"


@mutation("rotary")
def rotary_interleaved_slices(e: Edit, rng: np.random.Generator) -> str | None:
    """One rotate_half's halves taken interleaved: x[..., 0::2] and x[..., 1::2]."""
    site = _pick(rng, _rotate_half(e))
    if site is None:
        return None
    _, x1, x2 = site  # type: ignore[misc]
    for n, start in ((x1, 0), (x2, 1)):
        axes = e.const(n.input[3]) if len(n.input) > 3 and n.input[3] else np.array([-1])
        e.set_input_const(n, 1, np.array([start], np.int64))
        e.set_input_const(n, 2, np.array([INT64_MAX], np.int64))
        e.set_input_const(n, 3, np.asarray(axes, np.int64).reshape(1))
        e.set_input_const(n, 4, np.array([2], np.int64))
    return f"{x1.name}, {x2.name}: step 2"


@mutation("slice")
def slice_end_finite(e: Edit, rng: np.random.Generator) -> str | None:
    """Every Slice end of INT64_MAX becomes 2^31 + 7 (the same slice, a different constant)."""
    count = 0
    for n in e.nodes("Slice"):
        if len(n.input) < 3:
            continue
        end = e.const(n.input[2])
        if end is not None and end.size == 1 and int(end.reshape(-1)[0]) == INT64_MAX:
            e.set_input_const(n, 2, np.array([2**31 + 7], np.int64))
            count += 1
    return f"{count} Slice ends" if count else None


@mutation("slice")
def slice_reversed_half(e: Edit, rng: np.random.Generator) -> str | None:
    """One rotate_half's second half read backwards (step -1 from the last element)."""
    site = _pick(rng, _rotate_half(e))
    if site is None:
        return None
    x2 = site[2]  # type: ignore[index]
    half = e.const(x2.input[1])
    axes = e.const(x2.input[3]) if len(x2.input) > 3 and x2.input[3] else np.array([-1])
    if half is None:
        return None
    h = int(half.reshape(-1)[0])
    e.set_input_const(x2, 1, np.array([-1], np.int64))
    e.set_input_const(x2, 2, np.array([-h - 1], np.int64))
    e.set_input_const(x2, 3, np.asarray(axes, np.int64).reshape(1))
    e.set_input_const(x2, 4, np.array([-1], np.int64))
    return f"{x2.name}: [-1:-{h + 1}:-1]"


@mutation("fusion")
def position_offset(e: Edit, rng: np.random.Generator) -> str | None:
    """position_ids + 3 for every reader (positions that the cache must not recompute)."""
    if not any(i.name == "position_ids" for i in e.graph.input):
        return None
    start = len(e.graph.node)
    shifted = e.add_node("Add", ["position_ids", e.add_const(np.array(3, np.int64))])
    e.rewire("position_ids", shifted, keep=e.outputs_since(start))
    return "position_ids + 3"


# --- order of operands, cast chains, dtype ---------------------------------------------------


@mutation("order")
def swap_commutative(e: Edit, rng: np.random.Generator) -> str | None:
    """Every Add and Mul with two inputs has them swapped (the same model)."""
    count = 0
    for n in e.graph.node:
        if n.op_type in ("Add", "Mul") and len(n.input) == 2:
            n.input[0], n.input[1] = n.input[1], n.input[0]
            count += 1
    return f"{count} nodes" if count else None


@mutation("cast")
def cast_chain_int(e: Edit, rng: np.random.Generator) -> str | None:
    """The embeddings quantized through int32: Cast(Cast(h * 64, int32), float) / 64."""
    dt = e.input_dtype()
    et = int(onnx.helper.np_dtype_to_tensor_dtype(dt))

    def chain(v: str) -> str:
        scaled = e.add_node("Mul", [v, e.add_const(np.array(64, dt))])
        back = e.add_node("Cast", [e.add_node("Cast", [scaled], to=TensorProto.INT32)], to=et)
        return e.add_node("Mul", [back, e.add_const(np.array(1 / 64, dt))])

    h = _embedding(e)
    if h is None:
        return None
    _splice(e, h, chain)
    return f"on {h}"


@mutation("cast")
def cast_chain_fp16(e: Edit, rng: np.random.Generator) -> str | None:
    """The embeddings through float16 and back (a narrowing round trip to keep)."""
    h = _embedding(e)
    if h is None or e.input_dtype() != np.float32:
        return None

    def chain(v: str) -> str:
        return e.add_node(
            "Cast", [e.add_node("Cast", [v], to=TensorProto.FLOAT16)], to=TensorProto.FLOAT
        )

    _splice(e, h, chain)
    return f"on {h}"


@mutation("dtype")
def large_activations(e: Edit, rng: np.random.Generator) -> str | None:
    """The embedding table times 300: a residual stream whose squares overflow float16
    (fp16 conversion must keep those ops in float32 or say so)."""
    h = _embedding(e)
    if h is None:
        return None
    table = e.producer(h).input[0]  # type: ignore[union-attr]
    c = e.const(table)
    assert c is not None
    e.set_input_const(e.producer(h), 0, (c.astype(np.float32) * 300).astype(c.dtype))  # type: ignore[arg-type]
    return f"{table} x 300"


# --- opsets ---------------------------------------------------------------------------------


def _convert(e: Edit, opset: int) -> bool:
    try:
        converted = version_converter.convert_version(e.model, opset)
    except Exception:  # onnx's converter has no adapter for some op: no site
        return False
    e.model.CopyFrom(converted)
    e.graph = e.model.graph
    e.inits = {t.name: t for t in e.graph.initializer}
    return True


_AXES_TO_ATTRIBUTE = {
    "Unsqueeze": 13,
    "Squeeze": 13,
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceL2": 18,
    "ReduceSumSquare": 18,
}


def _downgrade_to_12(e: Edit) -> bool:
    """The export relabelled opset 12 (onnx's converter has no adapter down from Shape-15 or
    LayerNormalization): axes inputs become attributes, Shape(start, end) a Slice of the Shape,
    Split's sizes an attribute; False where an op has no opset-12 form."""
    if e.opset <= 12:
        return e.opset == 12
    version = e.opset
    for n in list(e.graph.node):
        if n.domain not in ("", "ai.onnx"):
            return False
        try:
            onnx.defs.get_schema(n.op_type, 12, "")
        except Exception:  # no opset-12 form (LayerNormalization, Gelu, Trilu...)
            return False
        since = _AXES_TO_ATTRIBUTE.get(n.op_type)
        if since is not None and version >= since and len(n.input) > 1:
            if n.input[1]:
                axes = e.const(n.input[1])
                if axes is None:
                    return False
                e.set_attr(n, "axes", [int(a) for a in axes.reshape(-1)])
            del n.input[1:]
        if since is not None:
            e.set_attr(n, "noop_with_empty_axes", None)  # an opset-18 attribute
        if n.op_type == "Reshape":  # allowzero is opset 14; no zero dims in these feeds
            e.set_attr(n, "allowzero", None)
        if n.op_type == "Split" and version >= 13 and len(n.input) > 1:
            sizes = e.const(n.input[1])
            if sizes is None:
                return False
            e.set_attr(n, "split", [int(a) for a in sizes.reshape(-1)])
            del n.input[1:]
        if n.op_type == "Shape" and (
            e.attr(n, "start") is not None or e.attr(n, "end") is not None
        ):
            start, end = e.attr(n, "start", 0), e.attr(n, "end", INT64_MAX)
            e.set_attr(n, "start", None)
            e.set_attr(n, "end", None)
            full = e.fresh("shape")
            out = n.output[0]
            n.output[0] = full
            e.graph.node.append(
                onnx.helper.make_node(
                    "Slice",
                    [
                        full,
                        e.add_const(np.array([start], np.int64)),
                        e.add_const(np.array([end], np.int64)),
                    ],
                    [out],
                    name=e.fresh("shape_slice"),
                )
            )
    for o in e.model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = 12
    e.model.ir_version = min(e.model.ir_version, 7)
    return True


@mutation("opset")
def opset_12(e: Edit, rng: np.random.Generator) -> str | None:
    """The export written at opset 12 (Softmax, Unsqueeze, Reduce* in their old forms; a
    last-axis Softmax means the same there)."""
    if e.opset <= 12 or not _downgrade_to_12(e):
        return None
    return "opset 12"


@mutation("opset")
def opset_12_softmax_default_axis(e: Edit, rng: np.random.Generator) -> str | None:
    """Opset 12, one attention Softmax with the default axis (1): before opset 13 it
    normalises over all axes from 1 on, flattened."""
    if not _downgrade_to_12(e):
        return None
    s = _pick(rng, _softmaxes(e))
    if not isinstance(s, onnx.NodeProto):
        return None
    e.set_attr(s, "axis", None)
    return f"opset 12, {s.name} axis default"


@mutation("opset")
def opset_21(e: Edit, rng: np.random.Generator) -> str | None:
    """The export converted up to opset 21."""
    if e.opset >= 21 or not _convert(e, 21):
        return None
    return "converted to opset 21"


# --- folding probes: a new output computed by integer ops on constants ------------------------


def _probe(e: Edit, value: str, elem_type: int) -> None:
    """Ties `value` to the batch (so it is an activation, not a constant output) and adds it as
    the graph output ``difftest_probe``."""
    batch = e.add_node(
        "Slice",
        [
            e.add_node("Shape", ["input_ids"]),
            e.add_const(np.array([0], np.int64)),
            e.add_const(np.array([1], np.int64)),
        ],
    )
    zero = e.add_node("Mul", [batch, e.add_const(np.array(0, np.int64))])
    cast = e.add_node("Cast", [zero], to=elem_type) if elem_type != TensorProto.INT64 else zero
    out = "difftest_probe"
    e.graph.node.append(onnx.helper.make_node("Add", [value, cast], [out], name="difftest_tie"))
    e.add_output(out, elem_type)


@mutation("probe")
def probe_narrowing_cast(e: Edit, rng: np.random.Generator) -> str | None:
    """Slice(arange(6), 0, Cast(Cast(INT64_MAX, int32), int64)): ONNX Runtime wraps the int32
    cast to -1, so 5 elements."""
    if not any(i.name == "input_ids" for i in e.graph.input):
        return None
    end = e.add_node(
        "Cast",
        [e.add_node("Cast", [e.add_const(np.array([INT64_MAX], np.int64))], to=TensorProto.INT32)],
        to=TensorProto.INT64,
    )
    data = e.add_const(np.arange(6, dtype=np.int64))
    sliced = e.add_node("Slice", [data, e.add_const(np.array([0], np.int64)), end])
    _probe(e, sliced, TensorProto.INT64)
    return "probe Slice end Cast(Cast(INT64_MAX, int32), int64)"


@mutation("probe")
def probe_slice_reverse(e: Edit, rng: np.random.Generator) -> str | None:
    """Slice(arange(5), start -1, end INT64_MAX, step -1): ONNX Runtime returns the whole
    tensor reversed."""
    if not any(i.name == "input_ids" for i in e.graph.input):
        return None
    sliced = e.add_node(
        "Slice",
        [
            e.add_const(np.arange(5, dtype=np.int64)),
            e.add_const(np.array([-1], np.int64)),
            e.add_const(np.array([INT64_MAX], np.int64)),
            e.add_const(np.array([0], np.int64)),
            e.add_const(np.array([-1], np.int64)),
        ],
    )
    _probe(e, sliced, TensorProto.INT64)
    return "probe Slice(arange(5), -1, INT64_MAX, step -1)"


@mutation("probe")
def probe_empty_slice(e: Edit, rng: np.random.Generator) -> str | None:
    """Slice(arange(5), 3, 1): an empty shape value, then broadcast against one element
    ((0) + (1) is (0))."""
    if not any(i.name == "input_ids" for i in e.graph.input):
        return None
    sliced = e.add_node(
        "Slice",
        [
            e.add_const(np.arange(5, dtype=np.int64)),
            e.add_const(np.array([3], np.int64)),
            e.add_const(np.array([1], np.int64)),
        ],
    )
    _probe(e, sliced, TensorProto.INT64)
    return "probe Slice(arange(5), 3, 1) + (1,)"


@mutation("probe")
def probe_div_int_min(e: Edit, rng: np.random.Generator) -> str | None:
    """Div(INT64_MIN, -1) on constants (undefined in C++: x86 traps)."""
    if not any(i.name == "input_ids" for i in e.graph.input):
        return None
    q = e.add_node(
        "Div",
        [e.add_const(np.array([INT64_MIN], np.int64)), e.add_const(np.array([-1], np.int64))],
    )
    _probe(e, q, TensorProto.INT64)
    return "probe Div(INT64_MIN, -1)"


@mutation("probe")
def probe_shape_arith(e: Edit, rng: np.random.Generator) -> str | None:
    """Integer arithmetic on the sequence length (Shape -> Gather -> Mul/Sub/Mod/Div by
    negative numbers): what fold_shapes and the shape analysis evaluate."""
    if not any(i.name == "input_ids" for i in e.graph.input):
        return None
    seq = e.add_node(
        "Gather", [e.add_node("Shape", ["input_ids"]), e.add_const(np.array([1], np.int64))]
    )
    a = e.add_node("Sub", [e.add_const(np.array([-7], np.int64)), seq])
    b = e.add_node("Div", [a, e.add_const(np.array([-3], np.int64))])
    c = e.add_node("Mod", [a, e.add_const(np.array([-4], np.int64))], fmod=0)
    d = e.add_node("Mul", [b, e.add_const(np.array([1 << 62], np.int64))])
    _probe(e, e.add_node("Concat", [a, b, c, d], axis=0), TensorProto.INT64)
    return "probe (-7 - S), (-7 - S) / -3, mod -4, * 2^62"
