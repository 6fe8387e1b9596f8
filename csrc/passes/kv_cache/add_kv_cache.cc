// add_kv_cache: turns a decoder exported WITHOUT a KV cache into one WITH a cache, by editing the
// internal Attention ops (internal_op.h) between fuse_attention and lower_attention.
//
// Before (per layer i; exporters: TorchScript and dynamo exports with use_cache=False, which
// recompute every key and value of the whole sequence at each step):
//
//   input_ids (B,S)   attention_mask (B,S)   position_ids (B,S)
//        |                  |                      |
//       ...          mask subgraph (B,1,S,S)   RotaryEmbedding ...
//        |                  |                      |
//   Q (B,Hq,S,D)  K (B,Hkv,S,D)  V (B,Hkv,S,D)     |
//        \              |             /            |
//         internal::Attention(Q, K, V, mask) -> Y (B,Hq,S,D)
//
// After (the cached internal form, one shared mask subgraph for all layers):
//
//   past_key_values.i.key (B,Hkv,P,D)   K (B,Hkv,S,D)
//                     \                /
//                  Concat(axis=2) = present.i.key (B,Hkv,T,D)   [graph output]; same for V
//
//   T = Shape(attention_mask)[1]    S = Shape(input_ids)[1]    P = T - S
//   causal(s, t)  = Range(0,T)[t] <= Range(P,T)[s]                              (S, T)
//   allowed       = And(causal, Unsqueeze(Cast(attention_mask, bool), [1, 2]))  (B, 1, S, T)
//   internal::Attention(Q, present.i.key, present.i.value, allowed), is_causal = 0
//
// attention_mask becomes (B, T). Every other use the export made of it (its Shape gives B and S
// to head-split Reshapes in dynamo exports, where S and the mask width share one symbol) reads
// its last S columns, attention_mask[:, P:], so nothing else ties S to the key length. The old
// mask subgraph is left dead (eliminate_dead_nodes removes it). Positions: a position_ids input
// is kept (callers pass absolute positions); positions computed inside the graph by Range(0, S)
// feeding a RotaryEmbedding become Range(P, P + S).
//
// A model exported WITH a cache (past_* inputs) is adopted instead (adopt_cache): after
// fuse_attention its attentions already are in the cached form; each gets the shared mask above,
// and in place (kv_cache 2) every Shape read of a past that includes its length gets P instead
// of the buffer's max length. An ALiBi bias is kept as for a no-cache model (kv_cache_bias.cc;
// it may also read a past's shape, P). A sliding-window cache that keeps only its last rows
// (transformers' sliding layers: present = Slice(Concat(past, new), -(w - 1))) is adopted as a
// full cache when its mask is proven over the rows it holds (kv_cache_adopt.cc).
//
// Masks: every attention's mask is replaced, so each is first proven (mask_proof.h,
// by evaluating it on probes) to be causal with padding, or that with a sliding window of w
// keys; the sliding layers then get `allowed` AND t > P + s - w and the attribute
// sliding_window = w. A mask proven to be neither is refused.
//
// Refused (ModelError, the graph is not changed) when: no internal Attention node exists; an op
// other than the attentions mixes positions (kv_cache_positionwise.cc: a layer whose attention
// did not fuse, a running sum, a token shift, a mean over the tokens, a convolution over them);
// a mask is not proven (it reads other inputs, cannot be evaluated, or is another pattern);
// input_ids or attention_mask is missing; the sequence length is static (fixed dims, a constant
// mask, a Reshape of a symbolic-length tensor to a constant shape); K/V are not (B, Hkv, S, D);
// positions are computed in a way this pass does not know; with past inputs: an attention not in
// the cached form, a past input feeding no attention's cache, in place a past read (data, not
// shape) by anything else than its cache Concat.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "ir/error.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/kv_cache.h"
#include "passes/kv_cache/kv_cache_cross.h"

