// ALiBi's score bias through the KV-cache rewrite (internal_op.h score_bias; alibi.h).
//
// A score_bias attention's mask input is Add(bias, m) (alibi::combine). The cached form keeps
// the bias and replaces m, proven like every mask (mask_proof.h), by the shared mask:
//
//   Add(bias, m)  ==>  Where(allowed (B, 1, S, T), bias', lowest)
//
// bias' must be what the no-cache model computes for the same tokens. It is when the bias is a
// function of attention_mask alone (its ancestors reach no graph input but attention_mask and no
// activation) and the same for every query (dim -2 is 1): a cached step's attention_mask is the
// whole (B, T) one the full recompute reads, so the same ops on it give the full recompute's
// bias over all T keys, which each new query reads, holes (a short row's padding before the
// tokens generated after the longest row) included. bloom's bias, slopes x (cumsum(mask) - 1)
// x mask, is such a function; it is copied so that the copy keeps reading the whole
// attention_mask while the export's other readers see its last S columns
// (widen_attention_mask). mpt's bias slices a table by the keys' length (a Shape of K): refused.
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "analysis/shape_facts.h"
#include "passes/attention/kv_cache.h"
#include "passes/attention/shapes.h"

namespace fastopt::passes::kv_cache {
namespace {

constexpr size_t kMaxBiasNodes = 64;

// Adds the nodes computing `v` to `nodes`; false, with *why, when they read anything but
// attention_mask and constants (or are too many, or hold subgraphs).
bool collect(const Value* v, const Value* attention_mask, std::unordered_set<const Node*>& seen,
             std::vector<Node*>& nodes, std::string* why) {
  if (!v || v == attention_mask || v->initializer()) return true;
  Node* p = v->producer();
  if (!p) {
    *why = "reads the graph input '" + v->name() + "'";
    return false;
  }
  if (!seen.insert(p).second) return true;
  if (p->has_subgraphs() || seen.size() > kMaxBiasNodes) {
    *why = "is not a small subgraph of plain ops";
    return false;
  }
  nodes.push_back(p);
  for (const Value* in : p->inputs()) {
    if (!collect(in, attention_mask, seen, nodes, why)) {
      if (p->op_type == "Shape" && why->rfind("reads the shape", 0) != 0) {
        *why = "reads the shape of '" + in->name() +
               "', an activation (mpt slices its table by the keys' length, which a cached "
               "step's keys exceed)";
      }
      return false;
    }
  }
  return true;
}

// The nodes `bias` is computed by, refusing any other input than attention_mask and constants.
std::vector<Node*> bias_subgraph(const Value* bias, const Value* attention_mask,
                                 const std::string& layer) {
  std::unordered_set<const Node*> seen;
  std::vector<Node*> nodes;
  std::string why;
  if (!collect(bias, attention_mask, seen, nodes, &why)) {
    refuse("the score bias (ALiBi) of " + layer + " " + why +
           ": only a bias computed from attention_mask alone is the same in a cached step");
  }
  return nodes;
}

}  // namespace

std::vector<ScoreBias> check_score_biases(const Graph& g, const std::vector<Node*>& attentions,
                                          const Value* attention_mask) {
  std::vector<ScoreBias> out;
  analysis::ShapeFacts& facts = analysis::facts_of(*g.model());
  for (size_t i = 0; i < attentions.size(); ++i) {
    Node* att = attentions[i];
    if (!int_attr_or(att, "score_bias", 0)) continue;
    const std::string layer = "layer " + std::to_string(i) + " ('" + att->name.value + "')";
    Value* combined = att->inputs().size() > 3 ? att->inputs()[3] : nullptr;
    Node* add = combined ? combined->producer() : nullptr;
    // alibi::combine wrote Add(bias, m), or Where(masked, value, bias) for masked_fill (mpt).
    const bool masked_fill = add && add->op_type == "Where" && add->inputs().size() == 3;
    if (!add || (add->op_type != "Add" && !masked_fill) ||
        (!masked_fill && add->inputs().size() != 2) || combined->uses().size() != 1) {
      refuse("the mask of " + layer + " is not Add(score bias, mask) as fuse_attention writes it");
    }
    Value* bias = add->inputs()[masked_fill ? 2 : 0];
    if (dtype_of(bias) != kFloat && dtype_of(bias) != kFloat16) {
      refuse("the score bias (ALiBi) of " + layer + " is neither float nor float16");
    }
    bias_subgraph(bias, attention_mask, layer);
    if (facts.rank(bias) < 2 || facts.known_dim(bias, -2) != 1) {
      refuse("the score bias (ALiBi) of " + layer + " is not proven the same for every query");
    }
    if (masked_fill) {
      refuse("the score bias (ALiBi) of " + layer +
             " is masked with masked_fill, whose mask the cached form does not separate");
    }
    out.push_back({att, combined, bias, add->inputs()[1]});
  }
  return out;
}

std::vector<const Node*> copy_biases(Graph& g, std::vector<ScoreBias>& biases,
                                     const Value* attention_mask) {
  std::unordered_set<const Node*> inside;
  for (const ScoreBias& s : biases) {
    for (Node* n : bias_subgraph(s.bias, attention_mask, "")) inside.insert(n);
  }
  std::unordered_map<const Value*, Value*> copy;
  std::vector<const Node*> readers;
  for (Node* n = g.first(); n; n = n->next()) {
    if (!inside.count(n)) continue;
    std::vector<Value*> inputs;
    bool reads_mask = false;
    for (Value* in : n->inputs()) {
      auto it = copy.find(in);
      inputs.push_back(it == copy.end() ? in : it->second);
      reads_mask = reads_mask || in == attention_mask;
    }
    std::vector<std::string> names;
    for (const Value* o : n->outputs()) {
      names.push_back(o ? g.unique_name(o->name() + "_full_mask") : "");
    }
    Node* c = g.create_node(n->op_type, n->domain.value, inputs, names, n);
    for (const Attribute& a : n->attributes) c->attributes.push_back(pattern::copy_attribute(a));
    for (size_t k = 0; k < n->outputs().size(); ++k) {
      if (n->outputs()[k] && c->outputs()[k]) copy[n->outputs()[k]] = c->outputs()[k];
    }
    if (reads_mask) readers.push_back(c);
  }
  for (ScoreBias& s : biases) {
    auto it = copy.find(s.bias);
    if (it != copy.end()) s.bias = it->second;
  }
  return readers;
}

void use_biases(Graph& g, KvCacheBuilder& b, const std::vector<ScoreBias>& biases,
                PassContext& ctx) {
  for (const ScoreBias& s : biases) {
    Node* att = s.att;
    const int32_t t = dtype_of(s.bias);  // float or float16 (check_score_biases)
    std::string lowest;
    if (t == kFloat16) {
      lowest = std::string("\xff\xfb", 2);  // -65504
    } else {
      const float x = std::numeric_limits<float>::lowest();
      lowest.assign(reinterpret_cast<const char*>(&x), sizeof x);
    }
    Value* low =
        g.add_initializer(g.unique_name("kv_bias_lowest"), make_tensor(t, {}, std::move(lowest)));
    Value* mask = b.op("Where", {att->inputs()[3], s.bias, low}, "kv_biased_mask", att);
    // The dtype for the lowerings; the copies' types are left unset: the export's say S, not T.
    mask->type.known = mask->type.is_tensor = true;
    mask->type.elem_type = t;
    att->set_input(3, mask);
    ctx.counters["score bias (ALiBi) kept"] += 1;
  }
}

}  // namespace fastopt::passes::kv_cache
