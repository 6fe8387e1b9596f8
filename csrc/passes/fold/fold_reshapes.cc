// Chains of reshaping ops collapse into one op, or into nothing when they cancel.
//
//   Reshape(Reshape|Flatten|Squeeze|Unsqueeze(x), s2)  =>  Reshape(x, s2)
//   Unsqueeze(Unsqueeze(x, a), b)                      =>  Unsqueeze(x, a and b merged)
//   Squeeze(Squeeze(x, a), b)                          =>  Squeeze(x, a and b merged)
//   Squeeze(Unsqueeze(x, a), a)                        =>  x      (also Unsqueeze(Squeeze))
//   Flatten(Reshape(x, s), k)                          =>  Reshape(x, [P, Q])
//   Flatten(Flatten(x, k), 0|1)                        =>  Flatten(x, 0|k)
//   Reshape(Cast(Reshape(x)), s2)                      =>  Cast(Reshape(Reshape(x), s2))
//
// TorchScript exports view/unsqueeze/flatten one call at a time, so head splitting and merging
// in attention leaves such chains. Reshape's 0 copies a dim of its *input*: a target with 0
// entries folds with allowzero=1 (0 means an empty dim), or where the dims it copies are the
// same in x (types or shape facts: Reshape(Reshape(x3d, [0, 0, H, D]), [0, 0, H*D]) after
// attention is x3d's shape again, and eliminate_noop drops the Reshape left). The first op may have
// other users: it then stays for them.
#include <memory>
#include <unordered_map>
#include <utility>

#include "analysis/shape_facts.h"
#include "passes/cleanup/cleanup_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;
using cleanup::has_attr_refs;
using cleanup::int_attr;
using cleanup::int_list;
using cleanup::IntList;
using cleanup::normalize_axes;
using cleanup::value_dims;

// Sets the axes of a Squeeze/Unsqueeze in the form it already uses: an attribute (opset < 13)
// or an int64 input (opset >= 13). Called once every check has passed.
void set_axes(Node* n, Rewriter& rw, const std::vector<int64_t>& axes) {
  for (auto& a : n->attributes) {
    if (a.name == "axes") {
      a.ints = axes;
      return;
    }
  }
  n->set_input(1, cleanup::int64_constant(rw, n->outputs()[0]->name() + "_axes", axes));
}

// Dim i of a and b declared the same in their types (a number, or a dim_param by name).
bool same_type_dim(const Value* a, const Value* b, size_t i) {
  auto dim = [i](const Value* v) -> const Dim* {
    const TypeInfo& t = v->type;
    if (!t.known || !t.is_tensor || !t.has_shape || i >= t.dims.size()) return nullptr;
    return &t.dims[i];
  };
  const Dim *x = dim(a), *y = dim(b);
  if (!x || !y) return false;
  if (x->value && *x->value >= 0) return x->value == y->value;
  return x->param && !x->param->empty() && x->param->rfind("unk__", 0) != 0 && x->param == y->param;
}

// Per pass run: the chains Reshape(mid = inner(x), s2) whose s2 copies (0) only dims of mid
// that shape facts prove equal to x's, decided in one sweep over the graph as it was when
// the first such chain was met (later rewrites keep every value's shape, so the proofs hold).
class ZeroCopyProofs {
 public:
  bool proven(Model& model, const Node* outer, const Value* mid, const Value* x) {
    if (!swept_) sweep(model);
    auto it = proven_.find(outer);
    return it != proven_.end() && it->second == std::make_pair(mid, x);
  }

 private:
  void sweep(Model& model) {
    swept_ = true;
    analysis::ShapeFacts facts(model);  // the graph now, not the model's memo of an older one
    for (Node* n = model.graph->first(); n; n = n->next()) {
      if (n->op_type != "Reshape" || !n->domain.value.empty() || n->inputs().size() < 2) continue;
      Value* mid = n->inputs()[0];
      const Node* inner = mid ? mid->producer() : nullptr;
      if (!inner || inner->inputs().empty() || !inner->inputs()[0]) continue;
      const Value* x = inner->inputs()[0];
      auto s2 = constant_ints(n->inputs()[1], 4096);
      if (!s2) continue;
      bool ok = true;
      for (size_t i = 0; ok && i < s2->size(); ++i) {
        const int a = static_cast<int>(i);
        ok = (*s2)[i] != 0 || facts.same_dim(mid, a, x, a);
      }
      if (ok) proven_[n] = {mid, x};
    }
  }

