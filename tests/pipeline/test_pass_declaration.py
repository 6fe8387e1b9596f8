"""How a C++ pass is declared (csrc/passes/registry.h): PassDecl / OptionDecl with named fields,
the target an enum parsed once where the context is made, not a string each pass compares."""

from __future__ import annotations

import fastopt
import pytest
from fastopt import _C
from onnx import TensorProto, helper


def identity_model() -> fastopt.Model:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return fastopt.load_bytes(model.SerializeToString())


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_a_known_target_runs(target: str) -> None:
    rewrites, _ = _C.run_pass(identity_model(), "eliminate_identity", target=target)
    assert rewrites == 0  # the graph's own output: nothing to remove


def test_an_unknown_target_is_refused_by_name() -> None:
    # Compared as strings, an unknown target ran every pass as neither ort nor onnx.
    with pytest.raises(fastopt.ModelError, match="unknown target 'tensorrt': choose ort or onnx"):
        _C.run_pass(identity_model(), "eliminate_identity", target="tensorrt")


def test_declared_fields_read_back() -> None:
    passes = {p.name: p for p in _C.cpp_passes()}
    kv = passes["add_kv_cache"]
    assert not kv.idempotent
    assert kv.requires_facts == [_C.FACT_ATTENTION_FUSED] and kv.runs_before == ["lower_attention"]
    options = {o.name: o for o in kv.options}
    assert options["kv_cache"].internal and options["kv_cache"].default is None
    assert options["cross_attention_cache"].default == 1
    assert [c for c, _ in options["cross_attention_cache"].choices] == [0, 1, 2]
    assert passes["fuse_attention"].ensures_facts == [_C.FACT_ATTENTION_FUSED]
    assert passes["eliminate_dead_nodes"].idempotent
