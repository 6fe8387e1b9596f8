"""Small editing helpers over an onnx.ModelProto for the mutation kinds (mutations.py): find
producers and consumers by value name, read and replace small constants, add nodes and
initializers with fresh names, rewire uses. Edits append nodes; ``finish`` sorts the graph
topologically so that every mutant is a valid ONNX graph."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)


class Edit:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self._fresh = 0
        self.inits = {t.name: t for t in self.graph.initializer}

    # --- reading --------------------------------------------------------------------------

    @property
    def opset(self) -> int:
        return next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def producer(self, name: str) -> onnx.NodeProto | None:
        for n in self.graph.node:
            if name in n.output:
                return n
        return None

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return [n for n in self.graph.node if name in n.input]

    def nodes(self, op_type: str) -> list[onnx.NodeProto]:
        return [n for n in self.graph.node if n.op_type == op_type]

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output; None otherwise."""
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        p = self.producer(name)
        if p is not None and p.op_type == "Constant":
            for a in p.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f, np.float32)
                if a.name == "value_int":
                    return np.array(a.i, np.int64)
                if a.name == "value_ints":
                    return np.array(list(a.ints), np.int64)
        return None

    def attr(self, node: onnx.NodeProto, name: str, default: object = None) -> object:
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def set_attr(self, node: onnx.NodeProto, name: str, value: object) -> None:
        for i, a in enumerate(node.attribute):
            if a.name == name:
                del node.attribute[i]
                break
        if value is not None:
            node.attribute.append(helper.make_attribute(name, value))

    def input_dtype(self) -> np.dtype:
        """The float type of the model's activations: that of its first float output."""
        for o in self.graph.output:
            et = o.type.tensor_type.elem_type
            if et in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
                return np.dtype(helper.tensor_dtype_to_np_dtype(et))
        return np.dtype(np.float32)

    def upstream(self, name: str, depth: int) -> Iterator[onnx.NodeProto]:
        """Producers reachable from `name` within `depth` steps back (breadth first)."""
        seen: set[str] = set()  # by first output: protobuf wrappers are new objects each time
        frontier = [name]
        for _ in range(depth):
            nxt = []
            for v in frontier:
                p = self.producer(v)
                if p is None or p.output[0] in seen:
                    continue
                seen.add(p.output[0])
                yield p
                nxt.extend(i for i in p.input if i)
            frontier = nxt

    # --- writing --------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        self._fresh += 1
        return f"difftest_{hint}_{self._fresh}"

    def add_const(self, value: np.ndarray | float | int | list[int], hint: str = "c") -> str:
        arr = np.asarray(value)
        name = self.fresh(hint)
        t = numpy_helper.from_array(arr, name)
        self.graph.initializer.append(t)
        self.inits[name] = t
        return name

    def add_node(
        self, op: str, inputs: list[str], hint: str = "", outputs: int = 1, **attrs: object
    ) -> str:
        outs = [self.fresh(hint or op.lower()) for _ in range(outputs)]
        self.graph.node.append(
            helper.make_node(op, inputs, outs, name=self.fresh(f"node_{op}"), **attrs)
        )
        return outs[0]

    def set_input_const(self, node: onnx.NodeProto, index: int, value: np.ndarray) -> None:
        """Gives `node` a fresh constant at input `index` (shared constants stay as they were)."""
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = self.add_const(value, "k")

    def rewire(self, old: str, new: str, keep: set[str] | None = None) -> None:
        """Every use of `old` (graph outputs included) reads `new`, except in nodes producing a
        name in `keep` (the new subgraph that reads `old` itself)."""
        for n in self.graph.node:
            if keep and keep & set(n.output):
                continue
            for i, v in enumerate(n.input):
                if v == old:
                    n.input[i] = new
        for o in self.graph.output:
            if o.name == old:
                # An output keeps its name: route through an Identity named like it.
                raise ValueError("rewiring a graph output is not supported")

    def outputs_since(self, start: int) -> set[str]:
        """The outputs of the nodes added since the graph had `start` nodes."""
        return {o for n in self.graph.node[start:] for o in n.output}

    def add_output(self, name: str, elem_type: int, rank: int = 1) -> None:
        """A graph output of that type and rank (dims unnamed: onnx's checker wants a shape)."""
        shape: list[int | str | None] = [None] * rank
        self.graph.output.append(helper.make_tensor_value_info(name, elem_type, shape))

    def finish(self) -> None:
        """Topological order (mutations append nodes that earlier nodes now read)."""
        available = {i.name for i in self.graph.input} | set(self.inits) | {""}
        pending = list(self.graph.node)
        ordered: list[onnx.NodeProto] = []
        while pending:
            rest = []
            for n in pending:
                if all(i in available for i in n.input):
                    ordered.append(n)
                    available.update(n.output)
                else:
                    rest.append(n)
            if len(rest) == len(pending):
                raise ValueError(f"mutation left a cycle or a dangling input: {rest[0].name}")
            pending = rest
        del self.graph.node[:]
        self.graph.node.extend(ordered)
        # Declared intermediate types may no longer hold after an edit: drop them (ORT infers).
        del self.graph.value_info[:]
