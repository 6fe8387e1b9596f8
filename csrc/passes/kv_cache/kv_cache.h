// The steps of add_kv_cache shared by its files: add_kv_cache.cc (the pass, a model without a
// cache), kv_cache_adopt.cc (a model exported with one), kv_cache_mask.cc (the shared mask).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/error.h"
#include "passes/attention/internal_op.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/cache_form.h"
#include "passes/kv_cache/mask_proof.h"

namespace fastopt::passes::kv_cache {

inline bool is_internal_attention(const Node* n) {
  return n->op_type == kInternalAttention && n->domain.value == kInternalDomain;
}

// Refuses the model (ModelError); nothing has been changed when a check calls it.
[[noreturn]] inline void refuse(const std::string& why) {
  throw ModelError("add_kv_cache: cannot add a KV cache: " + why);
}

inline const Dim* dim_of(const Value* v, size_t axis) {
  if (!v || !v->type.known || !v->type.is_tensor || !v->type.has_shape) return nullptr;
  return axis < v->type.dims.size() ? &v->type.dims[axis] : nullptr;
}

inline Value* graph_input(const Graph& g, const std::string& name) {
  for (Value* v : g.inputs()) {
    if (v && v->name() == name) return v;
  }
  return nullptr;
}

// Whether the model was exported with a cache: an input named as a past (kExportedPastPrefix).
inline bool has_exported_past(const Graph& g) {
  for (const Value* v : g.inputs()) {
    if (v && v->name().rfind(kExportedPastPrefix, 0) == 0) return true;
  }
  return false;
}

inline TypeInfo tensor_type(int32_t dtype, std::vector<Dim> dims) {
  TypeInfo t;
  t.known = true;
  t.is_tensor = true;
  t.elem_type = dtype;
  t.has_shape = true;
  t.dims = std::move(dims);
  return t;
}

inline Dim param_dim(const std::string& p) {
  Dim d;
  d.param = p;
  return d;
}

inline Dim value_dim(int64_t n) {
  Dim d;
  d.value = n;
  return d;
}

// Builds the rewrite's nodes and initializers (names made unique from a base).
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

// Builds the shared mask (and P) before the graph's first node.
SharedMask build_shared_mask(Graph& g, KvCacheBuilder& b, Value* input_ids, Value* attention_mask,
                             const Dim& batch_dim);

// The window of each attention's mask (0: none), proven by mask_proof.h: the cached form
// replaces the masks, so one it cannot reproduce is refused, never dropped. `sliding`: the
// model's sliding-window cache (its pasts hold min(P, rows) rows), read by `reading_rows`.
std::vector<int64_t> proven_windows(const Graph& g, const std::vector<Node*>& attentions,
                                    bool with_past, const SlidingRows* sliding = nullptr,
                                    const std::unordered_set<const Node*>& reading_rows = {});

// `mask` as the attention's mask input (nullptr: none), with is_causal 0: the cache's mask says
// what may be attended (kv_cache_mask.cc).
void set_attention_mask(Node* att, Value* mask);

// Positions computed inside the graph start at the past length P: Range(P, S + P)
// (add_kv_cache.cc).
void offset_positions(KvCacheBuilder& b, const std::vector<Node*>& ranges, Value* past_len,
                      PassContext& ctx);

// Each attention gets the shared mask, or its window's; sliding_window tells the lowerings that
// read no mask (in-place GroupQueryAttention) the window.
void use_masks(KvCacheBuilder& b, SharedMask& m, const std::vector<Node*>& attentions,
               const std::vector<int64_t>& windows, const Dim& batch_dim, PassContext& ctx);

// ALiBi's score bias through the cache (kv_cache_bias.cc): an attention with score_bias reads
// Add(bias, m) or, for masked_fill, Where(masked, lowest, bias) (alibi.h); the bias is kept, m
// (Not(masked)) is proven and replaced like any mask.
struct ScoreBias {
  Node* att;
  Value* combined;   // the attention's mask input
  Value* bias;       // a copy reading the whole attention_mask once copy_biases ran
  Value* mask_part;  // m, or masked_fill's condition (true = masked)
  bool masked_fill;
  int32_t cast_to;  // the dtype the sum was cast to for the attention (0: none)
};
// The score_bias attentions' biases; refused unless each is the same for every query and a
// function of attention_mask, the keys' length (Shape of an attention's keys) and constants.
// No edits.
std::vector<ScoreBias> check_score_biases(const Graph& g, const std::vector<Node*>& attentions,
                                          const Value* attention_mask);
// While it lives, each biased attention reads its mask part alone (Not(masked) for masked_fill,
// a node it removes again), so that proven_windows proves it; the graph is as before after it.
class MaskPartsForProof {
 public:
  MaskPartsForProof(Graph& g, const std::vector<ScoreBias>& biases);
  ~MaskPartsForProof();
  MaskPartsForProof(const MaskPartsForProof&) = delete;
  MaskPartsForProof& operator=(const MaskPartsForProof&) = delete;

 private:
  Graph& g_;
  const std::vector<ScoreBias>& biases_;
  std::vector<Node*> nots_;
};
// Copies the biases' subgraphs (they keep reading the whole (B, T) attention_mask; a Shape of
// the keys gives T on axis 2); returns the copies that read attention_mask, which
// widen_attention_mask leaves alone.
std::vector<const Node*> copy_biases(Graph& g, KvCacheBuilder& b, std::vector<ScoreBias>& biases,
                                     Value* attention_mask, const std::vector<Node*>& attentions);
// After use_masks: each biased attention reads Where(its bool mask, bias, lowest).
void use_biases(Graph& g, KvCacheBuilder& b, const std::vector<ScoreBias>& biases,
                PassContext& ctx);

// Proves, before any edit, that the decoder mixes its positions only in the internal Attention
// ops (all of which the rewrite caches): every other op between the per-token inputs and the
// outputs is position-wise (kv_cache_positionwise.cc); refuses naming the op, node and layer.
// `offset_ranges`: the Range(0, S) nodes whose positions the rewrite offsets by the past.
// `cached_export`: a model exported with a cache, whose attentions read Concat(past, new rows)
// (cached_kv): row P + s of the Concat is new position s, a Range over the new tokens numbers
// them as the export does, attention_mask (past + new) is no per-token input.
void prove_positionwise(Model& m, const std::vector<Node*>& attentions,
                        const std::vector<Node*>& offset_ranges, const Value* input_ids,
                        bool cached_export = false);

// A decoder exported with a cache (past_* inputs, attentions in the cached form): marks every
// attention masked_rows_unread when its rows whose every key is masked reach only the outputs
// at padded positions (kv_cache_mask.cc); returns how many it marked, 0 with `why` when none.
int64_t mark_unread_masked_rows(Model& m, std::string* why);

// Adopts a model exported WITH a cache into `form` (kStandard or kInPlace; the export's past
// names are kept) (kv_cache_adopt.cc); returns the layers adopted.
int64_t adopt_cache(Graph& g, const std::vector<Node*>& attentions, Value* input_ids,
                    Value* attention_mask, const Dim& batch_dim, const CacheForm& form,
                    PassContext& ctx);

}  // namespace fastopt::passes::kv_cache
