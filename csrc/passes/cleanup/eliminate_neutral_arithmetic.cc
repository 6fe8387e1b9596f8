// x * 1, 1 * x, x + 0, 0 + x, x - 0, x / 1  ->  x
//
//   x ──┐
//       Mul ── y        (c: a constant whose every element is the neutral value)
//   c ──┘
//
// Exporters leave these behind (a rotary scaling of 1.0, a norm weight or bias that is all ones
// or zeros in a freshly initialized model). The rewrite is only exact when broadcasting `c`
// cannot change x's shape: every dim of c must be 1 or equal to x's (known) dim, and c
// may not have more dims than x. x + 0 maps -0.0 to +0.0, which compares equal.
#include <cmath>

#include "ir/constant.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// True when y = op(x, c) has x's shape. (The type is x's already: these ops take one type.)
bool broadcast_keeps_shape(const Value* x, const Tensor& c) {
  if (c.dims.empty()) return true;  // a scalar never changes the shape
  const int xr = value_rank(x);
  const int cr = static_cast<int>(c.dims.size());
  if (xr < cr) return false;
  for (int i = 1; i <= cr; ++i) {
    const int64_t cd = c.dims[cr - i];
    if (cd == 1) continue;
    const Dim& xd = x->type.dims[xr - i];
    if (!xd.value || *xd.value != cd) return false;
  }
  return true;
}

Rule neutral(const std::string& name, const std::string& op, double value, bool commutative) {
  auto p = std::make_shared<Pattern>(name);
  P x = p->var("x");
  P c = p->scalar("c", value, 0.0);
  P root = p->op(op, {x, c});
  if (commutative) root.commutative();
  p->root(root);
  return {name, p, [](const Match& m, Rewriter& rw) -> Replacement {
            Value* x = m.value("x");
            Value* y = m.root()->outputs()[0];
            auto c = constant_tensor(m.value("c"));
            if (!c || !broadcast_keeps_shape(x, *c)) {
              return rw.fail("broadcasting the constant could change x's shape");
            }
            if (!can_replace(rw.graph(), y, x))
              return rw.fail("y is a graph output x cannot rename into");
            return std::vector<Value*>{x};
          }};
}

std::vector<Rule> rules(const PassContext&) {
  return {neutral("mul_by_one", "Mul", 1.0, true), neutral("add_zero", "Add", 0.0, true),
          neutral("sub_zero", "Sub", 0.0, false), neutral("div_by_one", "Div", 1.0, false)};
}

const PassRegistrar kRegister{rule_pass("eliminate_neutral_arithmetic",
                                        "remove x*1, x+0, x-0 and x/1 when broadcasting keeps x",
                                        {"cleanup"}, rules)};

}  // namespace
}  // namespace fastopt::passes
