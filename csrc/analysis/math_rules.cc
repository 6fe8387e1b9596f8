// Shape rules for computing ops: elementwise (unary, broadcast binary, variadic, Where),
// comparisons, MatMul, Gemm, normalizations, reductions, and the gathers. Integer arithmetic on
// shape values (Add/Sub/Mul/Div/Mod, comparisons, logic, Where, ReduceProd) carries the
// elements exporters compute shapes with.
#include <algorithm>
#include <climits>
#include <string>

#include "analysis/rule_util.h"
#include "ir/dtype.h"

namespace fastopt::analysis::rules {
namespace {

bool unary(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0));
  return true;
}

bool unary_bool(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0), kBool);
  return true;
}

// Broadcast output of all inputs with dtype `dtype` (0: input 0's).
bool broadcast_out(RuleContext& ctx, std::vector<Facts>& out, int32_t dtype) {
  std::vector<const Facts*> ins;
  for (size_t i = 0; i < ctx.num_inputs(); ++i) ins.push_back(&ctx.in(i));
  out[0].dtype = dtype;
  for (size_t i = 0; !out[0].dtype && i < ins.size(); ++i) out[0].dtype = ins[i]->dtype;
  if (auto b = broadcast(ctx, ins)) {
    out[0].ranked = true;
    out[0].dims = std::move(*b);
  }
  return true;
}

bool fits_int32(const DimExpr& e) {
  auto c = e.constant_value();
  return !c || (*c >= INT32_MIN && *c <= INT32_MAX);
}

template <std::optional<DimExpr> (*Fn)(const DimExpr&, const DimExpr&)>
bool arith(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  if (ctx.num_inputs() != 2) return false;
  broadcast_out(ctx, out, 0);
  const int32_t t = out[0].dtype;
  if ((t == kInt64 || t == kInt32) && ctx.num_inputs() == 2 && out[0].ranked &&
      out[0].dims.size() <= 1) {
    auto v = elementwise_value(ctx.in(0), ctx.in(1), Fn);
    // An int32 number past int32's range: ONNX Runtime wraps (or traps, INT32_MIN / -1);
    // unknown here. (int64 overflow already makes the expression unknown.)
    if (v && t == kInt32 && !std::all_of(v->begin(), v->end(), fits_int32)) v.reset();
    if (v) {
      out[0].has_value = true;
      out[0].value = std::move(*v);
    }
  }
  return true;
}

std::optional<DimExpr> add_fn(const DimExpr& a, const DimExpr& b) {
  return DimExpr::add(a, b);
}
std::optional<DimExpr> sub_fn(const DimExpr& a, const DimExpr& b) {
  return DimExpr::sub(a, b);
}
std::optional<DimExpr> mul_fn(const DimExpr& a, const DimExpr& b) {
  return DimExpr::mul(a, b);
}
std::optional<DimExpr> div_fn(const DimExpr& a, const DimExpr& b) {
  return DimExpr::div_exact(a, b);
}

// A comparison of two shape elements, 1 / 0, when decided: x - y a number, the same expression,
// or a size (>= 0) on one side of the other (x - y >= 0: x < y is false, x >= y true). A size
// never equals a negative number.
std::optional<DimExpr> compare_fn(const std::string& op, const DimExpr& x, const DimExpr& y,
                                  const SymbolTable& symbols) {
  auto d = DimExpr::sub(x, y);
  if (!d) return std::nullopt;
  auto bit = [](bool b) { return DimExpr::constant(b ? 1 : 0); };
  if (auto c = d->constant_value()) {
    if (op == "Equal") return bit(*c == 0);
    if (op == "Less") return bit(*c < 0);
    if (op == "Greater") return bit(*c > 0);
    if (op == "LessOrEqual") return bit(*c <= 0);
    return bit(*c >= 0);  // GreaterOrEqual
  }
  auto neg = DimExpr::sub(y, x);
  const bool ge = symbols.nonneg(*d), le = neg && symbols.nonneg(*neg);
  if (op == "Less" && ge) return bit(false);
  if (op == "GreaterOrEqual" && ge) return bit(true);
  if (op == "Greater" && le) return bit(false);
  if (op == "LessOrEqual" && le) return bit(true);
  if (op == "Equal") {
    auto cx = x.constant_value(), cy = y.constant_value();
    if ((cy && *cy < 0 && symbols.nonneg(x)) || (cx && *cx < 0 && symbols.nonneg(y))) {
      return bit(false);
    }
  }
  return std::nullopt;
}

