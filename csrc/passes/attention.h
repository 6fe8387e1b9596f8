// The internal attention op: the meeting point of the attention fusion's two stages.
//
// Stage 1 (fuse_attention) recognises the many exporter variants of scaled dot-product attention
// (head split, repeat_kv, scale placement, mask forms) and replaces each with one node
//
//   ai.fastopt.internal::Attention(Q, K, V, mask?) -> Y
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
//   Y (B, Hq, S, Dv) = softmax(scale * Q K^T + causal + mask) V, computed in Q's dtype unless
//   softmax_precision says otherwise; rows whose every key is masked give 0 (as the exporters'
//   Where(IsNaN(p), 0, p) and Attention-23 do).
// Attributes (always written by stage 1, so lowerings need no defaults):
//   scale (float): the total factor on Q K^T.
//   is_causal (int 0/1): causal mask, aligned bottom-right (key j visible to query i iff
//     j <= i + T - S), as Attention-23.
//   q_num_heads, kv_num_heads (int): Hq, Hkv.
//   softmax_precision (int, optional): an ONNX dtype when the model computed the softmax in a
//     wider type (fp16 models casting scores to fp32).
#pragma once

#include "passes/registry.h"
#include "pattern/rewrite.h"

namespace fastopt::passes {

inline constexpr const char* kInternalAttention = "Attention";

// Lowerings of one internal Attention node. Each builds its replacement with `rw` (which inserts
// before the node and removes what it made when a lowering fails) and returns the value that
// replaces Y, still (B, Hq, S, Dv); or `rw.fail(why)` when its preconditions do not hold.
pattern::Replacement lower_attention_ort(Node* attention, pattern::Rewriter& rw,
                                         PassContext& ctx);  // lower_attention_ort.cc
pattern::Replacement lower_attention_onnx(Node* attention, pattern::Rewriter& rw,
                                          PassContext& ctx);  // lower_attention_onnx.cc
// Standard ops (MatMul, Softmax, ...; opset >= 13): always possible.
pattern::Replacement decompose_attention(Node* attention, pattern::Rewriter& rw,
                                         PassContext& ctx);  // decompose_attention.cc

}  // namespace fastopt::passes
