// x's layout and the RotaryEmbedding emitter that fuse_rotary's rules share (rotary_emit.h).
#include "passes/rotary/rotary_emit.h"

#include <algorithm>

#include "ir/constant.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::rotary_emit {
namespace {
using namespace pattern;

constexpr int64_t kDefaultMaxPositions = 4096;

using rotary::int_attr;
using rotary::made_by;

std::optional<int64_t> known_dim(const Value* v, int axis) {
  if (!v->type.is_tensor || !v->type.has_shape) return std::nullopt;
  const auto& d = v->type.dims;
  const int i = axis < 0 ? static_cast<int>(d.size()) + axis : axis;
  if (i < 0 || i >= static_cast<int>(d.size()) || !d[i].value) return std::nullopt;
  return *d[i].value;
}

// Element `i` of a 1-D shape tensor: a constant, or input `i` of the Concat of 1-element
// pieces that exporters build shapes with. nullopt when not a constant.
std::optional<int64_t> shape_element(const Value* shape, size_t i) {
  if (auto c = constant_ints(shape)) {
    if (i < c->size()) return (*c)[i];
    return std::nullopt;
  }
  Node* cat = made_by(shape, "Concat");
  if (!cat || i >= cat->inputs().size()) return std::nullopt;
  for (const Value* in : cat->inputs()) {  // every piece must be one element
    auto t = constant_tensor(in);
    if (t ? t->numel() != 1 : (value_rank(in) != 1 || known_dim(in, 0) != 1)) return std::nullopt;
  }
  auto c = constant_ints(cat->inputs()[i]);
  if (!c || c->size() != 1) return std::nullopt;
  return (*c)[0];
}

// A Cast between float types with no attribute but `to` (a precision change that commutes
// with layout ops).
bool is_float_cast(const Node* n) {
  const Attribute* to = n->attribute("to");
  if (!to || !to->i || n->attributes.size() != 1) return false;
  const int32_t t = static_cast<int32_t>(*to->i);
  const int32_t from = value_dtype(n->inputs()[0]);
  auto is_float = [](int32_t d) { return d == kFloat || d == kFloat16 || d == kBFloat16; };
  return is_float(t) && is_float(from);
}

// Dim 0 of `v` from its type, or from the value a last-axis Slice / Transpose(0, ...) keeps it
// from (types inferred through a whole layer can run out).
std::optional<Dim> batch_dim(const Value* v) {
  for (int hops = 0; v && hops < 8; ++hops) {
    if (v->type.is_tensor && v->type.has_shape && !v->type.dims.empty()) {
      const Dim& d = v->type.dims[0];
      if (d.value || (d.param && !d.param->empty())) return d;
    }
    Node* n = v->producer();
    if (Node* sl = made_by(v, "Slice")) {
      auto axes = sl->inputs().size() > 3 ? constant_ints(sl->inputs()[3]) : std::nullopt;
      const int rank = value_rank(sl->inputs()[0]);
      if (!axes || rank < 2) return std::nullopt;
      for (int64_t a : *axes) {
        if (a == 0 || a == -rank) return std::nullopt;
      }
    } else if (Node* tr = made_by(v, "Transpose")) {
      const Attribute* perm = tr->attribute("perm");
      if (!perm || perm->ints.empty() || perm->ints[0] != 0) return std::nullopt;
    } else {
      return std::nullopt;
    }
    v = n->inputs()[0];
  }
  return std::nullopt;
}

}  // namespace

