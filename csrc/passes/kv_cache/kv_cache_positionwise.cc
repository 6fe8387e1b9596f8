// add_kv_cache's whole-decoder proof: the cached model runs the new tokens alone, so every op
// between the per-token inputs and the outputs must treat each position on its own, except the
// attentions the rewrite caches (positionwise.h has the dataflow, positionwise_rules.cc the ops).
//
//   input_ids, position_ids, attention_mask (B, S)      seq on axis 1
//        | Gather(embedding) -> (B, S, H)                seq on axis 1
//        | norms over H, MatMul over H, Reshape/Transpose to heads ...
//   internal::Attention(Q, K, V, mask)                   the only op that mixes positions
//        | ... -> logits (B, S, V), or the last position's (B, 1, V)
//
// Not read: an attention's mask input (proven and replaced: mask_proof.h, kv_cache_bias.cc) and
// the input of Shape / Size (the shape is no value). Positions a Range numbers inside the graph
// are per position only when the rewrite offsets that Range (Range(P, P + S)).
//
// Anything else is refused with the op, the node and its layer: a layer whose attention did not
// fuse (Q K^T is a product of two token-carrying values), a CumSum, ReduceMean, Slice, Pad or
// Concat along the sequence (running sums, sequence means, token shifts), a convolution over the
// tokens (conv/SSM hybrids: LFM2, Mamba), an op without a rule. Without this check a decoder
// whose attentions are not the only mixing ops was converted and gave wrong tokens from the
// second step on (issue 25).
#include <algorithm>
#include <cctype>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "analysis/shape_facts.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/kv_cache.h"
#include "passes/kv_cache/positionwise.h"

namespace fastopt::passes::kv_cache {
namespace {

bool shape_only(const Node* n) {
  return n->domain.value.empty() && (n->op_type == "Shape" || n->op_type == "Size");
}

// t5's fp16 overflow guard: Clip(x, -b, b) (dynamo: Min(Max(x, -b), b)) with b =
// Where(any(IsInf(x)), max - 1000, max), the "any" a reduction over every axis. It reads every
// position, but only picks one of two clamp bounds near the dtype's maximum: the cached and the
// full run differ only where a hidden value already lies within 1000 of it after an earlier token
// overflowed. Accepted, as the one known exception (README: KV cache); anything else the reduction
// reaches is refused as usual.
bool overflow_guard(const Node* reduce) {
  const Value* x = reduce->inputs().empty() ? nullptr : reduce->inputs()[0];
  const Node* p = x ? x->producer() : nullptr;
  if (p && p->op_type == "Cast" && !p->inputs().empty() && p->inputs()[0]) {
    p = p->inputs()[0]->producer();
  }
  if (!p || p->op_type != "IsInf" || !p->domain.value.empty()) return false;
  std::vector<const Value*> todo;
  for (const Value* v : reduce->outputs()) todo.push_back(v);
  for (size_t steps = 0; !todo.empty(); ++steps) {
    const Value* v = todo.back();
    todo.pop_back();
    if (!v || v->is_graph_output() || steps > 32) return false;
    for (const Use& u : v->uses()) {
      const Node* c = u.node;
      const std::string& op = c->op_type;
      if (!c->domain.value.empty()) return false;
      if ((op == "Clip" && u.input_index >= 1) || op == "Max" || op == "Min") continue;  // a bound
      if (op != "Greater" && op != "Less" && op != "Equal" && op != "Not" && op != "Cast" &&
          op != "Neg" && !(op == "Where" && u.input_index == 0)) {
        return false;
      }
      for (const Value* o : c->outputs()) todo.push_back(o);
    }
  }
  return true;
}

// Values of the main graph that bodies of `n` (If/Loop/Scan) read from outside.
void captured(const Node* n, const Graph& main, std::vector<const Value*>& out) {
  for (const Graph* body : n->subgraphs()) {
    for (const Node* b = body->first(); b; b = b->next()) {
      for (const Value* v : b->inputs()) {
        if (v && v->graph() == &main) out.push_back(v);
      }
      captured(b, main, out);
    }
  }
}

// The values whose data reaches an output: not through an attention's mask, nor into Shape.
std::unordered_set<const Value*> read_values(const Graph& g, std::vector<const Node*>& nodes) {
  std::unordered_set<const Value*> live;
  for (const Value* v : g.outputs()) live.insert(v);
  for (const Node* n = g.first(); n; n = n->next()) nodes.push_back(n);
  std::vector<const Value*> inner;
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    const Node* n = *it;
    bool read = false;
    for (const Value* v : n->outputs()) read = read || (v && live.count(v));
    if (!read || shape_only(n)) continue;
    const std::vector<Value*>& in = n->inputs();
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i] && !(i == 3 && is_internal_attention(n))) live.insert(in[i]);
    }
    inner.clear();
    captured(n, g, inner);
    live.insert(inner.begin(), inner.end());
  }
  return live;
}

