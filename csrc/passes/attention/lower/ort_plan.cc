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
#include "passes/kv_cache/cache_form.h"

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
    if (v->name() == kv_cache::kAttentionMask && (value_rank(v) == 2 || value_rank(v) == -1)) {
      return v;
    }
  }
  return nullptr;
}

// The input_ids graph input (B, S), or null.
Value* input_ids_input(const Graph& g) {
  for (Value* v : g.inputs()) {
    if (v->name() == kv_cache::kInputIds && (value_rank(v) == 2 || value_rank(v) == -1)) return v;
  }
  return nullptr;
}

// The past_sequence_length graph input (int32 (1)) of an in-place seq2seq decoder, or null.
Value* past_length_input(const Graph& g) {
  for (Value* v : g.inputs()) {
    if (v->name() == kv_cache::kPastSequenceLength && value_dtype(v) == kInt32) return v;
  }
  return nullptr;
}

// The plan's choice as the checks below make it, step by step: what the node says, then what
// the shapes allow, then which op. Each step adds to the plan or returns why no exact lowering
// exists; plan_ort_lowering runs them in order (the first refusal wins).
struct Planner {
  Planner(const Node* n, const Graph& graph, const PassContext& c) : node(n), g(graph), ctx(c) {}
  const Node* node;
  const Graph& g;
  const PassContext& ctx;
  OrtLoweringPlan plan;
  // Facts that decide the op but are not the plan's.
  bool needs_gqa = false;  // soft-capping or sinks: of the ort ops only GQA does them
  std::string why_gqa;
  std::optional<int64_t> head_dim, v_head_dim;
  bool static_head = false;
  bool heads_differ = false;  // multi-latent attention: V heads narrower than Q/K's
  bool same_len = false;      // S == T (the new rows have the query's length)
  bool gqa_fits = false;      // K/V of the query's length, one head size, a multiple of 8
  int64_t packed_mode = 0;
  MaskedRows rule = MaskedRows::kUnread;
  std::optional<std::vector<Projection>> qkv;
  bool use_gqa = false;

  std::string operands();
  std::string attributes();
  std::string dtypes();
  std::string mask_and_precision();
  std::string shapes();
  std::string packing();
  std::string op_choice();
  std::string gqa_refusal();
  std::string mha_refusal();
  std::string inplace_inputs();
  std::string rotaries();
  std::string record();
  std::string masked_rows_fix();
};

// Q, K, V, mask, sinks and the cached form's operands.
std::string Planner::operands() {
  const std::vector<Value*>& in = node->inputs();
  if (in.size() < 3 || !in[0] || !in[1] || !in[2]) return "Q, K or V is missing";
  if (in.size() > 5) return "inputs after the sinks are not supported";
  plan.sinks = in.size() > 4 ? in[4] : nullptr;  // sinks.h: GroupQueryAttention's head_sink
  if (node->outputs().size() != 1) return "outputs after Y are not supported";
  plan.q = in[0];
  plan.k = in[1];
  plan.v = in[2];
  plan.mask = in.size() > 3 ? in[3] : nullptr;
  // The cached form: the ops take past/present themselves and read only the new rows.
  plan.cache = cached_kv(node);
  const auto kv_option = ctx.options.find("kv_cache");
  // A cross-attention's cache (kv_cache_cross.cc) is filled once and keeps the standard form.
  plan.inplace = plan.cache && kv_option != ctx.options.end() && kv_option->second == 2 &&
                 !int_attr_or(node, "cross_cache", 0);
  plan.k_new = plan.cache ? plan.cache->k_new : plan.k;
  plan.v_new = plan.cache ? plan.cache->v_new : plan.v;
  return "";
}

// scale, softcap, is_causal and the head counts.
std::string Planner::attributes() {
  const Attribute* scale_attr = node->attribute("scale");
  if (!scale_attr || !scale_attr->f) return "no scale attribute";
  plan.scale = *scale_attr->f;
  // Both ops read scale 0 as "1/sqrt(D)".
  if (!std::isfinite(plan.scale) || plan.scale == 0.0f) return "scale is 0 or not finite";
  // Soft-capping (internal_op.h): of the ort ops only GroupQueryAttention caps (after the scale,
  // before the bias, as the internal op: tests/ort_behaviour/test_softcap_order.py).
  plan.softcap = float_attr(node, "softcap", 0.0f);
  if (!std::isfinite(plan.softcap) || plan.softcap < 0) return "softcap is negative or not finite";
  const bool capped = plan.softcap > 0;
  // Of the ort ops only GroupQueryAttention caps and takes sinks.
  needs_gqa = capped || plan.sinks;
  why_gqa = capped ? "soft-capping" : "attention sinks";
  plan.causal = int_attr_or(node, "is_causal", 0) != 0;
  plan.hq = int_attr_or(node, "q_num_heads", 0);
  plan.hkv = int_attr_or(node, "kv_num_heads", 0);
  if (plan.hq <= 0 || plan.hkv <= 0 || plan.hq % plan.hkv != 0) {
    return "bad q_num_heads / kv_num_heads";
  }
  return "";
}