std::optional<HeadSplit> reshape_split(const Value* x) {
  Node* rs = made_by(x, "Reshape");
  if (!rs || value_rank(rs->inputs()[0]) != 3) return std::nullopt;
  HeadSplit h;
  h.reshape = rs;
  h.x3d = rs->inputs()[0];
  const Value* shape = rs->inputs()[1];
  auto d = shape_element(shape, 3);
  if (!d || *d <= 0) d = known_dim(x, 3);
  if (!d || *d <= 0) return std::nullopt;
  h.head_dim = *d;
  auto hidden = known_dim(h.x3d, 2);
  auto heads = known_dim(x, 2);
  if (!heads || *heads <= 0) heads = shape_element(shape, 2);
  if ((!heads || *heads <= 0) && hidden && *hidden % h.head_dim == 0) {
    heads = *hidden / h.head_dim;
  }
  if (!heads || *heads <= 0) return std::nullopt;
  if (hidden && *hidden != *heads * h.head_dim) return std::nullopt;
  // B and S must pass through the Reshape unchanged: a constant element 0/1 of the shape must be
  // 0 (copy, allowzero unset) or x3d's known size there. (Dynamic elements are the Shape ->
  // Gather copies exporters write; the positions broadcast against x checks the rest.)
  const bool allowzero = int_attr(rs, "allowzero").value_or(0) != 0;
  for (int i = 0; i < 2; ++i) {
    auto e = shape_element(shape, static_cast<size_t>(i));
    if (!e || (*e == 0 && !allowzero)) continue;
    if (known_dim(h.x3d, i) != *e) return std::nullopt;
  }
  h.heads = *heads;
  return h;
}

std::optional<HeadSplit> head_split(const Value* x) {
  Node* tr = made_by(x, "Transpose");
  const Attribute* perm = tr ? tr->attribute("perm") : nullptr;
  if (!perm || perm->ints != std::vector<int64_t>{0, 2, 1, 3}) return std::nullopt;
  return reshape_split(tr->inputs()[0]);
}

std::optional<SliceBounds> last_axis_slice(const Node* sl) {
  const auto& in = sl->inputs();
  if (in.size() < 3) return std::nullopt;  // opset >= 10 form only
  auto axes = in.size() > 3 && in[3] ? constant_ints(in[3]) : std::nullopt;
  if (!axes || axes->size() != 1 || ((*axes)[0] != 3 && (*axes)[0] != -1)) return std::nullopt;
  if (in.size() > 4 && in[4]) {
    auto steps = constant_ints(in[4]);
    if (!steps || *steps != std::vector<int64_t>{1}) return std::nullopt;
  }
  return SliceBounds{in[1], in[2]};
}

std::optional<int64_t> single_int(const Value* v) {
  auto c = constant_ints(v);
  if (!c || c->size() != 1) return std::nullopt;
  return (*c)[0];
}

std::optional<int64_t> head_dim(const Value* x) {
  if (auto d = known_dim(x, 3)) return d;
  if (auto h = head_split(x)) return h->head_dim;
  if (auto h = reshape_split(x)) return h->head_dim;
  if (Node* sl = made_by(x, "Slice")) {
    auto b = last_axis_slice(sl);
    auto inner = head_dim(sl->inputs()[0]);
    if (!b || !inner) return std::nullopt;
    auto s = single_int(b->start), e = single_int(b->end);
    if (!s || !e || *s < 0 || *e < 0) return std::nullopt;
    return std::max<int64_t>(0, std::min(*e, *inner) - *s);
  }
  return std::nullopt;
}

std::optional<int64_t> num_heads_4d(const Value* x, int seq_axis) {
  if (auto n = known_dim(x, seq_axis == 2 ? 1 : 2)) return n;
  if (auto h = seq_axis == 2 ? head_split(x) : reshape_split(x)) return h->heads;
  if (Node* sl = made_by(x, "Slice")) {
    if (last_axis_slice(sl)) return num_heads_4d(sl->inputs()[0], seq_axis);
  }
  return std::nullopt;
}

bool is_rank4(const Value* x) {
  for (int hops = 0; x && hops < 4; ++hops) {
    if (value_rank(x) == 4 || head_split(x) || reshape_split(x)) return true;
    Node* sl = made_by(x, "Slice");
    if (!sl || !last_axis_slice(sl)) return false;
    x = sl->inputs()[0];
  }
  return false;
}

bool is_half_of(const Value* b, const Value* x, int64_t d) {
  if (auto c = single_int(b)) return *c == d / 2;
  Node* unsq = made_by(b, "Unsqueeze");
  if (!unsq) return false;
  const Value* q = unsq->inputs()[0];
  if (Node* cast = made_by(q, "Cast")) q = cast->inputs()[0];
  Node* div = made_by(q, "Div");
  if (!div || single_int(div->inputs()[1]) != 2) return false;
  Node* gather = made_by(div->inputs()[0], "Gather");
  if (!gather) return false;
  auto idx = single_int(gather->inputs()[1]);
  Node* shape = made_by(gather->inputs()[0], "Shape");
  return idx && (*idx == 3 || *idx == -1) && shape && shape->inputs()[0] == x &&
         !shape->attribute("start") && !shape->attribute("end");
}