// And / Or / Xor of two known booleans (elements 0 / 1).
std::optional<DimExpr> logic_fn(const std::string& op, const DimExpr& x, const DimExpr& y) {
  auto a = x.constant_value(), b = y.constant_value();
  if (!a || !b || (*a != 0 && *a != 1) || (*b != 0 && *b != 1)) return std::nullopt;
  const bool p = *a != 0, q = *b != 0;
  return DimExpr::constant((op == "And" ? p && q : op == "Or" ? p || q : p != q) ? 1 : 0);
}

// Comparisons and logic on shape values: TorchScript writes a size's floor division (`h //
// d` of Shape elements, torch.div(..., rounding_mode="floor")) as Div with a sign fix-up,
// Where(And(Xor(Less(a, 0), Less(b, 0)), Not(Equal(Mod(a, b), 0))), Div - 1, Div), and a
// Reshape target built from it stays known only if each step does.
bool comparison(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  if (ctx.num_inputs() != 2) return false;
  broadcast_out(ctx, out, kBool);
  if (!out[0].ranked || out[0].dims.size() > 1) return true;
  const Facts &a = ctx.in(0), &b = ctx.in(1);
  if (!a.has_value || !b.has_value) return true;
  const bool logic = n.op_type == "And" || n.op_type == "Or" || n.op_type == "Xor";
  const size_t na = a.value.size(), nb = b.value.size();
  if (na != nb && na != 1 && nb != 1) return true;
  std::vector<DimExpr> v;
  const size_t count = na == 0 || nb == 0 ? 0 : std::max(na, nb);  // (0) with (1) is (0)
  for (size_t i = 0; i < count; ++i) {
    const DimExpr &x = a.value[na == 1 ? 0 : i], &y = b.value[nb == 1 ? 0 : i];
    auto r = logic ? logic_fn(n.op_type, x, y) : compare_fn(n.op_type, x, y, ctx.symbols());
    if (!r) return true;
    v.push_back(*r);
  }
  out[0].has_value = true;
  out[0].value = std::move(v);
  return true;
}

bool not_rule(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  out[0] = same_as(x, kBool);
  out[0].has_value = false;
  out[0].value.clear();
  if (!x.has_value) return true;
  std::vector<DimExpr> v;
  for (const DimExpr& e : x.value) {
    auto c = e.constant_value();
    if (!c || (*c != 0 && *c != 1)) return true;
    v.push_back(DimExpr::constant(*c ? 0 : 1));
  }
  out[0].has_value = true;
  out[0].value = std::move(v);
  return true;
}

// Integer Mod (fmod 0: the sign of the divisor, as Python's %): two numbers, or 0 where b
// divides a exactly (a multiple of the divisor, whatever its symbols).
std::optional<DimExpr> mod_fn(const DimExpr& a, const DimExpr& b) {
  auto ca = a.constant_value(), cb = b.constant_value();
  // ORT fails on b = 0 and may trap on INT_MIN % -1 (eval/ort_semantics.h's rule for Div).
  if (cb && (*cb == 0 || *cb == -1)) return std::nullopt;
  if (ca && cb) {
    int64_t r = *ca % *cb;
    if (r != 0 && ((r < 0) != (*cb < 0))) r += *cb;
    return DimExpr::constant(r);
  }
  if (DimExpr::div_exact(a, b)) return DimExpr::constant(0);
  return std::nullopt;
}

bool mod_rule(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  if (ctx.num_inputs() != 2) return false;
  broadcast_out(ctx, out, 0);
  const int32_t t = out[0].dtype;
  if (attr_i(n, "fmod").value_or(0) != 0 || (t != kInt64 && t != kInt32) || !out[0].ranked ||
      out[0].dims.size() > 1) {
    return true;
  }
  if (auto v = elementwise_value(ctx.in(0), ctx.in(1), mod_fn)) {
    out[0].has_value = true;
    out[0].value = std::move(*v);
  }
  return true;
}

bool where(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  std::vector<const Facts*> ins{&ctx.in(0), &ctx.in(1), &ctx.in(2)};
  out[0].dtype = ctx.in(1).dtype ? ctx.in(1).dtype : ctx.in(2).dtype;
  if (auto b = broadcast(ctx, ins)) {
    out[0].ranked = true;
    out[0].dims = std::move(*b);
  }
  const Facts &c = ctx.in(0), &x = ctx.in(1), &y = ctx.in(2);
  if (c.has_value && x.has_value && y.has_value && out[0].ranked && out[0].dims.size() <= 1) {
    const size_t n = std::max({c.value.size(), x.value.size(), y.value.size()});
    auto at = [n](const Facts& f, size_t i) -> const DimExpr* {
      if (f.value.size() == 1) return &f.value[0];
      return f.value.size() == n ? &f.value[i] : nullptr;
    };
    std::vector<DimExpr> v;
    for (size_t i = 0; i < n; ++i) {
      const DimExpr *ci = at(c, i), *xi = at(x, i), *yi = at(y, i);
      if (!ci || !xi || !yi) return true;
      auto cv = ci->constant_value();
      if (!cv) return true;
      v.push_back(*cv ? *xi : *yi);
    }
    out[0].has_value = true;
    out[0].value = std::move(v);
  }
  return true;
}