  bool swept_ = false;
  std::unordered_map<const Node*, std::pair<const Value*, const Value*>> proven_;
};

// Reshape(inner(x), s2) -> Reshape(x, s2): inner only regroups elements, and s2 does not look
// at inner's dims (no 0 entries, or allowzero=1), or the dims its 0 entries copy are x's too
// (the same in the types, or proven equal by shape facts: a head split's (B, S) merged back).
Replacement reshape_of_reshape(const Match& m, Rewriter& rw, ZeroCopyProofs& proofs) {
  Node* outer = m.root();
  Node* inner = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(inner)) return rw.fail("attribute refs");
  auto s2 = constant_ints(outer->inputs()[1], 4096);
  if (!s2) return rw.fail("the outer shape is not a constant");
  const bool allowzero = int_attr(outer, "allowzero").value_or(0) != 0;
  Value *mid = m.value("mid"), *x = m.value("x");
  bool typed = true;
  for (size_t i = 0; i < s2->size(); ++i) {
    typed = typed && ((*s2)[i] != 0 || same_type_dim(mid, x, i));
  }
  if (!allowzero && !typed && !proofs.proven(*rw.graph().model(), outer, mid, x)) {
    return rw.fail("the outer shape copies dims (0) of the intermediate not known to be x's");
  }
  outer->set_input(0, x);
  return outer->outputs();
}

// Reshape(Cast(Reshape(x, s1)), s2) -> Cast(Reshape(Reshape(x, s1), s2)): a precision Cast
// between two reshapes (fp16 exports that compute a head-split step in fp32) commutes with
// them; moved below the pair, the reshapes meet and fold (or cancel) like any chain.
Replacement sink_cast(const Match& m, Rewriter& rw) {
  Node* outer = m.root();
  Node* cast = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(cast)) return rw.fail("attribute refs");
  if (cast->attributes.size() != 1 || !cast->attribute("to")) {
    return rw.fail("the Cast has attributes other than 'to'");
  }
  const Node* src = cast->inputs()[0] ? cast->inputs()[0]->producer() : nullptr;
  if (!src || src->op_type != "Reshape" || !src->domain.value.empty()) {
    return rw.fail("the Cast does not read a Reshape");
  }
  if (cast->outputs()[0]->uses().size() != 1) return rw.fail("the Cast has other users");
  std::vector<Attribute> attrs;
  for (const Attribute& a : outer->attributes) attrs.push_back(copy_attribute(a));
  Value* r = rw.op1("Reshape", {m.value("x"), outer->inputs()[1]}, std::move(attrs));
  std::vector<Attribute> to;
  to.push_back(copy_attribute(*cast->attribute("to")));
  return std::vector<Value*>{rw.op1("Cast", {r}, std::move(to))};
}

// The values of `v`, sorted, without repeats.
std::vector<int64_t> distinct(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// The k-th (from 0) non-negative integer not in `taken` (sorted, distinct): the position of
// dim k of the tensor without those dims. In O(|taken|), whatever the axes' values (a walk
// up to the largest axis hung on an axis of 2^44 when the rank is unknown).
int64_t kth_outside(const std::vector<int64_t>& taken, int64_t k) {
  int64_t pos = k;
  for (int64_t t : taken) {
    if (t > pos) break;
    ++pos;
  }
  return pos;
}

// Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, c): c lists the new dims of the final output.
Replacement unsqueeze_chain(const Match& m, Rewriter& rw) {
  Node* outer = m.root();
  Node* inner = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(inner)) return rw.fail("attribute refs");
  IntList a = int_list(inner, "axes", 1), b = int_list(outer, "axes", 1);
  if (!a.known || !b.known || a.values.empty() || b.values.empty()) {
    return rw.fail("axes are not constants");
  }
  const int r = value_rank(m.value("x"));
  const int64_t mid_rank = r < 0 ? -1 : r + static_cast<int64_t>(a.values.size());
  const int64_t out_rank = r < 0 ? -1 : mid_rank + static_cast<int64_t>(b.values.size());
  auto na = normalize_axes(a.values, mid_rank);
  auto nb = normalize_axes(b.values, out_rank);
  if (!na || !nb) return rw.fail("axes are negative with an unknown rank, or invalid");
  // The output's dims that are not in b are the intermediate's dims, in order: the k-th of
  // them is the intermediate's dim k, new if k is in a.
  std::vector<int64_t> c = *nb;
  for (int64_t k : distinct(*na)) c.push_back(kth_outside(distinct(*nb), k));
  std::sort(c.begin(), c.end());
  outer->set_input(0, m.value("x"));
  set_axes(outer, rw, c);
  return outer->outputs();
}

