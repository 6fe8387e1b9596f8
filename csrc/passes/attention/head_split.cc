// The head split and merge around an attention: Reshape + Transpose(0,2,1,3) of a 3-D
// projection, and the inverse pair after it.
#include "passes/attention/head_split.h"

#include <cstdint>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/sequence_proof.h"
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
  bool keeps =
      same_dim(dim_at(x3, 3, 0), dim_at(r4, 4, 0)) && same_dim(dim_at(x3, 3, 1), dim_at(r4, 4, 1));
  if (!keeps && rank_of(x3) == 3) {
    auto shape = constant_ints(r->inputs()[1]);
    keeps = int_attr_or(r, "allowzero", 0) == 0 && shape && shape->size() == 4 &&
            (*shape)[0] == 0 && (*shape)[1] == 0;
    // Elements that are x3's own dims need no allowzero: they copy whatever the dims are.
    keeps = keeps || copies_leading_dims(r->inputs()[1], x3);
  }
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
      bool merges_last = same_dim(dim_at(out, 3, 0), dim_at(q, 4, 0)) &&
                         same_dim(dim_at(out, 3, 1), dim_at(q, 4, 2));
      if (!merges_last && int_attr_or(r, "allowzero", 0) == 0) {
        auto shape = constant_ints(r->inputs()[1]);
        merges_last = shape && *shape == std::vector<int64_t>{0, 0, -1};
      }
      if (!merges_last) return {};
      merges.push_back(r);
    }
  }
  return merges;
}

}  // namespace fastopt::passes
