// Python bindings for patterns and rules. Patterns built from Python are compiled into the same
// C++ Pattern objects the C++ passes use and are matched in C++; Python code runs only when a
// match is complete (a rewrite callback), never per candidate node.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/handles.h"
#include "ir/constant.h"
#include "ir/error.h"
#include "pattern/pattern.h"
#include "pattern/rewrite.h"

namespace fastopt::bindings {

namespace {

using pattern::Pattern;

struct PyPattern {
  std::shared_ptr<Pattern> pattern;
};
struct PyPat {  // one node of a pattern
  std::shared_ptr<Pattern> pattern;
  int id;
  pattern::P p() const { return pattern::P(pattern.get(), id); }
};
struct PyMatch {
  ModelPtr model;
  const pattern::Match* match;
};
struct PyRewriter {
  ModelPtr model;
  pattern::Rewriter* rw;
};

std::vector<pattern::P> to_ps(const std::vector<PyPat>& in) {
  std::vector<pattern::P> out;
  for (const auto& x : in) out.push_back(x.p());
  return out;
}

// Python value -> Attribute. ints, floats, str/bytes, lists of those, numpy arrays (tensors).
Attribute to_attribute(const std::string& name, const py::handle& v) {
  if (py::isinstance<py::bool_>(v) || py::isinstance<py::int_>(v)) {
    return pattern::attr_int(name, v.cast<int64_t>());
  }
  if (py::isinstance<py::float_>(v)) return pattern::attr_float(name, v.cast<float>());
  if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v)) {
    return pattern::attr_string(name, v.cast<std::string>());
  }
  if (py::isinstance<PyTensor>(v)) return pattern::attr_tensor(name, v.cast<PyTensor>().tensor);
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    py::sequence seq = v.cast<py::sequence>();
    bool all_int = true;
    for (auto item : seq) all_int = all_int && py::isinstance<py::int_>(item);
    if (all_int) return pattern::attr_ints(name, v.cast<std::vector<int64_t>>());
    return pattern::attr_floats(name, v.cast<std::vector<float>>());
  }
  py::object tensor = py::module_::import("fastopt._numpy").attr("tensor_from_numpy")(v);
  return pattern::attr_tensor(name, tensor.cast<PyTensor>().tensor);
}

std::vector<Attribute> to_attributes(const py::dict& attrs) {
  std::vector<Attribute> out;
  for (auto kv : attrs) out.push_back(to_attribute(kv.first.cast<std::string>(), kv.second));
  return out;
}

// A replacement given as data: op type, inputs by pattern name, attributes (a string "$name"
// takes the scalar value of the named constant), domain. Runs without Python.
struct Template {
  std::string op_type;
  std::vector<std::string> inputs;
  std::vector<std::pair<std::string, py::object>> attrs;  // converted at rule creation
  std::vector<Attribute> fixed;
  std::vector<std::pair<std::string, std::string>> from_scalars;  // attr name -> pattern name
  std::string domain;
};

pattern::RewriteFn template_rewrite(std::shared_ptr<Template> t) {
  return [t](const pattern::Match& m, pattern::Rewriter& rw) -> pattern::Replacement {
    std::vector<Value*> inputs;
    for (const auto& name : t->inputs) {
      if (name.empty()) {
        inputs.push_back(nullptr);
        continue;
      }
      Value* v = m.value(name);
      if (!v) return rw.fail("replacement input '" + name + "' is not bound");
      inputs.push_back(v);
    }
    std::vector<Attribute> attrs;
    for (const auto& a : t->fixed) attrs.push_back(pattern::copy_attribute(a));
    for (const auto& [attr, source] : t->from_scalars) {
      auto s = constant_scalar(m.value(source));
      if (!s) return rw.fail("'" + source + "' is not a scalar constant");
      attrs.push_back(pattern::attr_float(attr, static_cast<float>(*s)));
    }
    return std::vector<Value*>{rw.op1(t->op_type, inputs, std::move(attrs), t->domain)};
  };
}

pattern::RewriteFn python_rewrite(py::function fn, ModelPtr* current_model) {
  return
      [fn, current_model](const pattern::Match& m, pattern::Rewriter& rw) -> pattern::Replacement {
        py::gil_scoped_acquire gil;
        py::object result = fn(PyMatch{*current_model, &m}, PyRewriter{*current_model, &rw});
        if (result.is_none())
          return rw.failure().empty() ? rw.fail("the rewrite returned None") : std::nullopt;
        std::vector<Value*> out;
        for (auto item : result.cast<py::sequence>()) {
          out.push_back(item.is_none() ? nullptr : item.cast<PyValue>().value);
        }
        return out;
      };
}

struct PyRule {
  std::string name;
  std::shared_ptr<Pattern> pattern;
  py::object rewrite;  // a callable, or None when `tmpl` is set
  std::shared_ptr<Template> tmpl;
};

}  // namespace