bool is_rotary(const Node* n) {
  return n && n->op_type == "RotaryEmbedding" &&
         (n->domain.value == kMsDomain || n->domain.value.empty() || n->domain.value == "ai.onnx");
}

std::optional<std::string> Emitter::target_problem(const Graph& g) const {
  if (onnx() && default_opset(*g.model()) < 23) {
    return std::string("target onnx needs opset >= 23 for RotaryEmbedding (run convert_version)");
  }
  return std::nullopt;
}

Value* Emitter::positions(Rewriter& rw, Value* pos, Value* in, Value* x, int64_t seq_axis) const {
  auto d = batch_dim(pos);
  for (const Value* v : {in, x}) {
    auto b = batch_dim(v);
    if (d && b &&
        ((d->value && b->value && *d->value == *b->value) ||
         (d->param && b->param && !d->param->empty() && *d->param == *b->param))) {
      return pos;
    }
  }
  ++ctx->counters["expanded_positions"];
  Value* axes = rw.initializer("rotary_bs_axes", make_int64_tensor({0, seq_axis}, {2}));
  Value* bs = rw.op1("Gather", {rw.op1("Shape", {in}), axes});
  return rw.op1("Expand", {pos, bs});
}

Value* Emitter::position_ids(Rewriter& rw, const rotary::CosSinSource& c) const {
  if (!c.positions_1d) return c.positions;
  Value* axes = rw.initializer("rotary_batch_axis", make_int64_tensor({0}, {1}));
  return rw.op1("Unsqueeze", {c.positions, axes});
}

int64_t Emitter::max_positions() const {
  auto it = ctx->options.find("rotary_max_positions");
  return it != ctx->options.end() ? it->second : kDefaultMaxPositions;
}

Value* Emitter::switched_positions(Rewriter& rw, const rotary::CosSinSource& c, Value* pos) const {
  if (!c.switch_cond) return pos;
  const int64_t rows = rotary::switch_table_rows(c, max_positions());
  std::vector<Attribute> to;
  to.push_back(attr_int("to", kInt64));
  Value* on = rw.op1("Cast", {c.switch_cond}, std::move(to));
  Value* r = rw.initializer("rotary_switch_rows", make_int64_tensor({rows}, {}));
  ++ctx->counters["switched_tables"];
  return rw.op1("Add", {pos, rw.op1("Mul", {on, r})});
}

