#include "analysis/rule_util.h"

#include <mutex>
#include <unordered_map>

namespace fastopt::analysis {
namespace rules {

std::optional<int64_t> attr_i(const Node& n, const char* name) {
  const Attribute* a = n.attribute(name);
  if (!a || a->ref_attr_name.present) return std::nullopt;
  if (a->i) return *a->i;
  return std::nullopt;
}

std::optional<std::vector<int64_t>> attr_is(const Node& n, const char* name) {
  const Attribute* a = n.attribute(name);
  if (!a || a->ref_attr_name.present || a->kind() != AttrType::kInts) return std::nullopt;
  return a->ints;
}

std::optional<int64_t> norm_axis(int64_t axis, int64_t rank) {
  if (axis < 0) axis += rank;
  if (axis < 0 || axis >= rank) return std::nullopt;
  return axis;
}

std::optional<std::vector<DimExpr>> broadcast(RuleContext& ctx,
                                              const std::vector<const Facts*>& inputs) {
  size_t rank = 0;
  for (const Facts* f : inputs) {
    if (!f || !f->ranked) return std::nullopt;
    rank = std::max(rank, f->dims.size());
  }
  std::vector<DimExpr> out(rank);
  const DimExpr one = DimExpr::constant(1);
  for (size_t i = 0; i < rank; ++i) {
    std::optional<DimExpr> d;  // the result so far; nullopt = every side was 1
    bool unknown = false;
    for (const Facts* f : inputs) {
      const size_t r = f->dims.size();
      if (i + r < rank) continue;  // this side has no dim here: broadcast as 1
      const DimExpr& x = f->dims[i + r - rank];
      if (x == one) continue;
      if (!d) {
        d = x;
      } else if (*d != x) {
        // A number > 1 wins over a symbol (which must then be 1 or equal); two different
        // symbols: unknown.
        auto cd = d->constant_value(), cx = x.constant_value();
        if (cx && !cd)
          d = x;
        else if (!(cd && !cx))
          unknown = true;
      }
    }
    out[i] = unknown ? ctx.fresh_dim() : d.value_or(one);
  }
  return out;
}

std::optional<std::vector<DimExpr>> elementwise_value(const Facts& a, const Facts& b, ValueFn fn) {
  if (!a.has_value || !b.has_value) return std::nullopt;
  const size_t na = a.value.size(), nb = b.value.size();
  if (na != nb && na != 1 && nb != 1) return std::nullopt;
  // An empty operand broadcasts the other's one element away: (0) op (1) is (0).
  const size_t n = na == 0 || nb == 0 ? 0 : std::max(na, nb);
  std::vector<DimExpr> out;
  for (size_t i = 0; i < n; ++i) {
    auto r = fn(a.value[na == 1 ? 0 : i], b.value[nb == 1 ? 0 : i]);
    if (!r) return std::nullopt;
    out.push_back(std::move(*r));
  }
  return out;
}

Facts same_as(const Facts& f, int32_t dtype) {
  Facts o;
  o.dtype = dtype ? dtype : f.dtype;
  o.ranked = f.ranked;
  o.dims = f.dims;
  return o;
}

std::optional<DimExpr> product(const std::vector<DimExpr>& dims, size_t begin, size_t end) {
  DimExpr p = DimExpr::constant(1);
  for (size_t i = begin; i < end; ++i) {
    auto q = DimExpr::mul(p, dims[i]);
    if (!q) return std::nullopt;
    p = std::move(*q);
  }
  return p;
}

Facts fresh_ranked(RuleContext& ctx, int32_t dtype, size_t rank) {
  Facts o;
  o.dtype = dtype;
  o.ranked = true;
  for (size_t i = 0; i < rank; ++i) o.dims.push_back(ctx.fresh_dim());
  return o;
}

}  // namespace rules

OpRule find_rule(const std::string& domain, const std::string& op_type) {
  using Map = std::unordered_map<std::string, OpRule>;
  struct Tables {
    Map onnx, ms, internal;
  };
  static const Tables tables = [] {
    rules::RuleTable onnx, ms, internal;
    rules::add_shape_rules(onnx);
    rules::add_math_rules(onnx);
    rules::add_routing_rules(onnx);
    rules::add_contrib_rules(ms);
    rules::add_attention_rules(onnx, internal);
    Tables t;
    for (auto& [name, fn] : onnx) t.onnx.emplace(name, fn);
    for (auto& [name, fn] : ms) t.ms.emplace(name, fn);
    for (auto& [name, fn] : internal) t.internal.emplace(name, fn);
    return t;
  }();
  // The internal domain is passes/fusion_util.h's kInternalDomain (the analysis sits below the
  // passes and does not include them).
  const Map* m = domain.empty() || domain == "ai.onnx" ? &tables.onnx
                 : domain == "com.microsoft"           ? &tables.ms
                 : domain == "ai.fastopt.internal"     ? &tables.internal
                                                       : nullptr;
  if (!m) return nullptr;
  auto it = m->find(op_type);
  return it == m->end() ? nullptr : it->second;
}

}  // namespace fastopt::analysis
