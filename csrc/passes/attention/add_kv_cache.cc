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
// of the buffer's max length.
//
// Masks: every attention's mask is replaced, so each is first proven (mask_proof.h,
// by evaluating it on probes) to be causal with padding, or that with a sliding window of w
// keys; the sliding layers then get `allowed` AND t > P + s - w and the attribute
// sliding_window = w. A mask proven to be neither is refused.
//
// Refused (ModelError, the graph is not changed) when: no internal Attention node exists;
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
#include "passes/attention/mask_proof.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {
using pattern::attr_int;
using pattern::attr_ints;

bool is_internal_attention(const Node* n) {
  return n->op_type == kInternalAttention && n->domain.value == kInternalDomain;
}

[[noreturn]] void refuse(const std::string& why) {
  throw ModelError("add_kv_cache: cannot add a KV cache: " + why);
}

const Dim* dim_of(const Value* v, size_t axis) {
  if (!v || !v->type.known || !v->type.is_tensor || !v->type.has_shape) return nullptr;
  return axis < v->type.dims.size() ? &v->type.dims[axis] : nullptr;
}

Value* graph_input(const Graph& g, const std::string& name) {
  for (Value* v : g.inputs()) {
    if (v && v->name() == name) return v;
  }
  return nullptr;
}

TypeInfo tensor_type(int32_t dtype, std::vector<Dim> dims) {
  TypeInfo t;
  t.known = true;
  t.is_tensor = true;
  t.elem_type = dtype;
  t.has_shape = true;
  t.dims = std::move(dims);
  return t;
}

Dim param_dim(const std::string& p) {
  Dim d;
  d.param = p;
  return d;
}

Dim value_dim(int64_t n) {
  Dim d;
  d.value = n;
  return d;
}

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

class KvCacheBuilder {
 public:
  explicit KvCacheBuilder(Graph& g) : g_(g) {}

  Value* constant(const std::string& base, const std::vector<int64_t>& values,
                  std::vector<int64_t> dims) {
    return g_.add_initializer(g_.unique_name(base), make_int64_tensor(values, std::move(dims)));
  }
  Node* node(const std::string& op, const std::vector<Value*>& inputs, const std::string& out,
             Node* before, std::vector<Attribute> attrs = {}) {
    Node* n = g_.create_node(op, "", inputs, {out}, before);
    n->attributes = std::move(attrs);
    return n;
  }
  Value* op(const std::string& op, const std::vector<Value*>& inputs, const std::string& out,
            Node* before, std::vector<Attribute> attrs = {}) {
    return node(op, inputs, g_.unique_name(out), before, std::move(attrs))->outputs()[0];
  }

 private:
  Graph& g_;
};

// The lengths and the mask every cached attention shares, built before every other node (they
// read graph inputs only). T is the attention mask's width and P = T - S, not the past's length:
// an in-place cache binds a max-length buffer as the past, whose length says nothing of the
// tokens it holds.
struct SharedMask {
  Value* past_len;  // P, int64 scalar
  Value* allowed;   // bool (B, 1, S, T)
  const Node* mask_bool;
  const Node* mask_shape;
  Value* query_column;                                    // (S, 1): P + s
  Value* key_positions;                                   // (T): t
  Node* head;                                             // the masks go before it
  std::vector<std::pair<int64_t, Value*>> windowed = {};  // window -> its mask
};

// The mask of a sliding-window layer: `allowed` and key t > P + s - w for query P + s, as
// transformers' window (key j visible to query i iff i - w < j <= i, positions as indices, so
// padding inside the window counts, exactly what the no-cache model computes on the same
// attention_mask). One per window, shared by its layers.
Value* windowed_mask(KvCacheBuilder& b, SharedMask& m, int64_t window, const Dim& batch_dim) {
  for (auto [w, v] : m.windowed) {
    if (w == window) return v;
  }
  Node* head = m.head;
  Value* oldest = b.op("Sub", {m.query_column, b.constant("kv_window", {window}, {})},
                       "kv_window_start", head);  // (S, 1): P + s - w
  Value* inside = b.op("Greater", {m.key_positions, oldest}, "kv_in_window", head);  // (S, T)
  Value* allowed = b.op("And", {m.allowed, inside}, "kv_sliding_window_mask", head);
  allowed->type = tensor_type(kBool, {batch_dim, value_dim(1), param_dim("sequence_length"),
                                      param_dim("total_sequence_length")});
  m.windowed.emplace_back(window, allowed);
  return allowed;
}

