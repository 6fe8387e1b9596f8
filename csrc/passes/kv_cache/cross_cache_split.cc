#include "passes/kv_cache/cross_cache_split.h"

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ir/error.h"
#include "passes/attention/internal_op.h"
#include "passes/kv_cache/kv_cache_cross.h"
#include "pattern/rewrite.h"

namespace fastopt::passes::kv_cache {
namespace {

[[noreturn]] void refuse_split(const std::string& why) {
  throw ModelError("cannot move the cross cache's projections into the encoder: " + why);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool is_cross_present(const std::string& name) {
  return name.rfind(kPresentPrefix, 0) == 0 &&
         (ends_with(name, ".encoder.key") || ends_with(name, ".encoder.value"));
}

const std::string& canonical_domain(const std::string& d) {
  static const std::string standard;
  return d == "ai.onnx" ? standard : d;
}

std::optional<int64_t> opset_of(const Model& m, const std::string& domain) {
  for (const OpsetId& o : m.opset_import) {
    if (canonical_domain(o.domain.value) == domain) return o.version.value_or(1);
  }
  return std::nullopt;
}

Value* graph_output(const Graph& g, const std::string& name) {
  for (Value* v : g.outputs()) {
    if (v && v->name() == name) return v;
  }
  return nullptr;
}

// What computes `outputs` in `g`: nodes (in graph order, so producers first) and constants.
struct Cone {
  std::vector<Node*> nodes;
  std::vector<Value*> constants;
};

Cone cone_of(const Graph& g, const std::vector<Value*>& outputs, const Value* hidden) {
  std::unordered_set<const Node*> in_cone;
  std::unordered_set<const Value*> seen;
  Cone cone;
  std::vector<Value*> todo(outputs.begin(), outputs.end());
  while (!todo.empty()) {
    Value* v = todo.back();
    todo.pop_back();
    if (!v || !seen.insert(v).second || v == hidden) continue;
    if (v->initializer()) {
      cone.constants.push_back(v);
      continue;
    }
    Node* p = v->producer();
    if (!p) {
      refuse_split("'" + v->name() + "', which the cross cache is computed from, is " +
                   (v->is_graph_input() ? "a graph input of the decoder" : "defined nowhere") +
                   "; only encoder_hidden_states and constants can move to the encoder");
    }
    if (p->has_subgraphs()) {
      refuse_split(p->op_type + " '" + p->name.value + "' holds a subgraph");
    }
    if (!in_cone.insert(p).second) continue;
    for (Value* x : p->inputs()) todo.push_back(x);
  }
  for (Node* n = g.first(); n; n = n->next()) {
    if (in_cone.count(n)) cone.nodes.push_back(n);
  }
  return cone;
}

}  // namespace

int64_t move_cross_projections(Model& encoder, const std::string& hidden, Model& decoder) {
  Graph& dg = *decoder.graph;
  Graph& eg = *encoder.graph;
  std::vector<Value*> presents;
  std::vector<size_t> present_slots;
  const std::vector<Value*> outputs = dg.outputs();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i] && is_cross_present(outputs[i]->name())) {
      presents.push_back(outputs[i]);
      present_slots.push_back(i);
    }
  }
  if (presents.empty()) {
    refuse_split(std::string("the decoder has no ") + kPresentPrefix +
                 "<i>.encoder.key|value outputs (add_kv_cache's cross_attention_cache 2 "
                 "writes them)");
  }
  Value* fed = graph_input(dg, kEncoderHiddenStates);
  if (!fed) refuse_split("the decoder has no encoder_hidden_states input");
  Value* source = graph_output(eg, hidden);
  if (!source) refuse_split("the encoder has no output '" + hidden + "'");
  if (fed->type.elem_type && source->type.elem_type &&
      fed->type.elem_type != source->type.elem_type) {
    refuse_split("the encoder's output '" + hidden +
                 "' and the decoder's encoder_hidden_states have different element types");
  }

  const Cone cone = cone_of(dg, presents, fed);
  const std::unordered_set<const Node*> moved(cone.nodes.begin(), cone.nodes.end());
  // Cone nodes the decoder still needs after the move (read outside the cone, or feeding one
  // that is) stay. The decoder loses encoder_hidden_states, so only moved nodes that do not stay
  // may read it.
  const std::unordered_set<const Value*> present_set(presents.begin(), presents.end());
  std::unordered_set<const Node*> staying;
  for (auto it = cone.nodes.rbegin(); it != cone.nodes.rend(); ++it) {
    const Node* n = *it;
    for (const Value* o : n->outputs()) {
      if (!o) continue;
      bool kept = o->is_graph_output() && !present_set.count(o);
      for (const Use& u : o->uses()) kept = kept || !moved.count(u.node) || staying.count(u.node);
      if (kept) staying.insert(n);
    }
  }
  for (const Use& u : fed->uses()) {
    const Node* n = u.node;
    if (!moved.count(n)) {
      refuse_split("encoder_hidden_states also feeds " + n->op_type + " '" + n->name.value +
                   "', which does not compute the cross cache: the decoder would still need it");
    }
    if (staying.count(n)) {
      refuse_split(n->op_type + " '" + n->name.value + "' reads encoder_hidden_states for " +
                   "the cross cache and for the rest of the decoder, which would still need it");
    }
  }
  std::vector<OpsetId> imports;
  for (const Node* n : cone.nodes) {
    const std::string& domain = canonical_domain(n->domain.value);
    const std::optional<int64_t> want = opset_of(decoder, domain);
    const std::optional<int64_t> have = opset_of(encoder, domain);
    if (want && have && *want != *have) {
      refuse_split("the encoder imports version " + std::to_string(*have) + " of opset '" + domain +
                   "', the decoder version " + std::to_string(*want));
    }
    if (want && !have && std::none_of(imports.begin(), imports.end(), [&](const OpsetId& o) {
          return o.domain.value == domain;
        })) {
      OpsetId o;
      o.domain.set(domain);
      o.version = *want;
      imports.push_back(std::move(o));
    }
  }
  for (const Value* p : presents) {
    if (Value* v = eg.lookup(p->name()); v && v->defined()) {
      refuse_split("the encoder already has a value named '" + p->name() + "'");
    }
  }

  // ---- edits: the encoder gets copies, then the decoder loses what only they needed ----
  for (OpsetId& o : imports) encoder.opset_import.push_back(std::move(o));
  std::unordered_map<const Value*, Value*> to;  // decoder value -> encoder value
  to[fed] = source;
  for (Value* c : cone.constants) {
    to[c] = eg.add_initializer(c->name(), std::make_shared<Tensor>(*c->initializer()));
    to[c]->type = c->type;
  }
  std::unordered_set<std::string> node_names;
  for (const Node* n = eg.first(); n; n = n->next()) node_names.insert(n->name.value);
  for (const Node* n : cone.nodes) {
    std::vector<Value*> inputs;
    for (const Value* x : n->inputs()) inputs.push_back(x ? to.at(x) : nullptr);
    std::vector<std::string> names;
    for (const Value* o : n->outputs()) names.push_back(o ? o->name() : "");
    Node* c = eg.create_node(n->op_type, n->domain.value, inputs, names);
    if (n->name.written()) {  // node names are unique in a graph (onnx.checker, ORT)
      std::string name = n->name.value;
      for (int k = 1; !node_names.insert(name).second; ++k) {
        name = n->name.value + "_" + std::to_string(k);
      }
      c->name.set(name);
    }
    c->overload = n->overload;
    c->extras = n->extras;
    for (const Attribute& a : n->attributes) c->attributes.push_back(pattern::copy_attribute(a));
    for (size_t i = 0; i < n->outputs().size(); ++i) {
      const Value* o = n->outputs()[i];
      if (!o) continue;
      Value* copy = c->outputs()[i];
      copy->type = o->type;
      // unique_name keeps a free name; the cache's names were checked free above.
      if (present_set.count(o) && copy->name() != o->name()) eg.rename(copy, o->name());
      to[o] = copy;
    }
  }
  for (const Value* p : presents) eg.add_output(to.at(p));
  for (auto it = present_slots.rbegin(); it != present_slots.rend(); ++it) dg.remove_output(*it);
  pattern::remove_dead(dg, cone.nodes);
  std::vector<Value*> unused_constants;
  for (Value* c : cone.constants) {
    if (c->uses().empty() && !c->is_graph_output()) unused_constants.push_back(c);
  }
  dg.remove_initializers(unused_constants);
  const std::vector<Value*> inputs = dg.inputs();
  for (size_t i = inputs.size(); i-- > 0;) {
    if (inputs[i] == fed) dg.remove_input(i);
  }
  // The encoder now reads the decoder's data files: a save must never replace them.
  for (const auto& [path, file] : decoder.external_files)
    encoder.external_files.emplace(path, file);
  return static_cast<int64_t>(presents.size());
}

}  // namespace fastopt::passes::kv_cache
