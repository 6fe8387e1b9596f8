// Python bindings: thin handles over the C++ IR. Every handle keeps its Model alive; nodes and
// values are never freed before the model, so a handle never dangles (a removed node reports
// alive == False). Long operations release the GIL.
//
// One file per group, the classes declared here first so that every signature can name any of
// them: ir_objects.cc (Tensor, Value, Node, Graph, Function), model.cc (Model, load and save),
// folding.cc, passes.cc, patterns.cc, analysis.cc.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <cstring>

#include "bindings/handles.h"
#include "ir/error.h"

namespace py = pybind11;
using namespace fastopt;
using namespace fastopt::bindings;

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

  bind_ir_objects(m, tensor_cls, value_cls, node_cls, graph_cls, function_cls);
  bind_model(m, model_cls);
  bind_folding(m);
  bind_passes(m);
  bind_quant(m);
  bind_patterns(m);
  bind_analysis(m);
}
