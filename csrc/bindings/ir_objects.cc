// Bindings of the IR objects: Tensor (bytes through the buffer protocol, never copied), Value,
// Node, Graph and Function handles. Each handle keeps its Model alive (handles.h).
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
#include "passes/fold/fold_constants.h"

namespace fastopt::bindings {
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

}  // namespace

void bind_ir_objects(py::module_& m, py::class_<PyTensor>& tensor_cls,
                     py::class_<PyValue>& value_cls, py::class_<PyNode>& node_cls,
                     py::class_<PyGraph>& graph_cls, py::class_<PyFunction>& function_cls) {
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
}

}  // namespace fastopt::bindings
