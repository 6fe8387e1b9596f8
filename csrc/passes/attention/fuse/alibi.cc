// ALiBi attention's flat heads and bias (alibi.h has the forms and why they are exact).
#include "passes/attention/fuse/alibi.h"

#include <optional>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/shapes.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::alibi {
namespace {
using analysis::DimExpr;
using analysis::ShapeFacts;

std::optional<DimExpr> product(ShapeFacts& facts, const Value* v, int a, int b) {
  auto x = facts.dim(v, a), y = facts.dim(v, b);
  if (!x || !y) return std::nullopt;
  return DimExpr::mul(*x, *y);
}

bool equal(const std::optional<DimExpr>& a, const std::optional<DimExpr>& b) {
  return a && b && *a == *b;
}

// (B*H, L, D) of `x3` against (B, H, L, D) of `x4`: the same elements in the same order.
bool flat_of(const Value* x3, const Value* x4, ShapeFacts& facts) {
  if (facts.rank(x3) != 3 || facts.rank(x4) != 4) return false;
  return equal(facts.dim(x3, 0), product(facts, x4, 0, 1)) && facts.same_dim(x3, 1, x4, 2) &&
         facts.same_dim(x3, 2, x4, 3);
}

Value* ints(pattern::Rewriter& rw, const std::vector<int64_t>& v) {
  return rw.initializer("alibi_shape", make_int64_tensor(v, {static_cast<int64_t>(v.size())}));
}

}  // namespace

Value* unflatten_heads(Value* x3, ShapeFacts& facts, Node** reshape) {
  Node* r = x3 ? x3->producer() : nullptr;
  if (!r || r->op_type != "Reshape" || !is_standard(r) || r->inputs().size() != 2) return nullptr;
  Value* x4 = r->inputs()[0];
  if (!x4 || !flat_of(x3, x4, facts)) return nullptr;
  *reshape = r;
  return x4;
}

bool splits_heads(const Value* x3, const Value* x4, const Value* heads_of, ShapeFacts& facts) {
  return flat_of(x3, x4, facts) && facts.same_dim(x4, 1, heads_of, 1);
}

bool merges_heads(const Value* x4, const Value* x3, ShapeFacts& facts) {
  return flat_of(x3, x4, facts);
}

FlatBias flat_bias_form(const Value* bias3, const Value* scores3, ShapeFacts& facts,
                        std::string* why) {
  if (facts.rank(bias3) != 3) {
    *why = "the bias on the flat (B*H, S, T) scores is not 3-D";
    return FlatBias::kNone;
  }
  if (facts.same_dim(bias3, 0, scores3, 0)) return FlatBias::kReshape;
  if (facts.known_dim(bias3, 0) == 1) return FlatBias::kUnsqueeze;
  *why = "the bias's dim 0 is proven neither B*H nor 1";
  return FlatBias::kNone;
}

Value* bias_4d(pattern::Rewriter& rw, Value* bias3, FlatBias form, int64_t heads) {
  if (form == FlatBias::kUnsqueeze) return rw.op1("Unsqueeze", {bias3, ints(rw, {0})});
  // (B*H, X, T) -> (B, H, X, T): dims 1 and 2 copied from the bias's own shape.
  std::vector<Attribute> start;
  start.push_back(pattern::attr_int("start", 1));
  Value* tail = rw.op1("Shape", {bias3}, std::move(start));
  Value* target = rw.op1("Concat", {ints(rw, {-1, heads}), tail}, [] {
    std::vector<Attribute> a;
    a.push_back(pattern::attr_int("axis", 0));
    return a;
  }());
  return rw.op1("Reshape", {bias3, target});
}

Node* flat_candidate(Node* root) {
  if (!is_standard(root) || root->op_type != "Reshape" || root->inputs().size() != 2) {
    return nullptr;
  }
  Node* mm = root->inputs()[0] ? root->inputs()[0]->producer() : nullptr;
  if (!mm || mm->op_type != "MatMul" || !is_standard(mm) || mm->inputs().size() != 2) {
    return nullptr;
  }
  const Node* r = mm->inputs()[0] ? mm->inputs()[0]->producer() : nullptr;
  if (!r || r->op_type != "Reshape" || !is_standard(r) || r->inputs().empty()) return nullptr;
  const Node* sm = r->inputs()[0] ? r->inputs()[0]->producer() : nullptr;
  if (sm && sm->op_type == "Cast" && !sm->inputs().empty() && sm->inputs()[0]) {
    sm = sm->inputs()[0]->producer();
  }
  return sm && sm->op_type == "Softmax" ? mm : nullptr;
}

