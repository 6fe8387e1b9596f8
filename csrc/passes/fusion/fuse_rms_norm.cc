// Decomposed RMSNorm -> SimplifiedLayerNormalization (target ort) or RMSNormalization-23
// (target onnx).
//
//   x ─────────────────────────────────────────┐
//   │                                          │
//   Pow(·, 2) | Mul(x, x)                      │
//   ReduceMean(axes = [-1], keepdims = 1)      │
//   Add(eps)                                   │        x [Cast to T]      scale (T)
//   Sqrt                                       │           \             /
//   Div(1, ·) | Reciprocal                     │    ==>   SimplifiedLayerNormalization |
//   RMSNormalization
//        \________________ Mul ________________┘            axis -1, epsilon = eps, stash_type 1
//                           │                                   │
//                        [Cast]?                             [Cast]?   (when the output dtype
//                           │                                   │       differs from the input's)
//                    [Mul(weight)]?                             y
//                           │
//                        [Cast]?
//                           y
//
// (or Div(x, Sqrt) directly, as hand-written norms do.)
//
// Every HF decoder with LlamaRMSNorm (llama, mistral, qwen2, phi3, gemma) exports this. TorchScript
// writes `Div(1, Sqrt)`, dynamo `Reciprocal(Sqrt)`; ReduceMean takes its axes as an attribute
// before opset 18 and as an input from 18 on. fp16 models compute the norm in fp32: a Cast up
// before Pow and a Cast back either before the weight Mul (llama) or after it (gemma:
// `(x * (1 + w)).to(dtype)`, the 1 + w already folded by cleanup). Without a weight Mul (a weight
// of ones removed by cleanup) the scale is a constant of ones.
//
// When the input was cast up from the dtype the output is cast back to, the fused op takes the
// original input (it computes in fp32 itself, stash_type 1) and both Casts go. ORT's CPU kernel
// wants X and scale of one dtype: the weight is converted only when it differs.
#include "ir/constant.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

struct Core {
  P x, mean, eps, n;
};

// True when `x` is Sub(a, ReduceMean(a)) over the last axis: x is centered, and an RMSNorm of it
// is the variance half of a LayerNorm, which fuse_layer_norm fuses whole (taking the half here
// would leave the mean's ReduceMean and Sub behind it).
bool is_centered(const Value* x) {
  const Node* sub = x->producer();
  if (!sub || sub->op_type != "Sub" || !sub->domain.value.empty() || sub->inputs().size() != 2) {
    return false;
  }
  const Node* mean = sub->inputs()[1] ? sub->inputs()[1]->producer() : nullptr;
  if (!mean || mean->op_type != "ReduceMean" || !mean->domain.value.empty() ||
      mean->inputs().empty() || mean->inputs()[0] != sub->inputs()[0]) {
    return false;
  }
  return !norm::check_last_axis_mean(mean, value_rank(sub->inputs()[0]));
}

// The shared part: x -> ... -> Mul(x, 1 / sqrt(mean(x^2) + eps)), or with `div`,
// Div(x, sqrt(mean(x^2) + eps)) (hand-written norms).
Core core(Pattern& p, bool div) {
  Core c;
  c.x = p.var("x");
  P sq = p.alt("square", {p.op("Pow", {c.x, p.scalar("two", 2.0)}), p.op("Mul", {c.x, c.x})});
  c.mean = p.op("ReduceMean", {sq}).extra_inputs();  // axes input from opset 18
  c.eps = p.var("epsilon");
  P sqrt = p.op("Sqrt", {p.op("Add", {c.mean, c.eps}).commutative()});
  if (div) {
    c.n = p.op("Div", {c.x, sqrt});
    return c;
  }
  P inv =
      p.alt("reciprocal", {p.op("Div", {p.scalar("one", 1.0), sqrt}), p.op("Reciprocal", {sqrt})});
  c.n = p.op("Mul", {c.x, inv}).commutative();
  return c;
}

// The single reader of `v`, or null.
Node* only_reader(const Value* v) {
  if (v->is_graph_output() || v->uses().size() != 1) return nullptr;
  return v->uses()[0].node;
}

// True when `n` is a Mul of `in` by a 1-D constant of `size` elements (a weight Mul).
bool is_weight_mul(const Node* n, const Value* in, std::optional<int64_t> size) {
  if (!n || n->op_type != "Mul" || !n->domain.value.empty() || n->inputs().size() != 2) {
    return false;
  }
  const Value* w = n->inputs()[0] == in ? n->inputs()[1] : n->inputs()[0];
  auto t = constant_tensor_view(w);
  return t && t->dims.size() == 1 && size && t->dims[0] == *size;
}