// The dtypes the kernels take, the same for Q, K, V and the cache, and 4-D operands.
std::string Planner::dtypes() {
  const int32_t dtype = plan.dtype = dtype_of(plan.q);
  if (dtype != kFloat && dtype != kFloat16 && dtype != kBFloat16) {
    return "dtype " + dtype_name(dtype) + " (MHA/GQA: float, float16, bfloat16)";
  }
  if (dtype_of(plan.k) != dtype || dtype_of(plan.v) != dtype) return "Q, K, V dtypes differ";
  const std::optional<CachedKV>& cache = plan.cache;
  if (cache && (dtype_of(plan.k_new) != dtype || dtype_of(plan.v_new) != dtype ||
                value_dtype(cache->past_k) != dtype || value_dtype(cache->past_v) != dtype)) {
    return "the cache's dtype is not Q's";
  }
  for (const Value* x : {plan.q, plan.k, plan.v, plan.k_new, plan.v_new}) {
    if (value_rank(x) != -1 && value_rank(x) != 4) return "Q, K, V must be 4-D";
  }
  return "";
}

// softmax_precision, the mask's dtype and rank, and the opset.
std::string Planner::mask_and_precision() {
  // The kernels accumulate the softmax in fp32 (fp16 too): a wider request is met, others not.
  const int64_t precision = int_attr_or(node, "softmax_precision", plan.dtype);
  if (precision != plan.dtype && precision != kFloat) {
    return "softmax_precision " + dtype_name(static_cast<int32_t>(precision));
  }
  const Value* mask = plan.mask;
  plan.mask_dtype = mask ? value_dtype(mask) : 0;
  if (mask && plan.mask_dtype != kBool && plan.mask_dtype != plan.dtype) {
    return "mask dtype " + dtype_name(plan.mask_dtype) + " (bool or the dtype of Q)";
  }
  if (mask && value_rank(mask) > 4) return "mask of rank > 4";
  if (default_opset(*g.model()) < 13) return "default opset < 13";
  return "";
}

// A head size: the new rows' dim 3, else the past's (shape analysis, shapes.h).
std::optional<int64_t> head_size(const Value* fresh, const Value* past) {
  std::optional<int64_t> d = rank_of(fresh) == 4 ? resolve_dim(fresh, 3) : std::nullopt;
  if (past && !d && rank_of(past) == 4) d = resolve_dim(past, 3);
  return d;
}

// Head sizes, lengths and options: what decides between the ops.
std::string Planner::shapes() {
  const std::optional<CachedKV>& cache = plan.cache;
  head_dim = head_size(plan.k_new, cache ? cache->past_k : nullptr);
  v_head_dim = head_size(plan.v_new, cache ? cache->past_v : nullptr);
  static_head = head_dim.has_value();
  heads_differ = head_dim && v_head_dim && *head_dim != *v_head_dim;
  // S == T from the shape analysis (symbolic dims through head splits, rotaries, norms). With a
  // cache: the new rows have the query's length (T = P + S is the ops' business).
  same_len = same_length(plan.q, 2, plan.k_new, 2, 4);
  // One query row sees every key under bottom-right alignment: no causal mask at all.
  const bool one_row = rank_of(plan.q) == 4 && resolve_dim(plan.q, 2) == 1;
  plan.mha_causal = plan.causal && !one_row;
  gqa_fits = same_len && static_head && *head_dim % 8 == 0 && head_dim == v_head_dim;
  plan.cuda = ctx.options.count("cuda") && ctx.options.at("cuda") != 0;
  // Packed QKV (com.microsoft Attention): option packed_attention 0 = off, 1 = non-causal
  // self-attention (encoders; the default), 2 = causal too (unidirectional; S == T holds since
  // Q and K are projections of one input). Decoders keep MHA/GQA by default.
  const auto packed_option = ctx.options.find("packed_attention");
  packed_mode = packed_option != ctx.options.end() ? packed_option->second : (plan.cuda ? 0 : 1);
  // A boolean mask's all-masked rows (masked_rows.h). In place GQA reads no mask.
  if (plan.mask && plan.mask_dtype == kBool && !plan.inplace) rule = masked_rows(node);
  return "";
}

