// Shape folding: Shape/Size of values whose dims are known from their types become constants.
//
//   x[B, S, 128] ── Shape ─┬─ Gather(2) ─── Unsqueeze ─┐
//                          └─ Gather(0) ── Unsqueeze ──┴─ Concat ── Reshape
//   =>   Gather(Shape(x), 2) -> 128 (constant); the B branch stays (B is dynamic)
//
// Every exporter computes shapes at run time: TorchScript exports Shape -> Gather -> Unsqueeze
// -> Concat chains around each Reshape, dynamo exports Shape(start, end) slices. With static
// dims (from value types: run infer_shapes first) these chains collapse:
//   - Shape(x) [start:end] when the selected dims are known;
//   - Size(x) when every dim is known;
//   - Gather(Shape(x), i) and Slice(Shape(x), ...) when the dims they select are known, even
//     if others are symbolic (partially static shapes).
// fold_constants then folds what follows (Unsqueeze, Concat, Cast, ...).
#include <algorithm>

#include "ir/constant.h"
#include "passes/fold_constants.h"
#include "passes/registry.h"
#include "pattern/attr_schema.h"

namespace fastopt::passes {
namespace {

using KnownDims = std::vector<std::optional<int64_t>>;

bool standard(const Node* n) {
  return n && (n->domain.value.empty() || n->domain.value == "ai.onnx");
}

// Dims of `v`: a number where known, nullopt where not; nullopt when the rank is unknown.
std::optional<KnownDims> known_dims(const Value* v) {
  if (auto t = constant_tensor(v)) return KnownDims(t->dims.begin(), t->dims.end());
  const TypeInfo& type = v->type;
  if (!type.is_tensor || !type.has_shape) return std::nullopt;
  KnownDims out;
  for (const Dim& d : type.dims) {
    out.push_back(d.value && *d.value >= 0 ? d.value : std::nullopt);
  }
  return out;
}

// The dims a Shape node returns (its start/end attributes applied), or nullopt.
std::optional<KnownDims> shape_output(const Node& shape, int64_t opset) {
  auto dims = known_dims(shape.inputs()[0]);
  if (!dims) return std::nullopt;
  const int64_t r = static_cast<int64_t>(dims->size());
  int64_t start = 0, end = r;
  if (opset >= 15) {
    if (const Attribute* a = shape.attribute("start"); a && a->i) start = *a->i;
    if (const Attribute* a = shape.attribute("end"); a && a->i) end = *a->i;
  }
  auto clampi = [r](int64_t v) { return std::clamp(v < 0 ? v + r : v, int64_t{0}, r); };
  start = clampi(start);
  end = std::max(start, clampi(end));
  return KnownDims(dims->begin() + start, dims->begin() + end);
}

// Known values at `indices` of `dims`, or nullopt when one is unknown or out of range.
std::optional<std::vector<int64_t>> pick(const KnownDims& dims,
                                         const std::vector<int64_t>& indices) {
  const int64_t n = static_cast<int64_t>(dims.size());
  std::vector<int64_t> out;
  for (int64_t i : indices) {
    if (i < -n || i >= n) return std::nullopt;
    const auto& d = dims[i < 0 ? i + n : i];
    if (!d) return std::nullopt;
    out.push_back(*d);
  }
  return out;
}

// Positions a 1-D Slice(starts, ends, axes, steps) of a length-n vector selects.
std::optional<std::vector<int64_t>> slice_positions(int64_t n, const Node& slice, int64_t opset) {
  auto ints = [&](size_t i) -> std::optional<std::vector<int64_t>> {
    if (i >= slice.inputs().size() || !slice.inputs()[i]) return std::nullopt;
    return constant_ints(slice.inputs()[i], 8);
  };
  auto attr = [&](const char* name) -> std::optional<std::vector<int64_t>> {
    const Attribute* a = slice.attribute(name);
    if (!a || a->kind() != AttrType::kInts) return std::nullopt;
    return a->ints;
  };
  std::optional<std::vector<int64_t>> starts, ends, axes, steps;
  if (opset < 10) {
    starts = attr("starts");
    ends = attr("ends");
    axes = attr("axes");
  } else {
    starts = ints(1);
    ends = ints(2);
    const auto& in = slice.inputs();
    if (in.size() > 3 && in[3] && !(axes = ints(3))) return std::nullopt;
    if (in.size() > 4 && in[4] && !(steps = ints(4))) return std::nullopt;
  }
  if (!starts || !ends || starts->size() != 1 || ends->size() != 1) return std::nullopt;
  if (axes && (axes->size() != 1 || ((*axes)[0] != 0 && (*axes)[0] != -1))) return std::nullopt;
  const int64_t step = steps ? (steps->size() == 1 ? (*steps)[0] : 0) : 1;
  if (step == 0 || step == std::numeric_limits<int64_t>::min()) return std::nullopt;
  int64_t s = (*starts)[0], e = (*ends)[0];
  if (s < 0) s += n;
  if (e < 0) e += n;
  std::vector<int64_t> out;
  if (step > 0) {
    s = std::clamp(s, int64_t{0}, n);
    e = std::clamp(e, int64_t{0}, n);
    for (int64_t i = s; i < e; i += step) out.push_back(i);
  } else if (n > 0) {
    s = std::clamp(s, int64_t{0}, n - 1);
    e = std::clamp(e, int64_t{-1}, n - 1);
    for (int64_t i = s; i > e; i += step) out.push_back(i);
  }
  return out;
}

struct ShapeFolder {
  Model& model;
  PassContext& ctx;

