// Residual Add + norm -> com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization
// (target ort only).
//
//   input   skip                            input  skip  gamma [beta] [bias]
//      \    /                                   \    |    |    /     /
//       Add [-> Add(bias)]  (or the bias       SkipLayerNormalization        epsilon = the norm's
//        │ \     added to input first)    ==>   SkipSimplifiedLayerNormalization
//        │  other readers (next residual)         │           │ output 3 = input + skip [+ bias]
//   LayerNormalization | SimplifiedLayerNorm      y         other readers
//        │
//        y
//
// Every transformer block adds its residual right before a norm: pre-norm decoders (llama, gpt2,
// gpt_neox, ...) also read the sum as the next residual, post-norm encoders (bert) do not. Both
// exporters emit LayerNormalization for nn.LayerNorm; SimplifiedLayerNormalization comes from
// fuse_rms_norm. When the sum has other readers they are rewired to output 3
// (input_skip_bias_sum), the way ORT's LLM builder chains its Skip norms; outputs 1 and 2 are
// left out. A 1-D constant bias added to the input (or to the sum) goes into the bias input.
//
// Shapes: input (B, S, D) (or (T, D) for the simplified op), skip the same or (1, S, D) / (S, D)
// (what the kernels broadcast); gamma, beta and bias (D). Dims the model leaves unknown are
// checked by the kernels at run time.
#include <algorithm>

#include "ir/constant.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

bool one_d_constant(const Value* v) {
  const Tensor* t = constant_tensor_view(v);
  return t && t->dims.size() == 1;
}

// Input/skip shapes as the Skip kernels accept them (input first); empty string when they fit.
std::string shape_error(const std::vector<Dim>& in, const std::vector<Dim>& skip, int64_t d,
                        bool simplified) {
  const bool in_ok = in.size() == 3 || (simplified && in.size() == 2);
  if (!in_ok) return "the input's rank is not 3 (or 2 for the simplified op)";
  if (!in.back().value || *in.back().value != d) return "the input's last dim is not gamma's";
  if (!skip.back().value || *skip.back().value != d) return "the skip's last dim is not gamma's";
  if (skip.size() == in.size()) {
    for (size_t i = 0; i + 1 < in.size(); ++i) {
      const bool batch_one = in.size() == 3 && i == 0 && skip[0].value && *skip[0].value == 1;
      if (batch_one) continue;
      if (!norm::may_equal(in[i], skip[i])) return "input and skip shapes differ";
      // The Add broadcasts a 1 against a dim that may be larger; the kernels do not.
      if (is_one(skip[i]) != is_one(in[i])) return "the Add broadcasts a dim of 1";
    }
    return "";
  }
  if (in.size() == 3 && skip.size() == 2 && norm::may_equal(in[1], skip[0]) &&
      is_one(in[1]) == is_one(skip[0])) {
    return "";
  }
  return "the skip does not broadcast to the input as the Skip kernels allow";
}

bool broadcasts_batch(const std::vector<Dim>& a, const std::vector<Dim>& b) {
  // `a` would be broadcast up by `b` (a's batch is 1, b's is not): `b` must be the input.
  if (a.size() < b.size()) return true;
  return a.size() == 3 && b.size() == 3 && a[0].value && *a[0].value == 1 &&
         !(b[0].value && *b[0].value == 1);
}

// The norm's mean / inv_std_var outputs, which the Skip ops do not give, are unused.
bool stats_unused(const Node* norm_node) {
  const auto& outs = norm_node->outputs();
  for (size_t i = 1; i < outs.size(); ++i) {
    if (outs[i] && (!outs[i]->uses().empty() || outs[i]->is_graph_output())) return false;
  }
  return true;
}

// The kernels' dtypes, the same for both Add operands, and the default stash_type.
std::string dtype_problem(const Value* a, const Value* b, int32_t dt, const Node* norm_node) {
  if (dt != kFloat && dt != kFloat16 && dt != kDouble) {
    return "dtype " + dtype_name(dt) + " (Skip norms: float, float16, double)";
  }
  if (value_dtype(a) != dt || value_dtype(b) != dt) return "the Add's dtypes differ";
  const Attribute* stash = norm_node->attribute("stash_type");
  if (stash && stash->i && *stash->i != 1) return "stash_type is not 1";
  return "";
}