// Packed QKV where asked and the projections allow it.
std::string Planner::packing() {
  if (plan.cache || needs_gqa || plan.hq != plan.hkv || packed_mode <= 0 ||
      (plan.causal && packed_mode < 2)) {
    return "";
  }
  // A narrower dtype's rows with no visible key take a mean read from V, which would keep the
  // V projection that packing removes: MHA/GQA take them.
  if (rule == MaskedRows::kMean && plan.dtype != kFloat) {
    plan.not_packed = "rows whose every key is masked average V (masked_rows.h)";
  } else {
    qkv = packed_qkv(g, node, plan.hq, plan.dtype, &plan.not_packed);
  }
  return "";
}

// GroupQueryAttention or MultiHeadAttention (when not packed).
std::string Planner::op_choice() {
  const bool cuda = plan.cuda, cache = plan.cache.has_value();
  use_gqa = qkv             ? false
            : plan.inplace  ? true
            : needs_gqa     ? true
            : cuda && cache ? false  // CUDA GQA rejects the cache's bias
            : cuda          ? plan.dtype != kFloat && plan.causal && !plan.mask
                            : plan.dtype != kFloat || plan.hkv != plan.hq;
  // Where GQA does not fit (cross-attention's K/V of the encoder's length; a head size it
  // rejects), MHA takes any dtype (CPU runs fp16 too): over repeated kv heads without a cache;
  // with one only Hkv == Hq (present has Hkv) and no causal mask (MHA's is top-left aligned).
  const bool mha_fits =
      cache ? plan.hkv == plan.hq && !plan.mha_causal : plan.hkv == plan.hq || static_head;
  if (use_gqa && !plan.inplace && !needs_gqa && !gqa_fits && mha_fits) use_gqa = false;
  plan.repeat_kv = !use_gqa && plan.hkv != plan.hq;
  return "";
}

// GroupQueryAttention's limits: CUDA kernels, S == T, head sizes.
std::string Planner::gqa_refusal() {
  const bool fp32 = plan.dtype == kFloat;
  if (plan.inplace && plan.cuda && fp32) {
    return "in-place cache: GroupQueryAttention has no fp32 CUDA kernel";
  }
  if (needs_gqa && plan.cuda && !plan.inplace && (fp32 || plan.mask || plan.cache)) {
    return why_gqa + " needs GroupQueryAttention, which on CUDA takes neither fp32 nor a bias";
  }
  if (use_gqa && !same_len) {
    // Name why GQA was the only op left (MHA has neither soft-capping nor sinks).
    return (needs_gqa ? why_gqa + " needs GroupQueryAttention: " : std::string()) +
           "GroupQueryAttention (" + dtype_name(plan.dtype) +
           (fp32 && plan.hkv < plan.hq ? ", Hkv < Hq"
            : plan.inplace             ? ", in place"
                                       : "") +
           (plan.cache ? ") needs the new K/V rows of the query's length"
                       : ") needs S == T, not shown by the shapes of Q and K nor by the graph");
  }
  if (use_gqa && !gqa_fits) {
    return (needs_gqa ? why_gqa + " needs GroupQueryAttention: " : std::string()) +
           "GroupQueryAttention needs a static head size, a multiple of 8, the same for K and V";
  }
  return "";
}

// MultiHeadAttention's limits: its top-left causal mask, one head size with a cache, repeated
// kv heads.
std::string Planner::mha_refusal() {
  const bool cache = plan.cache.has_value(), mha = !use_gqa;
  if (cache && mha && plan.mha_causal) {
    return "causal MultiHeadAttention with a cache: its causal mask is top-left aligned";
  }
  if (mha && plan.mha_causal && !same_len) {
    return "causal MultiHeadAttention needs S == T (its causal mask is top-left aligned), not "
           "shown by the shapes of Q and K nor by the graph";
  }
  if (cache && mha && heads_differ) {
    // ORT 1.32 checks past_value's dim 3 against the head size of Q/K (bench: "Input
    // 'past_value' dimension 3 should be same as head_size").
    return "MultiHeadAttention with a cache needs one head size for K and V (" +
           std::to_string(*head_dim) + " and " + std::to_string(*v_head_dim) + ")";
  }
  if (cache && plan.repeat_kv) {
    return "a grouped cache (Hkv < Hq) needs GroupQueryAttention, which does not fit";
  }
  if (plan.repeat_kv && !static_head) {
    return "repeating kv heads for MultiHeadAttention needs a static head size";
  }
  return "";
}

// In place: the graph inputs GQA's lengths come from; a mask GQA can read; sliding windows.
std::string Planner::inplace_inputs() {
  const bool inplace = plan.inplace;
  plan.mask_input = inplace ? attention_mask_input(g) : nullptr;
  plan.past_length_input = inplace && !plan.mask_input ? past_length_input(g) : nullptr;
  if (inplace && !plan.mask_input && !plan.past_length_input) {
    return "in-place cache: no attention_mask graph input (B, total_sequence_length) nor "
           "past_sequence_length (1)";
  }
  if (inplace && !plan.causal && !plan.mask) return "in-place cache: neither causal nor a mask";
  if (inplace && plan.cuda && plan.mask && plan.mask_dtype != kBool) {
    return "in-place cache with a score bias: CUDA GroupQueryAttention rejects attention_bias";
  }
  if (int_attr_or(node, "sliding_window", 0) > 0 && !plan.cache) {
    return "a sliding_window attribute outside the cached form";
  }
  return "";
}

