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
bool reduces_is_inf(const Node* reduce) {
  const Value* x = reduce->inputs().empty() ? nullptr : reduce->inputs()[0];
  const Node* p = x ? x->producer() : nullptr;
  if (p && p->op_type == "Cast" && !p->inputs().empty() && p->inputs()[0]) {
    p = p->inputs()[0]->producer();
  }
  return p && p->op_type == "IsInf" && p->domain.value.empty();
}

// An op the guard's flag passes through on its way to a clamp bound (not the bound itself).
bool guard_step(const Use& u) {
  const std::string& op = u.node->op_type;
  return op == "Greater" || op == "Less" || op == "Equal" || op == "Not" || op == "Cast" ||
         op == "Neg" || (op == "Where" && u.input_index == 0);
}

bool overflow_guard(const Node* reduce) {
  if (!reduces_is_inf(reduce)) return false;
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
      if (!guard_step(u)) return false;
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
  if (name.rfind(kExportedPastPrefix, 0) == 0 || name.rfind("encoder_", 0) == 0) return SeqState();
  const int r = facts.rank(v);
  int axis = -1;
  for (int i = 0; i < r; ++i) {
    auto d = facts.dim(v, i);
    if (!d || !facts.equal(*d, seq)) continue;
    if (axis >= 0) refuse("input '" + name + "' has the sequence length on two axes");
    axis = i;
  }
  if (axis < 0 && r >= 1 && !cached_export &&
      (name == kAttentionMask || name == kPositionIds || name == "token_type_ids")) {
    axis = r - 1;
  }
  return axis < 0 ? SeqState() : SeqState::seq(axis);
}

// The walk of prove_positionwise, in graph order: each node the outputs read gets its outputs'
// states from its inputs' (positionwise.h) or a refusal; its outputs are then refused too, so
// only the first cause is reported (unless a later one explains more: its priority).
class PositionwiseWalk {
 public:
  PositionwiseWalk(Model& m, const std::vector<Node*>& attentions,
                   const std::vector<Node*>& offset_ranges, bool cached_export,
                   analysis::ShapeFacts& facts, const analysis::DimExpr& seq)
      : g_(*m.graph),
        attentions_(attentions),
        offset_(offset_ranges.begin(), offset_ranges.end()),
        cached_export_(cached_export),
        ctx_{facts, seq, default_opset(m), {}, {}, {}} {
    refused_.kind = SeqState::kRefused;
  }

  void run(const Value* input_ids) {
    std::vector<const Node*> nodes;
    live_ = read_values(g_, nodes);
    for (const Value* v : g_.inputs()) {
      if (v && live_.count(v)) {
        state_[v] = input_state(ctx_.facts, v, input_ids, ctx_.seq, cached_export_);
      }
    }
    collect_cache_concats();
    for (const Node* n : nodes) {
      if (is_read(n)) visit(n);
    }
    report();
  }

 private:
  struct Refusal {
    const Node* node;
    std::string why;
    int priority;
  };
  // What the node's inputs carry (their states are in ctx_.in).
  struct Reads {
    bool any_seq = false, any_last = false, after_refused = false;
  };

  // A cache's Concat(past, new rows) on axis 2: row P + s is new position s (the past is free).
  void collect_cache_concats() {
    for (const Node* att : cached_export_ ? attentions_ : std::vector<Node*>{}) {
      if (auto c = cached_kv(att))
        cache_concats_.insert({c->present_k->producer(), c->present_v->producer()});
    }
  }

  bool is_read(const Node* n) const {
    bool read = false;
    for (const Value* v : n->outputs()) read = read || (v && live_.count(v));
    return read && !shape_only(n);
  }

  const SeqState& state_of(const Value* v) const {
    auto it = v ? state_.find(v) : state_.end();
    return it == state_.end() ? free_ : it->second;
  }

  void set_outputs(const Node* n, const SeqState& s) {
    for (const Value* v : n->outputs()) {
      if (v) state_[v] = s;
    }
  }

  void refuse_at(const Node* n, const std::string& why, int priority) {
    refusals_.push_back({n, why, priority});
    set_outputs(n, refused_);
  }

  Reads read_inputs(const Node* n) {
    Reads r;
    ctx_.in.clear();
    const bool attention = is_internal_attention(n);
    for (const Value* v : n->inputs()) {
      // an attention's mask is proven and replaced, not read (also where an unfused layer reads
      // the same mask values as data)
      ctx_.in.push_back(attention && ctx_.in.size() == 3 ? free_ : state_of(v));
      r.any_seq = r.any_seq || ctx_.in.back().kind == SeqState::kSeq;
      r.any_last = r.any_last || ctx_.in.back().kind == SeqState::kLast;
      r.after_refused = r.after_refused || ctx_.in.back().kind == SeqState::kRefused;
    }
    return r;
  }

