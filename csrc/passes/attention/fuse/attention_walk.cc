// The attention fusion's walk (attention_walk.h): the operands' side, Q, K^T and V through
// scales, repeated kv heads and flat heads; the masks, biases and sinks on the scores.
#include "passes/attention/fuse/attention_walk.h"

#include <cmath>
#include <set>
#include <utility>

#include "ir/constant.h"
#include "passes/attention/fuse/disentangled.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/attention/sinks.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::attention_walk {
namespace {

// An additive mask value this negative removes the key: exp() of it underflows to 0 in fp32.
constexpr double kMaskedBelow = -1e4;

}  // namespace

Node* producer_of(const Value* v, const char* op) {
  Node* p = v ? v->producer() : nullptr;
  return p && p->op_type == op && (p->domain.value.empty() || p->domain.value == "ai.onnx")
             ? p
             : nullptr;
}

bool AttentionWalk::fail(std::string why) {
  error = std::move(why);
  return false;
}

void AttentionWalk::take(Node* n) {
  f_.nodes.push_back(n);
  f_.intermediates.push_back(n->outputs()[0]);
}

bool AttentionWalk::peel_scale(Value*& x) {
  Node* p = x->producer();
  if (!p || (p->op_type != "Mul" && p->op_type != "Div") || p->inputs().size() != 2) return false;
  for (int i = 0; i < 2; ++i) {
    if (p->op_type == "Div" && i == 0) continue;  // c / x is not a scale
    Value* c = p->inputs()[i];
    Value* other = p->inputs()[1 - i];
    auto s = constant_scalar(c);
    if (!s) {
      // A rank-0 or one-element factor that is not constant: a dynamic scale.
      const int r = rank_of(c);
      const bool scalar_shaped =
          r == 0 || (r == 1 && c->type.has_shape && c->type.dims[0].value == 1);
      if (scalar_shaped && rank_of(other) == 4) {
        error = "the scale factor (" + p->op_type + " '" + p->name.value + "') is not a constant";
      }
      continue;
    }
    if (rank_of(c) > 4) continue;  // would broadcast the scores to a higher rank
    if (!std::isfinite(*s) || *s == 0) {
      error = "the scale factor is not finite or zero";
      return false;
    }
    f_.scale = p->op_type == "Mul" ? f_.scale * *s : f_.scale / *s;
    take(p);
    x = other;
    return true;
  }
  return false;
}

Value* AttentionWalk::through_repeat_kv(Value* x) {
  Node* reshape = producer_of(x, "Reshape");
  if (!reshape || reshape->inputs().size() != 2) return x;
  Node* expand = producer_of(reshape->inputs()[0], "Expand");
  if (!expand || expand->inputs().size() != 2) return x;  // fuzz_pipeline: one-input Expand
  Node* unsq = producer_of(expand->inputs()[0], "Unsqueeze");
  if (!unsq || unsq->inputs().empty()) return x;
  std::vector<int64_t> axes;
  if (const Attribute* a = unsq->attribute("axes")) {
    axes = a->ints;
  } else if (unsq->inputs().size() > 1) {
    auto c = constant_ints(unsq->inputs()[1], 4);
    if (c) axes = *c;
  }
  Value* kv = unsq->inputs()[0];
  if (axes != std::vector<int64_t>{2} || rank_of(kv) != 4) return x;
  // The merged heads: Reshape target element 1 (Hkv*G) when computable; Expand element 2 = G.
  auto g = shape_element(expand->inputs()[1], 2);
  auto target_heads = shape_element(reshape->inputs()[1], 1);
  auto hkv = resolve_dim(kv, 1);
  auto d_in = resolve_dim(kv, 3);
  auto d_out = shape_element(reshape->inputs()[1], 3);
  if (shape_length(reshape->inputs()[1]).value_or(4) != 4) return x;
  if (d_in && d_out && *d_out > 0 && *d_in != *d_out) return x;
  if (g && hkv && target_heads && *target_heads > 0 && *target_heads != *g * *hkv) return x;
  take(reshape);
  take(expand);
  take(unsq);
  return kv;
}