// In place: RoPE goes into GQA (do_rotary) when both rotaries can fold there.
std::string Planner::rotaries() {
  if (!plan.inplace) return "";
  const Node* rot_q = foldable_rotary_of(g, plan.q, plan.dtype);
  const Node* rot_k = foldable_rotary_of(g, plan.k_new, plan.dtype);
  if (rot_q && rot_k && *head_dim % 16 == 0 && rot_q->inputs()[2] == rot_k->inputs()[2] &&
      rot_q->inputs()[3] == rot_k->inputs()[3] &&
      int_attr_or(rot_q, "interleaved", 0) == int_attr_or(rot_k, "interleaved", 0)) {
    plan.rotary_q = rot_q;
    plan.rotary_k = rot_k;
  }
  return "";
}

// The op and what lower_attention_ort.cc builds it from.
std::string Planner::record() {
  plan.op = qkv       ? OrtAttentionOp::kPackedAttention
            : use_gqa ? OrtAttentionOp::kGroupQueryAttention
                      : OrtAttentionOp::kMultiHeadAttention;
  plan.head_dim = head_dim.value_or(0);
  plan.v_head_dim = v_head_dim.value_or(0);
  plan.kv_bsd = heads_differ;
  plan.kv_query_length = same_len;
  // The mask's (S, T) and batch against Q's and K's, for the bias and GQA's lengths.
  const Value *mask = plan.mask, *q = plan.q, *k = plan.k;
  plan.mask_full = mask && same_length(mask, 2, q, 2, 4) && same_length(mask, 3, k, 2, 4);
  plan.mask_bs = mask && same_length(mask, 0, q, 0, 4) && same_length(mask, 2, q, 2, 4) &&
                 resolve_dim(mask, 0) != 1;
  plan.mask_t = plan.mask_bs && same_length(mask, 3, k, 2, 4);
  if (qkv) plan.qkv = std::move(*qkv);
  plan.ids_input = plan.mask_input ? input_ids_input(g) : nullptr;
  plan.window = int_attr_or(node, "sliding_window", 0);
  return "";
}

// Rows whose every key is masked (masked_rows.h): reproduced by the op itself, or fixed after.
std::string Planner::masked_rows_fix() {
  // Does the op's bias reach every key? GQA is causal with a cache or a causal node. Such an
  // op (fp32: the export's sums) computes a finite masking value's rows itself.
  const bool packed = plan.op == OrtAttentionOp::kPackedAttention;
  const bool bias_only =
      !(use_gqa && (plan.causal || plan.cache)) && !plan.mha_causal && !(packed && plan.causal);
  const bool fp32 = plan.dtype == kFloat;
  if (rule == MaskedRows::kScores) {
    if (!fp32 || !bias_only) {
      return "rows whose every key is masked are softmax(scores + " +
             std::to_string(masked_value(node)) +
             ") in the export, which only an fp32 bias on every key reproduces";
    }
    plan.bias_masked_value = masked_value(node);
  } else if (rule == MaskedRows::kMean && fp32 && bias_only) {
    // The lowest fp32 bias: the op's own mean (exact, as the export's sum).
  } else if (rule != MaskedRows::kUnread) {
    if (std::string why = rows_with_keys_refusal(plan.mask); !why.empty()) return why;
    // fp16/bf16 kernels add the bias in fp32, where no dtype value absorbs the scores.
    if (rule == MaskedRows::kMean && bias_only && !packed) {
      plan.zero_masked_queries = true;
    } else {
      plan.fix_masked_rows = rule;
    }
  }
  return "";
}

}  // namespace

OrtLoweringPlan plan_ort_lowering(const Node* node, const Graph& g, const PassContext& ctx) {
  using Step = std::string (Planner::*)();
  Planner p(node, g, ctx);
  for (Step step :
       {&Planner::operands, &Planner::attributes, &Planner::dtypes, &Planner::mask_and_precision,
        &Planner::shapes, &Planner::packing, &Planner::op_choice, &Planner::gqa_refusal,
        &Planner::mha_refusal, &Planner::inplace_inputs, &Planner::rotaries, &Planner::record,
        &Planner::masked_rows_fix}) {
    std::string why = (p.*step)();
    if (!why.empty()) {
      p.plan.refusal = std::move(why);
      return p.plan;
    }
  }
  return p.plan;
}

}  // namespace fastopt::passes
