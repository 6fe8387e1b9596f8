// ALiBi's score bias through the KV-cache rewrite (internal_op.h score_bias; alibi.h).
//
// A score_bias attention's mask input is Add(bias, m) (alibi::combine), or Where(masked, lowest,
// bias) for masked_fill (mpt). The cached form keeps the bias and replaces m (or Not(masked)),
// proven like every mask (mask_proof.h), by the shared mask:
//
//   Add(bias, m) | Where(masked, lowest, bias)  ==>  Where(allowed (B, 1, S, T), bias', lowest)
//
// For a masked key both sides give a score exp() takes to 0. bias' must be what the no-cache
// model computes over the same T keys. It is when the bias is the same for every query (dim -2
// is at most 1) and a function of the keys alone: of attention_mask, of the keys' length read
// as Shape(K) of an attention's keys, and of constants. A cached step's attention_mask is the
// whole (B, T) one the full recompute reads, so a copy of the bias's ops on it, with each
// Shape(K) = (B, Hkv, S, D) read as (B, Hkv, T, D) (T = attention_mask's width; the full
// recompute's keys have that length), gives the full recompute's bias over all T keys.
//   - bloom: slopes x (cumsum(mask) - 1) x mask (positions skip the holes of a short row);
//   - mpt: Slice(table (H, 1, L), [L - T:]) on the keys' axis (TorchScript: T = Shape(K)[2];
//     dynamo: T = Shape(attention_mask)[1]), i.e. slopes x (t - (T - 1)); the key index counts
//     holes, as the no-cache model does on the same holed attention_mask. dynamo also slices
//     the table's one query row by max(1 - S, 0), which keeps at most that row.
// The copies keep reading the whole attention_mask while the export's other readers see its
// last S columns (widen_attention_mask). In place (GroupQueryAttention on one max-length
// buffer) the bias goes to GQA's attention_bias at (S, T = attention_mask's width), which ORT
// reads for the keys t <= seqlens_k[b] (lower_attention_ort.cc).
#include <algorithm>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "analysis/shape_facts.h"
#include "passes/attention/shapes.h"
#include "passes/kv_cache/kv_cache.h"