namespace fastopt::passes::kv_cache {
namespace {
using pattern::attr_int;

// The K or V an attention reads must be (B, Hkv, S, D), which the internal op promises and this
// checks where sizes are known: rank 4, Hkv heads on axis 1, the query's length on axis 2 (a
// longer sequence is cross-attention or a cache already), a known head size on axis 3.
void check_kv_layout(const Node* att, const Value* x, const char* what, int64_t hkv) {
  const std::string where = std::string(what) + " of attention '" + att->name.value + "'";
  const int rank = rank_of(x);
  if (rank != 4) refuse(where + " is not 4-D (B, Hkv, S, D) (rank " + std::to_string(rank) + ")");
  if (auto h = resolve_dim(x, 1); h && *h != hkv) {
    refuse(where + " has " + std::to_string(*h) + " heads on axis 1, not kv_num_heads " +
           std::to_string(hkv) + ": not the (B, Hkv, S, D) layout");
  }
  const Dim* s = dim_of(att->inputs()[0], 2);
  const Dim* t = dim_of(x, 2);
  // Symbolic names prove nothing (shape inference invents unk__N names); fixed sizes do: a
  // fixed key length the query does not share is cross-attention or a static export.
  if (t && t->value && !(s && s->value && *s->value == *t->value)) {
    refuse(where + " has a fixed length " + std::to_string(*t->value) +
           " on axis 2 that the query does not have: not a self-attention over the (B, Hkv, "
           "S, D) layout");
  }
  if (!resolve_dim(x, 3)) refuse(where + " has no known head size (axis 3)");
}

// Walks back from a RotaryEmbedding's position input through shape-keeping ops to a
// Range(0, n, 1); nullptr when there is none.
Node* position_range(Value* pos) {
  for (int steps = 0; pos && steps < 8; ++steps) {
    Node* p = pos->producer();
    if (!p || !p->domain.value.empty()) return nullptr;
    if (p->op_type == "Range") {
      auto start = constant_scalar(p->inputs()[0]);
      auto delta = constant_scalar(p->inputs()[2]);
      return start && *start == 0 && delta && *delta == 1 ? p : nullptr;
    }
    if (p->op_type != "Unsqueeze" && p->op_type != "Expand" && p->op_type != "Reshape" &&
        p->op_type != "Cast" && p->op_type != "Tile") {
      return nullptr;
    }
    pos = p->inputs()[0];
  }
  return nullptr;
}

// A Reshape to a constant shape without 0 or -1 whose input has a symbolic dim: the export
// wrote the lengths it was traced with into the graph, which then runs only at that length
// (and never for one new token after a past).
void refuse_baked_lengths(const Graph& g) {
  for (const Node* n = g.first(); n; n = n->next()) {
    if (n->op_type != "Reshape" || !n->domain.value.empty() || n->inputs().size() < 2) continue;
    const Value* x = n->inputs()[0];
    if (!x || !x->type.known || !x->type.has_shape) continue;
    const Dim* symbolic = nullptr;
    for (const Dim& d : x->type.dims) {
      if (!d.value && d.param && !d.param->empty()) symbolic = &d;
    }
    if (!symbolic) continue;
    auto target = constant_ints(n->inputs()[1]);
    if (!target || target->empty()) continue;
    bool all_fixed = true;
    for (int64_t d : *target) all_fixed = all_fixed && d > 0;
    if (!all_fixed) continue;
    std::string shape;
    for (int64_t d : *target) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    refuse("Reshape '" + n->name.value + "' reshapes a tensor with the symbolic dim '" +
           *symbolic->param + "' to the constant shape [" + shape +
           "]: the export baked a sequence length (or batch size) into the graph, so it cannot "
           "run one new token after a past; export with dynamic shapes");
  }
}

// The internal Attention nodes of the main graph in topological order (layer i = the i-th; a
// reorder changes no result); refused when there are none or one sits in a subgraph.
std::vector<Node*> find_attentions(Model& m) {
  Graph& g = *m.graph;
  std::vector<Node*> attentions;
  g.topological_sort();
  for (Node* n = g.first(); n; n = n->next()) {
    if (is_internal_attention(n)) attentions.push_back(n);
  }
  if (attentions.empty()) {
    refuse(
        "no fused attention found (no ai.fastopt.internal::Attention node): run preset llm's "
        "passes up to fuse_attention first; `--explain fuse_attention` tells why an attention "
        "did not fuse");
  }
  m.for_each_graph([&](Graph& sub) {
    if (&sub == &g) return;
    for (Node* n = sub.first(); n; n = n->next()) {
      if (is_internal_attention(n)) refuse("an attention inside a subgraph (If/Loop body)");
    }
  });
  return attentions;
}

// The graph inputs the cached form is built on; refused when the lengths are not dynamic.
struct CacheInputs {
  Value* input_ids;
  Value* attention_mask;
  Dim batch_dim;
};

CacheInputs check_inputs(const Model& m, const Graph& g) {
  Value* input_ids = graph_input(g, kInputIds);
  Value* attention_mask = graph_input(g, kAttentionMask);
  if (!input_ids) refuse("the model has no input_ids input");
  if (!attention_mask) refuse("the model has no attention_mask input (needed over past + new)");
  if (const Dim* s = dim_of(input_ids, 1); s && s->value) {
    refuse("input_ids has a fixed sequence length (" + std::to_string(*s->value) +
           "): a static-shape export bakes it into shapes");
  }
  if (const Dim* s = dim_of(attention_mask, 1); s && s->value) {
    refuse("attention_mask has a fixed length (" + std::to_string(*s->value) +
           "): a static-shape export bakes it into shapes");
  }
  const Dim* batch = dim_of(input_ids, 0);
  if (default_opset(m) < 13) refuse("the model's opset is below 13");
  refuse_baked_lengths(g);
  return {input_ids, attention_mask, batch ? *batch : param_dim("batch_size")};
}

// What each layer's past/present carries.
struct Layer {
  Node* att;
  int32_t dtype;
  int64_t hkv, dk, dv;
};

// Each attention in the no-cache form with (B, Hkv, S, D) keys and values of one dtype; the new
// input and output names are free.
std::vector<Layer> check_layers(const Graph& g, const std::vector<Node*>& attentions,
                                const CacheForm& form) {
  for (size_t i = 0; i < attentions.size(); ++i) {
    for (bool value : {false, true}) {
      for (const std::string& n : {past_name(form, i, value), present_name(form, i, value)}) {
        if (Value* v = g.lookup(n); v && v->defined()) refuse("a value named '" + n + "' exists");
      }
    }
  }
  std::vector<Layer> layers;
  for (Node* att : attentions) {
    const std::vector<Value*>& in = att->inputs();
    if (in.size() < 3 || !in[0] || !in[1] || !in[2]) refuse("an attention without Q, K or V");
    if (in.size() > 5 || att->outputs().size() != 1) {  // (input 4: sinks, kept)
      refuse("attention '" + att->name.value + "' has past/present already");
    }
    const int64_t hkv = int_attr_or(att, "kv_num_heads", 0);
    if (hkv <= 0) refuse("attention '" + att->name.value + "' has no kv_num_heads");
    if (in.size() > 3 && in[3] && constant_tensor(in[3])) {
      refuse("the mask of attention '" + att->name.value +
             "' is a constant: the export fixed the sequence length");
    }
    if (const Dim* s = dim_of(in[0], 2); s && s->value && *s->value != 1) {
      refuse("the query of attention '" + att->name.value + "' has a fixed sequence length (" +
             std::to_string(*s->value) + ")");
    }
    check_kv_layout(att, in[1], "K", hkv);
    check_kv_layout(att, in[2], "V", hkv);
    const int32_t dtype = dtype_of(in[1]);
    if (dtype == 0 || dtype_of(in[2]) != dtype) {
      refuse("attention '" + att->name.value + "': K/V dtype unknown or different");
    }
    layers.push_back({att, dtype, hkv, *resolve_dim(in[1], 3), *resolve_dim(in[2], 3)});
    // One layout for every layer: genai_config.json (num_key_value_heads, head_size) and the
    // runtimes' cache allocators describe the cache once. A layer that caches its K/V after a
    // repeat_kv of its own (Hq heads where the others keep Hkv) would be fed buffers of the
    // wrong shape.
    const Layer& first = layers.front();
    const Layer& last = layers.back();
    if (last.hkv != first.hkv || last.dk != first.dk || last.dv != first.dv) {
      auto layout = [](const Layer& l) {
        return std::to_string(l.hkv) + " kv heads of sizes " + std::to_string(l.dk) + "/" +
               std::to_string(l.dv);
      };
      refuse("attention '" + att->name.value + "' would cache " + layout(last) +
             " where attention '" + first.att->name.value + "' caches " + layout(first) +
             ": every layer's cache must have one layout");
    }
  }
  return layers;
}

// A reduction over the positions (LongRoPE's max(position_ids) + 1 > t that switches rotary
// tables, fused or not) makes every token's rotation depend on the longest position: a cached
// key keeps the rotation of its step, which the full recompute replaces once the switch flips.
// The first such node that reads `positions` through shape-keeping ops, or null.
const Node* position_reduction(const Graph& g, const Value* positions) {
  if (!positions) return nullptr;
  for (const Node* n = g.first(); n; n = n->next()) {
    if (!n->domain.value.empty() ||
        (n->op_type != "ReduceMax" && n->op_type != "ReduceMin" && n->op_type != "ArgMax")) {
      continue;
    }
    const Value* v = n->inputs().empty() ? nullptr : n->inputs()[0];
    for (int steps = 0; v && v != positions && steps < 4; ++steps) {
      const Node* p = v->producer();
      if (!p || !p->domain.value.empty() ||
          (p->op_type != "Cast" && p->op_type != "Unsqueeze" && p->op_type != "Reshape")) {
        v = nullptr;
        break;
      }
      v = p->inputs()[0];
    }
    if (v == positions) return n;
  }
  return nullptr;
}

// Positions computed inside the graph: the Range(0, S) of each RotaryEmbedding's positions
// (none when the model has a position_ids input).
std::vector<Node*> position_ranges(Graph& g) {
  std::vector<Node*> ranges;
  if (graph_input(g, kPositionIds)) return ranges;
  std::unordered_set<Node*> seen;
  for (Node* n = g.first(); n; n = n->next()) {
    if (n->op_type != "RotaryEmbedding") continue;
    // com.microsoft: (X, position_ids, cos, sin); ONNX 23: (X, cos, sin, position_ids?).
    const size_t at = n->domain.value == kMsDomain ? 1 : 3;
    if (n->inputs().size() <= at || !n->inputs()[at]) continue;
    Value* pos = n->inputs()[at];
    if (pos->is_graph_input()) continue;
    Node* r = position_range(pos);
    if (!r) {
      refuse("the positions of RotaryEmbedding '" + n->name.value +
             "' are computed in the graph in a way the rewrite does not know (no "
             "position_ids input, no Range(0, S))");
    }
    if (seen.insert(r).second) ranges.push_back(r);
  }
  return ranges;
}

// ---- edits ----

// past_key_values.i.key/value graph inputs (B, Hkv, past_sequence_length, D), per layer.
std::vector<std::pair<Value*, Value*>> add_past_inputs(Graph& g, const CacheForm& form,
                                                       const std::vector<Layer>& layers,
                                                       const Dim& batch_dim) {
  std::vector<std::pair<Value*, Value*>> pasts;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    Value* kv[2];
    for (int k = 0; k < 2; ++k) {
      Value* p = g.create_value(past_name(form, i, k == 1));
      p->type = tensor_type(l.dtype, {batch_dim, value_dim(l.hkv), param_dim(form.past_dim),
                                      value_dim(k ? l.dv : l.dk)});
      g.add_input(p);
      kv[k] = p;
    }
    pasts.emplace_back(kv[0], kv[1]);
  }
  return pasts;
}

// attention_mask becomes (B, T); every earlier use of it sees its last S columns, (B, S) as at
// export.
void widen_attention_mask(Graph& g, KvCacheBuilder& b, const CacheForm& form,
                          const SharedMask& mask, Node* head, const CacheInputs& in,
                          const std::vector<const Node*>& full_readers) {
  Value* attention_mask = in.attention_mask;
  std::vector<Use> old_uses;
  for (const Use& u : attention_mask->uses()) {
    const bool full = std::find(full_readers.begin(), full_readers.end(), u.node) !=
                      full_readers.end();  // score biases' copies (kv_cache_bias.cc)
    if (u.node != mask.mask_bool && u.node != mask.mask_shape && !full) old_uses.push_back(u);
  }
  if (!old_uses.empty()) {
    Value* current = b.op("Slice",
                          {attention_mask,
                           b.op("Unsqueeze", {mask.past_len, b.constant("kv_axes_0", {0}, {1})},
                                "kv_past_len_1d", head),
                           b.constant("kv_end", {std::numeric_limits<int64_t>::max()}, {1}),
                           b.constant("kv_axes_1", {1}, {1})},
                          "kv_attention_mask_current", head);
    current->type =
        tensor_type(value_dtype(attention_mask), {in.batch_dim, param_dim("sequence_length")});
    for (const Use& u : old_uses) u.node->set_input(u.input_index, current);
  }
  attention_mask->type =
      tensor_type(value_dtype(attention_mask), {in.batch_dim, param_dim(form.present_dim)});
  for (ValueInfoEntry& e : g.input_entries) {
    if (e.value == attention_mask) e.own_type.reset();
  }
}

// Per layer: present = Concat(past, new) (a graph output), which the attention reads.
void add_presents(Graph& g, KvCacheBuilder& b, const CacheForm& form,
                  const std::vector<Layer>& layers,
                  const std::vector<std::pair<Value*, Value*>>& pasts, const Dim& batch_dim) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    Node* att = l.att;
    for (int kv = 0; kv < 2; ++kv) {
      Value* cur = att->inputs()[1 + kv];
      Node* cat = b.node("Concat", {kv ? pasts[i].second : pasts[i].first, cur},
                         present_name(form, i, kv == 1), att, one_attr(attr_int("axis", 2)));
      Value* present = cat->outputs()[0];
      present->type = tensor_type(
          l.dtype,
          {batch_dim, value_dim(l.hkv), param_dim(form.present_dim), value_dim(kv ? l.dv : l.dk)});
      g.add_output(present);
      att->set_input(1 + kv, present);
    }
  }
}

