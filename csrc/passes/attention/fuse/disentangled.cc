// deberta-v2's position terms (disentangled.h has the form).
#include "passes/attention/fuse/disentangled.h"

#include <vector>

#include "passes/attention/shapes.h"

namespace fastopt::passes::disentangled {
namespace {

// The one node reading `v` (nullptr when v is read by none, by several, or is a graph output).
const Node* only_reader(const Value* v) {
  if (v->is_graph_output() || v->uses().size() != 1) return nullptr;
  const Node* n = v->uses()[0].node;
  return is_standard(n) ? n : nullptr;
}

bool has_perm(const Node* n, const std::vector<int64_t>& perm) {
  const Attribute* a = n->attribute("perm");
  return a && a->ints == perm;
}

// A scalar-shaped factor (rank 0, or one element): the term's 1/c.
bool scalar_shaped(const Value* v) {
  const int r = rank_of(v);
  return r == 0 || (r == 1 && v->type.has_shape && v->type.dims[0].value == 1);
}

// A MatMul of flat Q/K x3 (rank 3) by something else: the start of a position term.
bool is_term_matmul(const Value* x3, const Node* user) {
  return is_standard(user) && user->op_type == "MatMul" && user->inputs().size() == 2 &&
         user->inputs()[0] == x3 && rank_of(x3) == 3;
}

// GatherElements on the last axis of `v`, its sole reader: its output, or null.
const Value* gathered(const Value* v) {
  const Node* n = only_reader(v);
  if (!n || n->op_type != "GatherElements" || n->inputs()[0] != v) return nullptr;
  const Attribute* axis = n->attribute("axis");
  if (!axis || !axis->i || (*axis->i != -1 && *axis->i != 2)) return nullptr;
  return n->outputs()[0];
}

// Steps `v` past its sole reader's Transpose(0, 2, 1) (p2c: (T, S) -> (S, T)), then past a
// Div or Mul by a scalar-shaped factor, each where present.
const Value* past_transpose_and_scale(const Value* v) {
  const Node* n = only_reader(v);
  if (n && n->op_type == "Transpose" && has_perm(n, {0, 2, 1})) {
    v = n->outputs()[0];
    n = only_reader(v);
  }
  if (n && (n->op_type == "Div" || n->op_type == "Mul") && n->inputs().size() == 2 &&
      n->inputs()[0] == v && scalar_shaped(n->inputs()[1])) {
    v = n->outputs()[0];
  }
  return v;
}

}  // namespace

bool reads_for_position_term(const Value* x3, const Node* user, const Value* bias) {
  if (!bias || !is_term_matmul(x3, user)) return false;
  const Value* v = gathered(user->outputs()[0]);
  if (!v) return false;
  v = past_transpose_and_scale(v);
  const Node* n = only_reader(v);
  // The sum of the terms: a few Adds (two terms and TorchScript's 0 + c2p) end at the bias.
  for (int i = 0; i < 4 && v != bias; ++i) {
    if (!n || n->op_type != "Add" || n->inputs().size() != 2) return false;
    v = n->outputs()[0];
    if (v != bias) n = only_reader(v);
  }
  return v == bias;
}

}  // namespace fastopt::passes::disentangled