std::string flat_output_refusal(const Value* flat, const Node* root) {
  if (flat->is_graph_output()) return "flat heads: the flat output is a graph output";
  for (const Use& u : flat->uses()) {
    if (u.node != root && u.node->op_type != "Shape") {
      return "flat heads: the attention's flat output has another use (" + u.node->op_type + ")";
    }
  }
  return "";
}

bool flat_output_shape_is_q3(const Value* flat, const Value* q3, ShapeFacts& facts) {
  return facts.rank(flat) == 3 && facts.rank(q3) == 3 && facts.same_dim(flat, 0, q3, 0) &&
         facts.same_dim(flat, 1, q3, 1) && facts.same_dim(flat, 2, q3, 2);
}

bool flat_output_is_4d(const Value* out, const Value* q, const Value* v, ShapeFacts& facts) {
  return facts.rank(out) == 4 && facts.same_dim(out, 0, q, 0) && facts.same_dim(out, 1, q, 1) &&
         facts.same_dim(out, 2, q, 2) && facts.same_dim(out, 3, v, 3);
}

void shape_reads_to_q3(Node* root, Value* q3) {
  const std::vector<Use> uses = root->inputs()[0]->uses();
  for (const Use& u : uses) {
    if (u.node != root) u.node->set_input(u.input_index, q3);
  }
}

std::string intermediate_use_refusal(const Value* x, const Node* user, bool flat) {
  std::string why = "intermediate '" + x->name() + "' has another use (" + user->op_type + ")";
  if (flat) {
    why +=
        ": attention on heads folded into the batch whose Q or K also feed other score terms "
        "(deberta-v2's disentangled attention) is not fused";
  }
  return why;
}

Node* flat_kt_transpose(const Value* kt) {
  Node* t = kt ? kt->producer() : nullptr;
  if (!t || t->op_type != "Transpose" || !is_standard(t) || t->inputs().empty()) return nullptr;
  const Attribute* perm = t->attribute("perm");
  return perm && perm->ints == std::vector<int64_t>{0, 2, 1} ? t : nullptr;
}

std::string check_flat_views(const Value* scores3, const Value* scores4, const Value* probs4,
                             const Value* probs3, const Value* q, const Value* bias,
                             FlatBias* bias_form, int64_t opset, ShapeFacts& facts) {
  if (!scores3 || !splits_heads(scores3, scores4, q, facts) ||
      !merges_heads(probs4, probs3, facts)) {
    return "flat heads: the scores' Reshapes do not split and merge (B, H)";
  }
  if (!bias) return "";
  std::string why;
  *bias_form = flat_bias_form(bias, scores3, facts, &why);
  if (*bias_form == FlatBias::kNone) return why;
  if (opset < 15) return "flat heads: the bias's reshape needs opset 15 (Shape's start)";
  return "";
}

std::string bias_refusal(const Value* bias, int32_t score_dtype, bool flat) {
  if (dtype_of(bias) != score_dtype || !norm::is_float_type(score_dtype)) {
    return "the bias's dtype differs";
  }
  if (rank_of(bias) > (flat ? 3 : 4)) return "the bias has a higher rank than the scores";
  return "";
}

std::string masked_fill_refusal(const Node* w, bool flat, double masked_below) {
  const Value* cond = w->inputs()[0];
  auto neg = constant_doubles(w->inputs()[1], 1);
  if (dtype_of(cond) != kBool || !neg || neg->size() != 1 || (*neg)[0] > masked_below) {
    return "a Where on the scores that is not Where(masked, lowest, scores)";
  }
  if (rank_of(cond) > 4) return "the mask has rank > 4";
  if (flat) return "masked_fill on flat (B*H, S, T) scores";
  return "";
}

Value* combine(pattern::Rewriter& rw, Value* bias, Value* additive_mask, Value* masked_cond,
               Value* masked_value) {
  if (masked_cond) return rw.op1("Where", {masked_cond, masked_value, bias});
  if (additive_mask) return rw.op1("Add", {bias, additive_mask});
  return bias;
}

}  // namespace fastopt::passes::alibi
