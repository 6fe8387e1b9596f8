// Constant folding: nodes whose inputs are all constants become constants.
//
//   c1 (initializer) ──┐
//   c2 = Constant() ───┴─ Op ── y ── ...       =>       y' (initializer) ── ...
//
// Exporters leave constant subexpressions behind, above all in the shape arithmetic around
// Reshape/Expand/Slice (Unsqueeze, Concat, Cast, Gather, Range over constants; TorchScript
// exports emit a Constant node for every literal). The ops of such chains are evaluated here,
// natively and bit-exactly (see fold_constants.h); other ops are left to the ONNX Runtime
// fallback (the Python pass fold_constants_ort).
//
// What folds: ai.onnx nodes without subgraphs whose inputs are initializers that are not graph
// inputs, or Constant outputs; deterministic ops only; outputs within the size limits
// (options fold_max_bytes, fold_max_expand_bytes); values on which ONNX Runtime fails, traps or
// differs from ONNX's spec stay (counter refused_<Op>(<why>), --explain fold_constants).
// Constant nodes themselves become initializers (zero copy), except in function bodies, which
// cannot hold initializers, in models of IR version < 4, whose initializers are all graph
// inputs, and for graph outputs.
// Identity of a constant forwards the constant.
#include "passes/fold/fold_constants.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "ir/constant.h"
#include "ir/error.h"
#include "passes/registry.h"
#include "pattern/rewrite.h"
#include "proto/onnx_writer.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {

namespace {

bool standard_domain(const Node& n) {
  return n.domain.value.empty() || n.domain.value == "ai.onnx";
}

bool all_inputs_constant(const Node& n) {
  bool any = false;
  for (Value* v : n.inputs()) {
    if (!v) continue;
    if (!constant_tensor(v)) return false;
    any = true;
  }
  return any;
}

bool used(const Value* v) {
  return v && (!v->uses().empty() || v->is_graph_output());
}

bool dead(const Node& n) {
  for (Value* v : n.outputs()) {
    if (used(v)) return false;
  }
  return true;
}

struct Folder {
  Model& model;
  PassContext& ctx;
  FoldLimits limits;
  std::vector<std::pair<Graph*, Value*>> created;  // new initializers

  int64_t run() {
    std::vector<Graph*> graphs;
    model.for_each_graph([&](Graph& g) { graphs.push_back(&g); });
    int64_t rewrites = 0;
    for (Graph* g : graphs) rewrites += fold_graph(*g);
    // Constants made here that later folds left unused.
    std::map<Graph*, std::vector<Value*>> unused;
    for (auto [g, v] : created) {
      if (v->initializer() && v->uses().empty() && !v->is_graph_output()) unused[g].push_back(v);
    }
    for (auto& [g, vs] : unused) g->remove_initializers(vs);
    return rewrites;
  }

  int64_t fold_graph(Graph& g) {
    const int64_t opset = graph_opset(model, g);
    const bool initializers_allowed = !in_function(model, g) && model.ir_version.value_or(0) >= 4;
    int64_t rewrites = 0;
    for (Node *n = g.first(), *next; n; n = next) {
      next = n->next();
      if (!standard_domain(*n) || !n->subgraphs().empty()) continue;
      if (n->op_type == "Constant") {
        rewrites += initializers_allowed && lift(g, n);
      } else if (all_inputs_constant(*n) && !dead(*n)) {
        rewrites += n->op_type == "Identity" ? fold_identity(g, n) : fold_node(g, n, opset);
      }
    }
    return rewrites;
  }

  // Identity(constant): its readers read the constant.
  bool fold_identity(Graph& g, Node* n) {
    Value* x = n->inputs()[0];
    Value* y = n->outputs()[0];
    if (!y || !pattern::can_replace(g, y, x) || x->graph() != &g) return false;
    pattern::replace_value(g, y, x);
    g.remove_node(n);
    ++ctx.counters["folded_Identity"];
    return true;
  }

