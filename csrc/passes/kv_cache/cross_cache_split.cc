#include "passes/kv_cache/cross_cache_split.h"

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ir/error.h"
#include "passes/attention/internal_op.h"
#include "passes/kv_cache/cache_form.h"
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

// present.<i>.encoder.key|value: the cross cache the encoder is to compute.
bool is_cross_present(const std::string& name) {
  const std::string section = kSeq2SeqCrossFromEncoder.section;
  return name.rfind(kPresentPrefix, 0) == 0 &&
         (ends_with(name, section + ".key") || ends_with(name, section + ".value"));
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

// The decoder's cross-cache outputs and their slots among the outputs.
struct CrossPresents {
  std::vector<Value*> values;
  std::vector<size_t> slots;
};

CrossPresents cross_presents(const Graph& dg) {
  CrossPresents presents;
  const std::vector<Value*> outputs = dg.outputs();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i] && is_cross_present(outputs[i]->name())) {
      presents.values.push_back(outputs[i]);
      presents.slots.push_back(i);
    }
  }
  if (presents.values.empty()) {
    refuse_split(std::string("the decoder has no ") + kPresentPrefix +
                 "<i>.encoder.key|value outputs (add_kv_cache's cross_attention_cache 2 "
                 "writes them)");
  }
  return presents;
}

// The encoder's output `hidden` can stand for the decoder's encoder_hidden_states (`fed`).
void check_hidden(const Value* fed, const Value* source, const std::string& hidden) {
  if (!fed) refuse_split("the decoder has no encoder_hidden_states input");
  if (!source) refuse_split("the encoder has no output '" + hidden + "'");
  if (fed->type.elem_type && source->type.elem_type &&
      fed->type.elem_type != source->type.elem_type) {
    refuse_split("the encoder's output '" + hidden +
                 "' and the decoder's encoder_hidden_states have different element types");
  }
}

// Cone nodes the decoder still needs after the move (read outside the cone, or feeding one
// that is) stay.
std::unordered_set<const Node*> staying_nodes(const Cone& cone,
                                              const std::unordered_set<const Value*>& presents) {
  const std::unordered_set<const Node*> moved(cone.nodes.begin(), cone.nodes.end());
  std::unordered_set<const Node*> staying;
  for (auto it = cone.nodes.rbegin(); it != cone.nodes.rend(); ++it) {
    const Node* n = *it;
    for (const Value* o : n->outputs()) {
      if (!o) continue;
      bool kept = o->is_graph_output() && !presents.count(o);
      for (const Use& u : o->uses()) kept = kept || !moved.count(u.node) || staying.count(u.node);
      if (kept) staying.insert(n);
    }
  }
  return staying;
}

// The decoder loses encoder_hidden_states, so only moved nodes that do not stay may read it.
void check_hidden_readers(const Value* fed, const Cone& cone,
                          const std::unordered_set<const Node*>& staying) {
  const std::unordered_set<const Node*> moved(cone.nodes.begin(), cone.nodes.end());
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
}

// The opsets the moved nodes need that the encoder does not import; refused where both import
// one in different versions.
std::vector<OpsetId> opset_imports(const Model& encoder, const Model& decoder, const Cone& cone) {
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
  return imports;
}

void check_names_free(const Graph& eg, const std::vector<Value*>& presents) {
  for (const Value* p : presents) {
    if (Value* v = eg.lookup(p->name()); v && v->defined()) {
      refuse_split("the encoder already has a value named '" + p->name() + "'");
    }
  }
}

// A copy of `n` in the encoder, reading `to`'s copies; node names stay unique in the encoder
// (onnx.checker, ORT); its outputs are added to `to`, the cache's under their own names.
void copy_node(Graph& eg, const Node* n, std::unordered_map<const Value*, Value*>& to,
               std::unordered_set<std::string>& node_names,
               const std::unordered_set<const Value*>& presents) {
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
    if (presents.count(o) && copy->name() != o->name()) eg.rename(copy, o->name());
    to[o] = copy;
  }
}

// The encoder gets copies of the cone (constants shared, not copied: Tensor views), reading
// `source` where the decoder read `fed`; returns decoder value -> encoder value.
std::unordered_map<const Value*, Value*> copy_cone(
    Graph& eg, const Cone& cone, Value* fed, Value* source,
    const std::unordered_set<const Value*>& presents) {
  std::unordered_map<const Value*, Value*> to;  // decoder value -> encoder value
  to[fed] = source;
  for (Value* c : cone.constants) {
    to[c] = eg.add_initializer(c->name(), std::make_shared<Tensor>(*c->initializer()));
    to[c]->type = c->type;
  }
  std::unordered_set<std::string> node_names;
  for (const Node* n = eg.first(); n; n = n->next()) node_names.insert(n->name.value);
  for (const Node* n : cone.nodes) copy_node(eg, n, to, node_names, presents);
  return to;
}

// The decoder loses the cross cache's outputs, what only they needed and encoder_hidden_states.
void strip_decoder(Graph& dg, const CrossPresents& presents, const Cone& cone, const Value* fed) {
  for (auto it = presents.slots.rbegin(); it != presents.slots.rend(); ++it) {
    dg.remove_output(*it);
  }
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
}

}  // namespace

int64_t move_cross_projections(Model& encoder, const std::string& hidden, Model& decoder) {
  Graph& dg = *decoder.graph;
  Graph& eg = *encoder.graph;
  const CrossPresents presents = cross_presents(dg);
  Value* fed = graph_input(dg, kEncoderHiddenStates);
  Value* source = graph_output(eg, hidden);
  check_hidden(fed, source, hidden);
  const Cone cone = cone_of(dg, presents.values, fed);
  const std::unordered_set<const Value*> present_set(presents.values.begin(),
                                                     presents.values.end());
  check_hidden_readers(fed, cone, staying_nodes(cone, present_set));
  std::vector<OpsetId> imports = opset_imports(encoder, decoder, cone);
  check_names_free(eg, presents.values);

  // ---- edits: the encoder gets copies, then the decoder loses what only they needed ----
  for (OpsetId& o : imports) encoder.opset_import.push_back(std::move(o));
  const std::unordered_map<const Value*, Value*> to = copy_cone(eg, cone, fed, source, present_set);
  for (const Value* p : presents.values) eg.add_output(to.at(p));
  strip_decoder(dg, presents, cone, fed);
  // The encoder now reads the decoder's data files: a save must never replace them.
  for (const auto& [path, file] : decoder.external_files)
    encoder.external_files.emplace(path, file);
  return static_cast<int64_t>(presents.values.size());
}

}  // namespace fastopt::passes::kv_cache
