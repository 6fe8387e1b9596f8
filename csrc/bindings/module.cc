// Python bindings: thin handles over the C++ IR. Every handle keeps its Model alive; nodes and
// values are never freed before the model, so a handle never dangles (a removed node reports
// alive == False). Long operations release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "bindings/handles.h"
#include "ir/constant.h"
#include "ir/error.h"
#include "ir/graph.h"
#include "ir/types.h"
#include "passes/fold_constants.h"
#include "proto/onnx_reader.h"
#include "proto/onnx_writer.h"
#include "proto/output_files.h"

namespace py = pybind11;
using namespace fastopt;
using namespace fastopt::bindings;

namespace {

// A tensor's bytes mapped from a file that shrank or changed since the load would raise SIGBUS
// (or show other bytes) when touched: refuse them with a ModelError instead.
void check_source_unchanged(const Tensor& t) {
  auto check = [](const ByteRef& r) {
    if (r.buffer) r.buffer->check_unchanged(r.offset + r.size);
  };
  switch (t.storage) {
    case Tensor::Storage::kRaw: check(t.raw); break;
    case Tensor::Storage::kExternal:
      t.external->file->check_unchanged(t.external->offset + t.external->length);
      break;
    case Tensor::Storage::kTyped:
      for (const auto& r : t.typed) check(r);
      break;
    case Tensor::Storage::kNone: break;
  }
}

Node* live(const PyNode& n) {
  if (!n.node->alive()) throw ModelError("node '" + n.node->name.value + "' was removed");
  return n.node;
}

py::object attribute_value(const ModelPtr& m, const Attribute& a) {
  switch (a.kind()) {
    case AttrType::kFloat: return py::float_(a.f.value_or(0.f));
    case AttrType::kInt: return py::int_(a.i.value_or(0));
    case AttrType::kString: return py::bytes(a.s.value_or(""));
    case AttrType::kTensor: return a.t ? py::cast(PyTensor{m, a.t}) : py::none();
    case AttrType::kGraph: return a.g ? py::cast(PyGraph{m, a.g.get()}) : py::none();
    case AttrType::kFloats: return py::cast(a.floats);
    case AttrType::kInts: return py::cast(a.ints);
    case AttrType::kStrings: {
      py::list l;
      for (const auto& s : a.strings) l.append(py::bytes(s));
      return std::move(l);
    }
    case AttrType::kTensors: {
      py::list l;
      for (const auto& t : a.tensors) l.append(PyTensor{m, t});
      return std::move(l);
    }
    case AttrType::kGraphs: {
      py::list l;
      for (const auto& g : a.graphs) l.append(PyGraph{m, g.get()});
      return std::move(l);
    }
    default: return py::none();  // sparse tensors and type protos: kept, not exposed
  }
}

using Shape = py::typing::Optional<
    py::typing::Tuple<py::typing::Union<int, py::str, py::none>, py::ellipsis>>;
Shape shape_of(const TypeInfo& t) {
  if (!t.is_tensor || !t.has_shape) return py::none();
  py::list dims;
  for (const Dim& d : t.dims) {
    if (d.value)
      dims.append(py::int_(*d.value));
    else if (d.param)
      dims.append(py::str(*d.param));
    else
      dims.append(py::none());
  }
  return py::tuple(dims);
}

const char* storage_name(Tensor::Storage s) {
  switch (s) {
    case Tensor::Storage::kRaw: return "raw";
    case Tensor::Storage::kExternal: return "external";
    case Tensor::Storage::kTyped: return "typed";
    default: return "none";
  }
}

std::string fspath(const py::object& p) {
  return py::module_::import("os").attr("fspath")(p).cast<std::string>();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastopt C++ core: ONNX wire-format reader/writer and graph IR";
  static py::exception<ModelError> model_error(m, "ModelError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ModelError& e) {
      // Messages quote names from the file; never let a stray byte turn into a decode error.
      const char* w = e.what();
      py::object text = py::reinterpret_steal<py::object>(
          PyUnicode_DecodeUTF8(w, static_cast<py::ssize_t>(std::strlen(w)), "replace"));
      py::set_error(model_error, text);
    }
  });

  py::class_<PyTensor> tensor_cls(m, "Tensor", "A tensor whose bytes stay where they were read");
  py::class_<PyValue> value_cls(m, "Value", "A value (edge) of the graph");
  py::class_<PyNode> node_cls(m, "Node", "An operator node");
  py::class_<PyGraph> graph_cls(m, "Graph", "A graph or subgraph");
  py::class_<PyFunction> function_cls(m, "Function", "A model-local function (FunctionProto)");
  py::class_<Model, ModelPtr> model_cls(m, "Model", "An ONNX model; weights stay in their files");

  py::class_<Bytes>(m, "Bytes", py::buffer_protocol(), "Read-only view of tensor bytes")
      .def_buffer([](Bytes& b) {
        return py::buffer_info(const_cast<uint8_t*>(b.ref.data()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.ref.size)}, {1}, /*readonly=*/true);
      })
      .def("__len__", [](const Bytes& b) { return b.ref.size; });

  tensor_cls.def_property_readonly("name", [](const PyTensor& t) { return t.tensor->name.value; })
      .def_property_readonly("dtype", [](const PyTensor& t) { return t.tensor->dtype(); })
      .def_property_readonly("shape",
                             [](const PyTensor& t) -> py::typing::Tuple<int, py::ellipsis> {
                               return py::tuple(py::cast(t.tensor->dims));
                             })
      .def_property_readonly("nbytes", [](const PyTensor& t) { return t.tensor->nbytes(); })
      .def_property_readonly("is_external",
                             [](const PyTensor& t) { return t.tensor->is_external(); })
      .def_property_readonly("storage",
                             [](const PyTensor& t) { return storage_name(t.tensor->storage); })
      .def_property_readonly(
          "external_location",
          [](const PyTensor& t) -> py::typing::Optional<py::typing::Tuple<py::str, int, int>> {
            if (!t.tensor->is_external()) return py::none();
            const auto& e = *t.tensor->external;
            return py::make_tuple(e.file->path(), e.offset, e.length);
          },
          "(path, offset, length) of external data, or None")
      .def(
          "raw_bytes",
          [](const PyTensor& t) {
            py::gil_scoped_release release;
            check_source_unchanged(*t.tensor);
            return Bytes{t.tensor->bytes()};
          },
          "Element bytes (little-endian): a view for raw/external data, decoded for typed fields")
      .def(
          "strings",
          [](const PyTensor& t) {
            py::typing::List<py::bytes> l;
            check_source_unchanged(*t.tensor);
            for (const auto& s : t.tensor->strings()) l.append(py::bytes(s));
            return l;
          },
          "Elements of a STRING tensor")
      .def(
          "numpy",
          [](py::object self) {
            return py::module_::import("fastopt._numpy").attr("tensor_to_numpy")(self);
          },
          "The tensor as a numpy array (zero copy and read-only when the bytes allow)")
      .def("__repr__", [](const PyTensor& t) {
        std::string s =
            "<Tensor '" + t.tensor->name.value + "' " + dtype_name(t.tensor->dtype()) + "[";
        for (size_t i = 0; i < t.tensor->dims.size(); ++i)
          s += (i ? "," : "") + std::to_string(t.tensor->dims[i]);
        return s + "]" + (t.tensor->is_external() ? " external>" : ">");
      });

  value_cls.def_property_readonly("name", [](const PyValue& v) { return v.value->name(); })
      .def_property_readonly(
          "producer", [](const PyValue& v) { return wrap_node(v.model, v.value->producer()); })
      .def_property_readonly("producer_output",
                             [](const PyValue& v) { return v.value->producer_output(); })
      .def_property_readonly(
          "uses",
          [](const PyValue& v) {
            py::typing::List<py::typing::Tuple<PyNode, int>> l;
            for (const Use& u : v.value->uses())
              l.append(py::make_tuple(PyNode{v.model, u.node}, u.input_index));
            return l;
          },
          "(node, input index) pairs, including nodes inside subgraphs")
      .def_property_readonly(
          "dtype",
          [](const PyValue& v) { return v.value->type.is_tensor ? v.value->type.elem_type : 0; })
      .def_property_readonly("shape", [](const PyValue& v) { return shape_of(v.value->type); })
      .def_property_readonly("is_graph_input",
                             [](const PyValue& v) { return v.value->is_graph_input(); })
      .def_property_readonly("is_graph_output",
                             [](const PyValue& v) { return v.value->is_graph_output(); })
      .def_property_readonly("initializer",
                             [](const PyValue& v) -> py::typing::Optional<PyTensor> {
                               if (!v.value->initializer()) return py::none();
                               return py::cast(PyTensor{v.model, v.value->initializer()});
                             })
      .def_property_readonly("graph",
                             [](const PyValue& v) { return PyGraph{v.model, v.value->graph()}; })
      .def(
          "replace_all_uses_with",
          [](const PyValue& v, const PyValue& other) {
            v.value->graph()->replace_all_uses(v.value, other.value);
          },
          "Points every use of this value (and graph outputs) at `other`")
      .def("rename", [](const PyValue& v,
                        const std::string& name) { v.value->graph()->rename(v.value, name); })
      .def_property_readonly(
          "constant",
          [](const PyValue& v) -> py::typing::Optional<PyTensor> {
            auto t = constant_tensor(v.value);
            if (!t) return py::none();
            return py::cast(PyTensor{v.model, std::const_pointer_cast<Tensor>(t)});
          },
          "The value's tensor when it is fixed (an initializer that is not a graph input, or a "
          "Constant node's output), else None")
      .def(
          "replace_with_constant",
          [](const PyValue& v, int32_t dtype, const std::vector<int64_t>& shape,
             const py::buffer& data) {
            py::buffer_info info = data.request();
            py::ssize_t expected_stride = info.itemsize;
            for (size_t i = info.ndim; i-- > 0;) {
              if (info.shape[i] > 1 && info.strides[i] != expected_stride) {
                throw ModelError("replace_with_constant: data must be C-contiguous");
              }
              expected_stride *= info.shape[i];
            }
            std::string bytes(static_cast<const char*>(info.ptr),
                              static_cast<size_t>(info.size * info.itemsize));
            auto t = make_tensor(dtype, shape, std::move(bytes));
            Graph& g = *v.value->graph();
            Node* producer = v.value->producer();
            Value* c = passes::replace_with_constant(g, v.value, std::move(t));
            if (producer && producer->alive()) {
              bool dead = true;
              for (Value* o : producer->outputs()) {
                dead = dead && (!o || (o->uses().empty() && !o->is_graph_output()));
              }
              if (dead) producer->graph()->remove_node(producer);
            }
            return PyValue{v.model, c};
          },
          py::arg("dtype"), py::arg("shape"), py::arg("data"),
          "Puts a constant (ONNX element type, shape, little-endian bytes) in place of this value "
          "everywhere: a new initializer, or a Constant node in function bodies and for graph "
          "outputs (which keep their name). Removes the producer once none of its outputs is "
          "used. Returns the constant's value.")
      .def("__eq__",
           [](const PyValue& a, const py::object& b) {
             return py::isinstance<PyValue>(b) && b.cast<const PyValue&>().value == a.value;
           })
      .def("__hash__", [](const PyValue& v) { return std::hash<const void*>()(v.value); })
      .def("__repr__", [](const PyValue& v) { return "<Value '" + v.value->name() + "'>"; });

  node_cls.def_property_readonly("op_type", [](const PyNode& n) { return n.node->op_type; })
      .def_property_readonly("domain", [](const PyNode& n) { return n.node->domain.value; })
      .def_property_readonly("name", [](const PyNode& n) { return n.node->name.value; })
      .def_property_readonly("alive", [](const PyNode& n) { return n.node->alive(); })
      .def_property_readonly("inputs",
                             [](const PyNode& n) {
                               py::typing::List<OptValue> l;
                               for (Value* v : live(n)->inputs()) l.append(wrap_value(n.model, v));
                               return l;
                             })
      .def_property_readonly("outputs",
                             [](const PyNode& n) {
                               py::typing::List<OptValue> l;
                               for (Value* v : live(n)->outputs()) l.append(wrap_value(n.model, v));
                               return l;
                             })
      .def_property_readonly(
          "attributes",
          [](const PyNode& n) {
            py::dict d;
            for (const auto& a : live(n)->attributes)
              d[py::str(a.name)] = attribute_value(n.model, a);
            return d;
          },
          "name -> int, float, bytes, Tensor, Graph, or a list of those")
      .def_property_readonly(
          "attribute_refs",
          [](const PyNode& n) {
            py::typing::Dict<py::str, py::str> d;
            for (const auto& a : live(n)->attributes) {
              if (a.ref_attr_name.written()) d[py::str(a.name)] = a.ref_attr_name.value;
            }
            return d;
          },
          "Attributes that refer to an attribute of the enclosing function: name -> referenced "
          "name")
      .def_property_readonly("subgraphs",
                             [](const PyNode& n) {
                               py::typing::List<PyGraph> l;
                               for (Graph* g : live(n)->subgraphs()) l.append(PyGraph{n.model, g});
                               return l;
                             })
      .def_property_readonly("graph",
                             [](const PyNode& n) { return PyGraph{n.model, n.node->graph()}; })
      .def("set_input",
           [](const PyNode& n, int i, std::optional<PyValue> v) {
             live(n)->set_input(i, v ? v->value : nullptr);
           })
      .def("__eq__",
           [](const PyNode& a, const py::object& b) {
             return py::isinstance<PyNode>(b) && b.cast<const PyNode&>().node == a.node;
           })
      .def("__hash__", [](const PyNode& n) { return std::hash<const void*>()(n.node); })
      .def("__repr__", [](const PyNode& n) {
        return "<Node " + n.node->op_type + " '" + n.node->name.value + "'>";
      });

  graph_cls.def_property_readonly("name", [](const PyGraph& g) { return g.graph->name.value; })
      .def_property_readonly("nodes",
                             [](const PyGraph& g) {
                               py::typing::List<PyNode> l;
                               for (Node* n = g.graph->first(); n; n = n->next())
                                 l.append(PyNode{g.model, n});
                               return l;
                             })
      .def_property_readonly("node_count", [](const PyGraph& g) { return g.graph->node_count(); })
      .def_property_readonly("inputs",
                             [](const PyGraph& g) {
                               py::typing::List<OptValue> l;
                               for (Value* v : g.graph->inputs()) l.append(wrap_value(g.model, v));
                               return l;
                             })
      .def_property_readonly("outputs",
                             [](const PyGraph& g) {
                               py::typing::List<OptValue> l;
                               for (Value* v : g.graph->outputs()) l.append(wrap_value(g.model, v));
                               return l;
                             })
      .def_property_readonly("initializers",
                             [](const PyGraph& g) {
                               py::typing::List<PyTensor> l;
                               for (Value* v : g.graph->initializer_order)
                                 l.append(PyTensor{g.model, v->initializer()});
                               return l;
                             })
      .def("initializer",
           [](const PyGraph& g, const std::string& name) -> py::typing::Optional<PyTensor> {
             auto it = g.graph->scope().find(name);
             if (it == g.graph->scope().end() || !it->second->initializer()) return py::none();
             return py::cast(PyTensor{g.model, it->second->initializer()});
           })
      .def(
          "value",
          [](const PyGraph& g, const std::string& name) {
            return wrap_value(g.model, g.graph->lookup(name));
          },
          "The value with this name, looked up in this graph and then enclosing graphs")
      .def_property_readonly(
          "outer_references",
          [](const PyGraph& g) {
            py::typing::List<PyValue> l;
            for (Value* v : g.graph->outer_references()) l.append(PyValue{g.model, v});
            return l;
          },
          "Values of enclosing graphs used in this graph")
      .def_property_readonly(
          "owner", [](const PyGraph& g) { return wrap_node(g.model, g.graph->owner_node()); })
      .def(
          "add_node",
          [](const PyGraph& g, const std::string& op_type,
             const std::vector<std::optional<PyValue>>& inputs,
             const std::vector<std::string>& outputs, const std::string& domain,
             const std::string& name, std::optional<PyNode> before) {
            std::vector<Value*> in;
            for (const auto& v : inputs) in.push_back(v ? v->value : nullptr);
            Node* n = g.graph->create_node(op_type, domain, in, outputs,
                                           before ? live(*before) : nullptr);
            if (!name.empty()) n->name.set(name);
            return PyNode{g.model, n};
          },
          py::arg("op_type"), py::arg("inputs"), py::arg("outputs"), py::arg("domain") = "",
          py::arg("name") = "", py::arg("before") = py::none(),
          "Creates a node; output names are made unique")
      .def("remove_node", [](const PyGraph& g, const PyNode& n) { g.graph->remove_node(live(n)); })
      .def("add_output", [](const PyGraph& g, const PyValue& v) { g.graph->add_output(v.value); })
      .def("topological_sort", [](const PyGraph& g) { g.graph->topological_sort(); })
      .def("__repr__", [](const PyGraph& g) {
        return "<Graph '" + g.graph->name.value + "' " + std::to_string(g.graph->node_count()) +
               " nodes>";
      });

  function_cls
      .def_property_readonly("name", [](const PyFunction& f) { return f.function->name.value; })
      .def_property_readonly("domain", [](const PyFunction& f) { return f.function->domain.value; })
      .def_property_readonly("overload",
                             [](const PyFunction& f) { return f.function->overload.value; })
      .def_property_readonly("attribute_names",
                             [](const PyFunction& f) { return f.function->attribute_names; })
      .def_property_readonly(
          "graph", [](const PyFunction& f) { return PyGraph{f.model, f.function->body.get()}; });

  model_cls
      .def_property_readonly("ir_version",
                             [](const Model& mm) { return mm.ir_version.value_or(0); })
      .def_property_readonly("producer_name",
                             [](const Model& mm) { return mm.producer_name.value; })
      .def_property_readonly("producer_version",
                             [](const Model& mm) { return mm.producer_version.value; })
      .def_property_readonly("domain", [](const Model& mm) { return mm.domain.value; })
      .def_property_readonly("model_version",
                             [](const Model& mm) { return mm.model_version.value_or(0); })
      .def_property_readonly("doc_string", [](const Model& mm) { return mm.doc_string.value; })
      .def_property_readonly("opset_imports",
                             [](const Model& mm) {
                               py::typing::Dict<py::str, int> d;
                               for (const auto& o : mm.opset_import)
                                 d[py::str(o.domain.value)] = o.version.value_or(0);
                               return d;
                             })
      .def_property_readonly("metadata_props",
                             [](const Model& mm) {
                               py::typing::Dict<py::str, py::str> d;
                               for (const auto& kv : mm.metadata_props)
                                 d[py::str(kv.first)] = kv.second;
                               return d;
                             })
      .def_property_readonly("graph",
                             [](const ModelPtr& mm) { return PyGraph{mm, mm->graph.get()}; })
      .def_property_readonly("functions",
                             [](const ModelPtr& mm) {
                               py::typing::List<PyFunction> l;
                               for (const auto& f : mm->functions)
                                 l.append(PyFunction{mm, f.get()});
                               return l;
                             })
      .def(
          "graphs",
          [](const ModelPtr& mm) {
            py::typing::List<PyGraph> l;
            mm->for_each_graph([&](Graph& g) { l.append(PyGraph{mm, &g}); });
            return l;
          },
          "Every graph: the main graph, function bodies and nested subgraphs")
      .def_property_readonly("path",
                             [](const Model& mm) -> py::typing::Optional<py::str> {
                               if (mm.path.empty()) return py::none();
                               return py::str(mm.path);
                             })
      .def_property_readonly("base_dir", [](const Model& mm) { return mm.base_dir; })
      .def("op_counts", &Model::op_counts, py::call_guard<py::gil_scoped_release>(),
           "Operator histogram over all graphs: 'Op' for ai.onnx, 'domain::Op' otherwise")
      .def(
          "node_count",
          [](const Model& mm) {
            int64_t n = 0;
            mm.for_each_graph([&](Graph& g) { n += static_cast<int64_t>(g.node_count()); });
            return n;
          },
          "The number of nodes over all graphs (the sum of op_counts(), without building it)")
      .def("note_edit", &Model::note_edit,
           "Marks the model edited: memoized analyses (the shape facts) recompute")
      .def("verify", &Model::verify, py::call_guard<py::gil_scoped_release>(),
           "Checks the IR's invariants; raises ModelError naming the first broken one")
      .def(
          "external_checksums",
          [](const Model& mm) {
            py::typing::List<py::typing::Tuple<py::str, py::str, py::str>> out;
            mm.for_each_graph([&](Graph& g) {
              for (Value* v : g.initializer_order) {
                const Tensor& t = *v->initializer();
                if (!t.is_external()) continue;
                for (const auto& kv : t.external->entries) {
                  if (kv.first == "checksum") {
                    out.append(py::make_tuple(t.name.value, t.external->file->path(), kv.second));
                  }
                }
              }
            });
            return out;
          },
          "(tensor, data file, checksum) of each external tensor with a 'checksum' key "
          "(fastopt.verify_checksums checks them)")
      .def(
          "num_parameters",
          [](const Model& mm) {
            uint64_t n = 0;
            mm.for_each_graph([&](Graph& g) {
              for (Value* v : g.initializer_order) n += v->initializer()->numel();
            });
            return n;
          },
          "Elements in all initializers (subgraphs included)")
      .def(
          "parameter_bytes",
          [](const Model& mm) {
            uint64_t n = 0;
            mm.for_each_graph([&](Graph& g) {
              for (Value* v : g.initializer_order) n += v->initializer()->nbytes();
            });
            return n;
          },
          "Bytes of all initializers (subgraphs included)")
      .def("external_data_files",
           [](const Model& mm) {
             std::vector<std::string> out;
             for (const auto& kv : mm.external_files) out.push_back(kv.first);
             return out;
           })
      .def("self_contained_size", &self_contained_size, py::call_guard<py::gil_scoped_release>(),
           "Bytes of the model serialized with all data inline")
      .def(
          "skeleton",
          [](Model& mm, uint64_t threshold_bytes) {
            std::string s;
            {
              py::gil_scoped_release release;
              s = serialize_skeleton(mm, threshold_bytes);
            }
            return py::bytes(s);
          },
          py::arg("threshold_bytes") = 1024,
          R"doc(The model as ModelProto bytes with every tensor payload of at least threshold_bytes
replaced by an external-data placeholder (location '*fastopt-skeleton*', offset = an index into
a table this Model keeps). Small whatever the weights weigh: hand it to tools that edit
ModelProtos (onnx shape inference, version conversion), then bind the result back with
fastopt._C.load_skeleton(bytes, model) or apply its types with Model.apply_types.)doc")
      .def(
          "apply_types",
          [](ModelPtr& mm, py::bytes data) {
            std::string s = data;
            py::gil_scoped_release release;
            auto inferred = read_skeleton(std::make_shared<OwnedBuffer>(std::move(s)), *mm);
            return apply_types(*mm, *inferred);
          },
          py::arg("skeleton_bytes"),
          "Applies the value types of an edited skeleton of this model (e.g. after onnx shape "
          "inference): values are matched by name per graph; a type is set where missing and "
          "refined where the other is more specific; graph inputs keep theirs. Values whose type "
          "changed get value_info entries. Returns how many changed.")
      .def(
          "serialize",
          [](const Model& mm) {
            std::string s;
            {
              py::gil_scoped_release release;
              s = serialize_model(mm);
            }
            return py::bytes(s);
          },
          "The model as ModelProto bytes, all data inline (under 2 GB only)")
      .def(
          "to_onnx",
          [](const Model& mm) {
            std::string s;
            {
              py::gil_scoped_release release;
              s = serialize_model(mm);
            }
            py::object parse = py::module_::import("onnx").attr("ModelProto").attr("FromString");
            try {
              return parse(py::bytes(s));
            } catch (py::error_already_set& e) {
              // Protobuf refuses some models fastopt reads (nesting past its depth limit of 100):
              // a ModelError, with protobuf's exception as __cause__.
              if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_MemoryError)) throw;
              const std::string text =
                  "to_onnx: protobuf cannot parse this model (" + std::string(e.what()) + ")";
              py::raise_from(e, model_error.ptr(), text.c_str());
              throw py::error_already_set();
            }
          },
          "The model as an onnx.ModelProto, all data inline (for models under 2 GB)")
      .def(
          "save",
          [](const Model& mm, const py::object& path, const py::object& external_data,
             const std::string& location, uint64_t size_threshold, uint64_t align,
             uint64_t max_file_bytes, const std::map<std::string, py::bytes>& side_files) {
            SaveOptions o;
            for (const auto& [name, bytes] : side_files) o.side_files.emplace_back(name, bytes);
            o.location = location;
            if (external_data.is_none()) {
              o.external = SaveOptions::External::kAuto;
            } else if (py::isinstance<py::str>(external_data)) {
              o.external = SaveOptions::External::kAlways;
              o.location = external_data.cast<std::string>();
            } else if (py::isinstance<py::bool_>(external_data)) {
              o.external = external_data.cast<bool>() ? SaveOptions::External::kAlways
                                                      : SaveOptions::External::kNever;
            } else {
              throw ModelError("external_data must be None, a bool, or a file name");
            }
            o.size_threshold = size_threshold;
            o.align = align;
            o.max_file_bytes = max_file_bytes;
            std::string p = fspath(path);
            py::gil_scoped_release release;
            write_model_file(mm, p, o);
          },
          py::arg("path"), py::arg("external_data") = py::none(), py::kw_only(),
          py::arg("location") = "", py::arg("size_threshold") = 1024, py::arg("align") = 0,
          py::arg("max_file_bytes") = 0, py::arg("side_files") = std::map<std::string, py::bytes>{},
          R"doc(Writes the model: complete or absent at every instant, never over the loaded model's files.

Files are written unnamed and named at the end, data files before the model file (the old
model file is removed first, so it never sits beside new data); missing folders are created.
A path that is the loaded model's own file or one of its external data files (by identity:
links and symlinks included), a directory, FIFO, socket or device is refused (ModelError), as
is a save after one of the loaded files shrank or changed.

