// The head split and merge around an attention: Reshape + Transpose(0,2,1,3) of a 3-D
// projection, and the inverse pair after it.
#include "passes/attention/head_split.h"

#include <cstdint>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {

Value* bsd_source(const Graph& g, const Value* x4, int32_t dtype) {
  const Node* t = x4->producer();
  if (!t || t->op_type != "Transpose" || !t->domain.value.empty() || t->graph() != &g) {
    return nullptr;
  }
  const Attribute* perm = t->attribute("perm");
  const Node* r = t->inputs()[0] ? t->inputs()[0]->producer() : nullptr;
  if (!perm || perm->ints != std::vector<int64_t>{0, 2, 1, 3} || !r || r->op_type != "Reshape" ||
      !r->domain.value.empty() || r->inputs().size() != 2 || !r->inputs()[0] ||
      !mistyped_reason(t).empty() || !mistyped_reason(r).empty()) {
    return nullptr;
  }
  Value* x3 = r->inputs()[0];
  const Value* r4 = r->outputs()[0];
  // (B, S) kept: the shape analysis reads 0 entries and targets computed from Shape ops.
  const bool keeps = rank_of(x3) == 3 && rank_of(r4) == 4 && same_length(x3, 0, r4, 0) &&
                     same_length(x3, 1, r4, 1);
  return keeps && dtype_of(x3) == dtype ? x3 : nullptr;
}

std::vector<Node*> head_merges(const Value* y, const Value* q) {
  std::vector<Node*> merges;
  for (const Use& u : y->uses()) {
    const Node* t = u.node;
    const Attribute* perm = t->attribute("perm");
    if (t->op_type != "Transpose" || !t->domain.value.empty() || !perm ||
        perm->ints != std::vector<int64_t>{0, 2, 1, 3} || t->outputs()[0]->is_graph_output() ||
        t->outputs()[0]->uses().empty() || !mistyped_reason(t).empty()) {
      return {};
    }
    for (const Use& w : t->outputs()[0]->uses()) {
      Node* r = w.node;
      if (r->op_type != "Reshape" || !r->domain.value.empty() || w.input_index != 0 ||
          r->graph() != y->graph() || !mistyped_reason(r).empty()) {
        return {};
      }
      const Value* out = r->outputs()[0];
      const bool merges_last = rank_of(out) == 3 && rank_of(q) == 4 && same_length(out, 0, q, 0) &&
                               same_length(out, 1, q, 2);
      if (!merges_last) return {};
      merges.push_back(r);
    }
  }
  return merges;
}

}  // namespace fastopt::passes
