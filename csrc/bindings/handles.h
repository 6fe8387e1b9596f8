// Python handles over IR objects. Each keeps its Model alive; nodes and values are never freed
// before their model, so a handle never dangles.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/typing.h>

#include <memory>

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

void bind_patterns(py::module_& m);
void bind_analysis(py::module_& m);
void bind_passes(py::module_& m);  // passes.cc

}  // namespace fastopt::bindings