bool variadic(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  if (ctx.num_inputs() == 0) return false;
  return broadcast_out(ctx, out, 0);
}

bool pow_rule(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  std::vector<const Facts*> ins{&ctx.in(0), &ctx.in(1)};
  out[0].dtype = ctx.in(0).dtype;
  if (auto b = broadcast(ctx, ins)) {
    out[0].ranked = true;
    out[0].dims = std::move(*b);
  }
  return true;
}

// MatMul dims of a [.., M, K] x [.., K, N] (1-D operands promoted and the added dim dropped).
std::optional<std::vector<DimExpr>> matmul_dims(RuleContext& ctx, const Facts& a, const Facts& b) {
  if (!a.ranked || !b.ranked || a.dims.empty() || b.dims.empty()) return std::nullopt;
  Facts ba, bb;
  ba.ranked = bb.ranked = true;
  ba.dims.assign(a.dims.begin(), a.dims.end() - std::min<size_t>(a.dims.size(), 2));
  bb.dims.assign(b.dims.begin(), b.dims.end() - std::min<size_t>(b.dims.size(), 2));
  auto batch = broadcast(ctx, {&ba, &bb});
  if (!batch) return std::nullopt;
  std::vector<DimExpr> out = *batch;
  if (a.dims.size() >= 2) out.push_back(a.dims[a.dims.size() - 2]);
  if (b.dims.size() >= 2) out.push_back(b.dims.back());
  return out;
}

bool matmul(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0].dtype = ctx.in(0).dtype;
  if (auto d = matmul_dims(ctx, ctx.in(0), ctx.in(1))) {
    out[0].ranked = true;
    out[0].dims = std::move(*d);
  }
  return true;
}

bool gemm(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts &a = ctx.in(0), &b = ctx.in(1);
  out[0].dtype = a.dtype;
  if (!a.ranked || !b.ranked || a.dims.size() != 2 || b.dims.size() != 2) return true;
  const bool ta = attr_i(n, "transA").value_or(0) != 0, tb = attr_i(n, "transB").value_or(0) != 0;
  out[0].ranked = true;
  out[0].dims = {a.dims[ta ? 1 : 0], b.dims[tb ? 0 : 1]};
  return true;
}

// LayerNormalization / RMSNormalization: Y like X; Mean, InvStdDev with the normalized dims 1.
bool norm(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  out[0] = same_as(x);
  if (out.size() > 1 && x.ranked) {
    const int64_t r = static_cast<int64_t>(x.dims.size());
    auto axis = norm_axis(attr_i(n, "axis").value_or(-1), r);
    if (!axis) return false;
    const int32_t stash = static_cast<int32_t>(attr_i(n, "stash_type").value_or(kFloat));
    for (size_t i = 1; i < out.size(); ++i) {
      out[i].dtype = stash;
      out[i].ranked = true;
      out[i].dims = x.dims;
      for (size_t d = static_cast<size_t>(*axis); d < x.dims.size(); ++d) {
        out[i].dims[d] = DimExpr::constant(1);
      }
    }
  }
  return true;
}

bool is_arg_reduce(const Node& n) {
  return n.op_type == "ArgMax" || n.op_type == "ArgMin";
}

// The reduced axes of an op: ArgMax/ArgMin's `axis`, the `axes` attribute or input; nullopt
// for all (or none, with noop_with_empty_axes). `unknown`: the axes input is not known.
std::optional<std::vector<int64_t>> reduce_axes(const Node& n, RuleContext& ctx, bool* unknown) {
  if (is_arg_reduce(n)) return std::vector<int64_t>{attr_i(n, "axis").value_or(0)};
  auto axes = attr_is(n, "axes");
  if (!axes && ctx.present(1)) {
    axes = ctx.ints(1);
    *unknown = !axes;
  }
  return axes;
}

// ReduceProd(Shape(x)) is x's element count (TorchScript's numel()); ReduceSum a sum of sizes:
// the value of a 1-D int shape value reduced whole.
void reduce_shape_value(const Node& n, const Facts& x, Facts& out) {
  const bool prod = n.op_type == "ReduceProd", sum = n.op_type == "ReduceSum";
  if (!(prod || sum) || !x.has_value || (x.dtype != kInt64 && x.dtype != kInt32)) return;
  std::optional<DimExpr> acc = DimExpr::constant(prod ? 1 : 0);
  for (size_t i = 0; acc && i < x.value.size(); ++i) {
    acc = prod ? DimExpr::mul(*acc, x.value[i]) : DimExpr::add(*acc, x.value[i]);
  }
  if (acc && (x.dtype == kInt64 || fits_int32(*acc))) {
    out.has_value = true;
    out.value = {*acc};
  }
}

