// Sizes of attention tensors worked out through their producers (see shapes.h).
#include "passes/attention/shapes.h"

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "ir/constant.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {

constexpr int kMaxDepth = 16;  // producer chains between a head split and attention are short

std::optional<int64_t> dim_rec(const Value* v, int axis, int depth);
int rank_rec(const Value* v, int depth);
std::optional<int64_t> element_rec(const Value* shape, int index, int depth);
std::optional<int64_t> length_rec(const Value* shape, int depth);

// The producer of `v`, unless an attribute of it has the wrong type: sizes are never read from
// a node ORT refuses (its attributes would read as the defaults).
const Node* typed_producer(const Value* v) {
  const Node* p = v->producer();
  return p && !pattern::mistyped_attribute(*p) ? p : nullptr;
}

const std::vector<int64_t>* ints_attr(const Node* n, const std::string& name) {
  const Attribute* a = n->attribute(name);
  return a ? &a->ints : nullptr;
}

// A scalar int64 computed from shapes: a constant, Gather(Shape(x), i), or a product of those.
std::optional<int64_t> scalar_rec(const Value* v, int depth) {
  if (!v || depth > kMaxDepth) return std::nullopt;
  if (auto c = constant_ints(v, 1)) {
    if (c->size() == 1) return (*c)[0];
    return std::nullopt;
  }
  const Node* p = typed_producer(v);
  if (!p) return std::nullopt;
  if (p->op_type == "Gather" && p->inputs().size() == 2 && p->inputs()[0]->producer() &&
      p->inputs()[0]->producer()->op_type == "Shape") {
    auto idx = constant_ints(p->inputs()[1], 1);
    if (!idx || idx->size() != 1) return std::nullopt;
    return element_rec(p->inputs()[0], static_cast<int>((*idx)[0]), depth + 1);
  }
  if (p->op_type == "Mul" && p->inputs().size() == 2) {
    auto a = scalar_rec(p->inputs()[0], depth + 1), b = scalar_rec(p->inputs()[1], depth + 1);
    if (a && b) return *a * *b;
    return std::nullopt;
  }
  if (p->op_type == "Squeeze" || p->op_type == "Unsqueeze" || p->op_type == "Cast") {
    return element_rec(p->inputs()[0], 0, depth + 1);
  }
  return std::nullopt;
}

std::optional<int64_t> length_rec(const Value* shape, int depth) {
  if (!shape || depth > kMaxDepth) return std::nullopt;
  if (auto t = constant_tensor(shape)) {
    int64_t n = 1;
    for (int64_t d : t->dims) n *= d;
    return n;
  }
  if (shape->type.has_shape && shape->type.dims.size() == 1 && shape->type.dims[0].value) {
    return *shape->type.dims[0].value;
  }
  const Node* p = typed_producer(shape);
  if (!p) return std::nullopt;
  if (p->op_type == "Unsqueeze" && rank_rec(p->inputs()[0], depth + 1) == 0) return 1;
  if (p->op_type == "Shape") {
    const int r = rank_rec(p->inputs()[0], depth + 1);
    if (r < 0) return std::nullopt;
    int64_t start = int_attr_or(p, "start", 0), end = int_attr_or(p, "end", r);
    if (start < 0) start += r;
    if (end < 0) end += r;
    start = std::clamp<int64_t>(start, 0, r);
    end = std::clamp<int64_t>(end, 0, r);
    return std::max<int64_t>(0, end - start);
  }
  if (p->op_type == "Concat") {
    int64_t n = 0;
    for (const Value* in : p->inputs()) {
      auto l = length_rec(in, depth + 1);
      if (!l) return std::nullopt;
      n += *l;
    }
    return n;
  }
  if (p->op_type == "Where" || p->op_type == "Cast")
    return length_rec(p->inputs().back(), depth + 1);
  return std::nullopt;
}