  int64_t run() {
    std::vector<Graph*> graphs;
    model.for_each_graph([&](Graph& g) { graphs.push_back(&g); });
    int64_t rewrites = 0;
    for (Graph* g : graphs) rewrites += fold_graph(*g);
    return rewrites;
  }

  int64_t fold_graph(Graph& g) {
    const int64_t opset = graph_opset(model, g);
    int64_t rewrites = 0;
    for (Node *n = g.first(), *next; n; n = next) {
      next = n->next();
      if (!standard(n) || n->inputs().empty() || !n->inputs()[0] || n->outputs().size() != 1 ||
          !n->outputs()[0] ||
          (n->outputs()[0]->uses().empty() && !n->outputs()[0]->is_graph_output()) ||
          pattern::mistyped_attribute(*n)) {  // ORT refuses the node: never fold it away
        continue;
      }
      std::optional<std::pair<std::vector<int64_t>, std::vector<int64_t>>> folded;  // values, dims
      Node* shape = nullptr;  // the Shape node read by a Gather/Slice
      if (n->op_type == "Shape") {
        if (auto d = shape_output(*n, opset)) {
          std::vector<int64_t> all(d->size());
          for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
          if (auto v = pick(*d, all)) folded.emplace(*v, std::vector<int64_t>{int64_t(v->size())});
        }
      } else if (n->op_type == "Size") {
        if (auto d = known_dims(n->inputs()[0])) {
          int64_t size = 1;
          bool known = true;
          for (const auto& x : *d) {
            known = known && x;
            if (x) size *= *x;
          }
          if (known) folded.emplace(std::vector<int64_t>{size}, std::vector<int64_t>{});
        }
      } else if ((n->op_type == "Gather" || n->op_type == "Slice") && n->inputs()[0]->producer() &&
                 n->inputs()[0]->producer()->op_type == "Shape" &&
                 standard(n->inputs()[0]->producer())) {
        shape = n->inputs()[0]->producer();
        auto d = shape_output(*shape, opset);
        if (!d) continue;
        if (n->op_type == "Gather") folded = gather(*n, *d);
        if (n->op_type == "Slice") {
          auto positions = slice_positions(static_cast<int64_t>(d->size()), *n, opset);
          if (positions) {
            if (auto v = pick(*d, *positions)) {
              folded.emplace(*v, std::vector<int64_t>{int64_t(v->size())});
            }
          }
        }
      }
      if (!folded) continue;
      replace_with_constant(g, n->outputs()[0], make_int64_tensor(folded->first, folded->second));
      g.remove_node(n);
      ++ctx.counters[shape ? n->op_type + "(Shape)" : n->op_type];
      ++rewrites;
      if (shape && shape->alive() && shape->outputs()[0]->uses().empty() &&
          !shape->outputs()[0]->is_graph_output()) {
        if (next == shape) next = shape->next();
        g.remove_node(shape);
      }
    }
    return rewrites;
  }

  static std::optional<std::pair<std::vector<int64_t>, std::vector<int64_t>>> gather(
      const Node& n, const KnownDims& dims) {
    if (n.inputs().size() < 2 || !n.inputs()[1]) return std::nullopt;
    if (const Attribute* a = n.attribute("axis"); a && a->i && *a->i != 0 && *a->i != -1) {
      return std::nullopt;
    }
    auto idx = constant_tensor(n.inputs()[1]);
    if (!idx || (idx->dtype() != kInt64 && idx->dtype() != kInt32)) return std::nullopt;
    auto indices = tensor_ints(*idx, 64);
    if (!indices) return std::nullopt;
    auto v = pick(dims, *indices);
    if (!v) return std::nullopt;
    return std::make_pair(*v, idx->dims);
  }
};

int64_t fold_shapes(Model& model, PassContext& ctx) {
  return ShapeFolder{model, ctx}.run();
}

const PassRegistrar kRegister{{
    "fold_shapes",
    "Shape/Size, and Gather/Slice of Shape, over dims known from value types -> constants",
    {"cleanup", "needs_shapes"},
    1,
    INT64_MAX,
    true,
    fold_shapes,
}};

}  // namespace
}  // namespace fastopt::passes
