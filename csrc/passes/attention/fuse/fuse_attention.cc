// Stage 1 of the attention fusion: scaled dot-product attention as exporters write it becomes one
// internal Attention node (internal_op.h); lower_attention turns it into what the target runs.
//
//   q (B,Hq,S,D)       k (B,Hkv,T,D)                 v (B,Hkv,T,Dv)
//     |                  |                             |
//   [Mul|Div c]?      [repeat_kv]?                  [repeat_kv]?     repeat_kv: Unsqueeze(2) ->
//     |                  |                             |              Expand(B,Hkv,G,T,D) ->
//     |               Kt: Transpose(0,1,3,2)           |              Reshape(B,Hq,T,D)
//     |                 | Reshape-Transpose(0,2,1)-Reshape (torchlib SDPA)
//     |                 | Transpose(k_BSHD, 0,2,3,1)   |
//     |               [Mul|Div c]?                      |
//      \               /                                |
//        MatMul -> [Mul|Div c]? -> [softcap]? -> [Cast fp32]? -> [Add(mask)]? -> Softmax(-1)
//                                                                    |
//                                            [Where(IsNaN(p), 0, p)]? -> [Cast]? -> MatMul <-
//                                            [Cast]?
//   (gpt-oss: the Softmax reads Concat(scores, sink column) and is sliced back to the keys:
//    sinks.h)
//
//   ==>  ai.fastopt.internal::Attention(q, k, v, mask?, sinks?) [-> Cast]
//
// Both PyTorch exporters decompose F.scaled_dot_product_attention (what HF's sdpa attention
// calls) this way: TorchScript and dynamo split sqrt(scale) onto Q and K, dynamo transposes K
// through a 3-D Reshape, HF repeats the kv heads for GQA, fp16 TorchScript exports cast the
// scores to fp32 for the softmax (and V to fp32 for the last MatMul), and Where(IsNaN) zeroes
// rows whose keys are all masked. Older exports scale the scores instead; all placements
// multiply into one scale. The mask HF adds is Where(bool_mask, 0, -inf | finfo.min): the
// boolean (true = attend) becomes the internal op's mask; any other additive mask is kept as is.
// gemma2's eager attention soft-caps the scaled scores before the mask, c * tanh(s / c)
// (softcap.h): the internal op's `softcap` = c; a scale after the cap or a mask inside it is
// refused (neither GQA nor Attention-23 can say that).
#include <any>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "passes/attention/fuse/alibi.h"
#include "passes/attention/fuse/disentangled.h"
#include "passes/attention/fuse/softcap.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/attention/sinks.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// An additive mask value this negative removes the key: exp() of it underflows to 0 in fp32.
constexpr double kMaskedBelow = -1e4;

Node* producer_of(const Value* v, const char* op) {
  Node* p = v ? v->producer() : nullptr;
  return p && p->op_type == op && (p->domain.value.empty() || p->domain.value == "ai.onnx")
             ? p
             : nullptr;
}

struct Found {
  Value* q = nullptr;
  Value* k = nullptr;  // BNSH, or BSNH when k_bshd
  Value* v = nullptr;
  bool k_bshd = false;
  Value* mask = nullptr;
  bool mask_bool = false;
  Value* mask_additive = nullptr;  // the Where(c, 0, lowest) a boolean mask was read from
  double mask_value = 0;           // ... its `lowest` (or masked_fill's value), when finite
  int32_t mask_value_dtype = 0;    // the dtype it is added in
  // alibi.h: a second additive term (ALiBi's bias), masked_fill's Where(c, value, scores), and
  // flat (B*H, S, T) scores between the Reshapes `scores3` -> `scores4` and `probs4` -> 3-D.
  Value* bias = nullptr;
  alibi::FlatBias bias_flat = alibi::FlatBias::kNone;
  Value* masked_value = nullptr;  // mask is then masked_fill's condition (true = masked)
  bool flat = false;
  bool flat_out_4d = false;  // the flat rule's root gives (B, H, S, Dv) (y replaces it as is)
  int position_terms = 0;    // disentangled.h: reads of flat Q / K for the bias's terms
  Value* q3 = nullptr;       // flat Q (B*H, S, D): what Shape reads of the flat output are given
  Value *scores3 = nullptr, *scores4 = nullptr, *probs4 = nullptr, *probs3 = nullptr;
  double scale = 1.0;
  double softcap = 0;             // c of c * tanh(scale * QK^T / c), 0 for none
  Value* sink_logits = nullptr;   // sinks.h: the constant (1, H, 1, 1) per-head sink logits
  std::shared_ptr<Tensor> sinks;  // ... as the internal op's (Hq) input, once they fit
  int32_t softmax_precision = 0;
  int64_t hq = 0, hkv = 0;
  std::vector<Node*> nodes;           // matched nodes (removed when dead after the rewrite)
  std::vector<Value*> intermediates;  // values that must not be used outside the match
};