namespace fastopt::passes::kv_cache {
namespace {

constexpr size_t kMaxBiasNodes = 64;

// The subgraph computing a bias: its nodes, and the Shape(K) nodes among them (each reads the
// keys of an attention, whose length is the only thing a cached step changes in it).
struct BiasSubgraph {
  std::vector<Node*> nodes;
  std::vector<Node*> key_shapes;
};

// Whether `a` and `b` are one tensor: the same value, or Transposes of one value by one perm
// (TorchScript mpt reads the length off its own (0, 2, 1, 3) Transpose of the keys, whose
// twin fuse_attention made the attention's K).
bool same_tensor(const Value* a, const Value* b) {
  if (a == b) return true;
  const Node *p = a ? a->producer() : nullptr, *q = b ? b->producer() : nullptr;
  if (!p || !q || p->op_type != "Transpose" || q->op_type != "Transpose" ||
      !p->domain.value.empty() || !q->domain.value.empty() || p->inputs().size() != 1 ||
      q->inputs().size() != 1 || p->inputs()[0] != q->inputs()[0]) {
    return false;
  }
  const Attribute *x = p->attribute("perm"), *y = q->attribute("perm");
  return x && y && !x->ints.empty() && x->ints == y->ints;
}

// Whether `n` is Shape(K) of the keys of one of `attentions`, the whole shape (no start/end).
bool reads_keys_shape(const Node* n, const std::vector<Node*>& attentions) {
  if (n->op_type != "Shape" || !n->domain.value.empty() || n->inputs().size() != 1 ||
      n->attribute("start") || n->attribute("end")) {
    return false;
  }
  return std::any_of(attentions.begin(), attentions.end(), [&](const Node* a) {
    return a->inputs().size() > 1 && same_tensor(a->inputs()[1], n->inputs()[0]);
  });
}

// Whether `n` is a Shape of a past input (a model exported with a cache): P in a cached step,
// which adopt_cache keeps so in place too (kv_cache_adopt.cc gives those reads P, not the
// buffer's length).
bool reads_past_shape(const Node* n) {
  if (n->op_type != "Shape" || !n->domain.value.empty() || n->inputs().size() != 1) return false;
  const Value* x = n->inputs()[0];
  return x && x->is_graph_input() && !x->initializer() && x->name().rfind(kPastPrefix, 0) == 0;
}

// The keys whose shape a copied Shape(K) reads: the new rows when K is the cached form's
// present, which a lowering replaces by an op that reads the bias (a cycle) or, in place, by
// the max-length buffer; the batch, heads and head size are the same.
Value* keys_for_shape(Value* k) {
  const Node* cat = k ? k->producer() : nullptr;
  if (cat && cat->op_type == "Concat" && cat->domain.value.empty() && k->is_graph_output() &&
      cat->inputs().size() == 2 && cat->inputs()[0] && cat->inputs()[0]->is_graph_input()) {
    return cat->inputs()[1];
  }
  return k;
}

// Adds the nodes computing `v` to `out`; false, with *why, when they read anything but
// attention_mask, the keys' shape, a past's shape and constants (or are too many, or hold
// subgraphs).
bool collect(const Value* v, const Value* attention_mask, const std::vector<Node*>& attentions,
             std::unordered_set<const Node*>& seen, BiasSubgraph& out, std::string* why) {
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
  out.nodes.push_back(p);
  if (reads_past_shape(p)) return true;
  if (reads_keys_shape(p, attentions)) {
    out.key_shapes.push_back(p);
    return true;
  }
  for (const Value* in : p->inputs()) {
    if (!collect(in, attention_mask, attentions, seen, out, why)) {
      if (p->op_type == "Shape" && why->rfind("reads the shape", 0) != 0) {
        *why = "reads the shape of '" + in->name() +
               "', an activation that is not an attention's keys (a cached step's differs from "
               "the full recompute's)";
      }
      return false;
    }
  }
  return true;
}

// The nodes `bias` is computed by, refusing any other input than attention_mask, the keys'
// shape and constants.
BiasSubgraph bias_subgraph(const Value* bias, const Value* attention_mask,
                           const std::vector<Node*>& attentions, const std::string& layer) {
  std::unordered_set<const Node*> seen;
  BiasSubgraph out;
  std::string why;
  if (!collect(bias, attention_mask, attentions, seen, out, &why)) {
    refuse("the score bias (ALiBi) of " + layer + " " + why +
           ": only a bias computed from attention_mask, the keys' length and constants is the "
           "same in a cached step");
  }
  return out;
}

// Whether `v` has at most one row on axis -2 (so it is the same for every query): known 1, a
// constant with 1 there, or a Slice of such a value (a slice of one row keeps at most it).
bool at_most_one_row(const Value* v, analysis::ShapeFacts& facts, int depth = 0) {
  if (!v || depth > 8 || facts.rank(v) < 2) return false;
  if (facts.known_dim(v, -2) == 1) return true;
  const Node* p = v->producer();
  return p && p->op_type == "Slice" && p->domain.value.empty() && !p->inputs().empty() &&
         facts.rank(p->inputs()[0]) == facts.rank(v) &&
         at_most_one_row(p->inputs()[0], facts, depth + 1);
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
    // fuse_attention casts the sum to Q's dtype when the scores are wider (fp16 mpt).
    int32_t cast_to = 0;
    if (add && add->op_type == "Cast" && add->inputs().size() == 1 && add->inputs()[0] &&
        combined->uses().size() == 1) {
      cast_to = dtype_of(combined);
      combined = add->inputs()[0];
      add = combined->producer();
    }
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
    bias_subgraph(bias, attention_mask, attentions, layer);
    if (!at_most_one_row(bias, facts)) {
      refuse("the score bias (ALiBi) of " + layer +
             " is not proven the same for every query (its dim -2 is not shown to be 1)");
    }
    if (masked_fill && !constant_scalar(add->inputs()[1])) {
      refuse("the masked_fill value of " + layer + " is not a constant");
    }
    out.push_back(
        {att, att->inputs()[3], bias, add->inputs()[masked_fill ? 0 : 1], masked_fill, cast_to});
  }
  return out;
}

MaskPartsForProof::MaskPartsForProof(Graph& g, const std::vector<ScoreBias>& biases)
    : g_(g), biases_(biases) {
  for (const ScoreBias& s : biases_) {
    Value* part = s.mask_part;
    if (s.masked_fill) {  // masked_fill's condition is true where masked: the proof reads keeps
      Node* n = g_.create_node("Not", "", {part}, {g_.unique_name("kv_bias_kept")}, s.att);
      n->outputs()[0]->type = part->type;
      nots_.push_back(n);
      part = n->outputs()[0];
    }
    s.att->set_input(3, part);
  }
}

MaskPartsForProof::~MaskPartsForProof() {
  for (const ScoreBias& s : biases_) s.att->set_input(3, s.combined);
  for (Node* n : nots_) g_.remove_node(n);
}

std::vector<const Node*> copy_biases(Graph& g, KvCacheBuilder& b, std::vector<ScoreBias>& biases,
                                     Value* attention_mask, const std::vector<Node*>& attentions) {
  std::unordered_set<const Node*> inside, key_shapes;
  for (const ScoreBias& s : biases) {
    BiasSubgraph sub = bias_subgraph(s.bias, attention_mask, attentions, "");
    inside.insert(sub.nodes.begin(), sub.nodes.end());
    key_shapes.insert(sub.key_shapes.begin(), sub.key_shapes.end());
  }
  std::unordered_map<const Value*, Value*> copy;
  std::vector<const Node*> readers;
  Value* total = nullptr;  // (1): attention_mask's width, T
  for (Node* n = g.first(); n; n = n->next()) {
    if (!inside.count(n)) continue;
    if (key_shapes.count(n)) {  // Shape(K) (B, Hkv, S, D) -> (B, Hkv, T, D)
      if (!total) {
        Node* width = b.node("Shape", {attention_mask}, g.unique_name("kv_bias_mask_shape"), n);
        readers.push_back(width);
        total = b.op("Slice",
                     {width->outputs()[0], b.constant("kv_bias_1", {1}, {1}),
                      b.constant("kv_bias_2", {2}, {1})},
                     "kv_bias_total", n);
      }
      Value* shape = b.op("Shape", {keys_for_shape(n->inputs()[0])}, "kv_bias_keys_shape", n);
      auto part = [&](int64_t from, int64_t to) {
        return b.op(
            "Slice",
            {shape, b.constant("kv_bias_from", {from}, {1}), b.constant("kv_bias_to", {to}, {1})},
            "kv_bias_keys_dims", n);
      };
      copy[n->outputs()[0]] =
          b.op("Concat", {part(0, 2), total, part(3, 4)}, "kv_bias_keys_full_shape", n,
               one_attr(pattern::attr_int("axis", 0)));
      continue;
    }
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
    const int32_t out = s.cast_to ? s.cast_to : t;
    // The lowest finite score of the dtype the attention reads, written in the bias's dtype
    // (a float lowest cast to float16 would be -inf, and a pad query's row NaN).
    std::string lowest;
    if (t == kFloat16) {
      lowest = std::string("\xff\xfb", 2);  // -65504
    } else {
      const float x = out == kFloat16 ? -65504.0f : std::numeric_limits<float>::lowest();
      lowest.assign(reinterpret_cast<const char*>(&x), sizeof x);
    }
    Value* low =
        g.add_initializer(g.unique_name("kv_bias_lowest"), make_tensor(t, {}, std::move(lowest)));
    Value* mask = b.op("Where", {att->inputs()[3], s.bias, low}, "kv_biased_mask", att);
    if (s.cast_to) {
      mask = b.op("Cast", {mask}, "kv_biased_mask_cast", att,
                  one_attr(pattern::attr_int("to", s.cast_to)));
    }
    // The dtype for the lowerings; the copies' types are left unset: the export's say S, not T.
    mask->type.known = mask->type.is_tensor = true;
    mask->type.elem_type = out;
    att->set_input(3, mask);
    ctx.counters["score bias (ALiBi) kept"] += 1;
  }
}

}  // namespace fastopt::passes::kv_cache