std::optional<int64_t> element_rec(const Value* shape, int index, int depth) {
  if (!shape || depth > kMaxDepth) return std::nullopt;
  if (auto c = constant_ints(shape, 64)) {
    if (index < 0) index += static_cast<int>(c->size());
    if (index < 0 || index >= static_cast<int>(c->size())) return std::nullopt;
    return (*c)[index];
  }
  const Node* p = typed_producer(shape);
  if (!p) return std::nullopt;
  if (p->op_type == "Shape") {  // element i of Shape(x)[start:end]
    const Value* x = p->inputs()[0];
    int64_t start = int_attr_or(p, "start", 0);
    const int r = rank_rec(x, depth + 1);
    if (start < 0) {
      if (r < 0) return std::nullopt;
      start += r;
    }
    return dim_rec(x, static_cast<int>(start + index), depth + 1);
  }
  if (p->op_type == "Concat") {
    if (index < 0) {
      auto l = length_rec(shape, depth + 1);
      if (!l) return std::nullopt;
      index += static_cast<int>(*l);
    }
    int64_t offset = 0;
    for (const Value* in : p->inputs()) {
      auto l = length_rec(in, depth + 1);
      if (!l) return std::nullopt;
      if (index < offset + *l) return element_rec(in, static_cast<int>(index - offset), depth + 1);
      offset += *l;
    }
    return std::nullopt;
  }
  if (p->op_type == "Unsqueeze" && index == 0) return scalar_rec(p->inputs()[0], depth + 1);
  // TorchScript's Expand targets: Where(Equal(s, -1), 1, s) replaces -1 by 1.
  if (p->op_type == "Where" && p->inputs().size() == 3) {
    const Node* eq = p->inputs()[0]->producer();
    if (eq && eq->op_type == "Equal" && eq->inputs()[0] == p->inputs()[2]) {
      auto s = element_rec(p->inputs()[2], index, depth + 1);
      auto c = element_rec(eq->inputs()[1], index, depth + 1);
      auto r = element_rec(p->inputs()[1], index, depth + 1);
      if (!s || !c) return std::nullopt;
      if (*s != *c) return s;
      return r;
    }
    return std::nullopt;
  }
  if (p->op_type == "Slice" && p->inputs().size() >= 3) {  // Shape(x)[a:b] as a Slice
    auto starts = constant_ints(p->inputs()[1], 1);
    if (!starts || starts->size() != 1) return std::nullopt;
    if (p->inputs().size() > 4 && p->inputs()[4]) {
      auto steps = constant_ints(p->inputs()[4], 1);
      if (!steps || steps->size() != 1 || (*steps)[0] != 1) return std::nullopt;
    }
    int64_t start = (*starts)[0];
    auto l = length_rec(p->inputs()[0], depth + 1);
    if (start < 0) {
      if (!l) return std::nullopt;
      start = std::max<int64_t>(0, start + *l);
    }
    if (index < 0) return std::nullopt;
    return element_rec(p->inputs()[0], static_cast<int>(start + index), depth + 1);
  }
  return std::nullopt;
}

bool elementwise(const std::string& op) {
  static const char* kOps[] = {"Add", "Sub", "Mul", "Div", "Where", "Pow", "Max", "Min"};
  return std::any_of(std::begin(kOps), std::end(kOps), [&](const char* o) { return op == o; });
}

bool shape_preserving(const Node* n) {
  static const char* kOps[] = {"Cast",
                               "Neg",
                               "Identity",
                               "Sqrt",
                               "Relu",
                               "Sigmoid",
                               "Tanh",
                               "Softmax",
                               "RotaryEmbedding",
                               "LayerNormalization",
                               "SimplifiedLayerNormalization",
                               "RMSNormalization"};
  return std::any_of(std::begin(kOps), std::end(kOps),
                     [&](const char* o) { return n->op_type == o; });
}

