"""Which attention_bias ONNX Runtime's in-place GroupQueryAttention takes (one single-node model):
a test that fails when ORT changes what the code relies on (issue 26; was
the bench script probe_gqa_inplace_bias.py).

    python tests/ort_behaviour/test_gqa_inplace_bias.py   # per case: accepted (error) or refused

In place, past and present are one (B, Hkv, max_length, D) buffer per layer, seqlens_k[b] is the
row's valid length - 1 and total_sequence_length the attention_mask's width. add_kv_cache keeps
ALiBi's score bias in that form only if GQA reads it there: this binds one buffer to past and
present with IO binding, runs a right-padded prompt (lengths 5 and 3) and a decode step (6, 4),
and tries bias key lengths total_sequence_length and the buffer's, and one query row broadcast over
S. Accepted cases are compared with softmax(QK^T * scale + bias[b, h, s, :t+1]) V over each row's
keys 0..t (t = the query's position). lower_attention_ort relies on (S, total_sequence_length)
and on nothing else being taken (README, "ALiBi"): the tests assert both.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

B, H, D, MAX = 2, 2, 8, 16
RNG = np.random.default_rng(0)


def _model() -> bytes:
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", "", "", "", "bias"],
        ["y", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=H,
    )
    f = TensorProto.FLOAT
    cache = ["B", H, "M", D]
    graph = helper.make_graph(
        [node],
        "gqa_inplace_bias",
        [
            *(helper.make_tensor_value_info(n, f, ["B", "S", H * D]) for n in ("q", "k", "v")),
            helper.make_tensor_value_info("past_k", f, cache),
            helper.make_tensor_value_info("past_v", f, cache),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
            helper.make_tensor_value_info("bias", f, ["b", "h", "s", "t"]),
        ],
        [
            helper.make_tensor_value_info("y", f, None),
            helper.make_tensor_value_info("present_k", f, cache),
            helper.make_tensor_value_info("present_v", f, cache),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _reference(
    q: np.ndarray, cache: dict[str, np.ndarray], bias: np.ndarray, lens: list[int]
) -> np.ndarray:
    """Row b's query s sits at position s (prompt) or lens[b] - 1 (one new token)."""
    s_len = q.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for s in range(min(s_len, lens[b])):
                pos = s if s_len > 1 else lens[b] - 1
                keys = cache["k"][b, h, : pos + 1]
                scores = keys @ q[b, s, h * D : (h + 1) * D] / np.sqrt(D)
                scores = scores + bias[b % bias.shape[0], h % bias.shape[1], s, : pos + 1]
                p = np.exp(scores - scores.max())
                out[b, s, h * D : (h + 1) * D] = (p / p.sum()) @ cache["v"][b, h, : pos + 1]
    return out


def _step(
    sess: ort.InferenceSession,
    buffers: dict[str, ort.OrtValue],
    lens: list[int],
    s_len: int,
    bias_shape: tuple[int, ...],
) -> str:
    q, k, v = (RNG.standard_normal((B, s_len, H * D)).astype(np.float32) for _ in range(3))
    bias = RNG.standard_normal(bias_shape).astype(np.float32)
    io = sess.io_binding()
    feeds = {"q": q, "k": k, "v": v, "bias": bias}
    feeds["seqlens_k"] = (np.array(lens) - 1).astype(np.int32)
    feeds["total"] = np.array(max(lens), np.int32)
    for name, x in feeds.items():
        io.bind_cpu_input(name, x)
    io.bind_output("y")
    for kv, buf in buffers.items():
        io.bind_ortvalue_input(f"past_{kv}", buf)
        io.bind_ortvalue_output(f"present_{kv}", buf)
    try:
        sess.run_with_iobinding(io)
    except Exception as e:  # ORT's message is the result
        return "refused: " + str(e).split("Status Message: ")[-1].splitlines()[0]
    y = io.copy_outputs_to_cpu()[0]
    cache = {kv: buf.numpy() for kv, buf in buffers.items()}
    ref = _reference(q, cache, bias, lens)
    err = max(float(np.abs(y[b, : lens[b]] - ref[b, : lens[b]]).max()) for b in range(B))
    return f"accepted, max abs error {err:.2g}"


def _session() -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])


def _fresh() -> dict[str, ort.OrtValue]:
    zeros = np.zeros((B, H, MAX, D), np.float32)
    return {kv: ort.OrtValue.ortvalue_from_numpy(zeros.copy()) for kv in ("k", "v")}


PROMPT, DECODE = [5, 3], [6, 4]
# case -> (decode step?, bias shape, accepted?)
CASES = {
    "prompt, bias (B, H, S, total)": (False, (B, H, 5, 5), True),
    "prompt, bias (1, 1, S, total)": (False, (1, 1, 5, 5), True),
    "prompt, bias (B, H, S, buffer)": (False, (B, H, 5, MAX), False),
    "prompt, bias (B, H, 1, total)": (False, (B, H, 1, 5), False),
    "decode, bias (B, H, 1, total)": (True, (B, H, 1, 6), True),
    "decode, bias (B, H, 1, buffer)": (True, (B, H, 1, MAX), False),
}


def outcome(name: str) -> str:
    decode, shape, _ = CASES[name]
    sess, buffers = _session(), _fresh()
    if not decode:
        return _step(sess, buffers, PROMPT, 5, shape)
    _step(sess, buffers, PROMPT, 5, (B, H, 5, 5))
    return _step(sess, buffers, DECODE, 1, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_in_place_gqa_takes_the_bias_at_s_by_total_only(name: str) -> None:
    result = outcome(name)
    if CASES[name][2]:
        assert result.startswith("accepted"), result
        assert float(result.rsplit(" ", 1)[1]) < 1e-5, result
    else:
        assert result.startswith("refused"), result


def main() -> None:
    print(f"onnxruntime {ort.__version__}, buffer length {MAX}")
    for name in CASES:
        print(f"{name}: {outcome(name)}")


if __name__ == "__main__":
    main()
