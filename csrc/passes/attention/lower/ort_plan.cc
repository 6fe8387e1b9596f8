// The ort lowering's choice, computed before anything is built (see ort_plan.h; the reasons for
// each choice are in lower_attention_ort.cc's header).
#include "passes/attention/lower/ort_plan.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention/head_split.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {

// The RotaryEmbedding (com.microsoft, 3-D) that made `x3`, when GroupQueryAttention can apply
// it instead (do_rotary): no options but a partial dim r that GQA reads from a (M, r/2) cache
// whose width is a multiple of 8 (its kernels' rule); else null. (Other readers keep the node.)
const Node* foldable_rotary(const Value* x3) {
  const Node* r = x3 ? x3->producer() : nullptr;
  if (!r || r->op_type != "RotaryEmbedding" || r->domain.value != kMsDomain ||
      r->inputs().size() != 4 || int_attr_or(r, "is_packed_batching", 0) || r->attribute("scale") ||
      !r->inputs()[0] || !r->inputs()[2] || !r->inputs()[3] || !mistyped_reason(r).empty()) {
    return nullptr;
  }
  // GQA rotates at its own positions (past length + s): positions computed with an offset (a
  // LongRoPE table switch) must stay with the node.
  const Value* pos = r->inputs()[1];
  for (int steps = 0; pos && pos->producer() && steps < 6; ++steps) {
    const Node* p = pos->producer();
    if (p->op_type == "Add" || p->op_type == "Mul" || p->op_type == "Sub") return nullptr;
    if (p->inputs().empty()) break;
    pos = p->inputs()[0];
  }
  if (const int64_t dim = int_attr_or(r, "rotary_embedding_dim", 0); dim != 0) {
    auto cache = constant_tensor(r->inputs()[2]);
    if (!cache || cache->dims.size() != 2 || 2 * cache->dims[1] != dim || cache->dims[1] % 8 != 0) {
      return nullptr;
    }
  }
  return r;
}

// The rotary GroupQueryAttention can apply instead of the one on the BNSH operand `x4`: a 3-D
// one that made x4's (B, S, H*D) source, or a 4-D one that made x4 itself (a per-head norm
// between the head split and the rotary: Qwen3, Gemma3, OLMoE), whose BNSH input GQA then
// reads as (B, S, H*D).
const Node* foldable_rotary_of(const Graph& g, const Value* x4, int32_t dtype) {
  if (const Node* r = foldable_rotary(bsd_source(g, x4, dtype))) return r;
  const Node* r = foldable_rotary(x4);
  return r && rank_of(r->inputs()[0]) == 4 && dtype_of(r->inputs()[0]) == dtype ? r : nullptr;
}

// The attention_mask graph input (B, T) of the cached form (kv_cache contract), or null.
Value* attention_mask_input(const Graph& g) {
  for (Value* v : g.inputs()) {
    if (v->name() == "attention_mask" && (value_rank(v) == 2 || value_rank(v) == -1)) return v;
  }
  return nullptr;
}

// The input_ids graph input (B, S), or null.
Value* input_ids_input(const Graph& g) {
  for (Value* v : g.inputs()) {
    if (v->name() == "input_ids" && (value_rank(v) == 2 || value_rank(v) == -1)) return v;
  }
  return nullptr;
}

// The past_sequence_length graph input (int32 (1)) of an in-place seq2seq decoder, or null.
Value* past_length_input(const Graph& g) {
  for (Value* v : g.inputs()) {
    if (v->name() == kPastSequenceLength && value_dtype(v) == kInt32) return v;
  }
  return nullptr;
}

}  // namespace

