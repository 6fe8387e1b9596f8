// GELU written out elementwise -> one GELU op.
//
//   erf form (PyTorch nn.GELU(), BERT, GPT-NeoX; TorchScript exports and older dynamo ones):
//
//     x --> Div(1.41421) | Mul(0.70711) --> Erf --> Add(1) = t --+
//     |                                                           v
//     +--------------------------------------------------> Mul(x, t) --> Mul(0.5) --> y
//
//   tanh form (nn.GELU(approximate="tanh"): GPT-2, Gemma):
//
//     x --> Pow(3) | Mul(Mul(x, x), x) --> Mul(0.044715) --> Add(x) --> Mul(0.79788)
//       --> Tanh --> Add(1) = t;  y = Mul(x, t) & Mul(0.5)
//   or the Megatron / OpenAI spelling 0.79788·x·(1 + 0.044715·x·x):
//       Mul(Mul(x, 0.79788), Add(Mul(Mul(x, 0.044715), x), 1)) --> Tanh --> Add(1) = t
//
//   The 0.5 multiplies last (Mul(Mul(x, t), 0.5)), x first (Mul(Mul(x, 0.5), t), GPT-2), or t
//   (Mul(x, Mul(t, 0.5))); operand order is free everywhere.
//
//   ==>  target ort:  com.microsoft Gelu (erf) / FastGelu (tanh)
//        target onnx: Gelu-20 (approximate "none" / "tanh"); needs default opset >= 20
//
// Dynamo exports at opset >= 20 already emit Gelu-20. It is left alone: on ORT CPU, Gelu-20 and
// com.microsoft Gelu/FastGelu run at the same speed (0.38 vs 0.37 ms erf, 0.45 vs 0.45 ms tanh on
// [1,128,4864] fp32), and ORT's own BiasGelu fusion accepts Gelu-20 (fuse_bias_gelu does too).
// Constants are checked with a relative tolerance of 1e-3 so fp16 exports (whose constants are
// rounded to half precision) fuse as well; the fused op uses the exact GELU constants.
#include <cmath>

#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// A single-element constant within a relative tolerance of `value`. Single element only: a
// splat of a larger shape could broadcast x to a bigger output.
P near(Pattern& p, const std::string& name, double value) {
  return p.constant(
      name,
      [value](const std::vector<double>& v) {
        return v.size() == 1 && std::fabs(v[0] - value) <= 1e-3 * std::fabs(value);
      },
      "single-element constant ~= " + std::to_string(value));
}

P mul(Pattern& p, P a, P b) {
  return p.op("Mul", {a, b}).commutative();
}

// Add(Erf(x / sqrt2), 1)
P erf_term(Pattern& p, P x) {
  P scaled = p.alt("x_over_sqrt2", {p.op("Div", {x, near(p, "sqrt2", std::sqrt(2.0))}),
                                    mul(p, x, near(p, "inv_sqrt2", std::sqrt(0.5)))});
  return p.op("Add", {p.op("Erf", {scaled}), near(p, "one", 1.0)}).commutative();
}

// Add(Tanh(sqrt(2/pi) * (x + 0.044715 x^3)), 1), both spellings.
P tanh_term(Pattern& p, P x) {
  const double k = std::sqrt(2.0 / M_PI), c = 0.044715;
  P cube = p.alt("x_cubed", {p.op("Pow", {x, near(p, "three", 3.0)}), mul(p, mul(p, x, x), x)});
  P standard = mul(p, p.op("Add", {x, mul(p, cube, near(p, "c", c))}).commutative(),
                   near(p, "sqrt_2_over_pi", k));
  P cx2 = p.alt("c_x_x",
                {mul(p, mul(p, x, near(p, "c", c)), x), mul(p, mul(p, x, x), near(p, "c", c))});
  P megatron = mul(p, mul(p, x, near(p, "sqrt_2_over_pi", k)),
                   p.op("Add", {cx2, near(p, "one", 1.0)}).commutative());
  P arg = p.alt("tanh_arg", {standard, megatron});
  return p.op("Add", {p.op("Tanh", {arg}), near(p, "one", 1.0)}).commutative();
}

// The three places the 0.5 can go; each is one rule (the root must be an op).
std::vector<std::shared_ptr<Pattern>> patterns(const std::string& name, P (*term)(Pattern&, P)) {
  std::vector<std::shared_ptr<Pattern>> out;
  for (int form = 0; form < 3; ++form) {
    auto p = std::make_shared<Pattern>(name);
    P x = p->var("x").dtype_in({kFloat, kFloat16});
    P t = term(*p, x);
    P half = near(*p, "half", 0.5);
    if (form == 0) p->root(mul(*p, mul(*p, x, t), half));
    if (form == 1) p->root(mul(*p, mul(*p, x, half), t));
    if (form == 2) p->root(mul(*p, x, mul(*p, t, half)));
    out.push_back(p);
  }
  return out;
}

std::vector<Rule> rules(PassContext& ctx) {
  std::vector<Rule> out;
  for (bool tanh : {false, true}) {
    const std::string name = tanh ? "fuse_gelu_tanh" : "fuse_gelu_erf";
    RewriteFn rewrite = [&ctx, tanh](const Match& m, Rewriter& rw) -> Replacement {
      Value* x = m.value("x");
      Value* y = nullptr;
      if (ctx.target == Target::kOrt) {
        y = rw.op1(tanh ? "FastGelu" : "Gelu", {x}, {}, kMsDomain);
        import_domain(rw.graph(), kMsDomain);
      } else {
        if (default_opset(*rw.graph().model()) < 20) {
          return rw.fail("default opset < 20 (Gelu-20); run convert_version first");
        }
        std::vector<Attribute> attrs;
        if (tanh) attrs.push_back(attr_string("approximate", "tanh"));
        y = rw.op1("Gelu", {x}, std::move(attrs));
      }
      ++ctx.counters[tanh ? "gelu_tanh" : "gelu_erf"];
      return std::vector<Value*>{y};
    };
    for (auto& p : patterns(name, tanh ? tanh_term : erf_term)) out.push_back({name, p, rewrite});
  }
  return out;
}

const PassRegistrar kRegister{rule_pass(
    "fuse_gelu",
    "fuse elementwise GELU (erf and tanh forms) into com.microsoft Gelu/FastGelu (target ort) "
    "or Gelu-20 (target onnx, opset >= 20)",
    {"fusion", "llm"}, rules)};

}  // namespace
}  // namespace fastopt::passes