  // A node of constant inputs evaluated: its used outputs become constants, and it goes with
  // the Constant nodes only it read (function bodies keep Constant nodes).
  bool fold_node(Graph& g, Node* n, int64_t opset) {
    eval::Refusal refused;
    auto outs = evaluate_node(*n, opset, limits, nullptr, &refused);
    if (!outs && !refused.code.empty()) {
      // Values ONNX Runtime fails on or computes otherwise than ONNX: left to run time.
      ++ctx.counters["refused_" + n->op_type + "(" + refused.code + ")"];
      ctx.explain("fold_constants", (n->name.value.empty() ? n->op_type : n->name.value) +
                                        ": not folded: " + refused.text);
    }
    if (!outs || outs->size() != n->outputs().size()) return false;
    for (size_t i = 0; i < outs->size(); ++i) {
      Value* v = n->outputs()[i];
      if (!used(v)) continue;
      Value* c = replace_with_constant(g, v, (*outs)[i]);
      if (c->initializer()) created.emplace_back(&g, c);
    }
    const std::vector<Value*> inputs = n->inputs();
    g.remove_node(n);
    for (Value* v : inputs) {
      Node* p = v ? v->producer() : nullptr;
      if (p && p->alive() && p->graph() == &g && p->op_type == "Constant" && dead(*p)) {
        g.remove_node(p);
      }
    }
    ++ctx.counters["folded_" + n->op_type];
    return true;
  }

  // Constant node -> initializer (the tensor is shared, not copied).
  bool lift(Graph& g, Node* n) {
    Value* v = n->outputs().empty() ? nullptr : n->outputs()[0];
    if (!v || v->is_graph_output() || v->uses().empty()) return false;
    auto t = constant_tensor(v);
    if (!t) return false;  // sparse or string-valued attributes
    auto copy = std::make_shared<Tensor>(*t);
    Value* c = g.add_initializer(v->name(), copy);
    pattern::replace_value(g, v, c);
    g.remove_node(n);
    created.emplace_back(&g, c);
    ++ctx.counters["lifted_Constant"];
    return true;
  }
};

int64_t fold_constants(Model& model, PassContext& ctx) {
  Folder f{model, ctx, {}, {}};
  f.limits.max_bytes = static_cast<uint64_t>(
      option(ctx, "fold_max_bytes", static_cast<int64_t>(f.limits.max_bytes)));
  f.limits.max_expand_bytes = static_cast<uint64_t>(
      option(ctx, "fold_max_expand_bytes", static_cast<int64_t>(f.limits.max_expand_bytes)));
  return f.run();
}

const PassRegistrar kRegister{PassDecl("fold_constants",
                                       "evaluate nodes whose inputs are all constants "
                                       "(size-capped); Constant nodes -> initializers")
                                  .tags({"cleanup"})
                                  .run(fold_constants)};

Graph* root_of(const Graph& g) {
  const Graph* r = &g;
  while (r->parent()) r = r->parent();
  return const_cast<Graph*>(r);
}

const Function* function_of(const Model& model, const Graph& g) {
  const Graph* root = root_of(g);
  for (const auto& f : model.functions) {
    if (f->body.get() == root) return f.get();
  }
  return nullptr;
}

}  // namespace

Value* replace_with_constant(Graph& g, Value* v, std::shared_ptr<Tensor> t) {
  Value* c;
  // Function bodies hold no initializers; before IR version 4 every initializer must also be a
  // graph input (which would make it overridable, not constant).
  if (in_function(*g.model(), g) || g.model()->ir_version.value_or(0) < 4 || v->is_graph_output()) {
    Node* before = v->producer() && v->producer()->graph() == &g ? v->producer() : g.first();
    Node* k = g.create_node("Constant", "", {}, {v->name()}, before);
    if (v->producer() && !v->producer()->name.value.empty()) k->name.set(v->producer()->name.value);
    k->attributes.push_back(pattern::attr_tensor("value", std::move(t)));
    c = k->outputs()[0];
  } else {
    c = g.add_initializer(v->name(), std::move(t));
  }
  pattern::replace_value(g, v, c);
  return c;
}

int64_t graph_opset(const Model& model, const Graph& g) {
  if (const Function* f = function_of(model, g)) {
    for (const auto& o : f->opset_import) {
      if (o.domain.value.empty() || o.domain.value == "ai.onnx") return o.version.value_or(0);
    }
  }
  return default_opset(model);
}