  bool subgraph_reads_tokens(const Node* n) {
    inner_.clear();
    captured(n, g_, inner_);
    bool reads_tokens = false;
    for (const Value* v : inner_) {
      reads_tokens = reads_tokens || state_of(v).kind != SeqState::kFree;
    }
    return reads_tokens;
  }

  void cache_concat(const Node* n) {
    const SeqState& fresh = ctx_.in[1];
    if (ctx_.in[0].kind != SeqState::kFree || fresh.kind != SeqState::kSeq || fresh.axis != 2 ||
        fresh.flattened()) {
      refuse_at(n, "its new rows are not (B, Hkv, S, D) over the positions", 0);
    } else {
      state_[n->outputs()[0]] = fresh;
    }
  }

  // A Range over the new tokens: its positions, offset by the rewrite or (an export with a cache
  // numbers its own positions, adopted as exported) each position's own value; one the rewrite
  // does not offset is refused at the end unless a rule proves it a relative index.
  bool range_over_tokens(const Node* n) {
    if (!n->domain.value.empty() || n->op_type != "Range") return false;
    auto d = ctx_.facts.dim(n->outputs()[0], 0);
    if (!d || !ctx_.facts.equal(*d, ctx_.seq)) return false;
    if (offset_.count(n) || cached_export_) {
      state_[n->outputs()[0]] = SeqState::seq(0);
    } else {
      unoffset_ranges_.push_back(n);
    }
    return true;
  }

  void apply_rule(const Node* n) {
    const SeqRule rule = find_seq_rule(n->domain.value, n->op_type);
    std::string bad = mistyped_reason(n);
    outs_.clear();
    ctx_.priority = 0;
    if (!bad.empty() || !rule || !rule(*n, ctx_, outs_)) {
      refuse_at(n,
                !bad.empty() ? bad
                : rule       ? ctx_.why
                             : "it is not known to be position-wise (no rule says how it treats "
                               "the sequence axis)",
                ctx_.priority);
      return;
    }
    for (size_t i = 0; i < n->outputs().size() && i < outs_.size(); ++i) {
      if (n->outputs()[i]) state_[n->outputs()[i]] = outs_[i];
    }
  }

  void visit(const Node* n) {
    const Reads r = read_inputs(n);
    if (r.after_refused) return set_outputs(n, refused_);
    if (subgraph_reads_tokens(n)) {
      return refuse_at(n, "its subgraph reads the tokens (not proven position-wise)", 0);
    }
    if (cache_concats_.count(n)) return cache_concat(n);
    if (range_over_tokens(n)) return;
    if (!r.any_seq) {  // a function of weights, shapes and the last position only
      if (r.any_last) set_outputs(n, SeqState::last());
      return;
    }
    if (n->op_type.rfind("Reduce", 0) == 0 && overflow_guard(n)) return;  // free
    apply_rule(n);
  }

  // The first refusal, unless a later one explains more; then a Range(0, S) the rewrite does
  // not offset (its positions are wrong in the cached model): its refusal waits for the walk's
  // end, so that a mixing op (an unfused attention reading such a Range in its mask) is what
  // the message names.
  void report() const {
    if (!refusals_.empty()) {
      const Refusal* best = &refusals_.front();
      for (const Refusal& r : refusals_) best = r.priority > best->priority ? &r : best;
      refuse_node(best->node, attentions_, best->why);
    }
    for (const Node* r : unoffset_ranges_) {
      if (std::find(ctx_.relative_ranges.begin(), ctx_.relative_ranges.end(), r) !=
          ctx_.relative_ranges.end()) {
        continue;
      }
      refuse_node(r, attentions_,
                  "it numbers the positions 0 .. S-1 inside the graph and the rewrite does not "
                  "offset it, so the new tokens would be numbered from 0",
                  "is not position-wise");
    }
  }

  const Graph& g_;
  const std::vector<Node*>& attentions_;
  const std::unordered_set<const Node*> offset_;
  const bool cached_export_;
  SeqContext ctx_;
  std::unordered_set<const Value*> live_;
  std::unordered_map<const Value*, SeqState> state_;
  std::unordered_set<const Node*> cache_concats_;
  const SeqState free_;
  SeqState refused_;
  std::vector<const Node*> unoffset_ranges_;
  std::vector<Refusal> refusals_;
  std::vector<SeqState> outs_;
  std::vector<const Value*> inner_;
};

}  // namespace

void prove_positionwise(Model& m, const std::vector<Node*>& attentions,
                        const std::vector<Node*>& offset_ranges, const Value* input_ids,
                        bool cached_export) {
  analysis::ShapeFacts& facts = analysis::facts_of(m);
  auto seq = facts.dim(input_ids, 1);
  if (!seq) refuse("input_ids has no sequence axis (rank below 2)");
  PositionwiseWalk(m, attentions, offset_ranges, cached_export, facts, *seq).run(input_ids);
}

}  // namespace fastopt::passes::kv_cache