Value* Emitter::emit(Rewriter& rw, Value* x, Value* pos, Value* cos, Value* sin,
                     int64_t interleaved, int64_t rotary_dim, int seq_axis) const {
  auto rope = [&](Value* in, std::optional<int64_t> heads) {
    pos = positions(rw, pos, in, x, in != x ? 1 : 2);  // S: axis 1 of x3d, 2 of x
    std::vector<Attribute> attrs;
    attrs.push_back(attr_int("interleaved", interleaved));
    if (heads) attrs.push_back(attr_int("num_heads", *heads));
    if (rotary_dim > 0) attrs.push_back(attr_int("rotary_embedding_dim", rotary_dim));
    if (onnx()) return rw.op1("RotaryEmbedding", {in, cos, sin, pos}, std::move(attrs));
    import_domain(rw.graph(), kMsDomain);
    return rw.op1("RotaryEmbedding", {in, pos, cos, sin}, std::move(attrs), kMsDomain);
  };
  auto swap = [&](Value* v) {  // (B,S,H,D) <-> (B,H,S,D)
    std::vector<Attribute> perm;
    perm.push_back(attr_ints("perm", {0, 2, 1, 3}));
    return rw.op1("Transpose", {v}, std::move(perm));
  };
  // fp16 exports that rotate in fp32 (cohere) Cast between the head split and the rotary: the
  // Cast commutes with the split, so it moves onto the 3-D projection.
  const Node* up = made_by(x, "Cast");
  if (up && !(is_float_cast(up) && up->inputs().size() == 1)) up = nullptr;
  const Value* split = up ? up->inputs()[0] : x;
  if (auto h = seq_axis == 2 ? head_split(split) : reshape_split(split)) {
    Node* rs = h->reshape;
    Value* in = h->x3d;
    if (up) {
      std::vector<Attribute> to;
      for (const Attribute& a : up->attributes) to.push_back(copy_attribute(a));
      in = rw.op1("Cast", {in}, std::move(to));
    }
    Value* y = rope(in, h->heads);
    std::vector<Attribute> rs_attrs;
    for (const Attribute& a : rs->attributes) rs_attrs.push_back(copy_attribute(a));
    y = rw.op1("Reshape", {y, rs->inputs()[1]}, std::move(rs_attrs));
    ++ctx->counters["rotary_3d"];
    return seq_axis == 2 ? swap(y) : y;
  }
  ++ctx->counters["rotary_4d"];
  if (seq_axis == 1) {
    Value* bhsd = swap(x);
    auto heads = rotary_dim > 0 ? num_heads_4d(x, 1) : std::nullopt;
    pos = positions(rw, pos, bhsd, x, 2);
    std::vector<Attribute> attrs;
    attrs.push_back(attr_int("interleaved", interleaved));
    if (heads) attrs.push_back(attr_int("num_heads", *heads));
    if (rotary_dim > 0) attrs.push_back(attr_int("rotary_embedding_dim", rotary_dim));
    Value* y;
    if (onnx()) {
      y = rw.op1("RotaryEmbedding", {bhsd, cos, sin, pos}, std::move(attrs));
    } else {
      import_domain(rw.graph(), kMsDomain);
      y = rw.op1("RotaryEmbedding", {bhsd, pos, cos, sin}, std::move(attrs), kMsDomain);
    }
    return swap(y);
  }
  // num_heads is needed (and checked by the caller) only with rotary_embedding_dim.
  return rope(x, rotary_dim > 0 ? num_heads_4d(x) : std::nullopt);
}

std::optional<std::pair<Value*, Value*>> Emitter::caches(Graph& g, const rotary::CosSinSource& c,
                                                         const rotary::CosSinSource& s) const {
  std::string key =
      std::to_string(reinterpret_cast<uintptr_t>(&g)) + ":" + std::to_string(c.dtype) + ":";
  const int64_t rows = max_positions();
  std::string trig_key;
  if (c.kind == rotary::CosSinSource::Kind::kTable) {
    key += "table:" + std::to_string(reinterpret_cast<uintptr_t>(c.table.get())) + ":" +
           std::to_string(reinterpret_cast<uintptr_t>(s.table.get())) + ":" +
           std::to_string(c.table_column) + ":" + std::to_string(s.table_column) + ":" +
           std::to_string(c.half);
  } else {
    trig_key = rotary::trig_key(c, rows);
    key += std::string("freq:") + (c.via_half ? "half:" : "") +
           (c.switch_cond ? std::to_string(reinterpret_cast<uintptr_t>(c.switch_cond)) : "") + ":" +
           trig_key;
  }
  auto it = memo->caches.find(key);
  if (it != memo->caches.end()) return it->second;
  std::shared_ptr<Tensor> tc, ts;
  if (c.kind == rotary::CosSinSource::Kind::kTable) {
    tc = rotary::table_cache(c);
    ts = rotary::table_cache(s);
  } else {
    auto& trig = memo->trig[trig_key];
    if (!trig) trig = std::make_shared<rotary::TrigTables>(rotary::trig_tables(c, rows));
    tc = rotary::frequency_cache(*trig, true, c.dtype, c.via_half);
    ts = rotary::frequency_cache(*trig, false, s.dtype, s.via_half);
  }
  if (!tc || !ts) return std::nullopt;
  std::pair<Value*, Value*> out{g.add_initializer(g.unique_name("rotary_cos_cache"), tc),
                                g.add_initializer(g.unique_name("rotary_sin_cache"), ts)};
  ++ctx->counters["caches"];
  memo->caches[key] = out;
  return out;
}

}  // namespace fastopt::passes::rotary_emit