external_data: None writes a self-contained file when it fits protobuf's 2 GB limit and
external data otherwise; True always moves tensors of at least size_threshold bytes to
`location` (default '<file name>.data') beside the model; False never does (ModelError over
2 GB); a string is True with that location. align pads each tensor's offset in the data file to
a multiple of it (4096 lets runtimes mmap tensors); max_file_bytes > 0 splits the data into
several files. side_files ({name: bytes}) are written beside the model and committed with it
(genai_config.json: never beside another model file).)doc");

  m.def(
      "write_file",
      [](const py::object& path, py::bytes data) {
        std::string p = fspath(path);
        std::string s = data;
        py::gil_scoped_release release;
        write_output_file(p, s);
      },
      py::arg("path"), py::arg("data"),
      "Writes a small output file (e.g. genai_config.json) as Model.save writes a model file");
  m.def(
      "load",
      [](const py::object& path) {
        std::string p = fspath(path);
        py::gil_scoped_release release;
        return std::shared_ptr<Model>(read_model_file(p));
      },
      py::arg("path"), "Reads an ONNX model file (memory-mapped; weights are not copied)");
  m.def(
      "load_bytes",
      [](py::bytes data, const std::string& base_dir) {
        std::string s = data;
        py::gil_scoped_release release;
        return std::shared_ptr<Model>(
            read_model_from_buffer(std::make_shared<OwnedBuffer>(std::move(s)), base_dir));
      },
      py::arg("data"), py::arg("base_dir") = "", "Reads a serialized ModelProto held in memory");
  m.def(
      "load_skeleton",
      [](py::bytes data, const ModelPtr& original) {
        std::string s = data;
        py::gil_scoped_release release;
        return std::shared_ptr<Model>(
            read_skeleton(std::make_shared<OwnedBuffer>(std::move(s)), *original));
      },
      py::arg("data"), py::arg("original"),
      "Reads a skeleton of `original` (Model.skeleton bytes, possibly edited by onnx tools): "
      "placeholders take the original's tensor bytes as views (no copy); the new Model keeps "
      "the original's buffers alive");
  m.def("dtype_name", &dtype_name);
  m.def(
      "make_tensor",
      [](int32_t dtype, std::vector<int64_t> dims, py::bytes data) {
        return PyTensor{nullptr, make_tensor(dtype, std::move(dims), std::string(data))};
      },
      py::arg("dtype"), py::arg("dims"), py::arg("data"), "A new tensor owning a copy of `data`");
  m.def("native_fold_ops", &passes::native_fold_ops,
        "Op types fold_constants evaluates natively (others go to fold_constants_ort)");
  m.def(
      "native_fold_unsupported",
      [](const PyNode& n, uint64_t max_bytes, uint64_t max_expand_bytes) {
        Node* node = live(n);
        passes::FoldLimits limits;
        limits.max_bytes = max_bytes;
        limits.max_expand_bytes = max_expand_bytes;
        bool unsupported = false;
        passes::evaluate_node(*node, passes::graph_opset(*n.model, *node->graph()), limits,
                              &unsupported);
        return unsupported;
      },
      py::arg("node"), py::arg("max_bytes"), py::arg("max_expand_bytes"),
      "True when fold_constants declines this node (inputs constant, outputs within the limits) "
      "only for lack of a native implementation for its types: ONNX Runtime may fold it");
  m.def(
      "constant_nodes_model",
      [](const std::vector<PyNode>& nodes, const std::optional<std::vector<PyValue>>& outputs) {
        std::vector<Node*> ns;
        ModelPtr model;
        for (const PyNode& n : nodes) {
          ns.push_back(live(n));
          model = n.model;
        }
        if (ns.empty()) throw ModelError("constant_nodes_model: no nodes");
        std::vector<Value*> outs;
        for (const PyValue& v : outputs.value_or(std::vector<PyValue>{})) outs.push_back(v.value);
        std::string s = passes::constant_nodes_model(*model, ns, outs);
        return py::bytes(s);
      },
      py::arg("nodes"), py::arg("outputs") = py::none(),
      "A serialized model computing `nodes` (one graph, topological order, inputs constant or "
      "computed by earlier nodes of the list); its graph outputs are `outputs` (default: every "
      "output of the nodes)");

  bind_passes(m);
  bind_patterns(m);
  bind_analysis(m);
}
