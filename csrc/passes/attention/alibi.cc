// ALiBi attention's flat heads and bias (alibi.h has the forms and why they are exact).
#include "passes/attention/alibi.h"

#include <optional>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/shapes.h"

namespace fastopt::passes::alibi {
namespace {
using analysis::DimExpr;
using analysis::ShapeFacts;

std::optional<DimExpr> product(ShapeFacts& facts, const Value* v, int a, int b) {
  auto x = facts.dim(v, a), y = facts.dim(v, b);
  if (!x || !y) return std::nullopt;
  return DimExpr::mul(*x, *y);
}

bool equal(const std::optional<DimExpr>& a, const std::optional<DimExpr>& b) {
  return a && b && *a == *b;
}

// (B*H, L, D) of `x3` against (B, H, L, D) of `x4`: the same elements in the same order.
bool flat_of(const Value* x3, const Value* x4, ShapeFacts& facts) {
  if (facts.rank(x3) != 3 || facts.rank(x4) != 4) return false;
  return equal(facts.dim(x3, 0), product(facts, x4, 0, 1)) && facts.same_dim(x3, 1, x4, 2) &&
         facts.same_dim(x3, 2, x4, 3);
}

Value* ints(pattern::Rewriter& rw, const std::vector<int64_t>& v) {
  return rw.initializer("alibi_shape", make_int64_tensor(v, {static_cast<int64_t>(v.size())}));
}

}  // namespace

Value* unflatten_heads(Value* x3, ShapeFacts& facts, Node** reshape) {
  Node* r = x3 ? x3->producer() : nullptr;
  if (!r || r->op_type != "Reshape" || !is_standard(r) || r->inputs().size() != 2) return nullptr;
  Value* x4 = r->inputs()[0];
  if (!x4 || !flat_of(x3, x4, facts)) return nullptr;
  *reshape = r;
  return x4;
}

bool splits_heads(const Value* x3, const Value* x4, const Value* heads_of, ShapeFacts& facts) {
  return flat_of(x3, x4, facts) && facts.same_dim(x4, 1, heads_of, 1);
}

bool merges_heads(const Value* x4, const Value* x3, ShapeFacts& facts) {
  return flat_of(x3, x4, facts);
}

FlatBias flat_bias_form(const Value* bias3, const Value* scores3, ShapeFacts& facts,
                        std::string* why) {
  if (facts.rank(bias3) != 3) {
    *why = "the bias on the flat (B*H, S, T) scores is not 3-D";
    return FlatBias::kNone;
  }
  if (facts.same_dim(bias3, 0, scores3, 0)) return FlatBias::kReshape;
  if (facts.known_dim(bias3, 0) == 1) return FlatBias::kUnsqueeze;
  *why = "the bias's dim 0 is proven neither B*H nor 1";
  return FlatBias::kNone;
}

Value* bias_4d(pattern::Rewriter& rw, Value* bias3, FlatBias form, int64_t heads) {
  if (form == FlatBias::kUnsqueeze) return rw.op1("Unsqueeze", {bias3, ints(rw, {0})});
  // (B*H, X, T) -> (B, H, X, T): dims 1 and 2 copied from the bias's own shape.
  std::vector<Attribute> start;
  start.push_back(pattern::attr_int("start", 1));
  Value* tail = rw.op1("Shape", {bias3}, std::move(start));
  Value* target = rw.op1("Concat", {ints(rw, {-1, heads}), tail}, [] {
    std::vector<Attribute> a;
    a.push_back(pattern::attr_int("axis", 0));
    return a;
  }());
  return rw.op1("Reshape", {bias3, target});
}

Value* combine(pattern::Rewriter& rw, Value* bias, Value* additive_mask, Value* masked_cond,
               Value* masked_value) {
  if (masked_cond) return rw.op1("Where", {masked_cond, masked_value, bias});
  if (additive_mask) return rw.op1("Add", {bias, additive_mask});
  return bias;
}

}  // namespace fastopt::passes::alibi