// "layer 3" from the exporters' names (/model/layers.3/..., transformer.h.3, layers_3), or the
// attentions around the node in graph order.
std::string layer_of(const Node* n, const std::vector<Node*>& attentions) {
  const std::string& name = n->name.value;
  for (const char* key :
       {"layers.", "layers/", "layers_", "layer.", "layer_", "h.", "blocks.", "block."}) {
    for (size_t at = name.find(key); at != std::string::npos; at = name.find(key, at + 1)) {
      const size_t d = at + std::char_traits<char>::length(key);
      const bool starts = at == 0 || !std::isalnum(static_cast<unsigned char>(name[at - 1]));
      if (!starts || d >= name.size() || !std::isdigit(static_cast<unsigned char>(name[d]))) {
        continue;
      }
      size_t e = d;
      while (e < name.size() && std::isdigit(static_cast<unsigned char>(name[e]))) ++e;
      return "layer " + name.substr(d, e - d);
    }
  }
  size_t before = 0;
  for (const Node* p = n->prev(); p; p = p->prev()) before += is_internal_attention(p) ? 1 : 0;
  if (before == 0) return "before the first attention";
  if (before == attentions.size()) return "after the last attention";
  return "between attentions " + std::to_string(before - 1) + " and " + std::to_string(before);
}

[[noreturn]] void refuse_node(const Node* n, const std::vector<Node*>& attentions,
                              const std::string& why,
                              const std::string& what = "mixes the positions") {
  const std::string op = (n->domain.value.empty() ? "" : n->domain.value + "::") + n->op_type;
  refuse(op + " '" + n->name.value + "' (" + layer_of(n, attentions) + ") " + what + ": " + why +
         "; the cached model runs only the new tokens, so every op outside the attentions it "
         "caches must treat each position on its own");
}

// The per-token graph inputs: input_ids on axis 1, others where their dims have S (or, for the
// mask and positions, their last axis, unless `cached_export`: there attention_mask spans the
// past too); an encoder's states and a cache's pasts are no tokens of the decoder.
SeqState input_state(analysis::ShapeFacts& facts, const Value* v, const Value* input_ids,
                     const analysis::DimExpr& seq, bool cached_export) {
  if (v == input_ids) return SeqState::seq(1);
  const std::string& name = v->name();
  if (name.rfind("past_", 0) == 0 || name.rfind("encoder_", 0) == 0) return SeqState();
  const int r = facts.rank(v);
  int axis = -1;
  for (int i = 0; i < r; ++i) {
    auto d = facts.dim(v, i);
    if (!d || !facts.equal(*d, seq)) continue;
    if (axis >= 0) refuse("input '" + name + "' has the sequence length on two axes");
    axis = i;
  }
  if (axis < 0 && r >= 1 && !cached_export &&
      (name == "attention_mask" || name == "position_ids" || name == "token_type_ids")) {
    axis = r - 1;
  }
  return axis < 0 ? SeqState() : SeqState::seq(axis);
}

}  // namespace

