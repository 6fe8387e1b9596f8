// Bindings for the shape analysis (csrc/analysis): the native shape-inference step and a view
// of the facts for tests and tools.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "analysis/shape_facts.h"
#include "bindings/handles.h"

namespace fastopt::bindings {

namespace {
// Facts memoized on a model: recomputed on the first query after an edit.
struct PyShapeFacts {
  ModelPtr model;
  std::shared_ptr<analysis::ShapeFacts> facts;
};

py::object spell(analysis::ShapeFacts& f, const analysis::DimExpr& e) {
  if (auto c = e.constant_value()) return py::int_(*c);
  return py::str(f.symbols().str(e));
}

py::object facts_tuple(analysis::ShapeFacts& facts, const analysis::Facts& f) {
  py::object dims = py::none(), value = py::none();
  if (f.ranked) {
    py::list l;
    for (const auto& d : f.dims) l.append(spell(facts, d));
    dims = l;
  }
  if (f.has_value) {
    py::list l;
    for (const auto& d : f.value) l.append(spell(facts, d));
    value = l;
  }
  return py::make_tuple(f.dtype, dims, value);
}
}  // namespace

void bind_analysis(py::module_& m) {
  py::class_<PyShapeFacts>(m, "ShapeFacts",
                           "The C++ shape analysis of a model's main graph, memoized until an edit")
      .def(py::init([](const ModelPtr& model) {
             return PyShapeFacts{model, std::make_shared<analysis::ShapeFacts>(*model)};
           }),
           py::arg("model"))
      .def(
          "facts",
          [](PyShapeFacts& self, const std::string& name) -> py::object {
            const Value* v = self.model->graph->lookup(name);
            const analysis::Facts* f = v ? self.facts->facts(v) : nullptr;
            if (!f) return py::none();
            return facts_tuple(*self.facts, *f);
          },
          py::arg("name"),
          "(dtype, dims, shape value) of the named value (see shape_facts), or None")
      .def(
          "same_dim",
          [](PyShapeFacts& self, const std::string& a, int axis_a, const std::string& b,
             int axis_b) {
            const Value* x = self.model->graph->lookup(a);
            const Value* y = self.model->graph->lookup(b);
            return x && y && self.facts->same_dim(x, axis_a, y, axis_b);
          },
          py::arg("a"), py::arg("axis_a"), py::arg("b"), py::arg("axis_b"),
          "Dim axis_a of value a and axis_b of value b are proven equal (the same expression, or "
          "equated by a declared type)")
      .def_property_readonly(
          "computations", [](const PyShapeFacts& self) { return self.facts->computations(); },
          "How many times the facts were computed");
  m.def(
      "analyze_shapes",
      [](const ModelPtr& model, bool apply) {
        py::gil_scoped_release release;
        analysis::ShapeFacts& facts = analysis::facts_of(*model);
        const int64_t changed = apply ? facts.apply_to_types(*model) : 0;
        return std::make_pair(changed, facts.unknown_ops());
      },
      py::arg("model"), py::arg("apply") = true,
      R"doc(Runs the C++ shape analysis on the main graph (If/Loop/Scan bodies included); with
`apply`, writes what it proves into the value types (refining, never losing, what they say;
changed values get value_info).
Returns (values whose type changed, {op: count} of nodes it has no rule for).)doc");
  m.def(
      "shape_analysis_summary",
      [](const ModelPtr& model) {
        py::gil_scoped_release release;
        analysis::ShapeFacts& facts = analysis::facts_of(*model);
        return std::make_pair(facts.analysed_nodes(), facts.analysed_bodies());
      },
      py::arg("model"),
      R"doc((nodes the C++ shape analysis gave facts to, If/Loop/Scan bodies it analysed) for the
model's shared analysis (the one analyze_shapes runs; memoized until an edit).)doc");
  m.def(
      "shape_facts",
      [](const ModelPtr& model, bool subgraphs) {
        analysis::ShapeFacts facts(*model);
        py::dict out;
        auto add = [&](const Graph& g) {
          for (const auto& kv : g.scope()) {
            const Value* v = kv.second;
            if (!v->defined()) continue;
            const analysis::Facts* f = facts.facts(v);
            if (!f) continue;
            out[py::str(v->name())] = facts_tuple(facts, *f);
          }
        };
        add(*model->graph);
        if (subgraphs) for_each_subgraph(*model->graph, add);
        return out;
      },
      py::arg("model"), py::arg("subgraphs") = false,
      R"doc({value name: (dtype, dims, shape value)} for the main graph (with `subgraphs`, the
values of If/Loop/Scan bodies too; names are unique across them): dims and elements are
ints, or strings spelling expressions of symbols ('?N' names a fresh symbol: unknown, but equal
wherever it appears); None when the rank / the elements are unknown.)doc");
}

}  // namespace fastopt::bindings
