// Decomposed LayerNorm -> LayerNormalization-17 (both targets).
//
//   x ───────────┬──────────────────┐
//   ReduceMean(-1) = m              │
//        Sub(x, m) = d  (old exports duplicate the Sub)
//   [Cast]? -> Pow(·, 2) | Mul(d, d)                        x    gamma  [beta]
//   ReduceMean(-1)                                           \     |    /
//   Add(eps)                                        ==>    LayerNormalization
//   Sqrt -> [Cast]? = s                                   axis -1, epsilon = eps,
//   Div(d, s) | Mul(d, Reciprocal(s) | Div(1, s))          stash_type 1
//   Mul(gamma)                                                   │
//   [Add(beta)]?                                                 y
//        y
//
// torch.onnx exports nn.LayerNorm as LayerNormalization from opset 17 on (both exporters), so
// this fires on older exports (opset < 17 converted up), on TF/Keras graphs and on hand-written
// norms (`(x - mean) / sqrt(var + eps) * w + b`), the subgraph ORT's fusion_layernorm.py and
// onnxscript's layer-norm rule match. cohere's CohereLayerNorm is one: no bias, mean and variance
// in fp32, `(x - mean) * rsqrt(var + eps)`, which TorchScript writes as Div(1, Sqrt); without
// that form here, fuse_rms_norm took the variance half (an RMSNorm of x - mean) and left the
// mean's ReduceMean. fp16 exports may cast the centered value up before Pow and
// the root back after Sqrt. gamma and beta must be 1-D constants of the normalized size; without
// an Add(beta) the fused op has no bias input.
#include <optional>
#include <string>

#include "ir/constant.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

struct Core {
  P x, mean, var, reshape, kept, eps, norm, mean2;
};

Core core(Pattern& p) {
  Core c;
  c.x = p.var("x");
  c.mean = p.op("ReduceMean", {c.x}).extra_inputs();  // axes input from opset 18
  P d = p.op("Sub", {c.x, c.mean});
  P dc = p.optional(p.op("Cast", {d}));
  P sq = p.alt("square", {p.op("Pow", {dc, p.scalar("two", 2.0)}), p.op("Mul", {dc, dc})});
  c.var = p.op("ReduceMean", {sq}).extra_inputs();
  // dynamo's var(unbiased=False): the mean without keepdims, then a Reshape that puts the
  // reduced axis back (fuse() checks the shape it gives).
  c.reshape = p.op("Reshape", {c.var, p.var("kept_shape")});
  c.kept = p.optional(c.reshape);
  c.eps = p.var("epsilon");
  P s = p.optional(p.op("Cast", {p.op("Sqrt", {p.op("Add", {c.kept, c.eps}).commutative()})}));
  // The same Sub, or a duplicate of it (old PyTorch exports), or a Sub of a second mean of x
  // (dynamo writes var's mean and the norm's with different axes inputs, -1 and rank - 1).
  c.mean2 = p.op("ReduceMean", {c.x}).extra_inputs();
  P d2 = p.alt("centered", {d, p.op("Sub", {c.x, c.mean}), p.op("Sub", {c.x, c.mean2})});
  // 1 / s: Reciprocal (dynamo's rsqrt) or Div(1, s) (TorchScript's rsqrt, cohere's LayerNorm).
  P inv = p.alt("inverse", {p.op("Reciprocal", {s}), p.op("Div", {p.scalar("one", 1.0), s})});
  c.norm = p.alt("normalized", {p.op("Div", {d2, s}), p.op("Mul", {d2, inv}).commutative()});
  return c;
}

// The variance's mean: over the last axis, kept (keepdims 1), or dropped and put back by a
// Reshape to x's shape with 1 last (dims compared on the types: fixed sizes or the same
// symbols).
std::optional<std::string> check_variance(const Node* var, const Node* kept, const Value* x,
                                          int rank) {
  if (!kept) return norm::check_last_axis_mean(var, rank);
  if (auto e = norm::check_last_axis_mean(var, rank, false)) return e;
  const Value* y = kept->outputs()[0];
  if (rank <= 0 || value_rank(y) != rank || !x->type.has_shape) {
    return "the variance's Reshape has no known rank equal to the input's";
  }
  for (int i = 0; i < rank; ++i) {
    const Dim& a = x->type.dims[static_cast<size_t>(i)];
    const Dim& b = y->type.dims[static_cast<size_t>(i)];
    const bool last = i == rank - 1;
    const bool same = last ? (b.value && *b.value == 1)
                           : ((a.value && b.value && *a.value == *b.value) ||
                              (a.param && b.param && !a.param->empty() && *a.param == *b.param));
    if (!same) return "the variance's Reshape does not give the input's shape with 1 last";
  }
  return std::nullopt;
}

