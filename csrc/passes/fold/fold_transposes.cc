// Two Transposes in a row are one Transpose, or none when they cancel.
//
//   x ── Transpose(p1) ── Transpose(p2) ── y   =>  x ── Transpose(p) ── y,  p[j] = p1[p2[j]]
//                                              =>  x                       when p is the identity
//
// Attention blocks transpose to [B, H, S, Dh] and back ([0,2,1,3] twice), and layout changes
// around convolutions (NCHW <-> NHWC) leave such pairs. The first Transpose may have other users:
// it then stays for them. A Cast between the two moves after them (it commutes with layout).
#include <variant>

#include "passes/cleanup/cleanup_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;
using cleanup::has_attr_refs;

// The permutation of a Transpose: its perm, or the reversal of `rank` dims when it has none
// (rank -1: unknown).
std::optional<std::vector<int64_t>> perm_of(const Node* n, int rank) {
  if (has_attr_refs(n)) return std::nullopt;
  if (const Attribute* a = n->attribute("perm")) return a->ints;
  if (rank < 0) return std::nullopt;
  std::vector<int64_t> p(static_cast<size_t>(rank));
  for (int i = 0; i < rank; ++i) p[static_cast<size_t>(i)] = rank - 1 - i;
  return p;
}

bool is_permutation(const std::vector<int64_t>& p) {
  std::vector<bool> seen(p.size(), false);
  for (int64_t v : p) {
    if (v < 0 || v >= static_cast<int64_t>(p.size()) || seen[static_cast<size_t>(v)]) return false;
    seen[static_cast<size_t>(v)] = true;
  }
  return true;
}

// out[j] = mid[p2[j]] = x[p1[p2[j]]]: the one permutation of Transpose(p2)(Transpose(p1)(x)).
std::variant<std::vector<int64_t>, std::string> combined_perm(const Node* inner,
                                                              const Node* outer) {
  auto p1 = perm_of(inner, value_rank(inner->inputs()[0]));
  if (!p1) return std::string("the first perm is unknown");
  auto p2 = perm_of(outer, static_cast<int>(p1->size()));
  if (!p2) return std::string("the second perm is unknown");
  if (p1->size() != p2->size() || !is_permutation(*p1) || !is_permutation(*p2)) {
    return std::string("the perms are not permutations of the same rank");
  }
  std::vector<int64_t> p(p2->size());
  for (size_t j = 0; j < p.size(); ++j) p[j] = (*p1)[static_cast<size_t>((*p2)[j])];
  return p;
}

bool is_identity(const std::vector<int64_t>& p) {
  for (size_t j = 0; j < p.size(); ++j) {
    if (p[j] != static_cast<int64_t>(j)) return false;
  }
  return true;
}

Replacement fold(const Match& m, Rewriter& rw, P inner_p) {
  Node* outer = m.root();
  auto combined = combined_perm(m.node(inner_p), outer);
  if (auto* why = std::get_if<std::string>(&combined)) return rw.fail(*why);
  const auto& p = std::get<std::vector<int64_t>>(combined);
  Value* x = m.value("x");
  if (is_identity(p) && can_replace(rw.graph(), outer->outputs()[0], x)) {
    return std::vector<Value*>{x};
  }
  // Every check is done: edit in place (the node keeps its name and its output's type).
  outer->set_input(0, x);
  bool set = false;
  for (auto& a : outer->attributes) {
    if (a.name == "perm") {
      a.ints = p;
      set = true;
    }
  }
  if (!set) outer->attributes.push_back(attr_ints("perm", p));
  return outer->outputs();
}

// Transpose(p2)(Cast(Transpose(p1)(x))) -> Cast(Transpose(p)(x)): a precision Cast between the
// pair (fp16 exports that compute a head-split step in fp32) commutes with the layout.
Replacement fold_through_cast(const Match& m, Rewriter& rw, P inner_p, P cast_p) {
  Node* cast = m.node(cast_p);
  if (has_attr_refs(cast) || cast->attributes.size() != 1 || !cast->attribute("to")) {
    return rw.fail("the Cast has attributes other than 'to'");
  }
  auto combined = combined_perm(m.node(inner_p), m.root());
  if (auto* why = std::get_if<std::string>(&combined)) return rw.fail(*why);
  auto& p = std::get<std::vector<int64_t>>(combined);
  Value* x = m.value("x");
  if (!is_identity(p)) {
    std::vector<Attribute> perm;
    perm.push_back(attr_ints("perm", std::move(p)));
    x = rw.op1("Transpose", {x}, std::move(perm));
  }
  std::vector<Attribute> to;
  to.push_back(copy_attribute(*cast->attribute("to")));
  return std::vector<Value*>{rw.op1("Cast", {x}, std::move(to))};
}

std::vector<Rule> rules(const PassContext&) {
  std::vector<Rule> out;
  {
    auto p = std::make_shared<Pattern>("fold_transposes");
    P inner = p->op("Transpose", {p->var("x")}).shared();  // other users keep it
    p->root(p->op("Transpose", {inner}));
    out.push_back({"fold_transposes", p,
                   [inner](const Match& m, Rewriter& rw) { return fold(m, rw, inner); }});
  }
  {
    auto p = std::make_shared<Pattern>("fold_transposes_cast");
    P inner = p->op("Transpose", {p->var("x")}).shared();
    P cast = p->op("Cast", {inner});
    p->root(p->op("Transpose", {cast}));
    out.push_back({"fold_transposes_cast", p, [inner, cast](const Match& m, Rewriter& rw) {
                     return fold_through_cast(m, rw, inner, cast);
                   }});
  }
  return out;
}

const PassRegistrar kRegister{rule_pass("fold_transposes",
                                        "merge Transpose(Transpose(x)) into one Transpose, or "
                                        "remove both when they cancel",
                                        {"cleanup"}, rules)};

}  // namespace
}  // namespace fastopt::passes