void prove_positionwise(Model& m, const std::vector<Node*>& attentions,
                        const std::vector<Node*>& offset_ranges, const Value* input_ids,
                        bool cached_export) {
  const Graph& g = *m.graph;
  analysis::ShapeFacts& facts = analysis::facts_of(m);
  auto seq = facts.dim(input_ids, 1);
  if (!seq) refuse("input_ids has no sequence axis (rank below 2)");
  std::vector<const Node*> nodes;
  const std::unordered_set<const Value*> live = read_values(g, nodes);
  std::unordered_map<const Value*, SeqState> state;
  for (const Value* v : g.inputs()) {
    if (v && live.count(v)) state[v] = input_state(facts, v, input_ids, *seq, cached_export);
  }
  // A cache's Concat(past, new rows) on axis 2: row P + s is new position s (the past is free).
  std::unordered_set<const Node*> cache_concats;
  for (const Node* att : cached_export ? attentions : std::vector<Node*>{}) {
    if (auto c = cached_kv(att))
      cache_concats.insert({c->present_k->producer(), c->present_v->producer()});
  }
  const SeqState free_state;
  auto state_of = [&](const Value* v) -> const SeqState& {
    auto it = v ? state.find(v) : state.end();
    return it == state.end() ? free_state : it->second;
  };
  const std::unordered_set<const Node*> offset(offset_ranges.begin(), offset_ranges.end());
  // A Range(0, S) the rewrite does not offset: its positions are wrong in the cached model. Its
  // refusal waits for the walk's end, so that a mixing op (an unfused attention reading such a
  // Range in its mask) is what the message names.
  std::vector<const Node*> unoffset_ranges;
  struct Refusal {
    const Node* node;
    std::string why;
    int priority;
  };
  std::vector<Refusal> refusals;
  SeqState refused_state;
  refused_state.kind = SeqState::kRefused;
  SeqContext ctx{facts, *seq, default_opset(m), {}, {}, {}};
  std::vector<SeqState> outs;
  std::vector<const Value*> inner;
  for (const Node* n : nodes) {
    bool read = false;
    for (const Value* v : n->outputs()) read = read || (v && live.count(v));
    if (!read || shape_only(n)) continue;
    ctx.in.clear();
    bool any_seq = false, any_last = false, after_refused = false;
    const bool attention = is_internal_attention(n);
    for (const Value* v : n->inputs()) {
      // an attention's mask is proven and replaced, not read (also where an unfused layer reads
      // the same mask values as data)
      ctx.in.push_back(attention && ctx.in.size() == 3 ? free_state : state_of(v));
      any_seq = any_seq || ctx.in.back().kind == SeqState::kSeq;
      any_last = any_last || ctx.in.back().kind == SeqState::kLast;
      after_refused = after_refused || ctx.in.back().kind == SeqState::kRefused;
    }
    auto mark_refused = [&]() {
      for (const Value* v : n->outputs()) {
        if (v) state[v] = refused_state;
      }
    };
    if (after_refused) {
      mark_refused();
      continue;
    }
    inner.clear();
    captured(n, g, inner);
    bool reads_tokens = false;
    for (const Value* v : inner) reads_tokens = reads_tokens || state_of(v).kind != SeqState::kFree;
    if (reads_tokens) {
      refusals.push_back({n, "its subgraph reads the tokens (not proven position-wise)", 0});
      mark_refused();
      continue;
    }
    if (cache_concats.count(n)) {
      const SeqState& fresh = ctx.in[1];
      if (ctx.in[0].kind != SeqState::kFree || fresh.kind != SeqState::kSeq || fresh.axis != 2 ||
          fresh.flattened()) {
        refusals.push_back({n, "its new rows are not (B, Hkv, S, D) over the positions", 0});
        mark_refused();
      } else {
        state[n->outputs()[0]] = fresh;
      }
      continue;
    }
    if (n->domain.value.empty() && n->op_type == "Range") {
      auto d = facts.dim(n->outputs()[0], 0);
      if (d && facts.equal(*d, *seq)) {
        // An export with a cache numbers its own positions (adopted as exported): a Range over
        // the new tokens gives each position its own value.
        if (offset.count(n) || cached_export) {
          state[n->outputs()[0]] = SeqState::seq(0);
        } else {  // refused below unless a rule proves it a relative index
          unoffset_ranges.push_back(n);
        }
        continue;
      }
    }
    if (!any_seq) {  // a function of weights, shapes and the last position only
      if (any_last) {
        for (const Value* v : n->outputs()) {
          if (v) state[v] = SeqState::last();
        }
      }
      continue;
    }
    if (n->op_type.rfind("Reduce", 0) == 0 && overflow_guard(n)) continue;  // free
    const SeqRule rule = find_seq_rule(n->domain.value, n->op_type);
    std::string bad = mistyped_reason(n);
    outs.clear();
    ctx.priority = 0;
    if (!bad.empty() || !rule || !rule(*n, ctx, outs)) {
      refusals.push_back({n,
                          !bad.empty() ? bad
                          : rule       ? ctx.why
                                       : "it is not known to be position-wise (no rule says how "
                                         "it treats the sequence axis)",
                          ctx.priority});
      mark_refused();
      continue;
    }
    for (size_t i = 0; i < n->outputs().size() && i < outs.size(); ++i) {
      if (n->outputs()[i]) state[n->outputs()[i]] = outs[i];
    }
  }
  if (!refusals.empty()) {  // the first, unless a later one explains more
    const Refusal* best = &refusals.front();
    for (const Refusal& r : refusals) best = r.priority > best->priority ? &r : best;
    refuse_node(best->node, attentions, best->why);
  }
  for (const Node* r : unoffset_ranges) {
    if (std::find(ctx.relative_ranges.begin(), ctx.relative_ranges.end(), r) !=
        ctx.relative_ranges.end()) {
      continue;
    }
    refuse_node(r, attentions,
                "it numbers the positions 0 .. S-1 inside the graph and the rewrite does not "
                "offset it, so the new tokens would be numbered from 0",
                "is not position-wise");
  }
}

}  // namespace fastopt::passes::kv_cache
