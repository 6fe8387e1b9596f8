// Conv followed by an activation -> com.microsoft FusedConv (ONNX Runtime only).
//
//    x   W  [b]                        x   W  [b]
//     \  |  /                           \  |  /
//      Conv                ==>         FusedConv   activation = the activation's op type
//       |                                  |       activation_params = [alpha] (LeakyRelu),
//   Relu | LeakyRelu | Clip |              y           [min, max] (Clip),
//   Sigmoid | Tanh | HardSigmoid                       [alpha, beta] (HardSigmoid)
//       |
//       y
//
// Every CNN export has Conv -> Relu (Clip(0, 6) for MobileNets' ReLU6); with fuse_conv_bn run
// first, Conv -> BN -> Relu ends here too. ORT applies the activation inside the convolution's
// output loop instead of another pass over memory. FusedConv's CPU kernel is float only, so
// other dtypes stay; target "onnx" gets no rules (FusedConv is a contrib op). The CUDA EP's
// FusedConv takes Relu only: other activations would run on the CPU there.
#include <limits>

#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// activation_params for `act`, or nullopt when they are not constants.
std::optional<std::vector<float>> activation_params(const Node* act) {
  const std::string& op = act->op_type;
  if (op == "LeakyRelu") return std::vector<float>{float_attr(act, "alpha", 0.01f)};
  if (op == "HardSigmoid") {
    return std::vector<float>{float_attr(act, "alpha", 0.2f), float_attr(act, "beta", 0.5f)};
  }
  if (op == "Clip") {
    // Opset < 11: min/max attributes; from 11 on: optional inputs 1 and 2.
    float lo = float_attr(act, "min", std::numeric_limits<float>::lowest());
    float hi = float_attr(act, "max", std::numeric_limits<float>::max());
    const auto& in = act->inputs();
    for (size_t i = 1; i < in.size() && i < 3; ++i) {
      if (!in[i]) continue;
      auto v = constant_scalar(in[i]);
      if (!v) return std::nullopt;
      (i == 1 ? lo : hi) = static_cast<float>(*v);
    }
    return std::vector<float>{lo, hi};
  }
  return std::vector<float>{};  // Relu, Sigmoid, Tanh
}

std::vector<Rule> rules(const PassContext& ctx) {
  if (ctx.target != Target::kOrt) return {};
  auto p = std::make_shared<Pattern>("fuse_conv_activation");
  P conv = p->op("Conv", {p->var("x"), p->var("w")}).extra_inputs();  // optional bias
  P act = p->op_any({"Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid"}, {conv})
              .extra_inputs();  // Clip's min/max
  p->root(act);

  RewriteFn rewrite = [=](const Match& m, Rewriter& rw) -> Replacement {
    Node* conv_node = m.node(conv);
    Node* act_node = m.node(act);
    if (conv_node->graph() != &rw.graph()) return rw.fail("the producer is in an enclosing graph");
    // Float only: look at every value whose type says something.
    bool known = false;
    for (const Value* v : {conv_node->outputs()[0], m.value("x"), m.value("w")}) {
      const int32_t t = value_dtype(v);
      if (t == 0) continue;
      if (t != kFloat) return rw.fail("dtype " + dtype_name(t) + " (FusedConv's kernel is float)");
      known = true;
    }
    if (!known) return rw.fail("the dtype is unknown");
    auto params = activation_params(act_node);
    if (!params) return rw.fail("Clip's min/max are not constants");

    std::vector<Attribute> attrs;
    for (const Attribute& a : conv_node->attributes) attrs.push_back(copy_attribute(a));
    attrs.push_back(attr_string("activation", act_node->op_type));
    if (!params->empty()) attrs.push_back(attr_floats("activation_params", *params));
    std::vector<Value*> inputs = conv_node->inputs();
    while (!inputs.empty() && !inputs.back()) inputs.pop_back();
    Value* y = rw.op1("FusedConv", inputs, std::move(attrs), kMsDomain);
    import_domain(rw.graph(), kMsDomain);
    return std::vector<Value*>{y};
  };
  return {{"fuse_conv_activation", p, rewrite}};
}

const PassRegistrar kRegister{
    rule_pass("fuse_conv_activation",
              "fuse Conv + Relu/LeakyRelu/Clip/Sigmoid/Tanh/HardSigmoid into com.microsoft "
              "FusedConv (target ort, float)",
              {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
