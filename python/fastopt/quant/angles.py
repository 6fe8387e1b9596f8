"""Ops that stay float32 in fp16/bf16 for their precision, not their range: those computing
the argument of a Sin or Cos (a rotary embedding's angles, position x frequency, and the Cast of
the integer positions).

A 16-bit type keeps a relative precision, but Sin and Cos need an absolute one: bfloat16 spaces
its values 2 apart from 256 to 512 (float16 from 2048 to 4096), so the angle of position 500 is
off by up to a radian in bf16 and attention loses the positions. Measured on SmolLM2-135M
(bench/results/fp16_ranges.md, bf16 emulated in ONNX Runtime): on 488 tokens of prose, KL
against fp32 0.114 and top-1 0.883 with the angles in bf16, 0.00074 and 0.988 in float32.

The rule is structural, not read from the activation statistics: the largest angle measured is
the longest position run (16 random tokens, 128 of calibration text), far below the contexts the
model is used at. Sin and Cos themselves are converted (their outputs are in [-1, 1]).
"""

from __future__ import annotations

from fastopt import _C

_TRIG = {"Sin", "Cos"}


def angle_ops(model: _C.Model, float_values: set[str]) -> list[tuple[str, str, str]]:
    """(node name, op, first output) of the main graph's nodes whose float32 outputs flow into a
    Sin or Cos through float32 values only; ``float_values``: the graph's float32 value names."""
    producers: dict[str, _C.Node] = {}
    for n in model.graph.nodes:
        for o in n.outputs:
            if o is not None and o.name:
                producers[o.name] = n
    kept: dict[str, tuple[str, str, str]] = {}
    stack = [
        v.name
        for n in model.graph.nodes
        if n.op_type in _TRIG and n.domain in ("", "ai.onnx")
        for v in n.inputs[:1]
        if v is not None and v.name in float_values
    ]
    while stack:
        name = stack.pop()
        node = producers.get(name)
        if node is None or node.op_type == "Constant" or name in kept:
            continue  # a graph input or a weight (the pass keeps what only kept nodes read)
        kept[name] = (node.name or name, node.op_type, name)
        stack += [v.name for v in node.inputs if v is not None and v.name in float_values]
    order = {n.name: i for i, n in enumerate(model.graph.nodes)}
    return sorted(set(kept.values()), key=lambda k: order.get(k[0], 0))
