// A bias Add in front of a GELU -> the GELU op that adds the bias itself (target ort).
//
//    x [.., N]   b [N] (1-D constant)
//         \     /
//          Add                                  BiasGelu(x, b)   for com.microsoft Gelu and
//           |                   ==>                              Gelu-20 (approximate "none")
//   Gelu | FastGelu | Gelu-20                   FastGelu(x, b)   for com.microsoft FastGelu (one
//           |                                                    input) and Gelu-20 "tanh"
//           y
//
// The MLP of BERT, GPT-NeoX and friends is MatMul -> Add(bias) -> GELU: TorchScript exports
// give the GELU as elementwise ops (fuse_gelu turns them into Gelu/FastGelu first), dynamo
// exports give Gelu-20. The bias must be a 1-D constant as long as x's last dim (both kernels
// broadcast it over the last axis only), and the Add must have no other reader.
//
// Measured on ORT 1.32 CPU, [1,128,4864] fp32, one thread: ORT with its optimizations on already
// fuses Add + Gelu (either domain) into BiasGelu and Add + tanh Gelu into FastGelu at load, so
// this pass changes nothing there; it is for sessions with optimizations off and for other
// runtimes (CUDA has fp16/bf16 kernels). Note that ORT CPU's BiasGelu kernel (0.71 ms) is slower
// than Add + Gelu (0.58 ms, optimizations off) at that size; FastGelu(x, b) is on par (0.63 vs
// 0.66 ms).
#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

bool is_tanh(const Node* gelu) {
  const Attribute* a = gelu->attribute("approximate");
  return a && a->s && *a->s == "tanh";
}

std::vector<Rule> rules(PassContext& ctx) {
  if (ctx.target != Target::kOrt) return {};
  std::vector<Rule> out;
  // (op type, domain): the GELU the bias Add feeds.
  const std::pair<const char*, const char*> gelus[] = {
      {"Gelu", kMsDomain}, {"FastGelu", kMsDomain}, {"Gelu", ""}};
  for (const auto& [op, domain] : gelus) {
    auto p = std::make_shared<Pattern>("fuse_bias_gelu");
    P x = p->var("x").dtype_in({kFloat, kFloat16});
    P b = p->any_constant("b").rank(1);
    P add = p->op("Add", {x, b}).commutative();
    P gelu = p->op(op, {add}, domain);
    p->root(gelu);

    RewriteFn rewrite = [&ctx, gelu](const Match& m, Rewriter& rw) -> Replacement {
      Node* g = m.node(gelu);
      Value *vx = m.value("x"), *vb = m.value("b");
      if (value_dtype(vb) != value_dtype(vx)) return rw.fail("bias dtype differs from x");
      // x itself must have the Add's shape (the bias broadcasts over the last axis only).
      if (!vx->type.has_shape || vx->type.dims.empty()) return rw.fail("x's shape is unknown");
      const Dim& last = vx->type.dims.back();
      auto bias = constant_tensor(vb);
      if (!last.value || !bias || bias->dims.size() != 1 || bias->dims[0] != *last.value) {
        return rw.fail("the bias length is not x's last dim");
      }
      const bool fast = g->op_type == "FastGelu" || is_tanh(g);
      if (g->domain.value.empty()) {
        const Attribute* a = g->attribute("approximate");
        if (a && a->s && *a->s != "none" && *a->s != "tanh") return rw.fail("unknown approximate");
      }
      Value* y = rw.op1(fast ? "FastGelu" : "BiasGelu", {vx, vb}, {}, kMsDomain);
      import_domain(rw.graph(), kMsDomain);
      ++ctx.counters[fast ? "fast_gelu_bias" : "bias_gelu"];
      return std::vector<Value*>{y};
    };
    out.push_back({"fuse_bias_gelu", p, rewrite});
  }
  return out;
}

const PassRegistrar kRegister{
    rule_pass("fuse_bias_gelu",
              "fuse Add(x, 1-D constant bias) + Gelu/FastGelu/Gelu-20 into com.microsoft "
              "BiasGelu / FastGelu(x, bias) (target ort)",
              {"fusion", "llm"}, rules)};

}  // namespace
}  // namespace fastopt::passes