int64_t add_kv_cache(Model& m, PassContext& ctx) {
  const int64_t mode = ctx.options.count("kv_cache") ? ctx.options.at("kv_cache") : 1;
  if (mode != 1 && mode != 2) {
    throw ModelError("add_kv_cache: option kv_cache must be 1 (standard) or 2 (inplace), not " +
                     std::to_string(mode));
  }
  Graph& g = *m.graph;
  const CacheForm& form = mode == 2 ? kInPlace : kStandard;

  // ---- checks: nothing is changed before all of them pass ----
  const bool has_past = has_exported_past(g);
  const std::vector<Node*> attentions = find_attentions(m);
  if (graph_input(g, kEncoderHiddenStates)) {  // an encoder-decoder's decoder
    refuse_baked_lengths(g);
    return add_cross_cache(m, attentions, mode, ctx);
  }
  const CacheInputs in = check_inputs(m, g);
  if (has_past) {
    return adopt_cache(g, attentions, in.input_ids, in.attention_mask, in.batch_dim, form, ctx);
  }
  const std::vector<Layer> layers = check_layers(g, attentions, form);
  const std::vector<Node*> ranges = position_ranges(g);
  if (const Node* r = position_reduction(g, graph_input(g, kPositionIds))) {
    refuse(r->op_type + " '" + r->name.value +
           "' reduces over position_ids (a LongRoPE switch of rotary tables at the longest "
           "position): a cached key keeps the rotation of its step, which the full recompute "
           "changes once the switch flips");
  }
  std::vector<ScoreBias> biases = check_score_biases(g, attentions, in.attention_mask);
  std::vector<int64_t> windows;
  {  // a biased attention's mask part is proven like any mask
    MaskPartsForProof proving(g, biases);
    windows = proven_windows(g, attentions, false);
  }
  prove_positionwise(m, attentions, ranges, in.input_ids);

  // ---- edits ----
  KvCacheBuilder b(g);
  const std::vector<std::pair<Value*, Value*>> pasts =
      add_past_inputs(g, form, layers, in.batch_dim);
  Node* head = g.first();  // the shared mask goes before it
  SharedMask mask = build_shared_mask(g, b, in.input_ids, in.attention_mask, in.batch_dim);
  const std::vector<const Node*> full_readers =
      copy_biases(g, b, biases, in.attention_mask, attentions);
  widen_attention_mask(g, b, form, mask, head, in, full_readers);
  offset_positions(b, ranges, mask.past_len, ctx);
  add_presents(g, b, form, layers, pasts, in.batch_dim);
  use_masks(b, mask, attentions, windows, in.batch_dim, ctx);
  use_biases(g, b, biases, ctx);
  ctx.counters["layers cached"] += static_cast<int64_t>(layers.size());
  return static_cast<int64_t>(layers.size());
}

