// The attention fusion's walk (attention_walk.h): the probabilities' and the scores' side, from
// the second MatMul down to the first, and the checks of the whole match.
#include <set>
#include <string>

#include "ir/constant.h"
#include "passes/attention/fuse/attention_walk.h"
#include "passes/attention/fuse/disentangled.h"
#include "passes/attention/shapes.h"
#include "passes/attention/sinks.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes::attention_walk {

void AttentionWalk::take_flat_probs(Value*& p) {
  Node* r = producer_of(p, "Reshape");
  if (!r || rank_of(p) != 3) return;
  take(r);
  f_.flat = true;
  f_.probs3 = p;
  p = f_.probs4 = r->inputs()[0];
}

bool AttentionWalk::take_nan_guard(Node* w, Scores& sc) {
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

bool AttentionWalk::take_sinks(Value* p, Scores& sc) {
  std::string why;
  auto sinks = attention_sinks::match_sinks(p, why);
  if (!sinks) return fail(why.empty() ? "the first MatMul input is not a softmax" : why);
  for (Node* n : sinks->nodes) take(n);
  sc.softmax = sinks->softmax;
  f_.sink_logits = sinks->logits;
  sc.s = sinks->scores ? sinks->scores : sc.softmax->inputs()[0];
  return true;
}

bool AttentionWalk::match_probs(Value* p, Scores& sc) {
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

bool AttentionWalk::check_softmax(Scores& sc) {
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

bool AttentionWalk::check_score_arity(const Node* n) {
  if (n->op_type != "MatMul" && n->op_type != "Cast" && n->op_type != "Add") return true;
  const size_t arity = n->op_type == "Cast" ? 1 : 2;
  if (n->inputs().size() == arity && n->inputs()[0] && n->inputs()[arity - 1]) return true;
  return fail("a " + n->op_type + " on the scores with " + std::to_string(n->inputs().size()) +
              " inputs");
}

bool AttentionWalk::take_score_cast(Node* n, Scores& sc) {
  if (sc.casted) return fail("two Casts on the scores");
  sc.casted = true;
  take(n);
  sc.s = n->inputs()[0];
  return true;
}

bool AttentionWalk::take_mask_add(Node* n, Value*& s) {
  if (f_.softcap) return fail("the mask is added before the soft-cap");
  Value *a = n->inputs()[0], *b = n->inputs()[1];
  if (!reaches_matmul(a) && reaches_matmul(b)) std::swap(a, b);
  if (!reaches_matmul(a)) return fail("neither Add input comes from the scores MatMul");
  if (!match_mask(b, dtype_of(n->outputs()[0]))) return false;
  take(n);
  s = a;
  return true;
}

bool AttentionWalk::take_softcap(const attention_softcap::Softcap& cap, Scores& sc) {
  if (f_.softcap) return fail("two soft-caps on the scores");
  if (sc.scaled) return fail("a scale factor after the soft-cap");
  f_.softcap = cap.cap;
  for (Node* c : cap.nodes) take(c);
  sc.s = cap.capped;
  return true;
}

bool AttentionWalk::take_flat_scores(Node* n, Scores& sc) {
  take(n);
  f_.scores4 = sc.s;
  sc.s = f_.scores3 = n->inputs()[0];
  return true;
}

bool AttentionWalk::step_scores(Scores& sc) {
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

bool AttentionWalk::match_q(Value* q) {
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

bool AttentionWalk::match_v(Value* v) {
  if (Node* c = producer_of(v, "Cast")) {
    take(c);
    v = c->inputs()[0];
  }
  if (f_.flat && !(v = unflatten(v, "V"))) return false;
  f_.v = through_repeat_kv(v);
  return !f_.flat || check_flat();
}

bool AttentionWalk::check_types(const Scores& sc, int32_t out_dtype) {
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

bool AttentionWalk::read_heads(const Scores& sc) {
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

bool AttentionWalk::check_inside(const Node* root) {
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

bool AttentionWalk::match(Node* root) {
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

}  // namespace fastopt::passes::attention_walk
