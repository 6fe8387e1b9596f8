#include "passes/attention/masked_rows.h"

#include <cmath>
#include <vector>

#include "ir/dtype.h"
#include "passes/attention/lowering_ops.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
using namespace pattern;

MaskedRows masked_rows(const Node* attention) {
  if (int_attr_or(attention, "masked_rows_unread", 0) != 0) return MaskedRows::kUnread;
  if (int_attr_or(attention, "masked_rows_mean", 0) != 0) return MaskedRows::kMean;
  return attention->attribute("masked_value") ? MaskedRows::kScores : MaskedRows::kZero;
}

double masked_value(const Node* attention) {
  return float_attr(attention, "masked_value", 0.0f);
}

bool absorbs_scores(double v, int32_t dtype) {
  if (!std::isfinite(v)) return false;
  return dtype == kFloat16 ? v <= -65504.0 : v <= -std::ldexp(1.0, 104);
}

double absorbing_mask_value(int32_t dtype) {
  return dtype == kFloat16 ? -61440.0 : -std::ldexp(1.0, 127);
}

std::string rows_with_keys_refusal(const Value* mask) {
  const int rank = rank_of(mask);
  if (rank < 0) return "rows whose every key is masked: the mask's rank is unknown";
  if (rank <= 2) return "";
  if (resolve_dim(mask, rank == 4 ? 1 : 0) != 1) {
    return "rows whose every key is masked: the mask has a head axis (not 1)";
  }
  return "";
}

Value* rows_with_keys(Rewriter& rw, Value* mask, bool bnsh) {
  Value* counts = shared_op(rw, "Cast", {mask}, one_attr(attr_int("to", kFloat)));
  Value* sum = reduce(rw, "ReduceSum", counts, {-1}, true, true);
  Value* any = shared_op(rw, "Greater", {sum, float_scalar(rw, kFloat, false)});
  const int rank = rank_of(mask);
  if (bnsh || rank <= 2) return any;
  return shared_op(rw, "Squeeze", {any, ints(rw, {rank == 4 ? 1 : 0})});
}

namespace {

// The mean over the keys of V as (B, 1, Hq*Dv) (fix_masked_rows).
Value* mean_values(Rewriter& rw, Value* v4, Value* v3, int64_t hq, int64_t hkv) {
  const int64_t groups = hq / hkv;
  if (!v4) {  // (B, T, Hkv*Dv) -> (B, 1, Hkv*Dv)
    Value* mean = reduce(rw, "ReduceMean", v3, {1}, true);
    if (groups == 1) return mean;
    Value* x5 = rw.op1("Reshape", {mean, ints(rw, {0, 1, hkv, 1, -1})});
    x5 = rw.op1("Expand", {x5, ints(rw, {1, 1, 1, groups, 1})});
    return rw.op1("Reshape", {x5, ints(rw, {0, 1, -1})});
  }
  Value* mean = reduce(rw, "ReduceMean", v4, {2}, true);  // (B, Hkv, 1, Dv)
  if (groups > 1) {
    Value* x5 = rw.op1("Unsqueeze", {mean, ints(rw, {2})});
    x5 = rw.op1("Expand", {x5, ints(rw, {1, 1, groups, 1, 1})});
    mean = rw.op1("Reshape", {x5, ints(rw, {0, hq, 1, -1})});
  }
  Value* bshd = rw.op1("Transpose", {mean}, one_attr(attr_ints("perm", {0, 2, 1, 3})));
  return rw.op1("Reshape", {bshd, ints(rw, {0, 1, -1})});
}

}  // namespace

Value* fix_masked_rows(Rewriter& rw, Value* y, Value* mask, MaskedRows rule, Value* v4, Value* v3,
                       int64_t hq, int64_t hkv, int32_t dtype) {
  Value* keep = rows_with_keys(rw, mask, false);
  Value* other =
      rule == MaskedRows::kMean ? mean_values(rw, v4, v3, hq, hkv) : float_scalar(rw, dtype, false);
  return rw.op1("Where", {keep, y, other});
}

}  // namespace fastopt::passes