bool is_float_cast(const Node* n) {
  if (!n || n->op_type != "Cast" || !n->domain.value.empty()) return false;
  const Attribute* to = n->attribute("to");
  return to && to->i && norm::is_float_type(static_cast<int32_t>(*to->i));
}

int32_t cast_to(const Node* n) {
  return static_cast<int32_t>(*n->attribute("to")->i);
}

std::vector<Attribute> cast_attrs(int32_t to) {
  std::vector<Attribute> a;
  a.push_back(attr_int("to", to));
  return a;
}

// What follows the core in one variant of the pattern.
struct Tail {
  Node* cast_mid = nullptr;  // Cast between the core and the weight Mul
  Value* weight = nullptr;
  Node* cast_out = nullptr;  // Cast after the weight Mul (or after the core, without weight)
};

// The core's checks: one graph, a float input, a last-axis mean, not a LayerNorm's variance,
// an epsilon in [0, 1), a known normalized dim. "" or the refusal.
std::string core_problem(const Core& c, const Match& m, Rewriter& rw) {
  Value* x = m.value(c.x);
  Node* mean = m.node(c.mean);
  if (mean->graph() != &rw.graph()) return "the norm starts in an enclosing graph";
  if (!norm::is_float_type(value_dtype(x))) return "the input's dtype is unknown or not float";
  if (auto e = norm::check_last_axis_mean(mean, value_rank(x))) return *e;
  if (is_centered(x) && default_opset(*rw.graph().model()) >= 17) {
    return "the input is x - ReduceMean(x): a LayerNorm's variance (fuse_layer_norm)";
  }
  auto eps = constant_scalar(m.value(c.eps));
  if (!eps) return "epsilon is not a constant scalar";
  if (!std::isfinite(*eps) || *eps < 0 || *eps >= 1) return "epsilon outside [0, 1)";
  if (!norm::last_dim(x)) return "the normalized (last) dim of the input is unknown";
  return "";
}

// An input cast up from the dtype the output is cast back to: the original input (a down-cast
// is kept: the norm of the rounded input is what the model computes); else x.
Value* norm_input(Value* x, int32_t out_dt, const Graph& g) {
  Node* up = x->producer();
  const int32_t xdt = value_dtype(x);
  if (out_dt != xdt && is_float_cast(up) && up->graph() == &g &&
      value_dtype(up->inputs()[0]) == out_dt && dtype_bits(out_dt) < dtype_bits(xdt)) {
    return up->inputs()[0];
  }
  return x;
}

// The fused op for the target (in_dt: its input's dtype), or "" with the refusal in `why`.
std::string norm_op(const PassContext& ctx, const Graph& g, int32_t in_dt, std::string* why) {
  if (ctx.target == Target::kOnnx) {
    if (default_opset(*g.model()) >= kFusedOpsOpset) return "RMSNormalization";
    *why = "RMSNormalization needs opset >= 23 (run convert_version first)";
    return "";
  }
  if (in_dt != kBFloat16) return "SimplifiedLayerNormalization";
  *why = "bfloat16 (no CPU kernel for the ORT op)";
  return "";
}

// The scale input: the weight (in the input's dtype) or ones; null with the refusal in `why`.
Value* norm_scale(const Tail& t, int64_t size, int32_t weight_dt, int32_t in_dt, Rewriter& rw,
                  PassContext& ctx, std::string* why) {
  if (!t.weight) {
    auto ones = norm::ones(in_dt, size);
    if (!ones) {
      *why = "no ones scale for dtype " + dtype_name(in_dt);
      return nullptr;
    }
    ++ctx.counters["rms_norm_ones_scale"];
    return rw.initializer("rms_norm_ones", ones);
  }
  if (value_dtype(t.weight) != weight_dt) {
    *why = "the weight's dtype differs";
    return nullptr;
  }
  auto s = norm::scale_input(rw, t.weight, size, in_dt, "the weight");
  if (!s.value) {
    *why = s.error;
    return nullptr;
  }
  if (s.converted) ++ctx.counters["rms_norm_scale_converted"];
  return s.value;
}