bool in_function(const Model& model, const Graph& g) {
  return function_of(model, g) != nullptr;
}

std::string constant_nodes_model(const Model& model, const std::vector<Node*>& nodes,
                                 const std::vector<Value*>& outputs) {
  Model m;
  m.ir_version = model.ir_version;
  m.opset_import = model.opset_import;
  m.graph = std::make_unique<Graph>(&m);
  Graph& g = *m.graph;
  g.name.set("constant_nodes");
  std::unordered_map<const Value*, Value*> map;
  for (Node* n : nodes) {
    if (!n->alive() || n->graph() != nodes[0]->graph()) {
      throw ModelError("constant_nodes_model: nodes must be live nodes of one graph");
    }
    std::vector<Value*> inputs;
    for (Value* v : n->inputs()) {
      if (!v) {
        inputs.push_back(nullptr);
        continue;
      }
      auto it = map.find(v);
      if (it == map.end()) {
        auto t = constant_tensor(v);
        if (!t) {
          throw ModelError("constant_nodes_model: input '" + v->name() + "' of node '" +
                           n->name.value + "' is neither a constant nor computed by the nodes");
        }
        Value* c = g.create_value(v->name());
        g.set_initializer(c, std::make_shared<Tensor>(*t));
        it = map.emplace(v, c).first;
      }
      inputs.push_back(it->second);
    }
    std::vector<std::string> names;
    for (Value* v : n->outputs()) names.push_back(v ? v->name() : "");
    Node* c = g.create_node(n->op_type, n->domain.value, inputs, names);
    c->name = n->name;
    for (const auto& a : n->attributes) c->attributes.push_back(pattern::copy_attribute(a));
    for (size_t i = 0; i < names.size(); ++i) {
      if (!n->outputs()[i]) continue;
      map[n->outputs()[i]] = c->outputs()[i];
      if (outputs.empty()) g.add_output(c->outputs()[i]);
    }
  }
  for (Value* v : outputs) {
    auto it = map.find(v);
    if (it == map.end() || !it->second->producer()) {
      throw ModelError("constant_nodes_model: output '" + v->name() +
                       "' is not computed by the nodes");
    }
    g.add_output(it->second);
  }
  return serialize_model(m);
}

std::vector<Node*> ort_fold_candidates(const Model& model, Graph& g, const FoldLimits& limits,
                                       const std::unordered_set<std::string>& skip,
                                       const std::function<bool(Node*)>& safe_division,
                                       std::unordered_map<Value*, uint64_t>* origin) {
  static const std::unordered_set<std::string> native(native_fold_ops().begin(),
                                                      native_fold_ops().end());
  const int64_t opset = graph_opset(model, g);
  std::vector<Node*> found;
  std::vector<Value*> inputs;
  for (Node* n = g.first(); n; n = n->next()) {
    if (!standard_domain(*n) || skip.count(n->op_type) || n->has_subgraphs()) continue;
    inputs.clear();
    for (Value* v : n->inputs()) {
      if (v) inputs.push_back(v);
    }
    if (inputs.empty()) continue;
    bool all_known = true, downstream = false;
    uint64_t from = 0;  // the bytes of the constants the inputs come from
    for (Value* v : inputs) {
      auto it = origin->find(v);
      if (it != origin->end()) {
        downstream = true;
        from += it->second;
        continue;
      }
      auto t = constant_tensor(v);
      if (!t || t->nbytes() > limits.max_bytes) {
        all_known = false;
        break;
      }
      from += t->nbytes();
    }
    if (!all_known) continue;
    // A native op on plain constants was declined by fold_constants: for its types (then ONNX
    // Runtime may fold it), or for its limits or values (then no one should).
    if (!downstream && native.count(n->op_type)) {
      bool unsupported = false;
      evaluate_node(*n, opset, limits, &unsupported);
      if (!unsupported) continue;
    }
    if ((n->op_type == "Div" || n->op_type == "Mod" || n->op_type == "Pow") &&
        n->inputs().size() >= 2 && !safe_division(n)) {
      continue;
    }
    found.push_back(n);
    for (Value* v : n->outputs()) {
      if (v) (*origin)[v] = from;
    }
  }
  return found;
}

}  // namespace fastopt::passes
