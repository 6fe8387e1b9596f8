"""Generate the seed corpus for the reader fuzzers (tests/fuzz/corpus/).

Each seed is a small, valid serialized ModelProto that exercises one part of the reader:
tensors in raw_data and in every typed field, attributes of every type, subgraphs
(If/Loop/Scan with outer-scope references), external-data references, sparse initializers,
model-local functions and non-tensor types. External data refers to ``weights.bin``, which the
harnesses create next to the model (``weights_bin()`` below: deterministic bytes).

Real exports (tests/fixtures/models, /work/shared/corpus) become seeds too, as their graphs
without their megabytes (``export_seed``): every weight of 256 bytes or more reads
``export.bin`` (``export_bin()``, 1 MiB, which the harnesses also create) from offset 0, and doc
strings and metadata go. The committed corpus holds the two smallest such seeds; ``--exports``
writes all of them into a scratch corpus for a campaign.

    python tests/fuzz/make_seeds.py            # (re)write tests/fuzz/corpus/
    python tests/fuzz/make_seeds.py --check    # exit 1 if the committed seeds are stale
    python tests/fuzz/make_seeds.py --exports /tmp/corpus   # + every real export found
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
CORPUS_DIR = HERE / "corpus"
FIXTURE_MODELS = HERE.parent / "fixtures" / "models"
SHARED_CORPUS = HERE.parents[2] / "shared" / "corpus"
WEIGHTS_NAME = "weights.bin"
WEIGHTS_SIZE = 4096
EXPORT_NAME = "export.bin"
EXPORT_SIZE = 1 << 20  # the largest weight of the shared corpus (a 1 MiB embedding)
EXPORT_MIN_BYTES = 256  # smaller weights stay inline (shape constants, norms of tiny models)
# The committed export seeds: small (about 25 kB), a decoder (rotary, GQA) and an encoder.
COMMITTED_EXPORTS = ("llama_dynamo_float32", "bert_dynamo_float32")
OPSET = 21


def weights_bin() -> bytes:
    """Content of the external data file the external-data seeds point into."""
    return bytes((i * 7 + 3) & 0xFF for i in range(WEIGHTS_SIZE))


def export_bin() -> bytes:
    """Content of the file every large weight of an export seed reads (finite floats in any
    dtype: bytes 60..120, as tests/fuzz/fuzz_common.h export_byte())."""
    i = np.arange(EXPORT_SIZE, dtype=np.int64)
    return ((i * 13 + 5) % 61 + 60).astype(np.uint8).tobytes()


def write_data_files(folder: Path) -> None:
    """The external data files the seeds point into, as the harnesses create them."""
    (folder / WEIGHTS_NAME).write_bytes(weights_bin())
    (folder / EXPORT_NAME).write_bytes(export_bin())


def _strip_docs(g: onnx.GraphProto) -> None:
    g.doc_string = ""
    for n in g.node:
        n.doc_string = ""
        del n.metadata_props[:]
        for a in n.attribute:
            if a.HasField("g"):
                _strip_docs(a.g)
            for sub in a.graphs:
                _strip_docs(sub)
    for v in [*g.input, *g.output, *g.value_info]:
        v.doc_string = ""
        del v.metadata_props[:]
    del g.metadata_props[:]


def export_seed(path: Path) -> bytes:
    """A real export's graph, its large weights pointing into export.bin (see the docstring)."""
    m = onnx.load(str(path))
    m.doc_string = ""
    del m.metadata_props[:]
    _strip_docs(m.graph)
    for f in m.functions:
        f.doc_string = ""
        del f.metadata_props[:]
    for t in m.graph.initializer:
        data = t.raw_data
        if len(data) < EXPORT_MIN_BYTES or t.data_location == TensorProto.EXTERNAL:
            continue
        if len(data) > EXPORT_SIZE:
            raise ValueError(f"{path}: {t.name} has {len(data)} bytes, over {EXPORT_SIZE}")
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", EXPORT_NAME), ("offset", "0"), ("length", str(len(data)))):
            e = t.external_data.add()
            e.key = k
            e.value = v
    return m.SerializeToString(deterministic=True)


def export_models() -> dict[str, Path]:
    """Every real export there is: the fixtures, and the shared corpus when present."""
    found: dict[str, Path] = {}
    for root, prefix in ((FIXTURE_MODELS, "fixture"), (SHARED_CORPUS, "corpus")):
        if root.is_dir():
            for p in sorted(root.glob("*/model.onnx")):
                found[f"{prefix}_{p.parent.name}"] = p
    return found