void bind_patterns(py::module_& m) {
  py::class_<PyPattern> pattern_cls(m, "Pattern", "A declarative pattern, matched in C++");
  py::class_<PyPat> pat_cls(m, "PatternNode", "One node of a pattern (an op, a var, ...)");
  py::class_<PyMatch> match_cls(m, "Match", "A complete match (valid during the rewrite call)");
  py::class_<PyRewriter> rewriter_cls(m, "Rewriter",
                                      "Builds replacement nodes (valid during the rewrite call)");
  py::class_<PyRule> rule_cls(m, "Rule", "A pattern and its rewrite");

  pattern_cls
      .def(py::init(
               [](const std::string& name) { return PyPattern{std::make_shared<Pattern>(name)}; }),
           py::arg("name"))
      .def_property_readonly("name", [](const PyPattern& p) { return p.pattern->name(); })
      .def(
          "var",
          [](const PyPattern& p, const std::string& name) {
            return PyPat{p.pattern, p.pattern->var(name).id()};
          },
          py::arg("name"), "Anything; the same name twice must be the same value")
      .def(
          "op",
          [](const PyPattern& p, py::object op_type, const std::vector<PyPat>& inputs,
             const std::string& domain, const std::string& name) {
            std::vector<std::string> types;
            if (py::isinstance<py::str>(op_type))
              types.push_back(op_type.cast<std::string>());
            else
              types = op_type.cast<std::vector<std::string>>();
            int id = p.pattern->op_any(types, to_ps(inputs), domain).id();
            if (!name.empty()) p.pattern->node(id).name = name;
            return PyPat{p.pattern, id};
          },
          py::arg("op_type"), py::arg("inputs"), py::arg("domain") = "", py::arg("name") = "",
          "An op (or any of a list of op types) producing the value")
      .def(
          "scalar",
          [](const PyPattern& p, const std::string& name, double value, double tol) {
            return PyPat{p.pattern, p.pattern->scalar(name, value, tol).id()};
          },
          py::arg("name"), py::arg("value"), py::arg("tolerance") = 1e-6,
          "A constant whose elements are all within tolerance of value")
      .def(
          "constant",
          [](const PyPattern& p, const std::string& name) {
            return PyPat{p.pattern, p.pattern->any_constant(name).id()};
          },
          py::arg("name"), "Any constant (initializer or Constant output)")
      .def(
          "alt",
          [](const PyPattern& p, const std::string& name, const std::vector<PyPat>& a) {
            return PyPat{p.pattern, p.pattern->alt(name, to_ps(a)).id()};
          },
          py::arg("name"), py::arg("alternatives"))
      .def(
          "optional",
          [](const PyPattern& p, const PyPat& op) {
            return PyPat{p.pattern, p.pattern->optional(op.p()).id()};
          },
          py::arg("op"), "Matches the op, or skips it to its first input")
      .def("root", [](const PyPattern& p, const PyPat& r) { p.pattern->root(r.p()); })
      .def_property_readonly("benefit", [](const PyPattern& p) { return p.pattern->benefit(); });

  pat_cls.def_property_readonly("name", [](const PyPat& p) { return p.pattern->node(p.id).name; })
      .def("commutative",
           [](PyPat& p) {
             p.p().commutative();
             return p;
           })
      .def("output",
           [](PyPat& p, int i) {
             p.p().output(i);
             return p;
           })
      .def("extra_inputs",
           [](PyPat& p) {
             p.p().extra_inputs();
             return p;
           })
      .def("shared",
           [](PyPat& p) {
             p.p().shared();
             return p;
           })
      .def("dtype_in",
           [](PyPat& p, std::vector<int32_t> d) {
             p.p().dtype_in(std::move(d));
             return p;
           })
      .def("rank",
           [](PyPat& p, int r) {
             p.p().rank(r);
             return p;
           })
      .def(
          "dim",
          [](PyPat& p, int axis, const std::string& symbol) {
            p.p().dim(axis, symbol);
            return p;
          },
          py::arg("axis"), py::arg("symbol"),
          "Dim `axis` must be known and equal to every other dim bound to `symbol` in the match")
      .def(
          "attr",
          [](PyPat& p, const std::string& name, py::object value) {
            pattern::P h = p.p();
            if (value.is_none())
              h.attr_absent(name);
            else if (py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value))
              h.attr_int(name, value.cast<int64_t>());
            else if (py::isinstance<py::float_>(value))
              h.attr_float(name, value.cast<float>(), 1e-6f);
            else if (py::isinstance<py::str>(value) || py::isinstance<py::bytes>(value))
              h.attr_string(name, value.cast<std::string>());
            else
              h.attr_ints(name, value.cast<std::vector<int64_t>>());
            return p;
          },
          py::arg("name"), py::arg("value"), "Requires an attribute value (None: must be absent)");

  match_cls
      .def(
          "__getitem__",
          [](const PyMatch& m, const std::string& name) {
            Value* v = m.match->value(name);
            if (!v && m.match->pattern().find(name) < 0) throw py::key_error(name);
            return wrap_value(m.model, v);
          },
          "The value bound to a pattern node by name")
      .def(
          "node",
          [](const PyMatch& m, const std::string& name) {
            return wrap_node(m.model, m.match->node(name));
          },
          "The graph node matched by a pattern op node (None for a skipped optional)")
      .def_property_readonly("root",
                             [](const PyMatch& m) { return PyNode{m.model, m.match->root()}; })
      .def(
          "scalar",
          [](const PyMatch& m, const std::string& name) -> std::optional<double> {
            return constant_scalar(m.match->value(name));
          },
          "The value of a single-element constant bound to `name`, or None");

  rewriter_cls
      .def(
          "op",
          [](const PyRewriter& r, const std::string& op_type,
             const std::vector<std::optional<PyValue>>& inputs, const py::dict& attrs,
             int num_outputs, const std::string& domain) {
            std::vector<Value*> in;
            for (const auto& v : inputs) in.push_back(v ? v->value : nullptr);
            py::typing::List<OptValue> out;
            for (Value* v : r.rw->op(op_type, in, to_attributes(attrs), num_outputs, domain)) {
              out.append(wrap_value(r.model, v));
            }
            return out;
          },
          py::arg("op_type"), py::arg("inputs"), py::arg("attributes") = py::dict(),
          py::arg("num_outputs") = 1, py::arg("domain") = "",
          "Adds a node before the matched root; returns its outputs")
      .def(
          "initializer",
          [](const PyRewriter& r, const std::string& name, py::object array) {
            py::object t = py::module_::import("fastopt._numpy").attr("tensor_from_numpy")(array);
            return PyValue{r.model, r.rw->initializer(name, t.cast<PyTensor>().tensor)};
          },
          py::arg("name"), py::arg("array"), "Adds an initializer holding a copy of `array`")
      .def(
          "fail",
          [](const PyRewriter& r, const std::string& reason) {
            r.rw->fail(reason);
            return py::none();
          },
          "Declines the rewrite; `return rw.fail('why')`");

  rule_cls
      .def(
          py::init([](const std::string& name, const PyPattern& p, py::object rewrite,
                      py::object replace) {
            if (p.pattern->root_id() < 0) throw ModelError("pattern '" + name + "' has no root");
            PyRule r{name, p.pattern, py::none(), nullptr};
            if (!rewrite.is_none() == !replace.is_none()) {
              throw ModelError("a Rule takes exactly one of rewrite= and replace=");
            }
            if (!rewrite.is_none()) {
              r.rewrite = rewrite;
              return r;
            }
            // replace=(op_type, [input names], {attrs}, domain)
            py::sequence spec = replace.cast<py::sequence>();
            auto t = std::make_shared<Template>();
            t->op_type = spec[0].cast<std::string>();
            t->inputs = spec[1].cast<std::vector<std::string>>();
            if (spec.size() > 2) {
              for (auto kv : spec[2].cast<py::dict>()) {
                std::string attr = kv.first.cast<std::string>();
                if (py::isinstance<py::str>(kv.second) &&
                    kv.second.cast<std::string>().rfind("$", 0) == 0) {
                  t->from_scalars.emplace_back(attr, kv.second.cast<std::string>().substr(1));
                } else {
                  t->fixed.push_back(to_attribute(attr, kv.second));
                }
              }
            }
            if (spec.size() > 3) t->domain = spec[3].cast<std::string>();
            r.tmpl = t;
            return r;
          }),
          py::arg("name"), py::arg("pattern"), py::arg("rewrite") = py::none(),
          py::arg("replace") = py::none(),
          R"doc(A rule: `pattern` plus either `rewrite(match, rewriter) -> list[Value | None] | None`
(Python, called only on complete matches) or `replace=(op_type, [pattern names], {attributes},
domain)` (runs entirely in C++; an attribute value "$name" takes the scalar constant bound to
`name`).)doc")
      .def_readonly("name", &PyRule::name);

  m.def(
      "apply_rules",
      [](const ModelPtr& model, const std::vector<PyRule>& rules, int max_iterations,
         const std::string& explain_rule) {
        ModelPtr current = model;
        std::vector<pattern::Rule> cpp;
        for (const auto& r : rules) {
          pattern::RewriteFn fn = r.tmpl ? template_rewrite(r.tmpl)
                                         : python_rewrite(r.rewrite.cast<py::function>(), &current);
          cpp.push_back({r.name, r.pattern, std::move(fn)});
        }
        pattern::ApplyOptions o;
        o.max_iterations = max_iterations;
        o.explain_rule = explain_rule;
        std::vector<std::string> lines;
        o.explain_lines = explain_rule.empty() ? nullptr : &lines;
        pattern::ApplyStats stats;
        {
          py::gil_scoped_release release;
          stats = pattern::apply_rules(*model, cpp, o);
        }
        return py::make_tuple(stats.rewrites, stats.per_rule, lines);
      },
      py::arg("model"), py::arg("rules"), py::arg("max_iterations") = 10,
      py::arg("explain_rule") = "",
      "Applies rules to a fixed point; returns (rewrites, per-rule counts, explanation lines)");
}

}  // namespace fastopt::bindings