bool reduce(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  out[0].dtype = is_arg_reduce(n) ? kInt64 : x.dtype;
  if (!x.ranked) return true;
  const int64_t r = static_cast<int64_t>(x.dims.size());
  const bool keep = attr_i(n, "keepdims").value_or(1) != 0;
  bool unknown = false;
  std::optional<std::vector<int64_t>> axes = reduce_axes(n, ctx, &unknown);
  if (unknown) return true;
  std::vector<bool> reduced(static_cast<size_t>(r), false);
  if (!axes || axes->empty()) {
    if (attr_i(n, "noop_with_empty_axes").value_or(0) != 0) {
      out[0] = same_as(x);
      return true;
    }
    reduced.assign(static_cast<size_t>(r), true);
  }
  for (int64_t a : axes ? *axes : std::vector<int64_t>{}) {
    auto na = norm_axis(a, r);
    if (!na) return false;
    reduced[static_cast<size_t>(*na)] = true;
  }
  out[0].ranked = true;
  for (int64_t i = 0; i < r; ++i) {
    if (!reduced[static_cast<size_t>(i)]) {
      out[0].dims.push_back(x.dims[static_cast<size_t>(i)]);
    } else if (keep) {
      out[0].dims.push_back(DimExpr::constant(1));
    }
  }
  if (r == 1 && reduced[0]) reduce_shape_value(n, x, out[0]);
  return true;
}

bool gather_elements(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(1), ctx.in(0).dtype);
  return true;
}

bool gather_nd(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts &data = ctx.in(0), &idx = ctx.in(1);
  out[0].dtype = data.dtype;
  if (!data.ranked || !idx.ranked || idx.dims.empty()) return true;
  auto k = idx.dims.back().constant_value();
  const int64_t b = attr_i(n, "batch_dims").value_or(0);
  if (!k || b < 0 || b + *k > static_cast<int64_t>(data.dims.size())) return true;
  out[0].ranked = true;
  out[0].dims.assign(idx.dims.begin(), idx.dims.end() - 1);
  out[0].dims.insert(out[0].dims.end(), data.dims.begin() + b + *k, data.dims.end());
  return true;
}

bool dropout(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0));
  if (out.size() > 1) out[1] = same_as(ctx.in(0), kBool);
  return true;
}

bool softmax_like(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = same_as(ctx.in(0));
  return true;
}

}  // namespace

void add_math_rules(RuleTable& t) {
  for (const char* op :
       {"Neg",      "Abs",      "Sqrt", "Reciprocal",  "Exp",       "Log",       "Sigmoid", "Tanh",
        "Relu",     "Erf",      "Sin",  "Cos",         "Floor",     "Ceil",      "Round",   "Sign",
        "Softplus", "Softsign", "Gelu", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu",     "Selu",
        "Celu",     "Mish",     "Clip", "Trilu",       "CumSum",    "Tan",       "Asin",    "Acos",
        "Atan",     "Sinh",     "Cosh", "Asinh",       "Acosh",     "Atanh"}) {
    t.push_back({op, unary});
  }
  for (const char* op : {"IsNaN", "IsInf"}) t.push_back({op, unary_bool});
  t.push_back({"Not", not_rule});
  for (const char* op :
       {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"}) {
    t.push_back({op, comparison});
  }
  t.push_back({"Mod", mod_rule});
  for (const char* op : {"Max", "Min", "Sum", "Mean", "BitwiseAnd", "BitwiseOr"}) {
    t.push_back({op, variadic});
  }
  for (const char* op : {"Softmax", "LogSoftmax", "Hardmax"}) t.push_back({op, softmax_like});
  for (const char* op :
       {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceL1",
        "ReduceSumSquare", "ReduceLogSumExp", "ArgMax", "ArgMin"}) {
    t.push_back({op, reduce});
  }
  t.insert(t.end(), {{"Add", arith<add_fn>},
                     {"Sub", arith<sub_fn>},
                     {"Mul", arith<mul_fn>},
                     {"Div", arith<div_fn>},
                     {"Pow", pow_rule},
                     {"Where", where},
                     {"MatMul", matmul},
                     {"Gemm", gemm},
                     {"LayerNormalization", norm},
                     {"RMSNormalization", norm},
                     {"GatherElements", gather_elements},
                     {"GatherND", gather_nd},
                     {"Dropout", dropout}});
}

}  // namespace fastopt::analysis::rules
