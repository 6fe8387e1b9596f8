// Python handles over IR objects. Each keeps its Model alive; nodes and values are never freed
// before their model, so a handle never dangles.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/typing.h>

#include <memory>

#include "ir/error.h"
#include "ir/graph.h"

namespace fastopt::bindings {

namespace py = pybind11;

using ModelPtr = std::shared_ptr<Model>;

struct PyGraph {
  ModelPtr model;
  Graph* graph;
};
struct PyNode {
  ModelPtr model;
  Node* node;
};
struct PyValue {
  ModelPtr model;
  Value* value;
};
struct PyTensor {
  ModelPtr model;  // may be null for tensors made from Python
  std::shared_ptr<Tensor> tensor;
};
struct PyFunction {
  ModelPtr model;
  Function* function;
};
// Read-only bytes exposed through the buffer protocol; keeps the source mapping alive.
struct Bytes {
  ByteRef ref;
};

using OptValue = py::typing::Optional<PyValue>;
using OptNode = py::typing::Optional<PyNode>;

inline OptValue wrap_value(const ModelPtr& m, Value* v) {
  if (!v) return py::none();
  return py::cast(PyValue{m, v});
}
inline OptNode wrap_node(const ModelPtr& m, Node* n) {
  if (!n) return py::none();
  return py::cast(PyNode{m, n});
}

inline Node* live(const PyNode& n) {
  if (!n.node->alive()) throw ModelError("node '" + n.node->name.value + "' was removed");
  return n.node;
}

void bind_ir_objects(py::module_& m, py::class_<PyTensor>& tensor_cls,
                     py::class_<PyValue>& value_cls, py::class_<PyNode>& node_cls,
                     py::class_<PyGraph>& graph_cls, py::class_<PyFunction>& function_cls);
void bind_model(py::module_& m, py::class_<Model, ModelPtr>& model_cls);  // model.cc
void bind_folding(py::module_& m);                                        // folding.cc
void bind_patterns(py::module_& m);
void bind_analysis(py::module_& m);
void bind_passes(py::module_& m);  // passes.cc
void bind_quant(py::module_& m);   // quant.cc

}  // namespace fastopt::bindings