// Squeeze(Squeeze(x, a), b) -> Squeeze(x, c): c in terms of x's dims.
Replacement squeeze_chain(const Match& m, Rewriter& rw) {
  Node* outer = m.root();
  Node* inner = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(inner)) return rw.fail("attribute refs");
  IntList a = int_list(inner, "axes", 1), b = int_list(outer, "axes", 1);
  // Without axes, Squeeze drops every 1-dim: not something to merge.
  if (!a.known || !b.known || a.values.empty() || b.values.empty()) {
    return rw.fail("axes are absent or not constants");
  }
  const int r = value_rank(m.value("x"));
  const int64_t mid_rank = r < 0 ? -1 : r - static_cast<int64_t>(a.values.size());
  auto na = normalize_axes(a.values, r);
  auto nb = normalize_axes(b.values, mid_rank);
  if (!na || !nb) return rw.fail("axes are negative with an unknown rank, or invalid");
  // The intermediate's dim k is the k-th dim of x not in a.
  std::vector<int64_t> c = *na;
  for (int64_t k : distinct(*nb)) c.push_back(kth_outside(distinct(*na), k));
  std::sort(c.begin(), c.end());
  outer->set_input(0, m.value("x"));
  set_axes(outer, rw, c);
  return outer->outputs();
}

// Squeeze(Unsqueeze(x, a), a) and Unsqueeze(Squeeze(x, a), a) are x. The second holds because
// Squeeze only accepts dims of size 1, which Unsqueeze puts back.
Replacement cancel_pair(const Match& m, Rewriter& rw, bool unsqueeze_first) {
  Node* outer = m.root();
  Node* inner = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(inner)) return rw.fail("attribute refs");
  IntList a = int_list(inner, "axes", 1), b = int_list(outer, "axes", 1);
  if (!a.known || !b.known || a.values.empty() || a.values.size() != b.values.size()) {
    return rw.fail("axes are absent, not constants, or of different counts");
  }
  Value* x = m.value("x");
  const int r = value_rank(x);
  // The axes of both name dims of the larger tensor (the intermediate, or x).
  const int64_t big =
      r < 0 ? -1 : (unsqueeze_first ? r + static_cast<int64_t>(a.values.size()) : r);
  auto na = normalize_axes(a.values, big), nb = normalize_axes(b.values, big);
  if (!na || !nb) return rw.fail("axes are negative with an unknown rank, or invalid");
  std::sort(na->begin(), na->end());
  std::sort(nb->begin(), nb->end());
  if (*na != *nb) return rw.fail("the axes differ");
  if (!unsqueeze_first) {
    if (auto dims = value_dims(x)) {
      for (int64_t ax : *na) {
        const auto& d = (*dims)[static_cast<size_t>(ax)];
        if (d && *d != 1) return rw.fail("Squeeze of a dim that is not 1");
      }
    }
  }
  if (!can_replace(rw.graph(), outer->outputs()[0], x)) {
    return rw.fail("the output is a graph output that x cannot take the name of");
  }
  return std::vector<Value*>{x};
}

// Flatten(Reshape(x, s), k) -> Reshape(x, [P, Q]) with P, Q the products of s before/after k.
Replacement flatten_of_reshape(const Match& m, Rewriter& rw) {
  Node* outer = m.root();
  Node* inner = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(inner)) return rw.fail("attribute refs");
  // The new Reshape only pays off when the inner one goes away.
  Value* mid = m.value("mid");
  if (mid->uses().size() != 1 || mid->is_graph_output()) return rw.fail("the Reshape is shared");
  if (inner->inputs().size() < 2) return rw.fail("Reshape-1 (shape attribute)");
  auto s = constant_ints(inner->inputs()[1], 4096);
  if (!s) return rw.fail("the inner shape is not a constant");
  const int64_t rank = static_cast<int64_t>(s->size());
  int64_t k = int_attr(outer, "axis").value_or(1);
  if (k < 0) k += rank;
  if (k < 0 || k > rank) return rw.fail("axis out of range");
  // Only fully spelled-out targets (one -1 at most): 0 would copy a dim of x.
  int64_t p = 1, q = 1;
  int unknown = 0;
  bool unknown_in_p = false;
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t d = (*s)[static_cast<size_t>(i)];
    if (d == -1) {
      ++unknown;
      unknown_in_p = i < k;
    } else if (d <= 0) {
      return rw.fail("the inner shape has 0 or invalid entries");
    } else {
      (i < k ? p : q) *= d;
      if (p > (int64_t{1} << 40) || q > (int64_t{1} << 40)) return rw.fail("sizes too large");
    }
  }
  if (unknown > 1) return rw.fail("more than one -1");
  std::vector<int64_t> shape{p, q};
  if (unknown) shape[unknown_in_p ? 0 : 1] = -1;
  Value* init = cleanup::int64_constant(rw, outer->outputs()[0]->name() + "_shape", shape);
  return std::vector<Value*>{rw.op1("Reshape", {inner->inputs()[0], init})};
}

