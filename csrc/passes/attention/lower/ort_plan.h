// The choice of lowering for target "ort", made before anything is built: which op
// (com.microsoft Attention with packed QKV, GroupQueryAttention or MultiHeadAttention), with
// which flags and inputs, or the reason no exact lowering exists. lower_attention_ort.cc builds
// the ops from the plan (its header says why each choice is what it is).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/lower/packed_qkv.h"
#include "passes/attention/masked_rows.h"
#include "passes/registry.h"

namespace fastopt::passes {

enum class OrtAttentionOp { kPackedAttention, kGroupQueryAttention, kMultiHeadAttention };

struct OrtLoweringPlan {
  // Why no exact lowering exists (empty when the plan holds).
  std::string refusal;
  // Why Q/K/V were not packed into com.microsoft Attention when packing was asked (explained).
  std::string not_packed;
  bool ok() const { return refusal.empty(); }

  OrtAttentionOp op = OrtAttentionOp::kMultiHeadAttention;
  Value *q = nullptr, *k = nullptr, *v = nullptr, *mask = nullptr;
  std::optional<CachedKV> cache;             // the cached form (internal_op.h)
  Value *k_new = nullptr, *v_new = nullptr;  // K/V without the past (K/V when no cache)
  bool inplace = false;                      // kv_cache == 2: GQA on one max-length buffer
  bool cuda = false;                         // option cuda=1
  float scale = 0;
  float softcap = 0;  // the node's softcap (GroupQueryAttention only), 0 for none
  bool causal = false;
  bool mha_causal = false;  // MHA's unidirectional: causal with more than one query row
  int64_t hq = 0, hkv = 0;
  int32_t dtype = 0, mask_dtype = 0;
  int64_t head_dim = 0;    // the new K rows' dim 3 (the past's when that is static), 0 unknown
  int64_t v_head_dim = 0;  // the same for V (multi-latent attention: not K's), 0 unknown
  // MHA reads K/V as 3-D (B, T, H*D): the only form in which ORT 1.32's MultiHeadAttention takes
  // a V head size other than K's (BNSH K/V must have one shape).
  bool kv_bsd = false;
  bool kv_query_length = false;  // the new K rows have the query's length (S == T without cache)
  bool mask_full = false;        // the mask is (., ., S, T) of Q and K (no Expand needed)
  bool mask_bs = false;          // the mask has Q's batch (not 1) and S
  bool mask_t = false;           // ... and K's T
  bool repeat_kv = false;        // MHA over kv heads repeated Hq / Hkv times
  std::vector<Projection> qkv;   // kPackedAttention: the Q, K, V projections
  Value* mask_input = nullptr;   // in place: the attention_mask graph input (B, T)
  Value* ids_input = nullptr;    // ... and input_ids (B, S), whose shape every layer shares
  // In place without attention_mask (a seq2seq decoder): past_sequence_length (int32 (1)), the
  // tokens in the buffer, the same for every row; T = it + S.
  Value* past_length_input = nullptr;
  int64_t window = 0;      // sliding_window (the keys a query sees), 0 for none
  Value* sinks = nullptr;  // GroupQueryAttention's head_sink (sinks.h), or null
  // In place: the com.microsoft RotaryEmbeddings on Q and K (3-D, or 4-D on the BNSH heads)
  // that GQA applies instead (do_rotary), or null.
  const Node* rotary_q = nullptr;
  const Node* rotary_k = nullptr;
  // Rows whose every key is masked (masked_rows.h): what the op's output there is replaced by
  // (kUnread: left as the op gives it), and the value a boolean mask's bias masks with (the
  // export's own where the op then computes the export's row itself: fp32, every key in).
  MaskedRows fix_masked_rows = MaskedRows::kUnread;
  double bias_masked_value = 0;  // 0: the dtype's lowest
  // kMean through the op itself: those rows' queries and bias become 0, so that the op (its
  // bias reaching every key) averages V with equal weights. One Where per layer, no mean.
  bool zero_masked_queries = false;
};

// Checks every precondition of the internal Attention `node` (in graph `g`) for target ort and
// chooses the op; changes nothing.
OrtLoweringPlan plan_ort_lowering(const Node* node, const Graph& g, const PassContext& ctx);

}  // namespace fastopt::passes
