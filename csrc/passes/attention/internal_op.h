// The internal attention op: the meeting point of the attention fusion's two stages.
//
// Stage 1 (fuse_attention) recognises the many exporter variants of scaled dot-product attention
// (head split, repeat_kv, scale placement, mask forms) and replaces each with one node
//
//   ai.fastopt.internal::Attention(Q, K, V, mask?, sinks?) -> Y
//
// Stage 2 (lower_attention) turns that node into what the target runs: MultiHeadAttention or
// GroupQueryAttention (target "ort"), Attention-23 (target "onnx"), or, when no lowering's
// preconditions hold, standard ops again. Passes between the stages (the KV-cache rewrite) edit
// one canonical node instead of every variant. The internal op never reaches a saved file.
//
// Semantics: exactly ONNX Attention-23 on 4-D inputs (BNSH), without past/present:
//   Q (B, Hq, S, D), K (B, Hkv, T, D), V (B, Hkv, T, Dv); Hq % Hkv == 0 and query head h reads
//   kv head h / (Hq / Hkv) (what HF's repeat_kv computes).
//   mask (optional): bool, true = attend, or additive, of Q's dtype; broadcastable to
//   (B, Hq, S, T).
//   sinks (optional, input 4; gpt-oss, sinks.h): (Hq) logits of Q's dtype, one per query head,
//   that join each row's softmax and are dropped after it: the softmax below is over
//   [scores, sinks[h]]. Rows whose every key is masked then give 0 (no masked_rows_* then).
//   Y (B, Hq, S, Dv) = softmax(cap(scale * Q K^T) + causal + mask) V, computed in Q's dtype unless
//   softmax_precision says otherwise; rows whose every key is masked give 0 (as the exporters'
//   Where(IsNaN(p), 0, p) and Attention-23 do), unless masked_rows_mean / masked_value say
//   otherwise.
// Attributes (always written by stage 1, so lowerings need no defaults):
//   scale (float): the total factor on Q K^T.
//   is_causal (int 0/1): causal mask, aligned bottom-right (key j visible to query i iff
//     j <= i + T - S), as Attention-23.
//   q_num_heads, kv_num_heads (int): Hq, Hkv.
//   softmax_precision (int, optional): an ONNX dtype when the model computed the softmax in a
//     wider type (fp16 models casting scores to fp32).
//   softcap (float, optional): c > 0 makes cap(x) = c * tanh(x / c) (gemma2's logit
//     soft-capping: after the scale, before the masks, as Attention-23's and GQA's softcap in
//     ORT 1.32; softcap.h); absent, cap(x) = x.
//   score_bias (int, optional): 1 when the additive mask also carries a bias on the kept keys
//     (ALiBi, alibi.h), not only 0 / a masking value: Add(bias, m) or masked_fill's
//     Where(c, value, bias), which add_kv_cache separates (kv_cache_bias.cc).
//   masked_rows_mean (int 1) or masked_value (float), optional: the export masked with a finite
//     value v (Where(c, 0, v) or masked_fill's v), so a row whose every key is masked is
//     softmax(cap(scale * Q K^T) + v) over all T keys there, not 0: the plain mean of V when v
//     absorbs the scores in the dtype it is added in (finfo.min: masked_rows_mean), else
//     masked_value = v. Pad queries are such rows; what they give reaches real tokens where an
//     export's next step reads their keys (gemma2/3's sliding caches with right padding).
//     Lowerings reproduce the rule (masked_rows.h) or refuse.
//   masked_rows_unread (int 1, optional): set by add_kv_cache with its own mask: the rows whose
//     every key is masked are pad queries whose outputs and keys nothing reads, so a lowering
//     need not reproduce them.
//
// The cached form (issue 5, written by add_kv_cache between the stages): K and V are
//   Concat(past graph input (B, Hkv, P, D), k_new (B, Hkv, S, D), axis 2), whose output is the
//   graph output `present` (B, Hkv, P+S, D); the mask is bool (B, 1, S, T) with the causality in
//   it (is_causal 0): allowed[b, s, t] = (t <= P + s) AND attention_mask[b, t] != 0, so it
//   never lets a query see a later key and lowerings may add a causal flag. A sliding-window
//   layer's mask also has t > P + s - w, and the node the attribute sliding_window = w (int:
//   the keys a query sees, its own included), for lowerings that read no mask (in-place GQA:
//   local_window_size). A score_bias node's mask is additive instead, Where(allowed, bias,
//   lowest) (B, H, S, T), the bias a copy of the export's computed from attention_mask alone
//   (kv_cache_bias.cc; in place GQA's attention_bias). An encoder-decoder's cross-attention has
//   the attribute cross_cache = 1 (its new rows are the encoder's: kv_cache_cross.cc), which
//   stays the standard form in place. Each mask is proven to be what the export computed
//   before it replaces it (mask_proof.h). The node keeps the
//   semantics above; the lowerings recognise the form (cached_kv) and hand past/present to ops that
//   take a cache natively. Option kv_cache == 2 (in place) asks target ort for GroupQueryAttention
//   on one max-length buffer per layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "passes/registry.h"
#include "pattern/rewrite.h"