// Flatten(Flatten(x, k), 1) is Flatten(x, k); Flatten(Flatten(x, k), 0) is Flatten(x, 0).
Replacement flatten_of_flatten(const Match& m, Rewriter& rw) {
  Node* outer = m.root();
  Node* inner = m.value("mid")->producer();
  if (has_attr_refs(outer) || has_attr_refs(inner)) return rw.fail("attribute refs");
  int64_t k2 = int_attr(outer, "axis").value_or(1);
  if (k2 < 0) k2 += 2;  // the intermediate has rank 2
  if (k2 != 0 && k2 != 1) return rw.fail("outer axis is not 0 or 1");
  const int64_t k1 = int_attr(inner, "axis").value_or(1);
  outer->set_input(0, m.value("x"));
  bool set = false;
  for (auto& a : outer->attributes) {
    if (a.name == "axis") {
      a.i = k2 == 0 ? 0 : k1;
      set = true;
    }
  }
  if (!set) outer->attributes.push_back(attr_int("axis", k2 == 0 ? 0 : k1));
  return outer->outputs();
}

// A rule `outer(inner(x, ...), ...)`; inner may have other users (it then stays).
Rule chain_rule(const std::string& name, std::vector<std::string> inner_ops,
                const std::string& outer_op, int outer_inputs, RewriteFn fn) {
  auto p = std::make_shared<Pattern>(name);
  P mid = p->op_any(std::move(inner_ops), {p->var("x")}).extra_inputs().shared();
  p->node(mid.id()).name = "mid";
  std::vector<P> ins{mid};
  for (int i = 1; i < outer_inputs; ++i) ins.push_back(p->var("in" + std::to_string(i)));
  P root = p->op(outer_op, ins);
  if (outer_inputs == 1) root.extra_inputs();
  p->root(root);
  return {name, p, std::move(fn)};
}

std::vector<Rule> rules(const PassContext&) {
  auto proofs = std::make_shared<ZeroCopyProofs>();
  return {
      chain_rule(
          "fold_reshape_chain", {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}, "Reshape", 2,
          [proofs](const Match& m, Rewriter& rw) { return reshape_of_reshape(m, rw, *proofs); }),
      chain_rule("fold_reshape_cast_reshape", {"Cast"}, "Reshape", 2, sink_cast),
      chain_rule("fold_unsqueeze_chain", {"Unsqueeze"}, "Unsqueeze", 1, unsqueeze_chain),
      chain_rule("fold_squeeze_chain", {"Squeeze"}, "Squeeze", 1, squeeze_chain),
      chain_rule("cancel_unsqueeze_squeeze", {"Unsqueeze"}, "Squeeze", 1,
                 [](const Match& m, Rewriter& rw) { return cancel_pair(m, rw, true); }),
      chain_rule("cancel_squeeze_unsqueeze", {"Squeeze"}, "Unsqueeze", 1,
                 [](const Match& m, Rewriter& rw) { return cancel_pair(m, rw, false); }),
      chain_rule("fold_flatten_of_reshape", {"Reshape"}, "Flatten", 1, flatten_of_reshape),
      chain_rule("fold_flatten_chain", {"Flatten"}, "Flatten", 1, flatten_of_flatten),
  };
}

const PassRegistrar kRegister{rule_pass(
    "fold_reshapes",
    "collapse Reshape/Flatten/Squeeze/Unsqueeze chains into one op, or none when they cancel",
    {"cleanup"}, rules)};

}  // namespace
}  // namespace fastopt::passes