std::optional<int64_t> dim_rec(const Value* v, int axis, int depth) {
  if (!v || depth > kMaxDepth) return std::nullopt;
  const int rank = rank_rec(v, depth + 1);
  if (axis < 0) {
    if (rank < 0) return std::nullopt;
    axis += rank;
  }
  if (axis < 0 || (rank >= 0 && axis >= rank)) return std::nullopt;
  if (v->type.is_tensor && v->type.has_shape && axis < static_cast<int>(v->type.dims.size()) &&
      v->type.dims[axis].value) {
    return *v->type.dims[axis].value;
  }
  if (auto t = constant_tensor(v)) return t->dims[axis];
  const Node* p = typed_producer(v);
  if (!p) return std::nullopt;
  const auto& in = p->inputs();
  if (p->op_type == "Transpose") {
    const auto* perm = ints_attr(p, "perm");
    if (!perm || axis >= static_cast<int>(perm->size())) return std::nullopt;
    return dim_rec(in[0], static_cast<int>((*perm)[axis]), depth + 1);
  }
  if (p->op_type == "Reshape" && in.size() == 2) {
    auto e = element_rec(in[1], axis, depth + 1);
    if (!e) return std::nullopt;
    if (*e > 0) return e;
    if (*e == 0) {
      if (int_attr_or(p, "allowzero", 0) != 0) return 0;
      return dim_rec(in[0], axis, depth + 1);
    }
    // -1: the elements left over. Exporters keep the leading dims of the input (batch,
    // sequence) as the leading target elements and split or merge only the trailing ones, so
    // -1 = prod(input dims [r-1, r)) / prod(other target elements from r-1 on).
    const int r = rank_rec(in[0], depth + 1);
    auto n_out = length_rec(in[1], depth + 1);
    if (r < 1 || !n_out || axis < r - 1) return std::nullopt;
    int64_t total = 1;
    for (int i = r - 1; i < r; ++i) {
      auto d = dim_rec(in[0], i, depth + 1);
      if (!d) return std::nullopt;
      total *= *d;
    }
    int64_t rest = 1;
    for (int i = r - 1; i < *n_out; ++i) {
      if (i == axis) continue;
      auto d = element_rec(in[1], i, depth + 1);
      if (!d || *d <= 0) return std::nullopt;
      rest *= *d;
    }
    if (total % rest != 0) return std::nullopt;
    return total / rest;
  }
  if (p->op_type == "Slice" && in.size() >= 3) {
    std::vector<int64_t> axes;
    if (in.size() > 3 && in[3]) {
      auto a = constant_ints(in[3], 8);
      if (!a) return std::nullopt;
      axes = *a;
    } else {
      auto s = constant_ints(in[1], 8);
      if (!s) return std::nullopt;
      for (size_t i = 0; i < s->size(); ++i) axes.push_back(static_cast<int64_t>(i));
    }
    int pos = -1;
    for (size_t i = 0; i < axes.size(); ++i) {
      int64_t a = axes[i] < 0 && rank >= 0 ? axes[i] + rank : axes[i];
      if (a == axis) pos = static_cast<int>(i);
      if (axes[i] < 0 && rank < 0) return std::nullopt;
    }
    if (pos < 0) return dim_rec(in[0], axis, depth + 1);
    auto starts = constant_ints(in[1], 8), ends = constant_ints(in[2], 8);
    auto d = dim_rec(in[0], axis, depth + 1);
    if (!starts || !ends || !d) return std::nullopt;
    if (in.size() > 4 && in[4]) {
      auto steps = constant_ints(in[4], 8);
      if (!steps || (*steps)[pos] != 1) return std::nullopt;
    }
    int64_t s = (*starts)[pos], e = (*ends)[pos];
    if (s < 0) s += *d;
    if (e < 0) e += *d;
    s = std::clamp<int64_t>(s, 0, *d);
    e = std::clamp<int64_t>(e, 0, *d);
    return std::max<int64_t>(0, e - s);
  }
  if (p->op_type == "Concat") {
    int64_t cat = int_attr_or(p, "axis", 0);
    if (cat < 0 && rank >= 0) cat += rank;
    if (cat == axis || cat < 0) return std::nullopt;
    for (const Value* x : in) {
      if (auto d = dim_rec(x, axis, depth + 1)) return d;
    }
    return std::nullopt;
  }
  if (elementwise(p->op_type)) {
    // Broadcast: the size is that of any input whose aligned dim is not 1.
    if (rank < 0) return std::nullopt;
    bool all_one = true;
    for (const Value* x : in) {
      const int rx = rank_rec(x, depth + 1);
      if (rx < 0) {
        all_one = false;
        continue;
      }
      const int ax = axis - (rank - rx);
      if (ax < 0) continue;
      auto d = dim_rec(x, ax, depth + 1);
      if (d && *d != 1) return d;
      if (!d) all_one = false;
    }
    if (all_one) return 1;
    return std::nullopt;
  }
  if (shape_preserving(p) && !in.empty()) return dim_rec(in[0], axis, depth + 1);
  return std::nullopt;
}

