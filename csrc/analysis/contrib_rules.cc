// Shape rules for the com.microsoft ops fastopt writes: the norms and their skip forms,
// RotaryEmbedding, MatMulNBits, GroupQueryAttention, MultiHeadAttention, Attention, the GELU
// variants, FusedMatMul. Dims follow ONNX Runtime's contrib op documentation; what a present
// cache holds (its length depends on run-time lengths) is left to the declared types. Also the
// 4-D attention of ONNX Attention-23 and of fastopt's internal op (passes/attention/internal_op.h),
// which the attention passes query between their stages.
#include "analysis/rule_util.h"
#include "ir/dtype.h"

namespace fastopt::analysis::rules {
namespace {

bool like_input(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0));
  return true;
}

// SimplifiedLayerNormalization: Y, inv_std_var. Skip forms: Y, mean, inv_std_var, and the sum
// input + skip (+ bias) as output 3.
bool norm(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0));
  const bool skip = n.op_type.rfind("Skip", 0) == 0;
  if (skip && out.size() > 3) out[3] = same_as(ctx.in(0));
  return true;
}

bool matmul_nbits(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& a = ctx.in(0);
  auto N = attr_i(n, "N");
  if (!N) return false;
  out[0].dtype = a.dtype;
  if (!a.ranked || a.dims.empty()) return true;
  out[0].ranked = true;
  out[0].dims = a.dims;
  out[0].dims.back() = DimExpr::constant(*N);
  return true;
}

bool fused_matmul(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  Facts a = ctx.in(0), b = ctx.in(1);
  out[0].dtype = a.dtype;
  if (!a.ranked || !b.ranked || a.dims.size() < 2 || b.dims.size() < 2) return true;
  if (attr_i(n, "transBatchA").value_or(0) || attr_i(n, "transBatchB").value_or(0)) return true;
  if (attr_i(n, "transA").value_or(0)) std::swap(a.dims[a.dims.size() - 2], a.dims.back());
  if (attr_i(n, "transB").value_or(0)) std::swap(b.dims[b.dims.size() - 2], b.dims.back());
  Facts ba, bb;
  ba.ranked = bb.ranked = true;
  ba.dims.assign(a.dims.begin(), a.dims.end() - 2);
  bb.dims.assign(b.dims.begin(), b.dims.end() - 2);
  auto batch = broadcast(ctx, {&ba, &bb});
  if (!batch) return true;
  out[0].ranked = true;
  out[0].dims = *batch;
  out[0].dims.push_back(a.dims[a.dims.size() - 2]);
  out[0].dims.push_back(b.dims.back());
  return true;
}

// Present K/V [B, kv_heads, ?, head_size]: the length is a run-time matter.
void present(RuleContext& ctx, std::vector<Facts>& out, size_t first, const DimExpr& b,
             const std::optional<DimExpr>& heads, const std::optional<DimExpr>& head_size,
             int32_t dtype) {
  for (size_t i = first; i < out.size() && i < first + 2; ++i) {
    out[i].dtype = dtype;
    out[i].ranked = true;
    out[i].dims = {b, heads ? *heads : ctx.fresh_dim(), ctx.fresh_dim(),
                   head_size ? *head_size : ctx.fresh_dim()};
  }
}

bool gqa(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& q = ctx.in(0);
  auto heads = attr_i(n, "num_heads"), kv = attr_i(n, "kv_num_heads");
  if (!heads || !kv || *heads <= 0 || *kv <= 0) return false;
  out[0].dtype = q.dtype;
  if (!q.ranked || q.dims.size() != 3) return true;
  const bool packed = !ctx.present(1);
  auto hs = DimExpr::div_exact(q.dims[2], DimExpr::constant(packed ? *heads + 2 * *kv : *heads));
  out[0].ranked = true;
  std::optional<DimExpr> hidden;
  if (hs) hidden = DimExpr::mul(*hs, DimExpr::constant(*heads));
  out[0].dims = {q.dims[0], q.dims[1], hidden ? *hidden : ctx.fresh_dim()};
  present(ctx, out, 1, q.dims[0], DimExpr::constant(*kv), hs, q.dtype);
  return true;
}