SharedMask build_shared_mask(Graph& g, KvCacheBuilder& b, Value* input_ids, Value* attention_mask,
                             const Dim& batch_dim) {
  Node* head = g.first();
  Value* zero = b.constant("kv_zero", {0}, {});
  Value* one = b.constant("kv_one", {1}, {});
  Value* seq_len = b.op("Gather", {b.op("Shape", {input_ids}, "kv_ids_shape", head), one},
                        "kv_seq_len", head, one_attr(attr_int("axis", 0)));
  Value* mask_shape_value = b.op("Shape", {attention_mask}, "kv_mask_shape", head);
  Value* total_len =
      b.op("Gather", {mask_shape_value, one}, "kv_total_len", head, one_attr(attr_int("axis", 0)));
  Value* past_len = b.op("Sub", {total_len, seq_len}, "kv_past_len", head);
  Value* q_pos = b.op("Range", {past_len, total_len, one}, "kv_query_positions", head);
  Value* q_col =
      b.op("Unsqueeze", {q_pos, b.constant("kv_axes_1", {1}, {1})}, "kv_query_column", head);
  Value* k_pos = b.op("Range", {zero, total_len, one}, "kv_key_positions", head);
  Value* causal = b.op("LessOrEqual", {k_pos, q_col}, "kv_causal", head);
  Value* mask_bool =
      b.op("Cast", {attention_mask}, "kv_mask_bool", head, one_attr(attr_int("to", kBool)));
  Value* pad =
      b.op("Unsqueeze", {mask_bool, b.constant("kv_axes_1_2", {1, 2}, {2})}, "kv_padding", head);
  Value* allowed = b.op("And", {causal, pad}, "kv_attention_mask", head);
  allowed->type = tensor_type(kBool, {batch_dim, value_dim(1), param_dim("sequence_length"),
                                      param_dim("total_sequence_length")});
  return {past_len, allowed, mask_bool->producer(), mask_shape_value->producer(), q_col,
          k_pos,    head};
}

// The window of each attention's mask (0: none), proven by mask_proof.h: the cached
// form replaces the masks, so one it cannot reproduce is refused, never dropped.
std::vector<int64_t> proven_windows(const Graph& g, const std::vector<Node*>& attentions,
                                    bool with_past) {
  std::vector<int64_t> windows;
  // Layers sharing one mask value (and causal flag, head count) share the answer.
  std::vector<std::pair<const Node*, int64_t>> proven;
  auto same_mask = [](const Node* a, const Node* b) {
    return a->inputs().size() > 3 && b->inputs().size() > 3 && a->inputs()[3] == b->inputs()[3] &&
           int_attr_or(a, "is_causal", 0) == int_attr_or(b, "is_causal", 0) &&
           int_attr_or(a, "q_num_heads", 0) == int_attr_or(b, "q_num_heads", 0);
  };
  for (size_t i = 0; i < attentions.size(); ++i) {
    auto known = std::find_if(proven.begin(), proven.end(),
                              [&](const auto& p) { return same_mask(p.first, attentions[i]); });
    if (known != proven.end()) {
      windows.push_back(known->second);
      continue;
    }
    std::string why;
    auto kind = classify_attention_mask(*g.model(), g, attentions[i], with_past, &why);
    if (!kind) {
      refuse("the mask of layer " + std::to_string(i) + " (attention '" +
             attentions[i]->name.value +
             "') is not proven to be causal with padding, with or without a sliding window, "
             "which is all the cached form reproduces: " +
             why);
    }
    windows.push_back(kind->window);
    proven.emplace_back(attentions[i], kind->window);
  }
  return windows;
}

void use_shared_mask(Node* att, Value* allowed);