int32_t dtype_rec(const Value* v, int depth) {
  if (!v || depth > kMaxDepth) return 0;
  if (int32_t t = value_dtype(v)) return t;
  const Node* p = typed_producer(v);
  if (!p || p->inputs().empty()) return 0;
  if (p->op_type == "Cast") return static_cast<int32_t>(int_attr_or(p, "to", 0));
  if (p->op_type == "Where" && p->inputs().size() == 3) return dtype_rec(p->inputs()[1], depth + 1);
  static const char* kSame[] = {"Transpose", "Reshape", "Slice",  "Unsqueeze",
                                "Squeeze",   "Expand",  "Concat", "Split"};
  const bool same = std::any_of(std::begin(kSame), std::end(kSame),
                                [&](const char* o) { return p->op_type == o; });
  if (same || elementwise(p->op_type) || shape_preserving(p) || p->op_type == "MatMul") {
    return dtype_rec(p->inputs()[0], depth + 1);
  }
  return 0;
}

int rank_rec(const Value* v, int depth) {
  if (!v || depth > kMaxDepth) return -1;
  const int r = value_rank(v);
  if (r >= 0) return r;
  const Node* p = typed_producer(v);
  if (!p || p->inputs().empty()) return -1;
  if (p->op_type == "Transpose") {
    const auto* perm = ints_attr(p, "perm");
    return perm && !perm->empty() ? static_cast<int>(perm->size())
                                  : rank_rec(p->inputs()[0], depth + 1);
  }
  if (p->op_type == "Reshape" && p->inputs().size() == 2) {
    auto n = length_rec(p->inputs()[1], depth + 1);
    return n ? static_cast<int>(*n) : -1;
  }
  if (p->op_type == "MatMul" && p->inputs().size() == 2) {  // batched: the larger rank, >= 2
    const int a = rank_rec(p->inputs()[0], depth + 1), b = rank_rec(p->inputs()[1], depth + 1);
    return a >= 2 && b >= 2 ? std::max(a, b) : -1;
  }
  if (elementwise(p->op_type)) {
    int out = -1;
    for (const Value* x : p->inputs()) {
      const int rx = rank_rec(x, depth + 1);
      if (rx < 0) return -1;
      out = std::max(out, rx);
    }
    return out;
  }
  if (shape_preserving(p) || p->op_type == "Concat" || p->op_type == "Slice") {
    return rank_rec(p->inputs()[0], depth + 1);
  }
  if (p->domain.value == kMsDomain &&
      (p->op_type == "SkipLayerNormalization" ||
       p->op_type == "SkipSimplifiedLayerNormalization") &&
      (v == p->outputs()[0] || (p->outputs().size() > 3 && v == p->outputs()[3]))) {
    return rank_rec(p->inputs()[0], depth + 1);  // the normalized sum and the sum: the input's
  }
  return -1;
}

}  // namespace

int32_t dtype_of(const Value* v) {
  return dtype_rec(v, 0);
}

int rank_of(const Value* v) {
  return rank_rec(v, 0);
}