bool mha(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  static const Facts none;
  const Facts &q = ctx.in(0), &v = ctx.present(2) ? ctx.in(2) : none;
  auto heads = attr_i(n, "num_heads");
  if (!heads || *heads <= 0) return false;
  out[0].dtype = q.dtype;
  if (!q.ranked || q.dims.size() != 3) return true;
  std::optional<DimExpr> hidden, hs;
  if (v.ranked && v.dims.size() == 3) {
    hidden = v.dims[2];
    hs = DimExpr::div_exact(v.dims[2], DimExpr::constant(*heads));
  } else if (v.ranked && v.dims.size() == 4) {
    hs = v.dims[3];
    hidden = DimExpr::mul(v.dims[3], DimExpr::constant(*heads));
  } else if (!ctx.present(1) && !ctx.present(2)) {
    hidden = q.dims[2];  // unpacked query only: self-attention over the query's hidden size
  }
  out[0].ranked = true;
  out[0].dims = {q.dims[0], q.dims[1], hidden ? *hidden : ctx.fresh_dim()};
  present(ctx, out, 1, q.dims[0], DimExpr::constant(*heads), hs, q.dtype);
  return true;
}

bool attention(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts &x = ctx.in(0), &w = ctx.in(1);
  auto heads = attr_i(n, "num_heads");
  if (!heads || *heads <= 0) return false;
  out[0].dtype = x.dtype;
  if (!x.ranked || x.dims.size() != 3) return true;
  std::optional<DimExpr> hidden;
  if (auto sizes = attr_is(n, "qkv_hidden_sizes"); sizes && sizes->size() == 3) {
    hidden = DimExpr::constant((*sizes)[2]);
  } else if (w.ranked && w.dims.size() == 2) {
    hidden = DimExpr::div_exact(w.dims[1], DimExpr::constant(3));
  }
  out[0].ranked = true;
  out[0].dims = {x.dims[0], x.dims[1], hidden ? *hidden : ctx.fresh_dim()};
  if (out.size() > 1) {  // present: [2, B, heads, ?, head_size]
    std::optional<DimExpr> hs;
    if (hidden) hs = DimExpr::div_exact(*hidden, DimExpr::constant(*heads));
    out[1].dtype = x.dtype;
    out[1].ranked = true;
    out[1].dims = {DimExpr::constant(2), x.dims[0], DimExpr::constant(*heads), ctx.fresh_dim(),
                   hs ? *hs : ctx.fresh_dim()};
  }
  return true;
}

// Attention-23 / the internal op on 4-D inputs: Q (B, Hq, S, D), V (B, Hkv, T, Dv) give Y
// (B, Hq, S, Dv). 3-D inputs and the present outputs are left to the declared types.
bool attention_4d(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts &q = ctx.in(0), &v = ctx.in(2);
  out[0].dtype = q.dtype;
  if (!q.ranked || q.dims.size() != 4) return true;
  out[0].ranked = true;
  out[0].dims = {q.dims[0], q.dims[1], q.dims[2],
                 v.ranked && v.dims.size() == 4 ? v.dims[3] : ctx.fresh_dim()};
  return true;
}

}  // namespace

void add_attention_rules(RuleTable& onnx, RuleTable& internal) {
  onnx.push_back({"Attention", attention_4d});
  // ORT also registers SimplifiedLayerNormalization in the default domain, where fuse_rms_norm
  // writes it.
  onnx.push_back({"SimplifiedLayerNormalization", norm});
  onnx.push_back({"RotaryEmbedding", like_input});  // ONNX 23's: the output has X's shape
  internal.push_back({"Attention", attention_4d});
}

void add_contrib_rules(RuleTable& t) {
  t.insert(t.end(), {{"SimplifiedLayerNormalization", norm},
                     {"SkipSimplifiedLayerNormalization", norm},
                     {"SkipLayerNormalization", norm},
                     {"RotaryEmbedding", like_input},
                     {"FastGelu", like_input},
                     {"QuickGelu", like_input},
                     {"BiasGelu", like_input},
                     {"Gelu", like_input},
                     {"MatMulNBits", matmul_nbits},
                     {"FusedMatMul", fused_matmul},
                     {"GroupQueryAttention", gqa},
                     {"MultiHeadAttention", mha},
                     {"Attention", attention}});
}

}  // namespace fastopt::analysis::rules