namespace fastopt::passes {

inline constexpr const char* kInternalAttention = "Attention";

// The cache's graph inputs and outputs, their names and the forms: passes/kv_cache/cache_form.h.

// K and V of the cached form: each the output (a graph output) of a Concat on axis 2 of a graph
// input (past) and the new rows.
struct CachedKV {
  Value *past_k, *k_new, *present_k;
  Value *past_v, *v_new, *present_v;
};

inline std::optional<CachedKV> cached_kv(const Node* attention) {
  const std::vector<Value*>& in = attention->inputs();
  if (in.size() < 3 || !in[1] || !in[2]) return std::nullopt;
  auto split = [](Value* x) -> std::optional<std::pair<Value*, Value*>> {
    const Node* cat = x->producer();
    if (!cat || cat->op_type != "Concat" || !cat->domain.value.empty() ||
        cat->inputs().size() != 2 || !x->is_graph_output() || cat->graph() != x->graph()) {
      return std::nullopt;
    }
    const Attribute* axis = cat->attribute("axis");
    if (!axis || !axis->i || (*axis->i != 2 && *axis->i != -2)) return std::nullopt;
    Value* past = cat->inputs()[0];
    Value* fresh = cat->inputs()[1];
    if (!past || !fresh || !past->is_graph_input() || past->initializer()) return std::nullopt;
    return std::make_pair(past, fresh);
  };
  auto k = split(in[1]), v = split(in[2]);
  if (!k || !v || k->first == v->first) return std::nullopt;
  return CachedKV{k->first, k->second, in[1], v->first, v->second, in[2]};
}

// After a lowering built an op with present outputs `pk`, `pv` for `attention` (the internal
// node it lowers): they take over the graph outputs `present` (names included) and the Concats
// go. A read of a present that the op's inputs depend on would then read the op's own output (a
// cycle): ALiBi's bias reads the keys' length as Shape(present) (mpt). Those Shape reads are
// given the shape computed from the past and the new rows (`k3`/`v3`: the new rows as the op
// reads them, (B, S, H*D), or null); any other such read, or one in place (`inplace`: the
// present is the max-length buffer), refuses. Empty when done, else why (nothing changed).
std::string adopt_presents(Graph& g, const CachedKV& c, Value* pk, Value* pv, const Node* attention,
                           Value* k3 = nullptr, Value* v3 = nullptr,
                           bool inplace = false);  // cache_presents.cc

// Lowerings of one internal Attention node. Each builds its replacement with `rw` (which inserts
// before the node and removes what it made when a lowering fails) and returns the value that
// replaces Y, still (B, Hq, S, Dv); or `rw.fail(why)` when its preconditions do not hold.
pattern::Replacement lower_attention_ort(Node* attention, pattern::Rewriter& rw,
                                         PassContext& ctx);  // lower_attention_ort.cc
pattern::Replacement lower_attention_onnx(Node* attention, pattern::Rewriter& rw,
                                          PassContext& ctx);  // lower_attention_onnx.cc
// Standard ops (MatMul, Softmax, ...): always possible from opset kDecomposeOpset (Range), which
// fuse_attention checks before it makes an internal op, so that none can outlive the pass.
inline constexpr int64_t kDecomposeOpset = 11;
pattern::Replacement decompose_attention(Node* attention, pattern::Rewriter& rw,
                                         PassContext& ctx);  // decompose_attention.cc

}  // namespace fastopt::passes