def _model(graph: onnx.GraphProto, **kwargs: object) -> onnx.ModelProto:
    opsets = kwargs.pop("opset_imports", None) or [helper.make_opsetid("", OPSET)]
    m = helper.make_model(graph, opset_imports=opsets, **kwargs)  # type: ignore[arg-type]
    m.ir_version = 10
    return m


def _raw(name: str, arr: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(arr, name)  # numpy_helper writes raw_data


def seed_basic() -> onnx.ModelProto:
    w = _raw("W", np.arange(16, dtype=np.float32).reshape(4, 4) / 10)
    b = _raw("B", np.arange(4, dtype=np.float32))
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["xw"], name="mm"),
            helper.make_node("Add", ["xw", "B"], ["xwb"], name="add"),
            helper.make_node("Relu", ["xwb"], ["Y"], name="relu", doc_string="activation"),
        ],
        "basic",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        [w, b],
        doc_string="a tiny MLP",
        value_info=[helper.make_tensor_value_info("xw", TensorProto.FLOAT, ["batch", 4])],
    )
    m = _model(g, producer_name="fastopt-seeds", producer_version="1", doc_string="seed")
    m.model_version = 3
    m.domain = "ai.fastopt.test"
    helper.set_model_props(m, {"author": "fuzz", "purpose": "seed"})
    return m


def seed_typed() -> onnx.ModelProto:
    """Initializers in every typed field (and raw_data for the same dtypes), scalars, empties."""
    inits = [
        helper.make_tensor("f32", TensorProto.FLOAT, [2, 2], [1.0, -2.0, 3.5, 0.0]),
        helper.make_tensor("f64", TensorProto.DOUBLE, [3], [1.0, 2.5, -1e300]),
        helper.make_tensor("i64", TensorProto.INT64, [2], [-(2**62), 2**62]),
        helper.make_tensor("i32", TensorProto.INT32, [3], [-1, 0, 2**31 - 1]),
        helper.make_tensor("i16", TensorProto.INT16, [2], [-300, 300]),
        helper.make_tensor("i8", TensorProto.INT8, [4], [-128, -1, 0, 127]),
        helper.make_tensor("u8", TensorProto.UINT8, [2, 2], [0, 1, 254, 255]),
        helper.make_tensor("u16", TensorProto.UINT16, [2], [0, 65535]),
        helper.make_tensor("u32", TensorProto.UINT32, [2], [0, 2**32 - 1]),
        helper.make_tensor("u64", TensorProto.UINT64, [2], [0, 2**64 - 1]),
        helper.make_tensor("b", TensorProto.BOOL, [3], [True, False, True]),
        helper.make_tensor("f16", TensorProto.FLOAT16, [2], np.array([1.5, -2], np.float16)),
        helper.make_tensor("bf16", TensorProto.BFLOAT16, [2], [1.0, -3.0]),
        helper.make_tensor("c64", TensorProto.COMPLEX64, [1], [complex(1.0, 2.0)]),
        helper.make_tensor("str", TensorProto.STRING, [3], [b"a", b"", b"\xff\x00bytes"]),
        helper.make_tensor("scalar", TensorProto.FLOAT, [], [42.0]),
        helper.make_tensor("empty", TensorProto.FLOAT, [0, 3], []),
        _raw("raw_f16", np.array([[0.5, 1.5]], np.float16)),
        _raw("raw_i64", np.array([7, -7, 2**40], np.int64)),
        _raw("raw_bool", np.array([True, False], np.bool_)),
        _raw("raw_scalar", np.array(3, np.int32)),
        _raw("raw_empty", np.zeros((2, 0), np.float32)),
    ]
    nodes = [helper.make_node("Identity", [t.name], [f"out_{t.name}"]) for t in inits]
    outputs = [
        helper.make_tensor_value_info(f"out_{t.name}", t.data_type, list(t.dims)) for t in inits
    ]
    return _model(helper.make_graph(nodes, "typed", [], outputs, inits))