// The Add's operands as input and skip, with their dims.
struct SkipOperands {
  Value* input;
  Value* skip;
  std::vector<Dim> in_dims, skip_dims;
};

// Input and skip of known shapes (the one broadcast up is the skip), normalized on the last
// axis; nullopt with the refusal in `why`.
std::optional<SkipOperands> skip_operands(Value* a, Value* b, const Node* norm_node,
                                          std::string* why) {
  auto da = norm::dims_of(a), db = norm::dims_of(b);
  if (!da || !db || da->empty() || db->empty()) {
    *why = "an Add operand's shape is unknown";
    return std::nullopt;
  }
  if (broadcasts_batch(*da, *db)) {
    std::swap(a, b);
    std::swap(da, db);
  }
  const int rank = static_cast<int>(da->size());
  const Attribute* axis = norm_node->attribute("axis");
  const int64_t ax = axis && axis->i ? *axis->i : -1;
  if (ax != -1 && ax != rank - 1) {
    *why = "the norm's axis is not the last one";
    return std::nullopt;
  }
  return SkipOperands{a, b, *da, *db};
}

// 1-D (D) parameters in the input's dtype: gamma (D from it), beta, the constant bias.
std::string params_problem(const Value* gamma, const Value* beta, const Value* bias, int32_t dt,
                           int64_t* d) {
  auto dg = gamma ? norm::dims_of(gamma) : std::nullopt;
  if (!dg || dg->size() != 1 || !dg->front().value) return "gamma is not 1-D of known size";
  *d = *dg->front().value;
  if (value_dtype(gamma) != dt) return "gamma's dtype differs from the input's";
  if (beta) {
    auto dbeta = norm::dims_of(beta);
    if (!dbeta || dbeta->size() != 1 || !dbeta->front().value || *dbeta->front().value != *d) {
      return "beta is not 1-D of gamma's size";
    }
    if (value_dtype(beta) != dt) return "beta's dtype differs from the input's";
  }
  if (bias) {
    const Tensor* t = constant_tensor_view(bias);
    if (!t || t->dims.size() != 1 || t->dims[0] != *d) return "the bias is not 1-D (D)";
    if (t->dtype() != dt) return "the bias's dtype differs from the input's";
  }
  return "";
}

// The fused node goes right after the Add, so readers of the sum placed before the norm still
// come after it; gamma/beta/bias must then be made before that point too.
bool params_made_before(const Node* add_node, const Node* norm_node,
                        const std::vector<const Value*>& params) {
  for (Node* k = add_node->next(); k && k != norm_node; k = k->next()) {
    for (const Value* o : k->outputs()) {
      if (o && std::find(params.begin(), params.end(), o) != params.end()) return false;
    }
  }
  return true;
}

// Builds the Skip op after the Add (all checks done, nothing can fail); other readers of the
// sum (the next residual Add) move to output 3.
Value* build_skip_norm(const SkipOperands& ops, Value* gamma, Value* beta, Value* bias, Value* sum,
                       Node* norm_node, Graph& g, PassContext& ctx) {
  const bool simplified = norm_node->op_type == "SimplifiedLayerNormalization";
  bool other_readers = sum->is_graph_output();
  for (const Use& u : sum->uses()) other_readers |= u.node != norm_node;
  std::vector<Value*> inputs = {ops.input, ops.skip, gamma};
  if (simplified) {
    if (bias) inputs.push_back(bias);
  } else if (beta || bias) {
    inputs.push_back(beta);
    if (bias) inputs.push_back(bias);
  }
  const std::string op = simplified ? "SkipSimplifiedLayerNormalization" : "SkipLayerNormalization";
  const std::string base = (norm_node->name.value.empty() ? op : norm_node->name.value) + "/" + op +
                           "_" + std::to_string(g.model()->next_node_id++);
  std::vector<std::string> names = {base};
  if (other_readers) names = {base, "", "", base + ":sum"};
  // Built directly (the Rewriter makes every output).
  Node* n = g.create_node(op, kMsDomain, inputs, names, sum->producer()->next());
  n->name.set(base);
  n->attributes.push_back(attr_float("epsilon", float_attr(norm_node, "epsilon", 1e-5f)));
  import_domain(g, kMsDomain);
  if (other_readers) {
    replace_value(g, sum, n->outputs()[3]);
    ++ctx.counters["skip_norm_sum_output"];
  }
  if (bias) ++ctx.counters["skip_norm_bias"];
  ++ctx.counters[simplified ? "skip_simplified_layer_norm" : "skip_layer_norm"];
  return n->outputs()[0];
}

