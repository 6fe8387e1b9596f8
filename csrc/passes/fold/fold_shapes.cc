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
//
// Then, with the symbolic shape analysis (csrc/analysis), over the main graph:
//   - any integer shape computation whose elements the analysis proves to be numbers
//     (Concat(Unsqueeze(Gather(Shape(x), 2)), [14]) with dim 2 a number from a Reshape target,
//     Where(Equal(shape, -1), ones, shape), ...) becomes a constant;
//   - Reshape(x, s) with a computed s whose output dims are proven: s becomes a constant
//     with 0 where an output dim equals x's dim at the same position (allowzero=0), numbers,
//     and -1 only when every other entry is a nonzero number; when the output dims are x's
//     dims the Reshape is x;
//   - Expand(x, s) whose output dims are x's dims is x;
//   - a shape computation with the same elements as one of its inputs is that input
//     (TorchScript's Where(Equal(s, -1), ones, s) before an Expand);
//   - Gather(Shape(x), i) with x an Unsqueeze/Expand/Reshape chain holding an Expand reads the
//     same dim of the chain's source (proven equal): a shape read does not keep a broadcast
//     copy alive. transformers 4.49 slices the mask to Shape(repeat_kv(present key))[2]: read
//     through the repeat, the present would feed the attention's own mask (a cycle once the
//     lowered op writes the present); read on the present, add_kv_cache's shape rewrite applies.
//
//   x[B,S,896] ─ Shape ─ Gather(0) ─ Unsqueeze ─┐
//              └ Shape ─ Gather(1) ─ Unsqueeze ─┴ Concat(·,·,[14],[64]) ─ Reshape(x, ·)
//   =>   Reshape(x, [0, 0, 14, 64])       (the Shape chain dies)
#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "analysis/shape_facts.h"
#include "eval/ort_semantics.h"
#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/fold/fold_constants.h"
#include "passes/registry.h"
#include "pattern/rewrite.h"
#include "schema/attr_schema.h"

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
  if (shape.inputs().empty() || !shape.inputs()[0]) return std::nullopt;  // a Shape of nothing
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
// Sets `differs` where ONNX's spec and ONNX Runtime select differently (then nullopt).
std::optional<std::vector<int64_t>> slice_positions(int64_t n, const Node& slice, int64_t opset,
                                                    bool* differs) {
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
  const eval::ort::SliceAxis a = eval::ort::slice_axis(n, (*starts)[0], (*ends)[0], step);
  if (!a.spec_agrees) {  // ONNX and ONNX Runtime select different dims: not folded
    *differs = true;
    return std::nullopt;
  }
  std::vector<int64_t> out;
  for (int64_t k = 0; k < a.count; ++k) out.push_back(a.start + k * step);  // in [0, n)
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
            known = known && x;  // a product past int64 (absurd dims in a type): not folded
            if (x && __builtin_mul_overflow(size, *x, &size)) known = false;
          }
          if (known) folded.emplace(std::vector<int64_t>{size}, std::vector<int64_t>{});
        }
      } else if ((n->op_type == "Gather" || n->op_type == "Slice") && n->inputs()[0]->producer() &&
                 n->inputs()[0]->producer()->op_type == "Shape" &&
                 standard(n->inputs()[0]->producer()) &&
                 !pattern::mistyped_attribute(*n->inputs()[0]->producer())) {
        shape = n->inputs()[0]->producer();
        auto d = shape_output(*shape, opset);
        if (!d) continue;
        if (n->op_type == "Gather") folded = gather(*n, *d);
        if (n->op_type == "Slice") {
          bool differs = false;
          auto positions = slice_positions(static_cast<int64_t>(d->size()), *n, opset, &differs);
          if (differs) {
            ++ctx.counters["refused_Slice(Shape)(onnx_and_ort_differ)"];
            ctx.explain("fold_shapes", n->op_type + " '" + n->name.value +
                                           "': not folded: ONNX's spec and ONNX Runtime select "
                                           "different dims (an end of INT_MAX, negative step)");
          }
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

// Ops whose integer outputs are shape computations a constant may stand for.
bool computes_shape(const Node& n) {
  static const std::unordered_set<std::string> ops{
      "Shape",           "Size",     "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast",
      "Reshape",         "Add",      "Sub",    "Mul",   "Div",    "Where",     "Equal",   "Expand",
      "ConstantOfShape", "Identity", "Range"};
  return standard(&n) && ops.count(n.op_type) && n.outputs().size() == 1 && n.outputs()[0];
}

std::shared_ptr<Tensor> ints_tensor(int32_t dtype, const std::vector<int64_t>& v,
                                    std::vector<int64_t> dims) {
  if (dtype == kInt64) return make_int64_tensor(v, std::move(dims));
  std::string bytes(v.size() * 4, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    const int32_t x = static_cast<int32_t>(v[i]);
    std::memcpy(&bytes[i * 4], &x, 4);
  }
  return make_tensor(kInt32, std::move(dims), std::move(bytes));
}

// What the facts allow, decided on the unedited graph (facts recompute after an edit), then
// applied in one go: each edit replaces a value by one with the same contents, so the other
// decisions stay true.
struct FactFolder {
  Model& model;
  PassContext& ctx;
  struct Constant {
    Node* node;
    std::shared_ptr<Tensor> value;
  };
  struct Target {
    Node* reshape;
    std::vector<int64_t> shape;
  };
  struct Forward {
    Node* node;  // its output is its input `input`
    size_t input = 0;
  };
  struct Reroute {
    Node* gather;  // Gather(Shape(x), i) -> Gather(Shape(source), dim)
    Value* source;
    int64_t dim;
  };
  std::vector<Constant> constants;
  std::vector<Target> targets;
  std::vector<Forward> forwards;
  std::vector<Reroute> reroutes;

  int64_t run() {
    if (!model.graph) return 0;
    Graph& g = *model.graph;
    analysis::ShapeFacts& facts = analysis::facts_of(model);  // infer_shapes' sweep, if fresh
    for (Node* n = g.first(); n; n = n->next()) {
      if (!standard(n) || pattern::mistyped_attribute(*n) || n->has_subgraphs()) continue;
      decide(*n, facts);
    }
    return apply(g);
  }

  void decide(Node& n, analysis::ShapeFacts& facts) {
    Value* out = n.outputs().empty() ? nullptr : n.outputs()[0];
    if (!out || (out->uses().empty() && !out->is_graph_output())) return;
    const analysis::Facts* f = facts.facts(out);
    if (!f) return;
    if (computes_shape(n) && f->has_value && f->ranked && f->dims.size() <= 1 &&
        (f->dtype == kInt64 || f->dtype == kInt32) && !constant_tensor(out)) {
      if (auto v = facts.constant_shape_value(out)) {
        std::vector<int64_t> dims;
        if (!f->dims.empty()) dims.push_back(static_cast<int64_t>(v->size()));
        constants.push_back({&n, ints_tensor(f->dtype, *v, dims)});
        return;
      }
      // Where(Equal(s, -1), ones, s) and the like: the same elements as an input, which
      // stands for it.
      for (size_t i = 0; i < n.inputs().size(); ++i) {
        const analysis::Facts* fi = facts.facts(n.inputs()[i]);
        if (fi && fi->has_value && fi->value == f->value && fi->ranked && fi->dims == f->dims &&
            fi->dtype == f->dtype) {
          forwards.push_back({&n, i});
          return;
        }
      }
    }
    if (n.op_type == "Gather" && model.ir_version.value_or(0) >= 4) decide_reroute(n, facts);
    if ((n.op_type == "Reshape" || n.op_type == "Expand") && n.inputs().size() >= 2 &&
        n.inputs()[0] && n.inputs()[1]) {
      Value* x = n.inputs()[0];
      const analysis::Facts* fx = facts.facts(x);
      if (!fx || !fx->ranked || !f->ranked) return;
      if (fx->dims == f->dims && fx->dtype == f->dtype) {
        forwards.push_back({&n});
        return;
      }
      if (n.op_type == "Reshape" && !constant_tensor(n.inputs()[1]) &&
          !facts.constant_shape_value(n.inputs()[1])) {  // else the target itself folds
        if (auto shape = reshape_target(n, *fx, *f)) targets.push_back({&n, std::move(*shape)});
      }
    }
  }

  // Gather(Shape(x), i), x = chain(source) of Unsqueeze/Expand/Reshape with an Expand in it, and
  // dim i of x proven equal to a dim of the farthest source along the chain that has one.
  void decide_reroute(Node& n, analysis::ShapeFacts& facts) {
    if (n.inputs().size() != 2 || !n.inputs()[0] || !n.inputs()[1]) return;
    Node* shape = n.inputs()[0]->producer();
    if (!standard(shape) || shape->op_type != "Shape" || shape->inputs().size() != 1 ||
        shape->attribute("start") || shape->attribute("end") || !shape->inputs()[0]) {
      return;
    }
    const Attribute* axis = n.attribute("axis");
    if (axis && (!axis->i || *axis->i != 0)) return;
    auto idx = constant_ints(n.inputs()[1]);
    const int rank_idx = facts.rank(n.inputs()[1]);
    if (!idx || idx->size() != 1 || rank_idx > 1 || rank_idx < 0) return;
    Value* x = shape->inputs()[0];
    const int rank = facts.rank(x);
    if (rank <= 0) return;
    const int i = static_cast<int>((*idx)[0] < 0 ? (*idx)[0] + rank : (*idx)[0]);
    if (i < 0 || i >= rank) return;
    static const std::unordered_set<std::string> chain{"Unsqueeze", "Expand", "Reshape"};
    bool expand = false;
    Value* best = nullptr;
    int64_t best_dim = 0;
    for (Value* y = x; y->producer() && standard(y->producer()) &&
                       chain.count(y->producer()->op_type) && y->producer()->inputs().size() >= 1 &&
                       y->producer()->inputs()[0];) {
      expand = expand || y->producer()->op_type == "Expand";
      y = y->producer()->inputs()[0];
      const int ry = facts.rank(y);
      for (int j = 0; j < ry; ++j) {
        if (facts.same_dim(x, i, y, j)) {
          if (expand) best = y, best_dim = j;
          break;
        }
      }
    }
    if (best) reroutes.push_back({&n, best, best_dim});
  }

  // A constant target giving the same output: 0 copies x's dim at the same position, numbers
  // stay, one -1 only when every other entry is a nonzero number.
  static std::optional<std::vector<int64_t>> reshape_target(const Node& n, const analysis::Facts& x,
                                                            const analysis::Facts& out) {
    if (cleanup_has_attr_refs(n)) return std::nullopt;
    const Attribute* az = n.attribute("allowzero");
    if (az && az->i && *az->i != 0) return std::nullopt;
    std::vector<int64_t> shape;
    int infer = -1;
    for (size_t i = 0; i < out.dims.size(); ++i) {
      const analysis::DimExpr& d = out.dims[i];
      auto c = d.constant_value();
      if (i < x.dims.size() && x.dims[i] == d && !(c && *c > 0)) {
        shape.push_back(0);
      } else if (c && *c > 0) {
        shape.push_back(*c);
      } else {
        if (infer >= 0) return std::nullopt;
        infer = static_cast<int>(i);
        shape.push_back(-1);
      }
    }
    if (infer >= 0) {
      for (size_t i = 0; i < shape.size(); ++i) {
        if (static_cast<int>(i) != infer && shape[i] <= 0) return std::nullopt;
      }
    }
    return shape;
  }

  static bool cleanup_has_attr_refs(const Node& n) {
    for (const auto& a : n.attributes) {
      if (a.ref_attr_name.written()) return true;
    }
    return false;
  }

  // The names the type-based folds use for the same folds, "shape_value(op)" for the rest.
  static std::string counter_name(const Node& n) {
    if (n.op_type == "Shape" || n.op_type == "Size") return n.op_type;
    const Node* p = n.inputs().empty() || !n.inputs()[0] ? nullptr : n.inputs()[0]->producer();
    if ((n.op_type == "Gather" || n.op_type == "Slice") && p && p->op_type == "Shape") {
      return n.op_type + "(Shape)";
    }
    return "shape_value(" + n.op_type + ")";
  }

  int64_t apply(Graph& g) {
    int64_t rewrites = 0;
    std::vector<Node*> dead;
    auto note_inputs = [&](Node* n) {
      for (Value* v : n->inputs()) {
        if (v && v->producer()) dead.push_back(v->producer());
      }
    };
    // Only the last constant of a chain is written: a candidate whose readers all fold too just
    // dies with them.
    std::unordered_set<const Node*> folded;
    for (auto& c : constants) folded.insert(c.node);
    for (auto& c : constants) {
      Value* out = c.node->outputs()[0];
      bool needed = out->is_graph_output();
      for (const Use& u : out->uses()) needed = needed || !folded.count(u.node);
      if (!needed) {
        dead.push_back(c.node);
        continue;
      }
      note_inputs(c.node);
      replace_with_constant(g, out, c.value);
      if (out->uses().empty() && !out->is_graph_output()) g.remove_node(c.node);
      ++ctx.counters[counter_name(*c.node)];
      ++rewrites;
    }
    for (auto& t : targets) {
      if (!t.reshape->alive()) continue;
      Value* old = t.reshape->inputs()[1];
      if (old && old->producer()) dead.push_back(old->producer());
      auto tensor = make_int64_tensor(t.shape, {int64_t(t.shape.size())});
      const std::string name = g.unique_name(t.reshape->outputs()[0]->name() + "_shape");
      Value* k;
      if (model.ir_version.value_or(0) < 4) {  // initializers would be (overridable) inputs
        Node* c = g.create_node("Constant", "", {}, {name}, t.reshape);
        c->attributes.push_back(pattern::attr_tensor("value", std::move(tensor)));
        k = c->outputs()[0];
      } else {
        k = g.add_initializer(name, std::move(tensor));
      }
      t.reshape->set_input(1, k);
      ++ctx.counters["Reshape(target)"];
      ++rewrites;
    }
    for (auto& f : forwards) {
      Node* n = f.node;
      if (!n->alive()) continue;
      Value *out = n->outputs()[0], *x = n->inputs()[f.input];
      if (!pattern::can_replace(g, out, x)) continue;
      note_inputs(n);
      pattern::replace_value(g, out, x);
      if (out->uses().empty() && !out->is_graph_output()) g.remove_node(n);
      ++ctx.counters[n->op_type +
                     (f.input ? "(input " + std::to_string(f.input) + ")" : "(identity)")];
      ++rewrites;
    }
    for (auto& r : reroutes) {
      Node* n = r.gather;
      if (!n->alive() || !r.source) continue;
      Node* old = n->inputs()[0]->producer();
      Value* idx = n->inputs()[1];
      const std::vector<int64_t> dims =
          constant_tensor(idx) ? constant_tensor(idx)->dims : std::vector<int64_t>{};
      Node* s = g.create_node("Shape", "", {r.source}, {g.unique_name("rerouted_shape")}, n);
      s->name.set(s->outputs()[0]->name());
      analysis::type_new_node(model, *s);
      n->set_input(0, s->outputs()[0]);
      n->set_input(
          1, g.add_initializer(g.unique_name("rerouted_dim"), make_int64_tensor({r.dim}, dims)));
      if (old) dead.push_back(old);
      if (idx && idx->producer()) dead.push_back(idx->producer());
      ++ctx.counters["Gather(Shape) rerouted"];
      ++rewrites;
    }
    // Producers left without readers (the Shape -> Gather -> Concat chains), transitively.
    while (!dead.empty()) {
      Node* n = dead.back();
      dead.pop_back();
      if (!n->alive() || !standard(n) || n->has_subgraphs() || pattern::mistyped_attribute(*n)) {
        continue;  // ORT refuses a mistyped node: it stays, dead (eliminate_dead_nodes agrees)
      }
      bool used = false;
      for (Value* v : n->outputs())
        used = used || (v && (!v->uses().empty() || v->is_graph_output()));
      if (used) continue;
      note_inputs(n);
      g.remove_node(n);
    }
    return rewrites;
  }
};

int64_t fold_shapes(Model& model, PassContext& ctx) {
  // The analysis first, on the graph infer_shapes just typed (its facts are still fresh); then
  // the type-based folds for what it does not cover (subgraphs, functions).
  int64_t rewrites = FactFolder{model, ctx, {}, {}, {}, {}}.run();
  rewrites += ShapeFolder{model, ctx}.run();
  return rewrites;
}

const PassRegistrar kRegister{
    PassDecl("fold_shapes",
             "Shape/Size, and Gather/Slice of Shape, over dims known from value types -> constants")
        .tags({"cleanup"})
        .requires_facts({kValueTypes})
        .run(fold_shapes)};

}  // namespace
}  // namespace fastopt::passes