bool AttentionWalk::take_kt_transpose(Node* t) {
  const Attribute* perm = t->attribute("perm");
  if (perm && perm->ints == std::vector<int64_t>{0, 1, 3, 2}) {
    take(t);
    f_.k = t->inputs()[0];
    return true;
  }
  if (perm && perm->ints == std::vector<int64_t>{0, 2, 3, 1}) {
    take(t);
    f_.k = t->inputs()[0];
    f_.k_bshd = true;
    return rank_of(f_.k) == 4 || fail("K is not 4-D");
  }
  return fail("K is transposed with an unsupported permutation");
}

bool AttentionWalk::take_kt_reshapes(Node* outer) {
  Node* t = producer_of(outer->inputs()[0], "Transpose");
  Node* inner = t ? producer_of(t->inputs()[0], "Reshape") : nullptr;
  const Attribute* perm = t ? t->attribute("perm") : nullptr;
  if (!inner || !perm || perm->ints != std::vector<int64_t>{0, 2, 1}) {
    return fail("K^T is not Transpose(K) nor Reshape-Transpose-Reshape");
  }
  Value* k = inner->inputs()[0];
  if (rank_of(k) != 4) return fail("K is not 4-D");
  // The 3-D view keeps K's last two dims; the 4-D result is (lead..., D, T).
  if (shape_length(inner->inputs()[1]) != 3 || shape_length(outer->inputs()[1]) != 4) {
    return fail("K^T's reshapes are not 4-D -> 3-D -> 4-D");
  }
  auto d = resolve_dim(k, 3);
  auto d1 = shape_element(inner->inputs()[1], 2), d2 = shape_element(outer->inputs()[1], 2);
  if (!d || !d1 || !d2 || *d != *d1 || *d != *d2) {
    return fail("K^T's reshapes do not keep the head size");
  }
  take(outer);
  take(t);
  take(inner);
  f_.k = k;
  return true;
}

bool AttentionWalk::take_flat_kt(Value* kt) {
  Node* t = alibi::flat_kt_transpose(kt);
  if (!t) return fail("flat heads: K^T is not Transpose(K, (0, 2, 1))");
  take(t);
  f_.k = unflatten(t->inputs()[0], "K");
  return f_.k != nullptr;
}

bool AttentionWalk::match_kt(Value* kt) {
  while (peel_scale(kt)) {
  }
  if (!error.empty()) return false;
  if (f_.flat) return take_flat_kt(kt);
  if (Node* t = producer_of(kt, "Transpose")) {
    if (!take_kt_transpose(t)) return false;
    if (f_.k_bshd) return true;
  } else if (Node* outer = producer_of(kt, "Reshape")) {
    if (!take_kt_reshapes(outer)) return false;
  } else {
    return fail("K^T is not a Transpose or Reshape");
  }
  while (peel_scale(f_.k)) {
  }
  if (!error.empty()) return false;
  if (!f_.k_bshd) f_.k = through_repeat_kv(f_.k);
  return true;
}

Value* AttentionWalk::unflatten(Value* x3, const char* what) {
  Node* r = nullptr;
  Value* x4 = alibi::unflatten_heads(x3, facts(), &r);
  if (!x4) {
    fail(std::string("flat heads: ") + what + " is not Reshape((B, H, L, D)) to (B*H, L, D)");
    return nullptr;
  }
  take(r);
  return x4;
}

bool AttentionWalk::check_flat() {
  const Value* bias = f_.bias_flat != alibi::FlatBias::kNone ? f_.bias : nullptr;
  std::string why = alibi::check_flat_views(f_.scores3, f_.scores4, f_.probs4, f_.probs3, f_.q,
                                            bias, &f_.bias_flat, default_opset(*model_), facts());
  return why.empty() || fail(why);
}