// Each attention gets the shared mask, or its window's; sliding_window tells the lowerings that
// read no mask (in-place GroupQueryAttention) the window.
void use_masks(Graph& g, KvCacheBuilder& b, SharedMask& m, const std::vector<Node*>& attentions,
               const std::vector<int64_t>& windows, const Dim& batch_dim, PassContext& ctx) {
  (void)g;
  for (size_t i = 0; i < attentions.size(); ++i) {
    Node* att = attentions[i];
    if (!windows[i]) {
      use_shared_mask(att, m.allowed);
      continue;
    }
    use_shared_mask(att, windowed_mask(b, m, windows[i], batch_dim));
    att->attributes.push_back(attr_int("sliding_window", windows[i]));
    ctx.counters["sliding-window layers"] += 1;
  }
}

// Each attention reads `allowed` (causal over past + new, and padding) with is_causal 0.
void use_shared_mask(Node* att, Value* allowed) {
  if (att->inputs().size() > 3) {
    att->set_input(3, allowed);
  } else {
    att->append_input(allowed);
  }
  for (Attribute& a : att->attributes) {
    if (a.name == "is_causal") {
      a = attr_int("is_causal", 0);
      return;
    }
  }
  att->attributes.push_back(attr_int("is_causal", 0));
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

// A model exported WITH a cache: after fuse_attention its attentions already are in the cached
// form (internal_op.h: K = Concat(past input, new) = present output). Adopting it means checking
// that form everywhere and giving every attention the shared mask (the contract the in-place
// lowering relies on: its causal flag and seqlens_k replace the mask). In place, the past input
// is a max-length buffer: reads of its shape elsewhere (exports derive the past length and the
// positions from it) are given (B, Hkv, P, D) instead; other reads of its data are refused.
int64_t adopt_cache(Graph& g, const std::vector<Node*>& attentions, Value* input_ids,
                    Value* attention_mask, const Dim& batch_dim, int64_t mode, PassContext& ctx) {
  std::unordered_set<const Value*> pasts;
  std::vector<const Value*> past_order;  // the edits below follow it: the same output every run
  std::unordered_set<const Node*> cache_concats;  // Concat(past, new) of each attention
  for (Node* att : attentions) {
    if (att->inputs().size() > 4 || att->outputs().size() != 1) {
      refuse("attention '" + att->name.value + "' has inputs or outputs the form does not know");
    }
    const std::optional<CachedKV> c = cached_kv(att);
    if (!c) {
      // A Slice near the keys: a cache that keeps only its last rows (sliding-window layers
      // exported with a cache, e.g. gemma3), whose positions and mask this form cannot follow.
      bool sliced = false;
      const Value* x = att->inputs().size() > 1 ? att->inputs()[1] : nullptr;
      for (int i = 0; i < 4 && x && x->producer() && !sliced; ++i) {
        sliced = x->producer()->op_type == "Slice";
        x = x->producer()->inputs().empty() ? nullptr : x->producer()->inputs()[0];
      }
      for (const Value* out : g.outputs()) {
        const Node* p = out ? out->producer() : nullptr;
        sliced = sliced || (p && p->op_type == "Slice" && out->name().rfind("present", 0) == 0);
      }
      refuse("the model has past inputs, but attention '" + att->name.value +
             "' does not read its keys and values as Concat(past input, new rows) feeding a "
             "present output (the cached form of a model exported with a cache)" +
             (sliced
                  ? std::string("; a present is sliced: a sliding-window cache that keeps only its "
                                "last rows (gemma3-style) is not converted, export without a cache")
                  : std::string()));
    }
    for (const Value* x : {c->past_k, c->past_v}) {
      if (rank_of(x) != 4) refuse("past input '" + x->name() + "' is not 4-D (B, Hkv, P, D)");
      if (pasts.insert(x).second) past_order.push_back(x);
    }
    cache_concats.insert({c->present_k->producer(), c->present_v->producer()});
  }
  for (const Value* v : g.inputs()) {
    if (v && v->name().rfind("past_", 0) == 0 && !pasts.count(v)) {
      refuse("past input '" + v->name() + "' does not feed the cache of a fused attention");
    }
  }
  // Shape reads of a past that include its length (axis 2), with where that length sits.
  std::vector<std::pair<Node*, int64_t>> shape_reads;
  for (const Value* past : past_order) {
    for (const Use& u : past->uses()) {
      if (cache_concats.count(u.node)) continue;
      if (u.node->op_type == "Shape" && u.node->domain.value.empty()) {
        // Shape-15 start/end: negative counts from the end, out of range clamps.
        auto bound = [&](const char* name, int64_t fallback) {
          int64_t x = int_attr_or(u.node, name, fallback);
          x = x < 0 ? x + 4 : x;
          return std::min<int64_t>(std::max<int64_t>(x, 0), 4);
        };
        const int64_t start = bound("start", 0), end = bound("end", 4);
        if (start > 2 || end <= 2) continue;  // the length is not among the dims it reads
        if (u.node->outputs()[0] && u.node->outputs()[0]->is_graph_output()) {
          refuse("the shape of past input '" + past->name() + "' is a graph output");
        }
        shape_reads.emplace_back(u.node, 2 - start);
      } else if (mode == 2) {
        refuse("past input '" + past->name() + "' is read by " + u.node->op_type + " '" +
               u.node->name.value +
               "' besides its cache Concat: in an in-place buffer, the rows past the valid "
               "length are not the past");
      }
    }
  }

  const std::vector<int64_t> windows = proven_windows(g, attentions, true);

  // ---- edits ----
  KvCacheBuilder b(g);
  Node* head = g.first();  // the shared mask goes before it
  SharedMask mask = build_shared_mask(g, b, input_ids, attention_mask, batch_dim);
  use_masks(g, b, mask, attentions, windows, batch_dim, ctx);
  if (mode == 2) {
    // Shape(past) reads (B, Hkv, max_len, D) in place: give them (B, Hkv, P, D).
    Value* p1 = b.op("Unsqueeze", {mask.past_len, b.constant("kv_axes_0", {0}, {1})},
                     "kv_past_len_1d", head);
    for (auto [shape, at_length] : shape_reads) {
      Value* out = shape->outputs()[0];
      if (!out || out->uses().empty()) continue;
      const std::vector<Use> readers = out->uses();  // before the slices below read it too
      Node* at = shape->next();
      auto part = [&](int64_t start, int64_t end) {
        return b.op("Slice",
                    {out, b.constant("kv_start", {start}, {1}), b.constant("kv_end", {end}, {1})},
                    "kv_past_shape_part", at);
      };
      constexpr int64_t kToEnd = std::numeric_limits<int64_t>::max();
      Value* fixed = b.op("Concat", {part(0, at_length), p1, part(at_length + 1, kToEnd)},
                          "kv_past_shape", at, one_attr(attr_int("axis", 0)));
      for (const Use& u : readers) u.node->set_input(u.input_index, fixed);
    }
  }
  ctx.counters["layers adopted"] += static_cast<int64_t>(attentions.size());
  return static_cast<int64_t>(attentions.size());
}

int64_t add_kv_cache(Model& m, PassContext& ctx) {
  const int64_t mode = ctx.options.count("kv_cache") ? ctx.options.at("kv_cache") : 1;
  if (mode != 1 && mode != 2) {
    throw ModelError("add_kv_cache: option kv_cache must be 1 (standard) or 2 (inplace), not " +
                     std::to_string(mode));
  }
  Graph& g = *m.graph;

  // ---- checks: nothing is changed before all of them pass ----
  bool has_past = false;
  for (const Value* v : g.inputs()) has_past = has_past || (v && v->name().rfind("past_", 0) == 0);
  // Layer i = the i-th attention in topological order (a reorder changes no result).
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
  Value* input_ids = graph_input(g, "input_ids");
  Value* attention_mask = graph_input(g, "attention_mask");
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
  const Dim batch_dim = batch ? *batch : param_dim("batch_size");
  if (default_opset(m) < 13) refuse("the model's opset is below 13");
  refuse_baked_lengths(g);
  if (has_past) return adopt_cache(g, attentions, input_ids, attention_mask, batch_dim, mode, ctx);

  const size_t layers = attentions.size();
  std::vector<std::string> names;
  for (size_t i = 0; i < layers; ++i) {
    for (const char* kind : {"key", "value"}) {
      names.push_back("past_key_values." + std::to_string(i) + "." + kind);
      names.push_back("present." + std::to_string(i) + "." + kind);
    }
  }
  for (const std::string& n : names) {
    if (Value* v = g.lookup(n); v && v->defined()) refuse("a value named '" + n + "' exists");
  }

  struct Layer {
    Node* att;
    int32_t dtype;
    int64_t hkv, dk, dv;
  };
  std::vector<Layer> info;
  for (Node* att : attentions) {
    const std::vector<Value*>& in = att->inputs();
    if (in.size() < 3 || !in[0] || !in[1] || !in[2]) refuse("an attention without Q, K or V");
    if (in.size() > 4 || att->outputs().size() != 1) {
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
    info.push_back({att, dtype, hkv, *resolve_dim(in[1], 3), *resolve_dim(in[2], 3)});
  }

  // Positions computed inside the graph: Range(0, S) feeding a RotaryEmbedding.
  std::vector<Node*> ranges;
  if (!graph_input(g, "position_ids")) {
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
  }

  const std::vector<int64_t> windows = proven_windows(g, attentions, false);

  // ---- edits ----
  KvCacheBuilder b(g);

  // Past inputs and present outputs.
  std::vector<Value*> past_k(layers), past_v(layers);
  for (size_t i = 0; i < layers; ++i) {
    const Layer& l = info[i];
    const std::string idx = std::to_string(i);
    for (int kv = 0; kv < 2; ++kv) {
      Value* p = g.create_value("past_key_values." + idx + (kv ? ".value" : ".key"));
      p->type =
          tensor_type(l.dtype, {batch_dim, value_dim(l.hkv), param_dim("past_sequence_length"),
                                value_dim(kv ? l.dv : l.dk)});
      g.add_input(p);
      (kv ? past_v : past_k)[i] = p;
    }
  }

  Node* head = g.first();  // the shared mask goes before it
  SharedMask mask = build_shared_mask(g, b, input_ids, attention_mask, batch_dim);
  Value* past_len = mask.past_len;

  // Every earlier use of attention_mask sees its last S columns, (B, S) as at export.
  std::vector<Use> old_uses;
  for (const Use& u : attention_mask->uses()) {
    if (u.node != mask.mask_bool && u.node != mask.mask_shape) old_uses.push_back(u);
  }
  if (!old_uses.empty()) {
    Value* current = b.op(
        "Slice",
        {attention_mask,
         b.op("Unsqueeze", {past_len, b.constant("kv_axes_0", {0}, {1})}, "kv_past_len_1d", head),
         b.constant("kv_end", {std::numeric_limits<int64_t>::max()}, {1}),
         b.constant("kv_axes_1", {1}, {1})},
        "kv_attention_mask_current", head);
    current->type =
        tensor_type(value_dtype(attention_mask), {batch_dim, param_dim("sequence_length")});
    for (const Use& u : old_uses) u.node->set_input(u.input_index, current);
  }
  attention_mask->type =
      tensor_type(value_dtype(attention_mask), {batch_dim, param_dim("total_sequence_length")});
  for (ValueInfoEntry& e : g.input_entries) {
    if (e.value == attention_mask) e.own_type.reset();
  }

  // Positions computed inside the graph start at P.
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

  // Per layer: present = Concat(past, new), the attention reads the presents and the new mask.
  for (size_t i = 0; i < layers; ++i) {
    const Layer& l = info[i];
    Node* att = l.att;
    const std::string idx = std::to_string(i);
    for (int kv = 0; kv < 2; ++kv) {
      Value* cur = att->inputs()[1 + kv];
      Node* cat =
          b.node("Concat", {(kv ? past_v : past_k)[i], cur},
                 "present." + idx + (kv ? ".value" : ".key"), att, one_attr(attr_int("axis", 2)));
      Value* present = cat->outputs()[0];
      present->type =
          tensor_type(l.dtype, {batch_dim, value_dim(l.hkv), param_dim("total_sequence_length"),
                                value_dim(kv ? l.dv : l.dk)});
      g.add_output(present);
      att->set_input(1 + kv, present);
    }
  }
  use_masks(g, b, mask, attentions, windows, batch_dim, ctx);
  ctx.counters["layers cached"] += static_cast<int64_t>(layers);
  return static_cast<int64_t>(layers);
}

const PassRegistrar kRegister{{
    "add_kv_cache",
    "turn a no-cache decoder's internal Attention ops into a cached decoder (past/present "
    "inputs/outputs, mask over past + new); runs between fuse_attention and lower_attention",
    {"llm", "kv_cache"},
    1,
    INT64_MAX,
    false,
    add_kv_cache,
}};

}  // namespace
}  // namespace fastopt::passes