const PassRegistrar kRegister{
    PassDecl(
        "add_kv_cache",
        "turn a no-cache decoder's internal Attention ops into a cached decoder (past/present "
        "inputs/outputs, mask over past + new); runs between fuse_attention and lower_attention")
        .tags({"llm", "kv_cache"})
        .not_idempotent()
        .run(add_kv_cache)
        .requires_facts({kAttentionFused})  // it edits the internal Attention ops ...
        .runs_before({"lower_attention"})   // ... before they are lowered
        .options({
            OptionDecl("kv_cache",
                       "the KV cache form add_kv_cache writes; set by optimize(kv_cache=...)")
                .choices({{1, "standard"}, {2, "inplace"}})
                .internal(),
            OptionDecl("cross_attention_cache",
                       "an encoder-decoder's decoder: 1 caches the cross-attention's keys and "
                       "values (computed at the first step, passed through after), 0 recomputes "
                       "them from encoder_hidden_states at every step (the decoder "
                       "onnxruntime-genai's whisper runs when the encoder gives no cross cache), "
                       "2 reads them from inputs the encoder computes (its projections become "
                       "outputs, which fastopt.genai_whisper moves into the encoder)")
                .default_value(1)
                .choices({{0, "recompute"}, {1, "cached"}, {2, "from_encoder"}}),
        })};

}  // namespace

void offset_positions(KvCacheBuilder& b, const std::vector<Node*>& ranges, Value* past_len,
                      PassContext& ctx) {
  for (Node* r : ranges) {
    Value* limit = r->inputs()[1];
    Value* start = past_len;
    const int32_t t = value_dtype(limit);
    if (t != 0 && t != kInt64) {
      start = b.op("Cast", {past_len}, "kv_position_start", r, one_attr(attr_int("to", t)));
    }
    r->set_input(0, start);
    r->set_input(1, b.op("Add", {limit, start}, "kv_position_end", r));
    ctx.counters["positions offset by the past length"] += 1;
  }
}

}  // namespace fastopt::passes::kv_cache
