// The attention family's size queries on the one shape analysis (see shapes.h).
#include "passes/attention/shapes.h"

#include <vector>

#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {

// The model's analysis when `v` is a value of the main graph, else null (subgraph and function
// values: the analysis does not look inside them).
analysis::ShapeFacts* facts_for(const Value* v) {
  Graph* g = v ? v->graph() : nullptr;
  Model* m = g ? g->model() : nullptr;
  if (!m || m->graph.get() != g) return nullptr;
  return &analysis::facts_of(*m);
}

// Dims of `v`: the analysis's, or (outside the main graph) the declared ones.
std::optional<std::vector<analysis::DimExpr>> dims_known(const Value* v) {
  if (analysis::ShapeFacts* sf = facts_for(v)) {
    const analysis::Facts* f = sf->facts(v);
    if (f && f->ranked) return f->dims;
    return std::nullopt;
  }
  return std::nullopt;
}

int axis_in(int axis, int rank) {
  return axis < 0 ? axis + rank : axis;
}

}  // namespace

int32_t dtype_of(const Value* v) {
  if (!v) return 0;
  if (analysis::ShapeFacts* sf = facts_for(v)) {
    if (int32_t t = sf->dtype(v)) return t;
  }
  return value_dtype(v);
}

int rank_of(const Value* v) {
  if (!v) return -1;
  if (analysis::ShapeFacts* sf = facts_for(v)) {
    if (int r = sf->rank(v); r >= 0) return r;
  }
  return value_rank(v);
}

std::optional<int64_t> resolve_dim(const Value* v, int axis) {
  if (!v) return std::nullopt;
  if (analysis::ShapeFacts* sf = facts_for(v)) {
    if (sf->rank(v) >= 0) return sf->known_dim(v, axis);
  }
  auto dims = dims_of(v);
  if (!dims) return std::nullopt;
  const int a = axis_in(axis, static_cast<int>(dims->size()));
  if (a < 0 || a >= static_cast<int>(dims->size())) return std::nullopt;
  return (*dims)[static_cast<size_t>(a)].value;
}

std::optional<int64_t> shape_element(const Value* shape, int index) {
  if (!shape) return std::nullopt;
  if (analysis::ShapeFacts* sf = facts_for(shape)) {
    if (const auto* elems = sf->shape_value(shape)) {
      const int i = axis_in(index, static_cast<int>(elems->size()));
      if (i < 0 || i >= static_cast<int>(elems->size())) return std::nullopt;
      return (*elems)[static_cast<size_t>(i)].constant_value();
    }
    return std::nullopt;
  }
  auto c = constant_ints(shape, analysis::kMaxShapeValue);
  if (!c) return std::nullopt;
  const int i = axis_in(index, static_cast<int>(c->size()));
  if (i < 0 || i >= static_cast<int>(c->size())) return std::nullopt;
  return (*c)[static_cast<size_t>(i)];
}

std::optional<int64_t> shape_length(const Value* shape) {
  if (!shape) return std::nullopt;
  int64_t n = 1;
  if (auto dims = dims_known(shape)) {
    for (const analysis::DimExpr& d : *dims) {
      auto c = d.constant_value();
      if (!c) return std::nullopt;
      n *= *c;
    }
    return n;
  }
  auto dims = dims_of(shape);
  if (!dims) return std::nullopt;
  for (const Dim& d : *dims) {
    if (!d.value) return std::nullopt;
    n *= *d.value;
  }
  return n;
}

bool same_length(const Value* a, int axis_a, const Value* b, int axis_b, int rank) {
  if (!a || !b) return false;
  analysis::ShapeFacts* sf = facts_for(a);
  if (sf && sf == facts_for(b)) {
    if (rank > 0 && (sf->rank(a) != rank || sf->rank(b) != rank)) return false;
    return sf->same_dim(a, axis_a, b, axis_b);
  }
  // Outside the main graph: the declared dims.
  auto da = dims_of(a), db = dims_of(b);
  if (!da || !db ||
      (rank > 0 &&
       (da->size() != static_cast<size_t>(rank) || db->size() != static_cast<size_t>(rank)))) {
    return false;
  }
  const int ia = axis_in(axis_a, static_cast<int>(da->size()));
  const int ib = axis_in(axis_b, static_cast<int>(db->size()));
  if (ia < 0 || ib < 0 || ia >= static_cast<int>(da->size()) ||
      ib >= static_cast<int>(db->size())) {
    return false;
  }
  return same_dim((*da)[static_cast<size_t>(ia)], (*db)[static_cast<size_t>(ib)]);
}

bool is_standard(const Node* n) {
  return (n->domain.value.empty() || n->domain.value == "ai.onnx") && mistyped_reason(n).empty();
}

Node* standard_producer(const Value* v, const char* op, size_t arity) {
  Node* p = v ? v->producer() : nullptr;
  if (!p || p->op_type != op || !(p->domain.value.empty() || p->domain.value == "ai.onnx") ||
      (arity && p->inputs().size() != arity) || p->outputs().size() != 1) {
    return nullptr;
  }
  for (const Value* in : p->inputs()) {
    if (!in) return nullptr;
  }
  return p;
}

namespace {
bool read_only_for_shape_rec(const Value* v, const Node* replaced, int depth) {
  if (depth > 4 || v->is_graph_output()) return false;
  for (const Use& u : v->uses()) {
    const Node* n = u.node;
    if (n == replaced) continue;
    if (!is_standard(n)) return false;
    if (n->op_type == "Shape") continue;
    if ((n->op_type == "Reshape" && u.input_index == 0) || n->op_type == "Transpose") {
      if (n->outputs()[0] && read_only_for_shape_rec(n->outputs()[0], replaced, depth + 1))
        continue;
    }
    return false;
  }
  return true;
}
}  // namespace

bool read_only_for_shape(const Value* v, const Node* replaced) {
  return read_only_for_shape_rec(v, replaced, 0);
}

}  // namespace fastopt::passes