OrtLoweringPlan plan_ort_lowering(const Node* node, const Graph& g, const PassContext& ctx) {
  OrtLoweringPlan plan;
  auto refused = [&plan](std::string why) {
    plan.refusal = std::move(why);
    return plan;
  };
  const std::vector<Value*>& in = node->inputs();
  if (in.size() < 3 || !in[0] || !in[1] || !in[2]) return refused("Q, K or V is missing");
  if (in.size() > 5) return refused("inputs after the sinks are not supported");
  Value* sinks = in.size() > 4 ? in[4] : nullptr;  // sinks.h: GroupQueryAttention's head_sink
  if (node->outputs().size() != 1) return refused("outputs after Y are not supported");
  Value *q = in[0], *k = in[1], *v = in[2];
  Value* mask = in.size() > 3 ? in[3] : nullptr;
  // The cached form: the ops take past/present themselves and read only the new rows.
  const std::optional<CachedKV> cache = cached_kv(node);
  const auto kv_option = ctx.options.find("kv_cache");
  // A cross-attention's cache (kv_cache_cross.cc) is filled once and keeps the standard form.
  const bool inplace = cache && kv_option != ctx.options.end() && kv_option->second == 2 &&
                       !int_attr_or(node, "cross_cache", 0);
  Value* kn = cache ? cache->k_new : k;
  Value* vn = cache ? cache->v_new : v;

  const Attribute* scale_attr = node->attribute("scale");
  if (!scale_attr || !scale_attr->f) return refused("no scale attribute");
  const float scale = *scale_attr->f;
  // Both ops read scale 0 as "1/sqrt(D)".
  if (!std::isfinite(scale) || scale == 0.0f) return refused("scale is 0 or not finite");
  // Soft-capping (internal_op.h): of the ort ops only GroupQueryAttention caps (after the scale,
  // before the bias, as the internal op: bench/probe_softcap.py).
  const float softcap = float_attr(node, "softcap", 0.0f);
  if (!std::isfinite(softcap) || softcap < 0) return refused("softcap is negative or not finite");
  const bool capped = softcap > 0;
  // Of the ort ops only GroupQueryAttention caps and takes sinks.
  const bool needs_gqa = capped || sinks;
  const std::string why_gqa = capped ? "soft-capping" : "attention sinks";
  const bool causal = int_attr_or(node, "is_causal", 0) != 0;
  const int64_t hq = int_attr_or(node, "q_num_heads", 0);
  const int64_t hkv = int_attr_or(node, "kv_num_heads", 0);
  if (hq <= 0 || hkv <= 0 || hq % hkv != 0) return refused("bad q_num_heads / kv_num_heads");

  const int32_t dtype = dtype_of(q);
  if (dtype != kFloat && dtype != kFloat16 && dtype != kBFloat16) {
    return refused("dtype " + dtype_name(dtype) + " (MHA/GQA: float, float16, bfloat16)");
  }
  if (dtype_of(k) != dtype || dtype_of(v) != dtype) return refused("Q, K, V dtypes differ");
  if (cache && (dtype_of(kn) != dtype || dtype_of(vn) != dtype ||
                value_dtype(cache->past_k) != dtype || value_dtype(cache->past_v) != dtype)) {
    return refused("the cache's dtype is not Q's");
  }
  for (const Value* x : {q, k, v, kn, vn}) {
    if (value_rank(x) != -1 && value_rank(x) != 4) return refused("Q, K, V must be 4-D");
  }
  // The kernels accumulate the softmax in fp32 (fp16 too): a wider request is met, others not.
  const int64_t precision = int_attr_or(node, "softmax_precision", dtype);
  if (precision != dtype && precision != kFloat) {
    return refused("softmax_precision " + dtype_name(static_cast<int32_t>(precision)));
  }
  const int32_t mask_dtype = mask ? value_dtype(mask) : 0;
  if (mask && mask_dtype != kBool && mask_dtype != dtype) {
    return refused("mask dtype " + dtype_name(mask_dtype) + " (bool or the dtype of Q)");
  }
  if (mask && value_rank(mask) > 4) return refused("mask of rank > 4");
  if (default_opset(*g.model()) < 13) return refused("default opset < 13");

  // Head sizes: the new K rows' dim 3, else the past's (shape analysis, shapes.h).
  auto head_size = [&](const Value* fresh, const Value* past) {
    std::optional<int64_t> d = rank_of(fresh) == 4 ? resolve_dim(fresh, 3) : std::nullopt;
    if (cache && !d && rank_of(past) == 4) d = resolve_dim(past, 3);
    return d;
  };
  const std::optional<int64_t> head_dim = head_size(kn, cache ? cache->past_k : nullptr);
  const std::optional<int64_t> v_head_dim = head_size(vn, cache ? cache->past_v : nullptr);
  const bool static_head = head_dim.has_value();
  // Multi-latent attention (DeepSeek-V2/V3): V heads narrower than Q/K's.
  const bool heads_differ = head_dim && v_head_dim && *head_dim != *v_head_dim;
  // S == T from the shape analysis (symbolic dims through head splits, rotaries, norms). With a
  // cache: the new rows have the query's length (T = P + S is the ops' business).
  const bool same_len = same_length(q, 2, kn, 2, 4);
  // One query row sees every key under bottom-right alignment: no causal mask at all.
  const bool one_row = rank_of(q) == 4 && resolve_dim(q, 2) == 1;
  const bool mha_causal = causal && !one_row;
  // GQA takes K/V of the query's length, one head size for K and V, a multiple of 8.
  const bool gqa_fits = same_len && static_head && *head_dim % 8 == 0 && head_dim == v_head_dim;
  const bool cuda = ctx.options.count("cuda") && ctx.options.at("cuda") != 0;
  // Packed QKV (com.microsoft Attention): option packed_attention 0 = off, 1 = non-causal
  // self-attention (encoders; the default), 2 = causal too (unidirectional; S == T holds since
  // Q and K are projections of one input). Decoders keep MHA/GQA by default.
  const auto packed_option = ctx.options.find("packed_attention");
  const int64_t packed_mode =
      packed_option != ctx.options.end() ? packed_option->second : (cuda ? 0 : 1);
  // A boolean mask's all-masked rows (masked_rows.h). In place GQA reads no mask.
  const MaskedRows rule =
      mask && mask_dtype == kBool && !inplace ? masked_rows(node) : MaskedRows::kUnread;
  std::optional<std::vector<Projection>> qkv;
  if (!cache && !needs_gqa && hq == hkv && packed_mode > 0 && (!causal || packed_mode >= 2)) {
    // A narrower dtype's rows with no visible key take a mean read from V, which would keep the
    // V projection that packing removes: MHA/GQA take them.
    if (rule == MaskedRows::kMean && dtype != kFloat) {
      plan.not_packed = "rows whose every key is masked average V (masked_rows.h)";
    } else {
      qkv = packed_qkv(g, node, hq, dtype, &plan.not_packed);
    }
  }
  bool use_gqa = qkv             ? false
                 : inplace       ? true
                 : needs_gqa     ? true
                 : cuda && cache ? false  // CUDA GQA rejects the cache's bias
                 : cuda          ? dtype != kFloat && causal && !mask
                                 : dtype != kFloat || hkv != hq;
  // Where GQA does not fit (cross-attention's K/V of the encoder's length; a head size it
  // rejects), MHA takes any dtype (CPU runs fp16 too): over repeated kv heads without a cache;
  // with one only Hkv == Hq (present has Hkv) and no causal mask (MHA's is top-left aligned).
  const bool mha_fits = cache ? hkv == hq && !mha_causal : hkv == hq || static_head;
  if (use_gqa && !inplace && !needs_gqa && !gqa_fits && mha_fits) use_gqa = false;
  const bool repeat_kv = !use_gqa && hkv != hq;

  if (inplace && cuda && dtype == kFloat) {
    return refused("in-place cache: GroupQueryAttention has no fp32 CUDA kernel");
  }
  if (needs_gqa && cuda && !inplace && (dtype == kFloat || mask || cache)) {
    return refused(why_gqa +
                   " needs GroupQueryAttention, which on CUDA takes neither fp32 nor a bias");
  }
  if (use_gqa && !same_len) {
    return refused("GroupQueryAttention (" + dtype_name(dtype) +
                   (dtype == kFloat && hkv < hq ? ", Hkv < Hq"
                    : inplace                   ? ", in place"
                                                : "") +
                   (cache ? ") needs the new K/V rows of the query's length"
                          : ") needs S == T, not shown by the shapes of Q and K nor by the graph"));
  }
  if (use_gqa && !gqa_fits) {
    return refused((needs_gqa ? why_gqa + " needs GroupQueryAttention: " : std::string()) +
                   "GroupQueryAttention needs a static head size, a multiple of 8, the same for "
                   "K and V");
  }
  if (cache && !use_gqa && mha_causal) {
    return refused("causal MultiHeadAttention with a cache: its causal mask is top-left aligned");
  }
  if (!use_gqa && mha_causal && !same_len) {
    return refused(
        "causal MultiHeadAttention needs S == T (its causal mask is top-left "
        "aligned), not shown by the shapes of Q and K nor by the graph");
  }
  if (cache && !use_gqa && heads_differ) {
    // ORT 1.32 checks past_value's dim 3 against the head size of Q/K (bench: "Input
    // 'past_value' dimension 3 should be same as head_size").
    return refused("MultiHeadAttention with a cache needs one head size for K and V (" +
                   std::to_string(*head_dim) + " and " + std::to_string(*v_head_dim) + ")");
  }
  if (cache && repeat_kv) {
    return refused("a grouped cache (Hkv < Hq) needs GroupQueryAttention, which does not fit");
  }
  if (repeat_kv && !static_head) {
    return refused("repeating kv heads for MultiHeadAttention needs a static head size");
  }
  Value* mask_input = inplace ? attention_mask_input(g) : nullptr;
  Value* past_length = inplace && !mask_input ? past_length_input(g) : nullptr;
  if (inplace && !mask_input && !past_length) {
    return refused(
        "in-place cache: no attention_mask graph input (B, total_sequence_length) nor "
        "past_sequence_length (1)");
  }
  if (inplace && !causal && !mask) return refused("in-place cache: neither causal nor a mask");
  if (inplace && cuda && mask && mask_dtype != kBool) {
    return refused(
        "in-place cache with a score bias: CUDA GroupQueryAttention rejects attention_bias");
  }
  if (int_attr_or(node, "sliding_window", 0) > 0 && !cache) {
    return refused("a sliding_window attribute outside the cached form");
  }

  // In place: RoPE goes into GQA (do_rotary) when both rotaries can fold there.
  const Node* rot_q = inplace ? foldable_rotary_of(g, q, dtype) : nullptr;
  const Node* rot_k = inplace ? foldable_rotary_of(g, kn, dtype) : nullptr;
  if (rot_q && rot_k && *head_dim % 16 == 0 && rot_q->inputs()[2] == rot_k->inputs()[2] &&
      rot_q->inputs()[3] == rot_k->inputs()[3] &&
      int_attr_or(rot_q, "interleaved", 0) == int_attr_or(rot_k, "interleaved", 0)) {
    plan.rotary_q = rot_q;
    plan.rotary_k = rot_k;
  }

  plan.op = qkv       ? OrtAttentionOp::kPackedAttention
            : use_gqa ? OrtAttentionOp::kGroupQueryAttention
                      : OrtAttentionOp::kMultiHeadAttention;
  plan.q = q;
  plan.k = k;
  plan.v = v;
  plan.mask = mask;
  plan.cache = cache;
  plan.k_new = kn;
  plan.v_new = vn;
  plan.inplace = inplace;
  plan.cuda = cuda;
  plan.scale = scale;
  plan.softcap = softcap;
  plan.sinks = sinks;
  plan.causal = causal;
  plan.mha_causal = mha_causal;
  plan.hq = hq;
  plan.hkv = hkv;
  plan.dtype = dtype;
  plan.mask_dtype = mask_dtype;
  plan.head_dim = head_dim.value_or(0);
  plan.v_head_dim = v_head_dim.value_or(0);
  plan.kv_bsd = heads_differ;
  plan.kv_query_length = same_len;
  // The mask's (S, T) and batch against Q's and K's, for the bias and GQA's lengths.
  plan.mask_full = mask && same_length(mask, 2, q, 2, 4) && same_length(mask, 3, k, 2, 4);
  plan.mask_bs = mask && same_length(mask, 0, q, 0, 4) && same_length(mask, 2, q, 2, 4) &&
                 resolve_dim(mask, 0) != 1;
  plan.mask_t = plan.mask_bs && same_length(mask, 3, k, 2, 4);
  plan.repeat_kv = repeat_kv;
  if (qkv) plan.qkv = std::move(*qkv);
  plan.mask_input = mask_input;
  plan.ids_input = mask_input ? input_ids_input(g) : nullptr;
  plan.past_length_input = past_length;
  plan.window = int_attr_or(node, "sliding_window", 0);

  // Does the op's bias reach every key? GQA is causal with a cache or a causal node. Such an
  // op (fp32: the export's sums) computes a finite masking value's rows itself.
  const bool bias_only = !(use_gqa && (causal || cache)) && !mha_causal && !(qkv && causal);
  if (rule == MaskedRows::kScores) {
    if (dtype != kFloat || !bias_only) {
      return refused("rows whose every key is masked are softmax(scores + " +
                     std::to_string(masked_value(node)) +
                     ") in the export, which only an fp32 bias on every key reproduces");
    }
    plan.bias_masked_value = masked_value(node);
  } else if (rule == MaskedRows::kMean && dtype == kFloat && bias_only) {
    // The lowest fp32 bias: the op's own mean (exact, as the export's sum).
  } else if (rule != MaskedRows::kUnread) {
    if (std::string why = rows_with_keys_refusal(mask); !why.empty()) return refused(why);
    // fp16/bf16 kernels add the bias in fp32, where no dtype value absorbs the scores.
    if (rule == MaskedRows::kMean && bias_only && !qkv) {
      plan.zero_masked_queries = true;
    } else {
      plan.fix_masked_rows = rule;
    }
  }
  return plan;
}

}  // namespace fastopt::passes