def seed_attributes() -> onnx.ModelProto:
    """A custom-domain node carrying an attribute of every AttributeProto type."""
    body = helper.make_graph(
        [helper.make_node("Neg", ["X"], ["nx"])],
        "attr_body",
        [],
        [helper.make_tensor_value_info("nx", TensorProto.FLOAT, [2])],
    )
    t1 = helper.make_tensor("t1", TensorProto.INT64, [2], [1, 2])
    t2 = _raw("t2", np.array([1.0, 2.0], np.float32))
    sp = helper.make_sparse_tensor(
        helper.make_tensor("sv", TensorProto.FLOAT, [2], [5.0, 6.0]),
        helper.make_tensor("si", TensorProto.INT64, [2], [1, 3]),
        [4],
    )
    tp_seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [1]))
    attrs = {
        "f": 0.25,
        "i": -5,
        "s": b"bytes\x00\xff",
        "t": t1,
        "g": body,
        "floats": [1.0, -1.0, 3.5],
        "ints": [1, -2, 2**40],
        "strings": [b"x", b"", b"zz"],
        "tensors": [t1, t2],
        "graphs": [body, body],
        "sparse": sp,
        "sparses": [sp, sp],
        "tp": helper.make_tensor_type_proto(TensorProto.FLOAT16, ["n", 3]),
        "tps": [tp_seq, helper.make_optional_type_proto(tp_seq)],
        "empty_ints": helper.make_attribute("empty_ints", [], attr_type=onnx.AttributeProto.INTS),
    }
    node = helper.make_node("AllAttrs", ["X"], ["Y"], domain="test.fuzz", name="all")
    for k, v in attrs.items():
        a = v if isinstance(v, onnx.AttributeProto) else helper.make_attribute(k, v)
        node.attribute.append(a)
    node.attribute.append(helper.make_attribute("doc", 1, attr_type=onnx.AttributeProto.INT))
    node.attribute[-1].doc_string = "attribute with a doc string"
    g = helper.make_graph(
        [node],
        "attrs",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    return _model(
        g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("test.fuzz", 1)]
    )


def seed_subgraphs() -> onnx.ModelProto:
    """If (both branches read outer names), Loop (body reads an outer initializer), Scan."""
    then_g = helper.make_graph(
        [helper.make_node("Add", ["X", "one"], ["t_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2])],
    )
    else_g = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["cond"],
                ["inner"],
                then_branch=helper.make_graph(
                    [helper.make_node("Neg", ["X"], ["n1"])],
                    "inner_then",
                    [],
                    [helper.make_tensor_value_info("n1", TensorProto.FLOAT, [2])],
                ),
                else_branch=helper.make_graph(
                    [helper.make_node("Identity", ["one"], ["n2"])],
                    "inner_else",
                    [],
                    [helper.make_tensor_value_info("n2", TensorProto.FLOAT, [2])],
                ),
            ),
            helper.make_node("Mul", ["inner", "X"], ["e_out"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2])],
    )
    loop_body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
        ],
        "loop_body",
        [
            helper.make_tensor_value_info("iter", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2]),
        ],
    )
    scan_body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        "scan_body",
        [
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [2]),
        ],
        [
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [2]),
        ],
    )
    g = helper.make_graph(
        [
            helper.make_node("If", ["cond"], ["if_out"], then_branch=then_g, else_branch=else_g),
            helper.make_node("Loop", ["trip", "", "if_out"], ["loop_out"], body=loop_body),
            helper.make_node(
                "Scan",
                ["loop_out", "seq"],
                ["scan_state", "scan_ys"],
                body=scan_body,
                num_scan_inputs=1,
            ),
        ],
        "subgraphs",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("seq", TensorProto.FLOAT, [3, 2]),
        ],
        [
            helper.make_tensor_value_info("scan_state", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("scan_ys", TensorProto.FLOAT, [3, 2]),
        ],
        [
            _raw("one", np.ones(2, np.float32)),
            helper.make_tensor("trip", TensorProto.INT64, [], [3]),
        ],
    )
    return _model(g)


def _external(
    name: str, dtype: int, dims: list[int], offset: int, length: int | None
) -> TensorProto:
    t = TensorProto()
    t.name = name
    t.data_type = dtype
    t.dims.extend(dims)
    t.data_location = TensorProto.EXTERNAL
    entries = [("location", WEIGHTS_NAME), ("offset", str(offset))]
    if length is not None:
        entries.append(("length", str(length)))
    for k, v in entries:
        e = t.external_data.add()
        e.key = k
        e.value = v
    return t


def seed_external() -> onnx.ModelProto:
    inits = [
        _external("ext_a", TensorProto.FLOAT, [4, 4], 0, 64),
        # length omitted: the tensor runs to the end of the file (16 bytes either way)
        _external("ext_b", TensorProto.UINT8, [16], WEIGHTS_SIZE - 16, None),
        _external("ext_c", TensorProto.FLOAT16, [8], 64, 16),
        _raw("inline", np.arange(4, dtype=np.float32)),
    ]
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "ext_a"], ["y0"]),
            helper.make_node("Add", ["y0", "inline"], ["Y"]),
            helper.make_node("Identity", ["ext_b"], ["Z"]),
            helper.make_node("Identity", ["ext_c"], ["H"]),
        ],
        "external",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("Z", TensorProto.UINT8, [16]),
            helper.make_tensor_value_info("H", TensorProto.FLOAT16, [8]),
        ],
        inits,
    )
    return _model(g)