std::optional<int64_t> resolve_dim(const Value* v, int axis) {
  return dim_rec(v, axis, 0);
}

std::optional<int64_t> shape_element(const Value* shape, int index) {
  return element_rec(shape, index, 0);
}

std::optional<int64_t> shape_length(const Value* shape) {
  return length_rec(shape, 0);
}

const Dim* dim_at(const Value* v, size_t rank, size_t axis) {
  if (!v || !v->type.known || !v->type.is_tensor || !v->type.has_shape) return nullptr;
  return v->type.dims.size() == rank ? &v->type.dims[axis] : nullptr;
}

bool same_dim(const Dim* a, const Dim* b) {
  return a && b && passes::same_dim(*a, *b);
}

// A standard op with well-typed attributes: the proofs never read a node ORT refuses.
bool is_standard(const Node* n) {
  return (n->domain.value.empty() || n->domain.value == "ai.onnx") && mistyped_reason(n).empty();
}

const Value* shape_dim_source(const Value* v, int64_t* index) {
  const Node* n = v ? v->producer() : nullptr;
  if (!n || !is_standard(n) || n->inputs().empty() || !n->inputs()[0]) return nullptr;
  if (n->op_type == "Shape" && n->attribute("start") && n->attribute("end")) {
    // Shape-15 reading one dim (dynamo exports): Shape(z, start=i, end=i+1).
    const int64_t start = int_attr_or(n, "start", -1), end = int_attr_or(n, "end", -1);
    if (start < 0 || end != start + 1) return nullptr;
    *index = start;
    return n->inputs()[0];
  }
  bool scalar = false;  // the Gather index must then be a scalar
  if (n->op_type == "Unsqueeze") {
    const Attribute* a = n->attribute("axes");  // opset < 13: an attribute
    auto axes = n->inputs().size() > 1
                    ? constant_ints(n->inputs()[1])
                    : std::optional<std::vector<int64_t>>(a ? a->ints : std::vector<int64_t>{});
    if (!axes || axes->size() != 1 || ((*axes)[0] != 0 && (*axes)[0] != -1)) return nullptr;
    n = n->inputs()[0]->producer();
    scalar = true;
    if (!n || !is_standard(n) || n->op_type != "Gather" || n->inputs().size() != 2) return nullptr;
  }
  std::optional<std::vector<int64_t>> at;
  if (n->op_type == "Gather" && n->inputs().size() == 2 && int_attr_or(n, "axis", 0) == 0) {
    auto t = constant_tensor(n->inputs()[1]);
    if (!t || t->dims.size() != (scalar ? 0u : 1u)) return nullptr;
    at = constant_ints(n->inputs()[1]);
  } else if (n->op_type == "Slice" && n->inputs().size() >= 3) {
    auto starts = constant_ints(n->inputs()[1]), ends = constant_ints(n->inputs()[2]);
    for (size_t i = 3; i < n->inputs().size(); ++i) {  // axes [0], steps [1]
      if (!n->inputs()[i]) continue;
      auto c = constant_ints(n->inputs()[i]);
      if (!c || *c != std::vector<int64_t>{i == 3 ? 0 : 1}) return nullptr;
    }
    if (starts && ends && starts->size() == 1 && ends->size() == 1 && (*starts)[0] >= 0 &&
        (*ends)[0] == (*starts)[0] + 1) {
      at = starts;
    }
  }
  if (!at || at->size() != 1 || (*at)[0] < 0) return nullptr;
  const Node* shape = n->inputs()[0] ? n->inputs()[0]->producer() : nullptr;
  if (!shape || !is_standard(shape) || shape->op_type != "Shape" || shape->attribute("start") ||
      shape->attribute("end") || !shape->inputs()[0]) {
    return nullptr;
  }
  *index = (*at)[0];
  return shape->inputs()[0];
}

// Element 1 of a Reshape target: the copy of the input's dim 1 (a constant 0; allowzero 0) or

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
