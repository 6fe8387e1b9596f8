// Shape rules for the ops that select and route elements, as mixture-of-experts decoders use
// them (the router's TopK, OneHot expert masks, scatters of the routed tokens, NonZero of the
// tokens an expert takes): TopK, OneHot, ScatterElements, ScatterND, Scatter, NonZero.
// NonZero's count depends on the data: its dim is a fresh symbol, known only to equal itself.
#include "analysis/rule_util.h"
#include "ir/dtype.h"

namespace fastopt::analysis::rules {
namespace {

// The one element of a scalar or one-element input (K, depth) as a dim: a number, a symbol
// carried by a shape value, or a fresh dim when the analysis cannot tell.
DimExpr scalar_dim(RuleContext& ctx, size_t i) {
  const Facts& f = ctx.in(i);
  if (f.has_value && f.value.size() == 1) return f.value[0];
  return ctx.fresh_dim();
}

// TopK(X, K; axis): Values and Indices (int64), X's dims with the axis cut to K.
bool top_k(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  out[0].dtype = x.dtype;
  if (out.size() > 1) out[1].dtype = kInt64;
  if (!x.ranked) return true;
  auto axis = norm_axis(attr_i(n, "axis").value_or(-1), static_cast<int64_t>(x.dims.size()));
  if (!axis) return false;
  std::vector<DimExpr> dims = x.dims;
  if (ctx.opset() < 10) {  // K was an attribute until opset 10
    auto k = attr_i(n, "k");
    if (!k) return false;
    dims[static_cast<size_t>(*axis)] = DimExpr::constant(*k);
  } else {
    dims[static_cast<size_t>(*axis)] = scalar_dim(ctx, 1);
  }
  for (Facts& o : out) {
    o.ranked = true;
    o.dims = dims;
  }
  return true;
}

// OneHot(indices, depth, values; axis): a new dim of size depth at axis (-1: last), in the
// dtype of values.
bool one_hot(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& idx = ctx.in(0);
  out[0].dtype = ctx.in(2).dtype;
  DimExpr depth = scalar_dim(ctx, 1);
  if (!idx.ranked) return true;
  const int64_t r = static_cast<int64_t>(idx.dims.size()) + 1;
  auto axis = norm_axis(attr_i(n, "axis").value_or(-1), r);
  if (!axis) return false;
  out[0].ranked = true;
  out[0].dims = idx.dims;
  out[0].dims.insert(out[0].dims.begin() + *axis, depth);
  return true;
}

// ScatterElements / ScatterND / Scatter: data's type and shape (updates land inside it).
bool scatter(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0));
  out[0].has_value = false;  // the updated elements are not data's
  out[0].value.clear();
  return true;
}

// NonZero(X): int64 (rank(X), n) where n, the count of non-zero elements, depends on the data.
bool non_zero(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  out[0].dtype = kInt64;
  if (!x.ranked) return true;
  out[0].ranked = true;
  out[0].dims = {DimExpr::constant(static_cast<int64_t>(x.dims.size())), ctx.fresh_dim()};
  return true;
}

}  // namespace

void add_routing_rules(RuleTable& t) {
  t.insert(t.end(), {{"TopK", top_k},
                     {"OneHot", one_hot},
                     {"ScatterElements", scatter},
                     {"ScatterND", scatter},
                     {"Scatter", scatter},
                     {"NonZero", non_zero}});
}

}  // namespace fastopt::analysis::rules