Replacement fuse(const Core& c, const Tail& t, const Match& m, Rewriter& rw, PassContext& ctx) {
  if (std::string why = core_problem(c, m, rw); !why.empty()) return rw.fail(why);
  Value* x = m.value(c.x);
  const double eps = *constant_scalar(m.value(c.eps));
  const int64_t size = *norm::last_dim(x);
  if (t.cast_mid && !is_float_cast(t.cast_mid)) return rw.fail("the Cast is not to a float");
  // Output dtype: the input's, changed by each Cast of the tail.
  int32_t out_dt = value_dtype(x);
  if (t.cast_mid) out_dt = cast_to(t.cast_mid);
  const int32_t weight_dt = out_dt;
  if (t.cast_out) out_dt = cast_to(t.cast_out);
  Value* in = norm_input(x, out_dt, rw.graph());
  const int32_t in_dt = value_dtype(in);
  std::string why;
  const std::string op = norm_op(ctx, rw.graph(), in_dt, &why);
  if (op.empty()) return rw.fail(why);
  Value* scale = norm_scale(t, size, weight_dt, in_dt, rw, ctx, &why);
  if (!scale) return rw.fail(why);
  Value* y = rw.op1(op, {in, scale}, norm::norm_attrs(eps));
  if (in_dt != out_dt) y = rw.op1("Cast", {y}, cast_attrs(out_dt));
  ++ctx.counters["rms_norm"];
  return std::vector<Value*>{y};
}

void add_rules(std::vector<Rule>& out, PassContext& ctx, bool div) {
  // 1. core [-> Cast] -> Mul(weight)
  {
    auto p = std::make_shared<Pattern>("fuse_rms_norm");
    Core c = core(*p, div);
    P cast_mid = p->op("Cast", {c.n});
    P w = p->var("weight");
    P root = p->op("Mul", {p->optional(cast_mid), w}).commutative();
    p->root(root);
    out.push_back({"fuse_rms_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     // A float Cast after the weight Mul belongs to rule 2 (gemma's order).
                     if (is_float_cast(only_reader(m.root()->outputs()[0]))) {
                       return rw.fail("deferred: a Cast follows the weight Mul");
                     }
                     return fuse(c, Tail{m.node(cast_mid), m.value(w), nullptr}, m, rw, ctx);
                   }});
  }
  // 2. core -> Mul(weight) -> Cast
  {
    auto p = std::make_shared<Pattern>("fuse_rms_norm");
    Core c = core(*p, div);
    P w = p->var("weight");
    P root = p->op("Cast", {p->op("Mul", {c.n, w}).commutative()});
    p->root(root);
    out.push_back({"fuse_rms_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     if (!is_float_cast(m.root())) return rw.fail("the Cast is not to a float");
                     return fuse(c, Tail{nullptr, m.value(w), m.root()}, m, rw, ctx);
                   }});
  }
  // 3. core -> Cast (no weight)
  {
    auto p = std::make_shared<Pattern>("fuse_rms_norm");
    Core c = core(*p, div);
    P root = p->op("Cast", {c.n});
    p->root(root);
    out.push_back({"fuse_rms_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     if (!is_float_cast(m.root())) return rw.fail("the Cast is not to a float");
                     const Value* y = m.root()->outputs()[0];
                     if (is_weight_mul(only_reader(y), y, norm::last_dim(m.value(c.x)))) {
                       return rw.fail("deferred: a weight Mul follows");
                     }
                     return fuse(c, Tail{nullptr, nullptr, m.root()}, m, rw, ctx);
                   }});
  }
  // 4. core alone (no weight)
  {
    auto p = std::make_shared<Pattern>("fuse_rms_norm");
    Core c = core(*p, div);
    p->root(c.n);
    out.push_back({"fuse_rms_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     const Value* y = m.root()->outputs()[0];
                     Node* next = only_reader(y);
                     if (is_weight_mul(next, y, norm::last_dim(m.value(c.x)))) {
                       return rw.fail("deferred: a weight Mul follows");
                     }
                     if (is_float_cast(next)) return rw.fail("deferred: a Cast follows");
                     return fuse(c, Tail{}, m, rw, ctx);
                   }});
  }
}

std::vector<Rule> rules(PassContext& ctx) {
  std::vector<Rule> out;
  for (bool div : {false, true}) add_rules(out, ctx, div);
  return out;
}

const PassRegistrar kRegister{rule_pass(
    "fuse_rms_norm",
    "fuse decomposed RMSNorm (Pow/ReduceMean/Add/Sqrt/Div|Reciprocal/Mul [+ weight Mul, Casts]) "
    "into SimplifiedLayerNormalization (ort) or RMSNormalization-23 (onnx)",
    {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
