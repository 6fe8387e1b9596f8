// Identity(x) -> x, and Dropout(x) in inference mode -> x.
//
// Exporters leave Identity nodes behind to rename values, and inference-mode Dropout is an
// identity too (its mask output must be unused). A graph output keeps its name: when it cannot
// move onto `x` (x is a graph input, say), the node stays.
#include "ir/constant.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

Replacement forward_input(const Match& m, Rewriter& rw) {
  Value* x = m.value("x");
  Value* y = m.root()->outputs()[0];
  if (!can_replace(rw.graph(), y, x))
    return rw.fail("the output is a graph output that x cannot rename into");
  return std::vector<Value*>{x};
}

std::vector<Rule> rules(const PassContext&) {
  std::vector<Rule> out;
  {
    auto p = std::make_shared<Pattern>("eliminate_identity");
    p->root(p->op("Identity", {p->var("x")}));
    out.push_back({"eliminate_identity", p, forward_input});
  }
  {
    // Dropout(x [, ratio [, training_mode]]): an identity unless training_mode is a true constant.
    auto p = std::make_shared<Pattern>("eliminate_dropout");
    p->root(p->op("Dropout", {p->var("x")}).extra_inputs());
    out.push_back({"eliminate_dropout", p, [](const Match& m, Rewriter& rw) -> Replacement {
                     Node* d = m.root();
                     if (d->inputs().size() > 2 && d->inputs()[2]) {
                       auto training = constant_scalar(d->inputs()[2]);
                       if (!training) return rw.fail("training_mode is not a constant");
                       if (*training != 0) return rw.fail("training_mode is true");
                     }
                     if (auto* a = d->attribute("is_test"); a && a->i && *a->i == 0) {
                       // Opset < 7: is_test=0 means training.
                       return rw.fail("is_test is 0 (training)");
                     }
                     return forward_input(m, rw);
                   }});
  }
  return out;
}

const PassRegistrar kRegister{rule_pass(
    "eliminate_identity", "remove Identity and inference-mode Dropout nodes", {"cleanup"}, rules)};

}  // namespace
}  // namespace fastopt::passes