Replacement fuse(const Core& c, Value* gamma, Value* beta, const Match& m, Rewriter& rw,
                 PassContext& ctx) {
  Value* x = m.value(c.x);
  Node* mean = m.node(c.mean);
  if (mean->graph() != &rw.graph()) return rw.fail("the norm starts in an enclosing graph");
  if (default_opset(*rw.graph().model()) < 17) {
    return rw.fail("LayerNormalization needs opset >= 17");
  }
  const int32_t dt = value_dtype(x);
  if (!norm::is_float_type(dt)) return rw.fail("the input's dtype is unknown or not float");
  const int rank = value_rank(x);
  for (const Node* r : {mean, m.node(c.mean2)}) {
    if (!r) continue;
    if (auto e = norm::check_last_axis_mean(r, rank)) return rw.fail(*e);
  }
  if (auto e = check_variance(m.node(c.var), m.node(c.reshape), x, rank)) return rw.fail(*e);
  for (const Node* n : m.matched_nodes()) {
    if (n->op_type != "Cast") continue;
    const Attribute* to = n->attribute("to");
    if (!to || !to->i || !norm::is_float_type(static_cast<int32_t>(*to->i))) {
      return rw.fail("a Cast in the norm is not to a float type");
    }
  }
  auto eps = constant_scalar(m.value(c.eps));
  if (!eps) return rw.fail("epsilon is not a constant scalar");
  if (!std::isfinite(*eps) || *eps < 0 || *eps >= 1) return rw.fail("epsilon outside [0, 1)");
  auto size = norm::last_dim(x);
  if (!size) return rw.fail("the normalized (last) dim of the input is unknown");
  if (value_dtype(m.value(c.norm)) != 0 && value_dtype(m.value(c.norm)) != dt) {
    return rw.fail("the normalized value's dtype differs from the input's");
  }
  auto g = norm::scale_input(rw, gamma, *size, dt, "gamma");
  if (!g.value) return rw.fail(g.error);
  std::vector<Value*> inputs = {x, g.value};
  if (beta) {
    auto b = norm::scale_input(rw, beta, *size, dt, "beta");
    if (!b.value) return rw.fail(b.error);
    inputs.push_back(b.value);
  }
  Value* y = rw.op1("LayerNormalization", inputs, norm::norm_attrs(*eps));
  ++ctx.counters[beta ? "layer_norm" : "layer_norm_no_beta"];
  return std::vector<Value*>{y};
}

std::vector<Rule> rules(PassContext& ctx) {
  std::vector<Rule> out;
  {  // ... -> Mul(gamma) -> Add(beta)
    auto p = std::make_shared<Pattern>("fuse_layer_norm");
    Core c = core(*p);
    P gamma = p->var("gamma"), beta = p->var("beta");
    P root = p->op("Add", {p->op("Mul", {c.norm, gamma}).commutative(), beta}).commutative();
    p->root(root);
    out.push_back({"fuse_layer_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     return fuse(c, m.value(gamma), m.value(beta), m, rw, ctx);
                   }});
  }
  {  // ... -> Mul(gamma)
    auto p = std::make_shared<Pattern>("fuse_layer_norm");
    Core c = core(*p);
    P gamma = p->var("gamma");
    P root = p->op("Mul", {c.norm, gamma}).commutative();
    p->root(root);
    out.push_back({"fuse_layer_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     // An Add of a 1-D constant after it is the beta: the rule above fuses it.
                     const Value* y = m.root()->outputs()[0];
                     if (y->uses().size() == 1 && !y->is_graph_output()) {
                       const Node* next = y->uses()[0].node;
                       if (next->op_type == "Add" && next->domain.value.empty() &&
                           next->inputs().size() == 2) {
                         const Value* b = next->inputs()[next->inputs()[0] == y ? 1 : 0];
                         const Tensor* t = constant_tensor_view(b);
                         if (t && t->dims.size() == 1)
                           return rw.fail("deferred: an Add(beta) follows");
                       }
                     }
                     return fuse(c, m.value(gamma), nullptr, m, rw, ctx);
                   }});
  }
  return out;
}

const PassRegistrar kRegister{
    rule_pass("fuse_layer_norm",
              "fuse decomposed LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div + Mul(gamma) "
              "[+ Add(beta)]) into LayerNormalization-17",
              {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
