// Bindings fold_constants_ort needs from fold_constants: the ops it folds natively, whether it
// declines a node only for lack of a kernel, and a model computing constant nodes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/handles.h"
#include "ir/error.h"
#include "ir/graph.h"
#include "passes/fold/fold_constants.h"

namespace fastopt::bindings {

void bind_folding(py::module_& m) {
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
}

}  // namespace fastopt::bindings