// Walks back from the second MatMul through the exporter variants above (a code rule's match:
// the variants are optional ops in any order, which a pattern cannot say).
class AttentionWalk {
 public:
  explicit AttentionWalk(Found& f) : f_(f) {}
  std::string error;

  bool fail(std::string why) {
    error = std::move(why);
    return false;
  }

  void take(Node* n) {
    f_.nodes.push_back(n);
    f_.intermediates.push_back(n->outputs()[0]);
  }

  // Mul/Div by a constant scalar: folds it into the scale; true when one was peeled.
  // Sets error when the factor is a scalar that is not constant.
  bool peel_scale(Value*& x) {
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

  // HF repeat_kv: Reshape(Expand(Unsqueeze(kv, [2]), (B,Hkv,G,T,D)), (B,Hkv*G,T,D)).
  Value* through_repeat_kv(Value* x) {
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

  // K^T = Transpose(K, (0,1,3,2)) of BNSH K, or Transpose(k_BSHD, (0,2,3,1)).
  bool take_kt_transpose(Node* t) {
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

  // torchlib: Reshape(k, (-1, T, D)) -> Transpose(0,2,1) -> Reshape(lead..., D, T).
  bool take_kt_reshapes(Node* outer) {
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

  // Flat heads: Transpose(Reshape(k, (B*H, T, D)), (0, 2, 1)).
  bool take_flat_kt(Value* kt) {
    Node* t = alibi::flat_kt_transpose(kt);
    if (!t) return fail("flat heads: K^T is not Transpose(K, (0, 2, 1))");
    take(t);
    f_.k = unflatten(t->inputs()[0], "K");
    return f_.k != nullptr;
  }

  // K^T forms; sets f_.k (BNSH before transposing, or BSNH with k_bshd).
  bool match_kt(Value* kt) {
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

  analysis::ShapeFacts& facts() { return analysis::facts_of(*model_); }

  // Flat heads (alibi.h): x3 (B*H, L, D) as the 4-D x it was reshaped from.
  Value* unflatten(Value* x3, const char* what) {
    Node* r = nullptr;
    Value* x4 = alibi::unflatten_heads(x3, facts(), &r);
    if (!x4) {
      fail(std::string("flat heads: ") + what + " is not Reshape((B, H, L, D)) to (B*H, L, D)");
      return nullptr;
    }
    take(r);
    return x4;
  }

  bool check_flat() {
    const Value* bias = f_.bias_flat != alibi::FlatBias::kNone ? f_.bias : nullptr;
    std::string why = alibi::check_flat_views(f_.scores3, f_.scores4, f_.probs4, f_.probs3, f_.q,
                                              bias, &f_.bias_flat, default_opset(*model_), facts());
    return why.empty() || fail(why);
  }

  // A second additive term on the scores (ALiBi's bias, alibi.h).
  bool take_bias(Node* add, Value*& s) {
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

  // masked_fill: Where(masked (bool), value <= kMaskedBelow, scores) (mpt).
  bool take_masked_fill(Node* w, Value*& s) {
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

  // Does `x` lead to the scores MatMul through scale/Cast ops?
  static bool reaches_matmul(const Value* x, int depth = 0) {
    const Node* p = x->producer();
    if (!p || depth > 6) return false;
    if (p->op_type == "MatMul") return true;
    if (p->op_type == "Cast" || p->op_type == "Mul" || p->op_type == "Div" ||
        p->op_type == "Tanh" || p->op_type == "Reshape" ||
        p->op_type == "Add") {  // Reshape, Add: flat heads' bias (alibi.h)
      for (const Value* in : p->inputs()) {
        if (reaches_matmul(in, depth + 1)) return true;
      }
    }
    return false;
  }

  bool match_mask(Value* m, int32_t score_dtype) {
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

  // Attention sinks (sinks.h) in the forms the internal op states: one logit per query head in
  // Q's dtype, the softmax in it too, no score bias, and rows whose every key is masked giving
  // 0 (the sink takes them: -inf, or a masking value that absorbs the scores).
  bool sinks_fit(int32_t t) {
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

  // The walk from the Softmax down to the scores MatMul.
  struct Scores {
    Node* softmax = nullptr;
    Value* s = nullptr;  // the scores where the walk stands
    int32_t dtype = 0;   // the softmax's dtype
    Node* mm = nullptr;  // the scores MatMul, once reached
    bool casted = false;
    bool scaled = false;  // a scale factor was peeled (the walk meets a later one first)
  };

  // Flat heads (alibi.h): the output is Reshape(probs4 (B, H, S, T)) to 3-D.
  void take_flat_probs(Value*& p) {
    Node* r = producer_of(p, "Reshape");
    if (!r || rank_of(p) != 3) return;
    take(r);
    f_.flat = true;
    f_.probs3 = p;
    p = f_.probs4 = r->inputs()[0];
  }

  // Where(IsNaN(p), 0, p) of the Softmax (rows whose keys are all masked give 0).
  bool take_nan_guard(Node* w, Scores& sc) {
    if (w->inputs().size() != 3) return fail("a Where without three inputs");
    Node* isnan = producer_of(w->inputs()[0], "IsNaN");
    auto zero = constant_doubles(w->inputs()[1], 1);
    if (!isnan || isnan->inputs().empty() || isnan->inputs()[0] != w->inputs()[2] || !zero ||
        zero->size() != 1 || (*zero)[0] != 0.0) {
      return fail("the probabilities are a Where that is not Where(IsNaN(p), 0, p)");
    }
    Node* softmax = producer_of(w->inputs()[2], "Softmax");
    if (!softmax) return fail("Where(IsNaN(p), 0, p) of something other than a Softmax");
    take(w);
    f_.nodes.push_back(isnan);
    // The softmax output feeds both the IsNaN and the Where.
    for (const Use& u : softmax->outputs()[0]->uses()) {
      if (u.node != isnan && u.node != w) return fail("the softmax output has other uses");
    }
    f_.nodes.push_back(softmax);
    sc.softmax = softmax;
    sc.s = softmax->inputs()[0];
    return true;
  }

  // The Softmax over the scores joined to a sink column (sinks.h).
  bool take_sinks(Value* p, Scores& sc) {
    std::string why;
    auto sinks = attention_sinks::match_sinks(p, why);
    if (!sinks) return fail(why.empty() ? "the first MatMul input is not a softmax" : why);
    for (Node* n : sinks->nodes) take(n);
    sc.softmax = sinks->softmax;
    f_.sink_logits = sinks->logits;
    sc.s = sinks->scores ? sinks->scores : sc.softmax->inputs()[0];
    return true;
  }

  // Probabilities side: [Cast] <- [Where(IsNaN(s), 0, s)] <- Softmax, or the sinks' form.
  bool match_probs(Value* p, Scores& sc) {
    if (Node* c = producer_of(p, "Cast")) {
      take(c);
      p = c->inputs()[0];
    }
    if (Node* w = producer_of(p, "Where")) return take_nan_guard(w, sc);
    if (Node* softmax = producer_of(p, "Softmax")) {
      take(softmax);
      sc.softmax = softmax;
      sc.s = softmax->inputs()[0];
      return true;
    }
    return take_sinks(p, sc);
  }

  // 4-D scores normalized over the keys.
  bool check_softmax(Scores& sc) {
    if (rank_of(sc.s) != 4) return fail("the scores are not 4-D");
    // Softmax-13 normalizes over `axis` (default -1); before opset 13 it flattens the input to
    // 2-D at `axis` (default 1) and normalizes over the flattened tail, which is the last axis
    // alone only when axis is the last one.
    const int64_t opset = default_opset(*model_);
    const int64_t axis = int_attr_or(sc.softmax, "axis", opset < 13 ? 1 : -1);
    if (axis != -1 && axis != 3) {
      return fail(opset < 13 ? "Softmax (opset " + std::to_string(opset) + ") with axis " +
                                   std::to_string(axis) +
                                   " normalizes over the flattened axes from it, not the keys"
                             : std::string("Softmax is not over the last axis"));
    }
    sc.dtype = dtype_of(sc.s);
    return true;
  }

  // fuzz_pipeline: a one-input MatMul on the scores (read as two) overflowed.
  bool check_score_arity(const Node* n) {
    if (n->op_type != "MatMul" && n->op_type != "Cast" && n->op_type != "Add") return true;
    const size_t arity = n->op_type == "Cast" ? 1 : 2;
    if (n->inputs().size() == arity && n->inputs()[0] && n->inputs()[arity - 1]) return true;
    return fail("a " + n->op_type + " on the scores with " + std::to_string(n->inputs().size()) +
                " inputs");
  }

  bool take_score_cast(Node* n, Scores& sc) {
    if (sc.casted) return fail("two Casts on the scores");
    sc.casted = true;
    take(n);
    sc.s = n->inputs()[0];
    return true;
  }

  // Add(scores, mask): the attention mask.
  bool take_mask_add(Node* n, Value*& s) {
    if (f_.softcap) return fail("the mask is added before the soft-cap");
    Value *a = n->inputs()[0], *b = n->inputs()[1];
    if (!reaches_matmul(a) && reaches_matmul(b)) std::swap(a, b);
    if (!reaches_matmul(a)) return fail("neither Add input comes from the scores MatMul");
    if (!match_mask(b, dtype_of(n->outputs()[0]))) return false;
    take(n);
    s = a;
    return true;
  }

  bool take_softcap(const attention_softcap::Softcap& cap, Scores& sc) {
    if (f_.softcap) return fail("two soft-caps on the scores");
    if (sc.scaled) return fail("a scale factor after the soft-cap");
    f_.softcap = cap.cap;
    for (Node* c : cap.nodes) take(c);
    sc.s = cap.capped;
    return true;
  }

  // Flat heads: the scores Reshape (B*H, S, T) -> (B, H, S, T).
  bool take_flat_scores(Node* n, Scores& sc) {
    take(n);
    f_.scores4 = sc.s;
    sc.s = f_.scores3 = n->inputs()[0];
    return true;
  }

  // One op of the scores side: [Add(mask)] / [Cast] / [Mul|Div c] in any order, down to
  // MatMul(q', Kt').
  bool step_scores(Scores& sc) {
    Node* n = sc.s->producer();
    if (!n) return fail("the scores have no producer");
    if (!check_score_arity(n)) return false;
    const std::string& op = n->op_type;
    if (op == "MatMul") {
      sc.mm = n;
      take(n);
      return true;
    }
    if (op == "Cast") return take_score_cast(n, sc);
    if (op == "Add" && !f_.mask && !f_.scores3) return take_mask_add(n, sc.s);
    if (auto cap = attention_softcap::match_softcap(sc.s)) return take_softcap(*cap, sc);
    if (op == "Add" && !f_.bias) return take_bias(n, sc.s);
    if (op == "Where" && !f_.mask && n->inputs().size() == 3) return take_masked_fill(n, sc.s);
    if (op == "Reshape" && f_.flat && !f_.scores3) return take_flat_scores(n, sc);
    if (peel_scale(sc.s)) {
      sc.scaled = true;
      return true;
    }
    if (!error.empty()) return false;
    return fail("unexpected " + op + " between the scores MatMul and the Softmax");
  }

  // Q side: [Mul|Div c] (flat heads: Reshape back to 4-D).
  bool match_q(Value* q) {
    while (peel_scale(q)) {
    }
    if (!error.empty()) return false;
    if (f_.flat) {
      f_.q3 = q;
      if (!(q = unflatten(q, "Q"))) return false;
    }
    f_.q = q;
    return true;
  }

  // V side: [Cast] <- [repeat_kv].
  bool match_v(Value* v) {
    if (Node* c = producer_of(v, "Cast")) {
      take(c);
      v = c->inputs()[0];
    }
    if (f_.flat && !(v = unflatten(v, "V"))) return false;
    f_.v = through_repeat_kv(v);
    return !f_.flat || check_flat();
  }

  // Float Q, K, V of one dtype, 4-D; the softmax in it or in fp32; the mask's and output's.
  bool check_types(const Scores& sc, int32_t out_dtype) {
    const int32_t t = dtype_of(f_.q);
    if (!norm::is_float_type(t)) return fail("Q is not a float tensor");
    if (dtype_of(f_.k) != t || dtype_of(f_.v) != t) return fail("Q, K, V dtypes differ");
    if (rank_of(f_.q) != 4 || rank_of(f_.k) != 4 || rank_of(f_.v) != 4) {
      return fail("Q, K, V are not 4-D");
    }
    if (sc.dtype != t) {
      if (!sc.casted || sc.dtype != kFloat) return fail("the softmax runs in an unexpected dtype");
      f_.softmax_precision = kFloat;
    }
    if (out_dtype != t && out_dtype != sc.dtype) return fail("unexpected output dtype");
    if (f_.mask && !f_.mask_bool && !f_.masked_value && dtype_of(f_.mask) != t &&
        dtype_of(f_.mask) != kFloat) {
      return fail("the mask's dtype is neither Q's nor float");
    }
    return true;
  }

  // Heads: from Q (or from the repeated K it is multiplied with), kv heads from K and V.
  bool read_heads(const Scores& sc) {
    auto hq = resolve_dim(f_.q, 1);
    if (!hq) hq = resolve_dim(sc.mm->inputs()[0], 1);
    if (!hq) hq = resolve_dim(sc.s, 1);
    auto hkv = resolve_dim(f_.k, f_.k_bshd ? 2 : 1);
    auto hv = resolve_dim(f_.v, 1);
    if (!hq) return fail("the number of query heads is unknown");
    if (!hkv || !hv) return fail("the number of kv heads is unknown");
    if (*hkv != *hv) return fail("K and V have different head counts");
    if (*hkv <= 0 || *hq % *hkv != 0) return fail("query heads are not a multiple of kv heads");
    f_.hq = *hq;
    f_.hkv = *hkv;
    return true;
  }

  // Nothing computed inside may be used outside (Shape reads of the repeated K excepted:
  // torchlib's K^T reshapes read them, and they only need the shape).
  bool check_inside(const Node* root) {
    std::set<const Node*> inside(f_.nodes.begin(), f_.nodes.end());
    inside.insert(root);
    for (const Value* x : f_.intermediates) {
      if (x == root->outputs()[0]) continue;
      if (x->is_graph_output()) return fail("an intermediate value is a graph output");
      for (const Use& u : x->uses()) {
        if (f_.flat && disentangled::reads_for_position_term(x, u.node, f_.bias)) {
          ++f_.position_terms;
          continue;
        }
        if (!inside.count(u.node) && u.node->op_type != "Shape") {
          return fail(alibi::intermediate_use_refusal(x, u.node, f_.flat));
        }
      }
    }
    return true;
  }

  bool match(Node* root) {
    model_ = root->graph()->model();
    Value* p = root->inputs()[0];
    const int32_t out_dtype = dtype_of(root->outputs()[0]);
    take_flat_probs(p);
    Scores sc;
    if (!match_probs(p, sc) || !check_softmax(sc)) return false;
    while (!sc.mm) {
      if (!step_scores(sc)) return false;
    }
    if (!match_q(sc.mm->inputs()[0]) || !match_kt(sc.mm->inputs()[1])) return false;
    if (!match_v(root->inputs()[1]) || !check_types(sc, out_dtype) || !read_heads(sc)) {
      return false;
    }
    if (f_.sink_logits && !sinks_fit(dtype_of(f_.q))) return false;
    return check_inside(root);
  }

 private:
  Found& f_;
  Model* model_ = nullptr;
};

// Cheap filter: attention's second MatMul reads a softmax (through Cast / Where / the Slice that
// drops a sink's column).
bool reads_softmax(const Node* n) {
  if (n->op_type != "MatMul" || !n->domain.value.empty() || n->inputs().size() != 2) return false;
  const Node* p = n->inputs()[0]->producer();
  for (int i = 0; i < 2 && p && p->op_type != "Softmax"; ++i) {
    if (p->op_type == "Slice" && !p->inputs().empty() && p->inputs()[0]) {
      p = p->inputs()[0]->producer();
    } else if (p->op_type == "Cast" || p->op_type == "Where") {
      p = p->inputs().back()->producer();
    } else {
      p = nullptr;
    }
  }
  return p && p->op_type == "Softmax";
}

// The internal op must always be able to go back to standard ops (decompose_attention), which
// need Range: "" where the model's opset has it, else the refusal.
std::string opset_refusal(const Node* root) {
  const int64_t opset = default_opset(*root->graph()->model());
  if (opset >= kDecomposeOpset) return "";
  return "opset " + std::to_string(opset) + ": standard ops for the attention need " +
         std::to_string(kDecomposeOpset) + " (Range)";
}

bool match_attention(Node* root, CodeMatch& m, MatchFailure& why, PassContext& ctx) {
  if (!reads_softmax(root)) return false;  // no candidate: nothing to explain
  auto refuse = [&](std::string reason) {
    why.text = std::move(reason);
    ctx.counters["not fused"] += 1;
    return false;
  };
  if (std::string r = opset_refusal(root); !r.empty()) return refuse(r);
  Found f;
  AttentionWalk walk(f);
  if (!walk.match(root)) return refuse(walk.error);
  // A node ORT refuses (an attribute of the wrong type: Softmax's axis as a string) is never
  // fused into one it runs; its attribute was read as the default above.
  const Node* mistyped = nullptr;
  for (const Node* n : f.nodes) {
    if (pattern::mistyped_attribute(*n)) mistyped = n;
  }
  if (mistyped) {
    return refuse(pattern::describe_mistyped(*mistyped, *pattern::mistyped_attribute(*mistyped)));
  }
  m.nodes = f.nodes;
  m.found = std::move(f);
  return true;
}

// Flat heads (alibi.h, bloom): the root is Reshape(MatMul(Reshape(probs), v3), 4-D target).
bool match_flat_attention(Node* root, CodeMatch& m, MatchFailure& why, PassContext& ctx) {
  Node* mm = alibi::flat_candidate(root);
  if (!mm) return false;  // no candidate
  auto refuse = [&](std::string reason) {
    why.text = std::move(reason);
    ctx.counters["not fused"] += 1;
    return false;
  };
  if (std::string r = opset_refusal(root); !r.empty()) return refuse(r);
  const Value* flat = mm->outputs()[0];
  if (std::string r = alibi::flat_output_refusal(flat, root); !r.empty()) return refuse(r);
  Found f;
  AttentionWalk walk(f);
  if (!walk.match(mm)) return refuse(walk.error);
  // TorchScript reads the flat output's shape for the head merge: the same as flat Q's when
  // Dv == D, which the rewrite hands those Shape nodes instead.
  analysis::ShapeFacts& sf = analysis::facts_of(*root->graph()->model());
  if (flat->uses().size() > 1 && !alibi::flat_output_shape_is_q3(flat, f.q3, sf)) {
    return refuse("flat heads: the flat output's shape is read and is not flat Q's");
  }
  for (const Node* n : f.nodes) {
    if (pattern::mistyped_attribute(*n)) {
      return refuse(pattern::describe_mistyped(*n, *pattern::mistyped_attribute(*n)));
    }
  }
  f.flat_out_4d = alibi::flat_output_is_4d(root->outputs()[0], f.q, f.v, sf);
  f.nodes.push_back(mm);
  m.nodes = f.nodes;
  m.found = std::move(f);
  return true;
}

// The internal op's mask input (t: Q's dtype), or null without one.
Value* attention_mask(const Found& f, Rewriter& rw, int32_t t) {
  if (f.bias) {  // alibi.h: one additive mask, bias + the export's mask
    Value* bias = f.bias;
    if (f.bias_flat != alibi::FlatBias::kNone) bias = alibi::bias_4d(rw, bias, f.bias_flat, f.hq);
    Value* mask = alibi::combine(rw, bias, f.mask_bool ? f.mask_additive : f.mask,
                                 f.masked_value ? f.mask : nullptr, f.masked_value);
    if (dtype_of(mask) != t) mask = rw.op1("Cast", {mask}, one_attr(attr_int("to", t)));
    return mask;
  }
  if (f.masked_value) return rw.op1("Not", {f.mask});  // masked_fill without a bias: kept keys
  if (f.mask && !f.mask_bool && dtype_of(f.mask) != t) {
    return rw.op1("Cast", {f.mask}, one_attr(attr_int("to", t)));
  }
  return f.mask;
}

std::vector<Attribute> attention_attrs(const Found& f) {
  std::vector<Attribute> attrs;
  attrs.push_back(attr_float("scale", static_cast<float>(f.scale)));
  attrs.push_back(attr_int("is_causal", 0));
  attrs.push_back(attr_int("q_num_heads", f.hq));
  attrs.push_back(attr_int("kv_num_heads", f.hkv));
  if (f.softmax_precision) attrs.push_back(attr_int("softmax_precision", f.softmax_precision));
  if (f.softcap) attrs.push_back(attr_float("softcap", static_cast<float>(f.softcap)));
  if (f.bias) attrs.push_back(attr_int("score_bias", 1));
  // A finite masking value: a row whose every key is masked averages the keys (internal_op.h);
  // with sinks it gives 0 (the sink takes the row: sinks_fit).
  if (!f.bias && !f.sinks && (f.mask_bool || f.masked_value) && std::isfinite(f.mask_value)) {
    attrs.push_back(absorbs_scores(f.mask_value, f.mask_value_dtype)
                        ? attr_int("masked_rows_mean", 1)
                        : attr_float("masked_value", static_cast<float>(f.mask_value)));
  }
  return attrs;
}

void count_fused(const Found& f, PassContext& ctx) {
  ctx.counters["attention"] += 1;
  if (f.hkv != f.hq) ctx.counters["grouped kv heads"] += 1;
  if (f.mask) ctx.counters[f.mask_bool || f.masked_value ? "boolean mask" : "additive mask"] += 1;
  if (f.softcap) ctx.counters["soft-capped"] += 1;
  if (f.sinks) ctx.counters["attention sinks"] += 1;
  if (f.bias) {
    ctx.counters[f.position_terms ? "disentangled position terms" : "attention bias (ALiBi)"] += 1;
  }
  if (f.flat) ctx.counters["flat heads"] += 1;
}

Replacement rewrite_attention(const CodeMatch& m, Rewriter& rw, PassContext& ctx) {
  const Found& f = std::any_cast<const Found&>(m.found);
  Graph& g = rw.graph();
  Node* root = m.root;
  // Every rule's match checks it first (match_attention says why); this covers them all.
  if (default_opset(*g.model()) < kDecomposeOpset) return rw.fail("opset below 11");
  const int32_t t = dtype_of(f.q);
  Value* k = f.k;
  if (f.k_bshd) k = rw.op1("Transpose", {k}, one_attr(attr_ints("perm", {0, 2, 1, 3})));
  std::vector<Value*> inputs = {f.q, k, f.v};
  if (Value* mask = attention_mask(f, rw, t)) inputs.push_back(mask);
  if (f.sinks) {  // input 4, after the mask (or its empty slot)
    inputs.resize(4);
    inputs.push_back(rw.initializer("attention_sinks", f.sinks));
  }
  Value* y = rw.op1(kInternalAttention, inputs, attention_attrs(f), kInternalDomain);
  const int32_t out_dtype = dtype_of(root->outputs()[0]);
  if (out_dtype != t) y = rw.op1("Cast", {y}, one_attr(attr_int("to", out_dtype)));
  // Flat heads: the root is the Reshape of the flat output; a Reshape of y with its target is
  // the same tensor (both row-major views of (B*H, S, Dv)), and y itself where types show it.
  if (f.flat && !f.flat_out_4d) {
    y = rw.op1("Reshape", {y, root->inputs()[1]});
  }
  if (!can_replace(g, root->outputs()[0], y)) {
    ctx.counters["not fused"] += 1;
    return rw.fail("the output cannot be replaced");
  }
  if (f.flat) alibi::shape_reads_to_q3(root, f.q3);  // proven the same (match_flat_attention)
  import_domain(g, kInternalDomain);
  count_fused(f, ctx);
  return std::vector<Value*>{y};
}

// Removes every node of `g` whose outputs are unused (subgraph holders and nodes with mistyped
// attributes kept).
void remove_unused(Graph& g) {
  for (Node* n = g.last(); n;) {
    Node* prev = n->prev();
    bool dead = !n->has_subgraphs();
    for (Value* o : n->outputs())
      dead = dead && (!o || (o->uses().empty() && !o->is_graph_output()));
    if (dead && !pattern::mistyped_attribute(*n)) g.remove_node(n);  // ORT refuses those
    n = prev;
  }
}

int64_t fuse_attention(Model& model, PassContext& ctx) {
  // Each fusion replaces a subgraph by the internal op computing the same: the shape facts hold
  // across the rewrites (no sweep per fused layer).
  analysis::KeepAcrossEdits keep(analysis::facts_of(model));
  CodeRule rule;
  rule.name = "fuse_attention";
  rule.root_op_types = {"MatMul"};
  rule.match = [&ctx](Node* root, CodeMatch& m, MatchFailure& why) {
    return match_attention(root, m, why, ctx);
  };
  std::set<const Graph*> fused_in;
  rule.rewrite = [&ctx, &fused_in](const CodeMatch& m, Rewriter& rw) {
    Replacement r = rewrite_attention(m, rw, ctx);
    if (r) fused_in.insert(&rw.graph());
    return r;
  };
  ApplyOptions o;
  o.max_iterations = ctx.max_iterations;
  o.explain_rule = ctx.explain_rule;
  o.explain_lines = ctx.explain_rule.empty() ? nullptr : &ctx.explain_lines;
  // Flat heads' proofs read shape facts, which a fused layer's internal op (no shape rule) blurs
  // for the layers after it: every flat candidate is matched on the unedited graph first. A
  // match stays valid: rewrites remove only their own nodes.
  struct Early {
    bool ok;
    CodeMatch m;
    std::string why;
  };
  std::map<const Node*, Early> early;
  model.for_each_graph([&](Graph& g) {
    for (Node* n = g.first(); n; n = n->next()) {
      if (n->op_type != "Reshape") continue;
      Early e{false, {}, {}};
      MatchFailure why;
      e.ok = match_flat_attention(n, e.m, why, ctx);
      e.why = why.text;
      if (e.ok || !e.why.empty()) early.emplace(n, std::move(e));
    }
  });
  CodeRule flat = rule;
  flat.root_op_types = {"Reshape"};
  flat.match = [&ctx, &early](Node* root, CodeMatch& m, MatchFailure& why) {
    auto it = early.find(root);
    if (it == early.end()) return match_flat_attention(root, m, why, ctx);
    m.nodes = it->second.m.nodes;
    m.found = it->second.m.found;
    why.text = it->second.why;
    return it->second.ok;
  };
  const ApplyStats stats = apply_rules(model, {}, {rule, flat}, o);
  // What only fed the matched nodes' shapes (torchlib's K^T reshape targets, Shape reads of the
  // repeated K) is dead now: swept in the graphs from the first one with a fusion on.
  bool swept = false;
  model.for_each_graph([&](Graph& g) {
    swept = swept || fused_in.count(&g);
    if (swept) remove_unused(g);
  });
  return stats.rewrites;
}

const PassRegistrar kRegister{
    PassDecl(
        "fuse_attention",
        "recognise scaled dot-product attention (scale placements, repeat_kv, masks, fp32 softmax "
        "casts) as the internal Attention op; run lower_attention after it")
        .tags({"fusion", "llm"})
        .run(fuse_attention)
        .ensures_facts({kAttentionFused})};

}  // namespace
}  // namespace fastopt::passes