def seed_sparse() -> onnx.ModelProto:
    sp_1d = helper.make_sparse_tensor(
        helper.make_tensor("sp1", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0]),
        helper.make_tensor("sp1_idx", TensorProto.INT64, [3], [0, 5, 11]),
        [3, 4],
    )
    sp_2d = helper.make_sparse_tensor(
        _raw("sp2", np.array([4.0, 5.0], np.float32)),
        _raw("sp2_idx", np.array([[0, 1], [2, 3]], np.int64)),
        [3, 4],
    )
    const_sp = helper.make_node("Constant", [], ["c"], sparse_value=sp_1d)
    g = helper.make_graph(
        [
            const_sp,
            helper.make_node("Add", ["sp1", "sp2"], ["s"]),
            helper.make_node("Add", ["s", "c"], ["Y"]),
        ],
        "sparse",
        [],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 4])],
    )
    g.sparse_initializer.extend([sp_1d, sp_2d])
    return _model(g)


def seed_functions() -> onnx.ModelProto:
    fn = helper.make_function(
        "local.fn",
        "ScaledAdd",
        ["a", "b"],
        ["y"],
        [
            helper.make_node("Constant", [], ["alpha_t"], value_float=1.0),
            helper.make_node("Mul", ["a", "alpha_t"], ["sa"]),
            helper.make_node("Add", ["sa", "b"], ["y"]),
        ],
        [helper.make_opsetid("", OPSET)],
        attributes=["unused"],
    )
    # An attribute reference (ref_attr_name) and a default value (attribute_proto).
    fn.node[0].ClearField("attribute")
    ref = onnx.AttributeProto()
    ref.name = "value_float"
    ref.type = onnx.AttributeProto.FLOAT
    ref.ref_attr_name = "alpha"
    fn.node[0].attribute.append(ref)
    fn.attribute_proto.append(helper.make_attribute("alpha", 2.0))
    fn.doc_string = "y = alpha * a + b"
    g = helper.make_graph(
        [
            helper.make_node("ScaledAdd", ["X", "X"], ["t"], domain="local.fn", alpha=0.5),
            helper.make_node("ScaledAdd", ["t", "X"], ["Y"], domain="local.fn"),
        ],
        "functions",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])],
    )
    return _model(
        g,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("local.fn", 1)],
        functions=[fn],
    )


def seed_types() -> onnx.ModelProto:
    """Sequence, optional and map types, symbolic and unknown dims, value_info on everything."""
    seq = helper.make_tensor_sequence_value_info("S", TensorProto.FLOAT, ["n", None])
    opt = helper.make_value_info(
        "O",
        helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, [1])),
    )
    mp = helper.make_value_info(
        "M",
        helper.make_map_type_proto(
            TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, [])
        ),
    )
    g = helper.make_graph(
        [
            helper.make_node("SequenceLength", ["S"], ["len"]),
            helper.make_node("OptionalHasElement", ["O"], ["has"]),
        ],
        "types",
        [seq, opt, mp],
        [
            helper.make_tensor_value_info("len", TensorProto.INT64, []),
            helper.make_tensor_value_info("has", TensorProto.BOOL, []),
        ],
    )
    return _model(g)


SEEDS: dict[str, Callable[[], onnx.ModelProto]] = {
    "basic": seed_basic,
    "typed": seed_typed,
    "attributes": seed_attributes,
    "subgraphs": seed_subgraphs,
    "external": seed_external,
    "sparse": seed_sparse,
    "functions": seed_functions,
    "types": seed_types,
}


def build_all() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, make in SEEDS.items():
        m = make()
        if name not in ("attributes", "external"):
            # The custom op has no schema; external data is checked by the harness.
            onnx.checker.check_model(m)
        out[f"seed_{name}.onnx"] = m.SerializeToString(deterministic=True)
    for name in COMMITTED_EXPORTS:
        out[f"export_{name}.onnx"] = export_seed(FIXTURE_MODELS / name / "model.onnx")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=CORPUS_DIR)
    ap.add_argument("--check", action="store_true", help="only compare with the files on disk")
    ap.add_argument("--exports", action="store_true", help="also every real export found")
    args = ap.parse_args(argv)
    seeds = build_all()
    if args.exports:
        for name, path in export_models().items():
            seeds[f"export_{name}.onnx"] = export_seed(path)
    if args.check:
        stale = [n for n, b in seeds.items() if (args.out / n).read_bytes() != b]
        for n in stale:
            print(f"stale seed: {n}", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in seeds.items():
        (args.out / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