Replacement fuse(Value* a, Value* b, Value* bias, Value* sum, const Match& m, Rewriter& rw,
                 PassContext& ctx) {
  Node* norm_node = m.root();
  Graph& g = rw.graph();
  if (sum->producer()->graph() != &g) return rw.fail("the Add is in an enclosing graph");
  const bool simplified = norm_node->op_type == "SimplifiedLayerNormalization";
  if (!stats_unused(norm_node)) return rw.fail("the norm's mean / inv_std_var output is used");
  const int32_t dt = value_dtype(sum);
  std::string why = dtype_problem(a, b, dt, norm_node);
  if (!why.empty()) return rw.fail(why);
  auto ops = skip_operands(a, b, norm_node, &why);
  if (!ops) return rw.fail(why);
  const auto& in = norm_node->inputs();
  Value* gamma = in.size() > 1 ? in[1] : nullptr;
  Value* beta = !simplified && in.size() > 2 ? in[2] : nullptr;
  int64_t d = 0;
  why = params_problem(gamma, beta, bias, dt, &d);
  if (why.empty()) why = shape_error(ops->in_dims, ops->skip_dims, d, simplified);
  if (!why.empty()) return rw.fail(why);
  if (!params_made_before(sum->producer(), norm_node, {gamma, beta, bias})) {
    return rw.fail("a norm constant is made between the Add and the norm");
  }
  return std::vector<Value*>{build_skip_norm(*ops, gamma, beta, bias, sum, norm_node, g, ctx)};
}

std::vector<Rule> rules(PassContext& ctx) {
  if (ctx.target != Target::kOrt) return {};
  std::vector<Rule> out;
  auto norm_op = [](Pattern& p, P sum) {
    return p.op_any({"LayerNormalization", "SimplifiedLayerNormalization"}, {sum, p.var("gamma")})
        .extra_inputs();  // beta
  };
  auto bias_check = [](P& v) {
    v.check([](const Value* x) { return one_d_constant(x); }, "a 1-D constant");
  };
  // 1. Add(Add(input, bias), skip): the bias added to the input first (bert's dense + residual).
  {
    auto p = std::make_shared<Pattern>("fuse_skip_norm");
    P x = p->var("input"), skip = p->var("skip"), bias = p->var("bias");
    bias_check(bias);
    P inner = p->op("Add", {x, bias}).commutative();
    P sum = p->op("Add", {inner, skip}).commutative().shared();
    p->root(norm_op(*p, sum));
    out.push_back({"fuse_skip_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     return fuse(m.value(x), m.value(skip), m.value(bias), m.value(sum), m, rw,
                                 ctx);
                   }});
  }
  // 2. Add(Add(input, skip), bias): the bias added to the sum.
  {
    auto p = std::make_shared<Pattern>("fuse_skip_norm");
    P x = p->var("input"), skip = p->var("skip"), bias = p->var("bias");
    bias_check(bias);
    P inner = p->op("Add", {x, skip});
    P sum = p->op("Add", {inner, bias}).commutative().shared();
    p->root(norm_op(*p, sum));
    out.push_back({"fuse_skip_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     return fuse(m.value(x), m.value(skip), m.value(bias), m.value(sum), m, rw,
                                 ctx);
                   }});
  }
  // 3. Add(input, skip).
  {
    auto p = std::make_shared<Pattern>("fuse_skip_norm");
    P x = p->var("input"), skip = p->var("skip");
    P sum = p->op("Add", {x, skip}).shared();
    p->root(norm_op(*p, sum));
    out.push_back({"fuse_skip_norm", p, [=, &ctx](const Match& m, Rewriter& rw) -> Replacement {
                     if (one_d_constant(m.value(x)) || one_d_constant(m.value(skip))) {
                       return rw.fail("the Add adds a constant, not a residual");
                     }
                     return fuse(m.value(x), m.value(skip), nullptr, m.value(sum), m, rw, ctx);
                   }});
  }
  return out;
}

const PassRegistrar kRegister{rule_pass(
    "fuse_skip_norm",
    "fuse residual Add (+ 1-D bias) + LayerNormalization / SimplifiedLayerNormalization into "
    "com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization (target ort)",
    {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