bool AttentionWalk::take_bias(Node* add, Value*& s) {
  // Walking back from the softmax, a term found after the cap was added inside it.
  if (f_.softcap) return fail("a bias is added before the soft-cap");
  Value *a = add->inputs()[0], *b = add->inputs()[1];
  if (!reaches_matmul(a) && reaches_matmul(b)) std::swap(a, b);
  if (!reaches_matmul(a)) return fail("neither Add input comes from the scores MatMul");
  std::string why = alibi::bias_refusal(b, dtype_of(add->outputs()[0]), f_.scores3 != nullptr);
  if (!why.empty()) return fail(why);
  f_.bias = b;
  // Decided in check_flat once the whole walk is known; kNone for 4-D scores.
  f_.bias_flat = f_.scores3 ? alibi::FlatBias::kReshape : alibi::FlatBias::kNone;
  take(add);
  s = a;
  return true;
}

bool AttentionWalk::take_masked_fill(Node* w, Value*& s) {
  if (f_.softcap) return fail("the scores are masked before the soft-cap");
  std::string why = alibi::masked_fill_refusal(w, f_.scores3 != nullptr, kMaskedBelow);
  if (!why.empty()) return fail(why);
  f_.mask = w->inputs()[0];
  f_.masked_value = w->inputs()[1];
  f_.mask_value = (*constant_doubles(w->inputs()[1], 1))[0];  // checked by the refusal
  f_.mask_value_dtype = dtype_of(w->outputs()[0]);
  take(w);
  s = w->inputs()[2];
  return true;
}

bool AttentionWalk::reaches_matmul(const Value* x, int depth) {
  const Node* p = x->producer();
  if (!p || depth > 6) return false;
  if (p->op_type == "MatMul") return true;
  if (p->op_type == "Cast" || p->op_type == "Mul" || p->op_type == "Div" || p->op_type == "Tanh" ||
      p->op_type == "Reshape" || p->op_type == "Add") {  // Reshape, Add: flat heads' bias (alibi.h)
    for (const Value* in : p->inputs()) {
      if (reaches_matmul(in, depth + 1)) return true;
    }
  }
  return false;
}

bool AttentionWalk::match_mask(Value* m, int32_t score_dtype) {
  if (rank_of(m) > 4) return fail("the mask has rank > 4");
  if (Node* w = producer_of(m, "Where")) {
    Value* cond = w->inputs()[0];
    auto zero = constant_doubles(w->inputs()[1], 1);
    auto neg = constant_doubles(w->inputs()[2], 1);
    if (dtype_of(cond) == kBool && zero && neg && zero->size() == 1 && neg->size() == 1 &&
        (*zero)[0] == 0.0 && (*neg)[0] <= kMaskedBelow) {
      if (rank_of(cond) > 4) return fail("the mask has rank > 4");
      f_.mask = cond;
      f_.mask_bool = true;
      f_.mask_additive = m;
      f_.mask_value = (*neg)[0];
      f_.mask_value_dtype = dtype_of(m);
      return true;
    }
  }
  const int32_t t = dtype_of(m);
  if (!norm::is_float_type(t)) return fail("the added mask is not a float tensor");
  if (t != score_dtype) return fail("the mask's dtype differs from the scores'");
  f_.mask = m;
  return true;
}

bool AttentionWalk::sinks_fit(int32_t t) {
  f_.sinks = attention_sinks::head_logits(f_.sink_logits, t, f_.hq);
  if (!f_.sinks) {
    return fail("attention sinks: not one logit per query head in Q's dtype");
  }
  if (f_.softmax_precision) return fail("attention sinks with a softmax in a wider dtype");
  if (f_.bias || f_.flat) return fail("attention sinks with a score bias");
  if ((f_.mask_bool || f_.masked_value) && std::isfinite(f_.mask_value) &&
      !absorbs_scores(f_.mask_value, f_.mask_value_dtype)) {
    return fail("attention sinks with a masking value that does not absorb the scores");
  }
  return true;
}

}  // namespace fastopt::passes::attention_walk
