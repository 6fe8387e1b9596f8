// MatMul + Add on 2-D operands -> Gemm.
//
//    A [M,K]   B [K,N]                    A     B     C
//        \     /                            \   |   /
//        MatMul        C                      Gemm          C: [], [1], [N], [1,N], [M,1], [M,N]
//            \        /        ==>             |               (unidirectional broadcast to [M,N])
//               Add                            Y
//                |
//                Y
//
// `x @ W + b` written out in PyTorch exports as MatMul + Add (both exporters), as do Keras/TF
// dense layers and graphs where Gemm was decomposed. Ranks must be known from the value types;
// rank-3+ MatMuls (every LLM projection, [batch, seq, hidden]) stay as they are: Gemm is 2-D only,
// and carrying the bias in a following op is for other passes.
#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

std::vector<Rule> rules(const PassContext&) {
  auto p = std::make_shared<Pattern>("fuse_matmul_add");
  P a = p->var("A").rank(2), b = p->var("B").rank(2), c = p->var("C");
  P mm = p->op("MatMul", {a, b});
  P add = p->op("Add", {mm, c}).commutative();
  p->root(add);

  RewriteFn rewrite = [=](const Match& m, Rewriter& rw) -> Replacement {
    Value *va = m.value(a), *vb = m.value(b), *vc = m.value(c);
    if (m.node(mm)->graph() != &rw.graph()) return rw.fail("the producer is in an enclosing graph");
    if (vc == m.value(mm)) return rw.fail("the Add adds the MatMul to itself");
    if (default_opset(*rw.graph().model()) < 7) return rw.fail("opset < 7 (Gemm's broadcast attr)");
    const int32_t t = value_dtype(va);
    if (t != kFloat && t != kDouble && t != kFloat16) {
      return rw.fail("dtype " + dtype_name(t) + " (Gemm: float, double, float16)");
    }
    if (value_dtype(vb) != t || value_dtype(vc) != t) return rw.fail("operand dtypes differ");
    auto da = dims_of(va), db = dims_of(vb), dc = dims_of(vc);
    if (!da || !db || !dc) return rw.fail("a shape is unknown");
    // C must broadcast to [M, N] without growing it: each dim is 1 or equal to M / N.
    if (dc->size() > 2) return rw.fail("the bias has rank > 2");
    const Dim out[2] = {(*da)[0], (*db)[1]};
    for (size_t i = 0; i < dc->size(); ++i) {
      const Dim& d = (*dc)[dc->size() - 1 - i];
      if (!is_one(d) && !same_dim(d, out[1 - i])) {
        return rw.fail("the bias does not broadcast to [M, N] as Gemm allows");
      }
    }
    return std::vector<Value*>{rw.op1("Gemm", {va, vb, vc})};
  };
  return {{"fuse_matmul_add", p, rewrite}};
}

const PassRegistrar kRegister{rule_pass("fuse_matmul_add",
                                        "fuse 2-D MatMul + Add (bias broadcastable to [M, N]) "
                                        "into Gemm",
                                        {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
