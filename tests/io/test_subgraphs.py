"""Subgraphs and functions: If / Loop / Scan (nested, with outer-scope references) and
FunctionProtos with attributes referenced through ref_attr_name.
Round trip equality, ORT parity, and the API's walk of subgraphs and use-lists.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import fastopt
import onnx
import pytest
from conftest import assert_outputs_identical, assert_proto_equal, run_ort
from onnx import AttributeProto
from support.subgraph_models import (
    BUILDERS,
    nested_if,
)


@pytest.fixture(params=list(BUILDERS))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, onnx.ModelProto, list]:
    model, feeds = BUILDERS[request.param]()
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "in.onnx"
    onnx.save_model(model, str(path))
    return path, model, feeds


def test_roundtrip_and_ort_parity(case: tuple[Path, onnx.ModelProto, list], tmp_path: Path) -> None:
    path, model, feeds = case
    out = tmp_path / "out.onnx"
    fastopt.load(str(path)).save(str(out))
    assert_proto_equal(onnx.load(str(path)), onnx.load(str(out)))
    assert_proto_equal(model, fastopt.from_onnx(model).to_onnx())
    for f in feeds:
        assert_outputs_identical(run_ort(path, f), run_ort(out, f))


def _onnx_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        out += [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)
    return out


def _compare_walk(g: Any, proto: onnx.GraphProto) -> None:
    """The API graph mirrors the proto graph, recursively through node.subgraphs."""
    assert g.name == proto.name
    assert [(n.name, n.op_type, n.domain) for n in g.nodes] == [
        (n.name, n.op_type, n.domain) for n in proto.node
    ]
    for node, node_proto in zip(g.nodes, proto.node):
        subs, sub_protos = node.subgraphs, _onnx_subgraphs(node_proto)
        assert sorted(s.name for s in subs) == sorted(s.name for s in sub_protos)
        by_name = {s.name: s for s in sub_protos}
        for sub in subs:
            _compare_walk(sub, by_name[sub.name])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_walk_subgraphs(name: str) -> None:
    model, _ = BUILDERS[name]()
    m = fastopt.from_onnx(model)
    _compare_walk(m.graph, model.graph)
    for fn, fn_proto in zip(m.functions, model.functions):
        assert (fn.name, fn.domain) == (fn_proto.name, fn_proto.domain)
        assert [(n.name, n.op_type) for n in fn.graph.nodes] == [
            (n.name, n.op_type) for n in fn_proto.node
        ]
    m.verify()


def _expected_uses(graph: onnx.GraphProto, name: str) -> Counter[tuple[str, int]]:
    """(node name, input index) of every read of `name` in `graph` and its nested subgraphs
    (the test models never shadow a name)."""
    uses: Counter[tuple[str, int]] = Counter()
    for node in graph.node:
        uses.update((node.name, i) for i, n in enumerate(node.input) if n == name)
        for sub in _onnx_subgraphs(node):
            uses += _expected_uses(sub, name)
    return uses


# Values of the main graph (or, "else/e1", of a branch) read from inside subgraphs.
OUTER_VALUES = {
    "nested_if": ["X", "W", "zero", "else/e1"],
    "loop_with_if": ["X", "W", "zero_i", "loop_body/acc_new"],
    "scan_outer_scope": ["V"],
}


@pytest.mark.parametrize("name", list(OUTER_VALUES))
def test_outer_scope_uses(name: str) -> None:
    """A value read inside a subgraph lists the reading nodes (inside the subgraph) as its uses,
    with the index of the input slot that holds it."""
    model, _ = BUILDERS[name]()
    m = fastopt.from_onnx(model)
    graphs = {"": (m.graph, model.graph)}
    todo = [(m.graph, model.graph)]
    while todo:  # index every (sub)graph by name, walking node.subgraphs
        g, gp = todo.pop()
        for node, node_proto in zip(g.nodes, gp.node):
            protos = {s.name: s for s in _onnx_subgraphs(node_proto)}
            for sub in node.subgraphs:
                graphs[sub.name] = (sub, protos[sub.name])
                todo.append((sub, protos[sub.name]))
    for qualified in OUTER_VALUES[name]:
        graph_name, _, value_name = qualified.rpartition("/")
        g, gp = graphs[graph_name]
        v = g.value(value_name)
        assert v is not None, qualified
        uses = Counter((u.name, idx) for u, idx in v.uses)
        assert uses == _expected_uses(gp, value_name), qualified
        assert any(u.name not in {n.name for n in gp.node} for u, _ in v.uses), qualified
        for u, idx in v.uses:
            assert u.inputs[idx] is not None and u.inputs[idx].name == value_name


def test_op_counts_include_subgraphs() -> None:
    model, _ = nested_if()
    counts = fastopt.from_onnx(model).op_counts()
    assert counts == {
        "ReduceSum": 1,
        "Greater": 2,
        "If": 2,
        "Add": 2,
        "Mul": 1,
        "ReduceMax": 1,
        "Sub": 1,
    }
