// Rotary position embedding (RoPE) -> RotaryEmbedding (com.microsoft for target ort, ai.onnx 23
// for target onnx).
//
//   x (B,H,S,D)                                        x3d (B,S,H*D)   [3-D form, when x is
//    |  \___________________                             |              Transpose(0,2,1,3) of
//    |   Slice(D/2:)   Slice(:D/2)                  RotaryEmbedding     Reshape(x3d, [B,S,H,D])]
//    |      |              |                          (num_heads=H)
//    |     Neg             |         ==>                 |
//    |       \            /                           Reshape (same shape input)
//    |      Concat(axis -1)        cos4d / sin4d:        |
//    |          |                  Unsqueeze(1) of     Transpose(0,2,1,3)
//  Mul(cos4d)  Mul(sin4d)          cos/sin (B,S,D)       |
//        \      /                  (rotary_cache.h)
//          Add                                    otherwise the 4-D form RotaryEmbedding(x)
//
// Partial rotary (gpt_neox rotary_pct, phi): Concat(rope(Slice(x, 0, r)), Slice(x, r, end), -1)
// -> one RotaryEmbedding(x, rotary_embedding_dim=r); when r == D the pass-through slice is empty
// (phi3's export with the full head) and the Concat goes.
//
// Interleaved pairs (gptj, cohere, glm: rotate_every_two, cos/sin repeat_interleave'd) become
// RotaryEmbedding(interleaved = 1), see rotary_interleaved.h; gptj rotates (B,S,H,D) before the
// Transpose: the 3-D form on the projection, or Transposes around the 4-D form. DeepSeek's
// even/odd form (the rope part of an MLA head, rotated pairs laid out in halves) becomes
// RotaryEmbedding(interleaved = 0) of Concat(x[..., 0::2], x[..., 1::2]).
// LongRoPE (phi3): inv_freq = Where(max(positions) + 1 > t, long, short) for every position; the
// caches stack the short table's R rows over the long table's and the positions get + R while
// the switch is on (exact on both sides of t; add_kv_cache refuses such a model).
//
// Every Hugging Face RoPE model exports apply_rotary_pos_emb this way with both exporters
// (TorchScript computes rotate_half's bounds from Shape -> Gather -> Div(2)). The cos/sin
// subgraph becomes two (max_positions, D/2) constant caches shared by every layer's q and k;
// on-the-fly sources get max_positions = options["rotary_max_positions"] (default 4096), table
// sources keep the table's rows. Positions must stay below max_positions: ONNX Runtime 1.32's CPU
// kernels (both ops) fail the run with INVALID_ARGUMENT "position_ids value ... is out of range"
// (older contrib kernels read past the cache), where the decomposed graph had no limit.
//
// position_ids are the graph's positions before their Unsqueeze/Cast; (1, S) positions (computed
// with Range) are expanded to (B, S) unless their batch dim is known to be x's.
//
// The 3-D form is what MultiHeadAttention / GroupQueryAttention take, so the attention fusion
// that follows finds RotaryEmbedding(x3d) -> Reshape -> Transpose in front of its Q and K.
#include <algorithm>
#include <cstdint>
#include <map>

#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"
#include "passes/rotary/rotary_cache.h"
#include "passes/rotary/rotary_interleaved.h"

namespace fastopt::passes {
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

// x (B,H,S,D) = Transpose(0,2,1,3)(Reshape(x3d (B,S,H*D), shape)).
struct HeadSplit {
  Node* reshape = nullptr;
  Value* x3d = nullptr;
  int64_t heads = 0;
  int64_t head_dim = 0;
};

// x (B,S,H,D) = Reshape(x3d (B,S,H*D), shape): the split before the Transpose (gptj rotates
// there).
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

// x (B,H,S,D) = Transpose(0,2,1,3)(Reshape(x3d (B,S,H*D), shape)).
std::optional<HeadSplit> head_split(const Value* x) {
  Node* tr = made_by(x, "Transpose");
  const Attribute* perm = tr ? tr->attribute("perm") : nullptr;
  if (!perm || perm->ints != std::vector<int64_t>{0, 2, 1, 3}) return std::nullopt;
  return reshape_split(tr->inputs()[0]);
}

// Constant start/end of a Slice on the last axis of a rank-4 value with step 1, or nullopt.
struct SliceBounds {
  const Value* start;
  const Value* end;
};

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

// D of a rank-4 value: its type, the head split that makes it, or the Slice that cuts it.
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

// H of a rank-4 value, (B,H,S,D) (seq_axis 2) or (B,S,H,D) (seq_axis 1): its type, or the head
// split under last-axis Slices.
std::optional<int64_t> num_heads_4d(const Value* x, int seq_axis = 2) {
  if (auto n = known_dim(x, seq_axis == 2 ? 1 : 2)) return n;
  if (auto h = seq_axis == 2 ? head_split(x) : reshape_split(x)) return h->heads;
  if (Node* sl = made_by(x, "Slice")) {
    if (last_axis_slice(sl)) return num_heads_4d(sl->inputs()[0], seq_axis);
  }
  return std::nullopt;
}

// Any last-axis Slice, for the interleaved form's x[..., :r] (step 1 or 2 checked elsewhere).
bool is_rank4(const Value* x) {
  for (int hops = 0; x && hops < 4; ++hops) {
    if (value_rank(x) == 4 || head_split(x) || reshape_split(x)) return true;
    Node* sl = made_by(x, "Slice");
    if (!sl || !last_axis_slice(sl)) return false;
    x = sl->inputs()[0];
  }
  return false;
}

// rotate_half's split point: the constant D/2, or Unsqueeze(Div(Gather(Shape(x), -1), 2)).
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

// Per pass run: the cache initializers made so far, shared by every layer's q and k, and the
// fp32 tables they were made from, shared by the caches of every dtype.
struct CacheMemo {
  std::map<std::string, std::pair<Value*, Value*>> caches;
  std::map<std::string, std::shared_ptr<const rotary::TrigTables>> trig;
};

struct Emitter {
  PassContext* ctx;
  std::shared_ptr<CacheMemo> memo;

  bool onnx() const { return ctx->target == Target::kOnnx; }

  std::optional<std::string> target_problem(const Graph& g) const {
    if (onnx() && default_opset(*g.model()) < 23) {
      return std::string("target onnx needs opset >= 23 for RotaryEmbedding (run convert_version)");
    }
    return std::nullopt;
  }

  // position_ids (B, S) as the ops want them. The positions broadcast against x in the
  // original graph, so their first dim is B or 1 ((1, S) when the model computes them with
  // Range): unless it is known to be B, Expand them to [B, S] of the op's input.
  Value* positions(Rewriter& rw, Value* pos, Value* in, Value* x, int64_t seq_axis) const {
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

  // The source's positions as (B, S) or (1, S): (S) ones get a leading axis.
  Value* position_ids(Rewriter& rw, const rotary::CosSinSource& c) const {
    if (!c.positions_1d) return c.positions;
    Value* axes = rw.initializer("rotary_batch_axis", make_int64_tensor({0}, {1}));
    return rw.op1("Unsqueeze", {c.positions, axes});
  }

  int64_t max_positions() const {
    auto it = ctx->options.find("rotary_max_positions");
    return it != ctx->options.end() ? it->second : kDefaultMaxPositions;
  }

  // LongRoPE: the rows of the switched table follow the first table's R rows in the caches, so
  // positions + R * Cast(switch_cond) read the table the graph picks.
  Value* switched_positions(Rewriter& rw, const rotary::CosSinSource& c, Value* pos) const {
    if (!c.switch_cond) return pos;
    const int64_t rows = rotary::switch_table_rows(c, max_positions());
    std::vector<Attribute> to;
    to.push_back(attr_int("to", kInt64));
    Value* on = rw.op1("Cast", {c.switch_cond}, std::move(to));
    Value* r = rw.initializer("rotary_switch_rows", make_int64_tensor({rows}, {}));
    ++ctx->counters["switched_tables"];
    return rw.op1("Add", {pos, rw.op1("Mul", {on, r})});
  }

  // RotaryEmbedding over x (B,H,S,D) (seq_axis 2) or (B,S,H,D) (seq_axis 1): the 3-D form on
  // x3d when x is a head split of it; (B,S,H,D) otherwise goes through Transposes to the 4-D form.
  Value* emit(Rewriter& rw, Value* x, Value* pos, Value* cos, Value* sin, int64_t interleaved,
              int64_t rotary_dim, int seq_axis = 2) const {
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

  // The (cos, sin) cache initializers for a traced source, made once per distinct source and
  // dtype (the fp32 values once per distinct frequency source); nullopt (and nothing added)
  // when a table's two halves differ (not rotate_half's layout).
  std::optional<std::pair<Value*, Value*>> caches(Graph& g, const rotary::CosSinSource& c,
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
             (c.switch_cond ? std::to_string(reinterpret_cast<uintptr_t>(c.switch_cond)) : "") +
             ":" + trig_key;
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
};

// Why the traced cos `cs` and sin `ss` cannot feed one RotaryEmbedding over x of dtype `t` and
// rotary width `d` ("" when they can); `width_problem` names the width the rule expects.
std::string cos_sin_problem(const rotary::CosSinSource& cs, const rotary::CosSinSource& ss,
                            int32_t t, int64_t d, const std::string& width_problem) {
  if (cs.kind != ss.kind || cs.positions != ss.positions) {
    return "cos and sin come from different sources";
  }
  if (cs.kind == rotary::CosSinSource::Kind::kFrequencies &&
      (cs.inv_freq != ss.inv_freq || cs.scaling != ss.scaling || cs.via_half != ss.via_half ||
       cs.switch_cond != ss.switch_cond || cs.switched_inv_freq != ss.switched_inv_freq)) {
    return "cos and sin use different frequencies or scaling";
  }
  if (cs.dtype != t || ss.dtype != t) return "cos/sin dtype differs from x's";
  if (2 * cs.half != d || 2 * ss.half != d) return width_problem;
  if (value_rank(cs.positions) != (cs.positions_1d ? 1 : 2) ||
      value_dtype(cs.positions) != kInt64) {
    return "the positions are not int64 (B, S) or (S)";
  }
  return "";
}

// The same for an interleaved or even/odd rotation, whose cos and sin also share x's layout.
std::string cos_sin_problem(const rotary::InterleavedSource& c, const rotary::InterleavedSource& s,
                            int32_t t, int64_t d, const std::string& width_problem) {
  if (c.seq_axis != s.seq_axis) return "cos and sin come from different sources";
  return cos_sin_problem(c.source, s.source, t, d, width_problem);
}

// The dtypes RotaryEmbedding takes ("" when `t` is one).
std::string dtype_problem(int32_t t) {
  if (t == kFloat || t == kFloat16) return "";
  return "dtype " + dtype_name(t) + " (RotaryEmbedding: float, float16)";
}

// An even rotary width D of x, or nullopt.
std::optional<int64_t> even_width(const Value* x) {
  auto d = head_dim(x);
  if (!d || *d <= 0 || *d % 2 != 0) return std::nullopt;
  return d;
}

bool last_axis(const Node* concat) {
  auto axis = int_attr(concat, "axis");
  return axis == -1 || axis == 3;
}

// Every rule's first checks: one graph, the target's opset.
std::string graph_problem(const Node* matched, Rewriter& rw, const Emitter& em) {
  if (matched->graph() != &rw.graph()) return "the match spans graphs";
  return em.target_problem(rw.graph()).value_or("");
}

// --- the rotation: Add(Mul(x, cos), Mul(Concat(Neg(x[h:]), x[:h]), sin)) ---
struct RotateHalf {
  P x, lo, hi, rot, cos, sin;
};

// rotate_half's Concat on the last axis of x's halves: x[0:D/2] and x[D/2:D].
std::string halves_problem(const RotateHalf& h, const Match& m, const Value* vx, int64_t d) {
  if (!last_axis(m.node(h.rot))) return "rotate_half's Concat is not on the last axis";
  auto lb = last_axis_slice(m.node(h.lo)), hb = last_axis_slice(m.node(h.hi));
  if (!lb || !hb) return "rotate_half's Slices are not on the last axis with step 1";
  if (single_int(lb->start) != 0 || !is_half_of(lb->end, vx, d) || !is_half_of(hb->start, vx, d)) {
    return "rotate_half's Slices do not split x at D/2 = " + std::to_string(d / 2);
  }
  auto hi_end = single_int(hb->end);
  if (!hi_end || *hi_end < d) return "the second half's Slice does not run to D";
  return "";
}

// The option bounding on-the-fly caches ("" when unset or in range).
std::string max_positions_problem(const rotary::CosSinSource& c, const PassContext& ctx) {
  if (c.kind != rotary::CosSinSource::Kind::kFrequencies) return "";
  auto it = ctx.options.find("rotary_max_positions");
  if (it == ctx.options.end() || (it->second > 0 && it->second <= rotary::kMaxPositionsLimit)) {
    return "";
  }
  return "option rotary_max_positions must be in [1, " +
         std::to_string(rotary::kMaxPositionsLimit) + "]";
}

Replacement fuse_rotate_half(const RotateHalf& h, const Emitter& em, PassContext& ctx,
                             const Match& m, Rewriter& rw) {
  Value* vx = m.value(h.x);
  if (std::string why = graph_problem(m.node(h.rot), rw, em); !why.empty()) return rw.fail(why);
  auto split = head_split(vx);
  if (value_rank(vx) != 4 && !split) return rw.fail("x is not known to be rank 4 (B, H, S, D)");
  const int32_t t = value_dtype(vx) ? value_dtype(vx) : split ? value_dtype(split->x3d) : 0;
  if (std::string why = dtype_problem(t); !why.empty()) return rw.fail(why);
  auto d = even_width(vx);
  if (!d) return rw.fail("the head size D is unknown or odd");
  if (std::string why = halves_problem(h, m, vx, *d); !why.empty()) return rw.fail(why);
  std::string why;
  auto c = rotary::trace_cos_sin(m.value(h.cos), "Cos", &why);
  if (!c) return rw.fail(why);
  auto s = rotary::trace_cos_sin(m.value(h.sin), "Sin", &why);
  if (!s) return rw.fail(why);
  why = cos_sin_problem(*c, *s, t, *d,
                        "the cos/sin width is not the head size D = " + std::to_string(*d));
  if (why.empty()) why = max_positions_problem(*c, ctx);
  if (!why.empty()) return rw.fail(why);
  // Last check: caches() adds its initializers only when both caches could be made.
  auto caches = em.caches(rw.graph(), *c, *s);
  if (!caches) return rw.fail("a cos/sin table's two halves differ (not rotate_half's layout)");
  Value* pos = em.switched_positions(rw, *c, em.position_ids(rw, *c));
  return std::vector<Value*>{em.emit(rw, vx, pos, caches->first, caches->second, 0, 0)};
}

Rule rotate_half_rule(PassContext& ctx, const Emitter& em) {
  auto p = std::make_shared<Pattern>("fuse_rotary");
  RotateHalf h;
  h.x = p->var("x");
  h.lo = p->op("Slice", {h.x, p->var("lo_start"), p->var("lo_end")}).extra_inputs();
  h.hi = p->op("Slice", {h.x, p->var("hi_start"), p->var("hi_end")}).extra_inputs();
  h.rot = p->op("Concat", {p->op("Neg", {h.hi}), h.lo});
  h.cos = p->var("cos");
  h.sin = p->var("sin");
  p->root(p->op("Add", {p->op("Mul", {h.x, h.cos}).commutative(),
                        p->op("Mul", {h.rot, h.sin}).commutative()})
              .commutative());
  return {"fuse_rotary", p, [h, em, &ctx](const Match& m, Rewriter& rw) {
            return fuse_rotate_half(h, em, ctx, m, rw);
          }};
}

// x's dtype (else `fallback`'s) and rank, the interleaved and even/odd rules' first checks;
// the dtype in `t`.
std::string interleaved_x_problem(const Value* vx, const Value* fallback, int32_t* t) {
  if (!is_rank4(vx)) return "x is not known to be rank 4";
  *t = value_dtype(vx) ? value_dtype(vx) : value_dtype(fallback);
  return dtype_problem(*t);
}

// cos and sin of an interleaved or even/odd rotation over x (dtype t, width d).
std::optional<std::pair<rotary::InterleavedSource, rotary::InterleavedSource>> interleaved_cos_sin(
    Value* cos, Value* sin, int32_t t, int64_t d, bool repeated, const std::string& width_problem,
    std::string* why) {
  auto c = rotary::trace_interleaved(cos, "Cos", why, repeated);
  if (!c) return std::nullopt;
  auto s = rotary::trace_interleaved(sin, "Sin", why, repeated);
  if (!s) return std::nullopt;
  *why = cos_sin_problem(*c, *s, t, d, width_problem);
  if (!why->empty()) return std::nullopt;
  return std::make_pair(*c, *s);
}

// --- interleaved: Add(Mul(x, cos), Mul(rotate_every_two(x), sin)) (rotary_interleaved.h) ---
struct Interleaved {
  P x, rot, cos, sin;
};

Replacement fuse_interleaved(const Interleaved& h, const Emitter& em, PassContext& ctx,
                             const Match& m, Rewriter& rw) {
  Value* vx = m.value(h.x);
  if (std::string why = graph_problem(m.node(h.rot), rw, em); !why.empty()) return rw.fail(why);
  int32_t t = 0;
  if (std::string why = interleaved_x_problem(vx, m.value(h.rot), &t); !why.empty()) {
    return rw.fail(why);
  }
  auto d = even_width(vx);
  if (!d) return rw.fail("the rotary width D is unknown or odd");
  std::string why = rotary::check_rotate_every_two(m.value(h.rot), vx, *d);
  if (!why.empty()) return rw.fail(why);
  auto cs = interleaved_cos_sin(
      m.value(h.cos), m.value(h.sin), t, *d, true,
      "the cos/sin width is not the rotary width D = " + std::to_string(*d), &why);
  if (!cs) return rw.fail(why);
  const rotary::CosSinSource &c = cs->first.source, &s = cs->second.source;
  auto caches = em.caches(rw.graph(), c, s);
  if (!caches) return rw.fail("the cos/sin table has too few columns");
  ++ctx.counters["interleaved"];
  return std::vector<Value*>{em.emit(rw, vx, em.switched_positions(rw, c, em.position_ids(rw, c)),
                                     caches->first, caches->second, 1, 0, cs->first.seq_axis)};
}

Rule interleaved_rule(PassContext& ctx, const Emitter& em) {
  auto ip = std::make_shared<Pattern>("fuse_rotary_interleaved");
  Interleaved h;
  h.x = ip->var("x");
  P odd = ip->op("Slice", {h.x, ip->var("odd_start"), ip->var("odd_end")}).extra_inputs();
  P even = ip->op("Slice", {h.x, ip->var("even_start"), ip->var("even_end")}).extra_inputs();
  P pairs = ip->op("Concat", {ip->op("Unsqueeze", {ip->op("Neg", {odd})}).extra_inputs(),
                              ip->op("Unsqueeze", {even}).extra_inputs()})
                .shared();  // TorchScript reads its shape for the flatten
  h.rot = ip->op("Reshape", {pairs, ip->var("flat_shape")});
  h.cos = ip->var("cos");
  h.sin = ip->var("sin");
  ip->root(ip->op("Add", {ip->op("Mul", {h.x, h.cos}).commutative(),
                          ip->op("Mul", {h.rot, h.sin}).commutative()})
               .commutative());
  return {"fuse_rotary_interleaved", ip, [h, em, &ctx](const Match& m, Rewriter& rw) {
            return fuse_interleaved(h, em, ctx, m, rw);
          }};
}

// --- even/odd halves (rotary_interleaved.h): Concat(x1 c - x2 s, x2 c + x1 s) ---
// `prefix`: Concat(pass, x1 c - x2 s, x2 c + x1 s), the MLA head's no-rope part and its rope
// part in one Concat (TorchScript's export after cleanup flattens the two Concats).
struct EvenOdd {
  P x, x1, x2, cos, sin, pass, halves;
  bool prefix = false;
};

std::vector<Attribute> last_axis_attrs() {
  std::vector<Attribute> a;
  a.push_back(attr_int("axis", -1));
  return a;
}

Replacement fuse_even_odd(const EvenOdd& h, const Emitter& em, PassContext& ctx, const Match& m,
                          Rewriter& rw) {
  Value* vx = m.value(h.x);
  if (std::string why = graph_problem(m.node(h.halves), rw, em); !why.empty()) {
    return rw.fail(why);
  }
  int32_t t = 0;
  if (std::string why = interleaved_x_problem(vx, m.value(h.halves), &t); !why.empty()) {
    return rw.fail(why);
  }
  auto d = even_width(vx);
  if (!d) return rw.fail("the rotary width D is unknown or odd");
  if (!last_axis(m.node(h.halves))) return rw.fail("the halves' Concat is not on the last axis");
  std::string why = rotary::check_even_odd(m.node(h.x1), m.node(h.x2), vx, *d);
  if (!why.empty()) return rw.fail(why);
  auto cs = interleaved_cos_sin(m.value(h.cos), m.value(h.sin), t, *d, false,
                                "the cos/sin width is not D / 2 = " + std::to_string(*d / 2), &why);
  if (!cs) return rw.fail(why);
  const rotary::CosSinSource &c = cs->first.source, &s = cs->second.source;
  auto caches = em.caches(rw.graph(), c, s);
  if (!caches) return rw.fail("the cos/sin table has too few columns");
  ++ctx.counters["even_odd"];
  // rotate_half's rotary of the halves Concat(x1, x2) is the matched value, element for
  // element: y[i] = x1[i] c[i] - x2[i] s[i], y[D/2 + i] = x2[i] c[i] + x1[i] s[i].
  Value* in = rw.op1("Concat", {m.value(h.x1), m.value(h.x2)}, last_axis_attrs());
  Value* y = em.emit(rw, in, em.switched_positions(rw, c, em.position_ids(rw, c)), caches->first,
                     caches->second, 0, 0, cs->first.seq_axis);
  if (h.prefix) y = rw.op1("Concat", {m.value(h.pass), y}, last_axis_attrs());
  return std::vector<Value*>{y};
}

Rule even_odd_rule(PassContext& ctx, const Emitter& em, bool prefix) {
  auto ep = std::make_shared<Pattern>("fuse_rotary_even_odd");
  EvenOdd h;
  h.prefix = prefix;
  h.x = ep->var("x");
  h.x1 = ep->op("Slice", {h.x, ep->var("even_start"), ep->var("even_end")}).extra_inputs();
  h.x2 = ep->op("Slice", {h.x, ep->var("odd_start"), ep->var("odd_end")}).extra_inputs();
  h.cos = ep->var("cos");
  h.sin = ep->var("sin");
  P first = ep->op("Sub", {ep->op("Mul", {h.x1, h.cos}).commutative(),
                           ep->op("Mul", {h.x2, h.sin}).commutative()});
  P second = ep->op("Add", {ep->op("Mul", {h.x2, h.cos}).commutative(),
                            ep->op("Mul", {h.x1, h.sin}).commutative()})
                 .commutative();
  h.pass = ep->var("pass");
  h.halves = prefix ? ep->op("Concat", {h.pass, first, second}) : ep->op("Concat", {first, second});
  ep->root(h.halves);
  return {"fuse_rotary_even_odd", ep,
          [h, em, &ctx](const Match& m, Rewriter& rw) { return fuse_even_odd(h, em, ctx, m, rw); }};
}

// --- partial rotary: Concat(rope(x[..., :r]), x[..., r:]) ---
struct Partial {
  P rotated, x, pass, cat;
};

// The fused rotary that made the rotated part: RotaryEmbedding (4-D form) or
// Transpose(Reshape(RotaryEmbedding)), or on (B,S,H,D): Transpose(RotaryEmbedding(Transpose(.)))
// or Reshape(RotaryEmbedding). `tr`: the Transpose after it, or null.
struct Rotated {
  Node* re = nullptr;
  Node* tr = nullptr;
  int seq_axis = 2;
};

std::optional<Rotated> rotated_part(Value* vy) {
  Rotated r;
  r.re = vy->producer();
  r.tr = made_by(vy, "Transpose");
  if (is_rotary(r.re)) return r;
  if (r.tr && is_rotary(r.tr->inputs()[0]->producer()) &&
      made_by(r.tr->inputs()[0]->producer()->inputs()[0], "Transpose")) {
    r.re = r.tr->inputs()[0]->producer();
    r.seq_axis = 1;
    return r;
  }
  Node* rs = made_by(r.tr ? r.tr->inputs()[0] : vy, "Reshape");
  r.re = rs ? rs->inputs()[0]->producer() : nullptr;
  if (!r.tr) r.seq_axis = 1;
  if (!is_rotary(r.re)) return std::nullopt;
  return r;
}

// rotary_embedding_dim = r: the rotated part must be the 4-D form on x[..., :r].
std::string rotated_slice_problem(const Rotated& r, const Value* vx, const Value* vy,
                                  int64_t rdim) {
  const bool bshd = r.seq_axis == 1;
  Node* in_tr = bshd ? made_by(r.re->inputs()[0], "Transpose") : nullptr;
  Node* sl = made_by(in_tr ? in_tr->inputs()[0] : r.re->inputs()[0], "Slice");
  auto rb = sl ? last_axis_slice(sl) : std::nullopt;
  const Value* re_out = bshd ? (r.tr ? r.tr->outputs()[0] : nullptr) : r.re->outputs()[0];
  if (bshd && (!in_tr || !r.tr)) {
    return "the rotary embedding is not applied to Slice(x, 0, r) (B, S, H, D)";
  }
  if (re_out != vy || !sl || sl->inputs()[0] != vx || !rb || single_int(rb->start) != 0 ||
      single_int(rb->end) != rdim) {
    return "the rotary embedding is not applied to Slice(x, 0, r = " + std::to_string(rdim) + ")";
  }
  return "";
}

// A full, sole-use rotary of this target's kind, with positions and a (max_positions, r/2)
// cos cache, over x of known heads.
std::string partial_op_problem(const Rotated& r, const Value* vx, const Value* vy, int64_t rdim,
                               Rewriter& rw, const Emitter& em) {
  if (vy->uses().size() != 1) return "the rotated part has other uses";
  if (int_attr(r.re, "rotary_embedding_dim").value_or(0) != 0) {
    return "the rotary embedding is already partial";
  }
  if (auto problem = em.target_problem(rw.graph())) return *problem;
  const bool onnx_op = r.re->domain.value != kMsDomain;
  if (onnx_op != em.onnx()) return "the rotary embedding is not of this target's kind";
  if (!r.re->inputs()[onnx_op ? 3 : 1]) return "the rotary embedding has no position_ids";
  auto cache = constant_tensor(r.re->inputs()[onnx_op ? 1 : 2]);
  if (!cache || cache->dims.size() != 2 || 2 * cache->dims[1] != rdim) {
    return "the cos cache is not (max_positions, r/2)";
  }
  if (!num_heads_4d(vx, r.seq_axis)) {
    return "the number of heads is unknown (num_heads is needed with a partial dim)";
  }
  return "";
}

// The pass-through Slice(x, r, D): r, or nullopt when not a constant slice to the end.
std::optional<int64_t> pass_through_start(const Node* pass, int64_t d) {
  auto b = last_axis_slice(pass);
  auto r = b ? single_int(b->start) : std::nullopt;
  auto end = b ? single_int(b->end) : std::nullopt;
  if (!r || !end || *r < 0 || *end < d) return std::nullopt;
  return r;
}

Replacement fuse_partial(const Partial& h, const Emitter& em, PassContext& ctx, const Match& m,
                         Rewriter& rw) {
  Value* vx = m.value(h.x);
  Value* vy = m.value(h.rotated);
  if (m.node(h.pass)->graph() != &rw.graph()) return rw.fail("the match spans graphs");
  if (!last_axis(m.node(h.cat))) return rw.fail("the Concat is not on the last axis");
  auto rotated = rotated_part(vy);
  if (!rotated) return rw.fail("the first input is not a fused rotary embedding");
  if (!is_rank4(vx)) return rw.fail("x is not known to be rank 4");
  auto d = head_dim(vx);
  if (!d) return rw.fail("the head size D is unknown");
  auto r = pass_through_start(m.node(h.pass), *d);
  if (!r) return rw.fail("the pass-through is not a constant Slice(x, r, D) on the last axis");
  if (*r >= *d) {  // nothing passes through: the Concat copies the rotated part
    ++ctx.counters["empty_pass_through"];
    return std::vector<Value*>{vy};
  }
  std::string why = rotated_slice_problem(*rotated, vx, vy, *r);
  if (why.empty()) why = partial_op_problem(*rotated, vx, vy, *r, rw, em);
  if (!why.empty()) return rw.fail(why);
  const Node* re = rotated->re;
  const bool onnx_op = re->domain.value != kMsDomain;
  Value *pos = re->inputs()[onnx_op ? 3 : 1], *cc = re->inputs()[onnx_op ? 1 : 2],
        *sc = re->inputs()[onnx_op ? 2 : 3];
  ++ctx.counters["partial"];
  return std::vector<Value*>{
      em.emit(rw, vx, pos, cc, sc, int_attr(re, "interleaved").value_or(0), *r, rotated->seq_axis)};
}

Rule partial_rule(PassContext& ctx, const Emitter& em) {
  auto pp = std::make_shared<Pattern>("fuse_rotary_partial");
  Partial h;
  h.rotated = pp->var("rotated");
  h.x = pp->var("x");
  h.pass = pp->op("Slice", {h.x, pp->var("r"), pp->var("end")}).extra_inputs();
  h.cat = pp->op("Concat", {h.rotated, h.pass});
  pp->root(h.cat);
  return {"fuse_rotary_partial", pp,
          [h, em, &ctx](const Match& m, Rewriter& rw) { return fuse_partial(h, em, ctx, m, rw); }};
}

std::vector<Rule> rules(PassContext& ctx) {
  const Emitter em{&ctx, std::make_shared<CacheMemo>()};
  return {rotate_half_rule(ctx, em), interleaved_rule(ctx, em), even_odd_rule(ctx, em, false),
          even_odd_rule(ctx, em, true), partial_rule(ctx, em)};
}

const PassRegistrar kRegister{rule_pass(
    "fuse_rotary",
    "fuse rotary position embeddings (rotate_half, partial) into RotaryEmbedding (com.microsoft "
    "for target ort, ai.onnx 23 for target onnx) with precomputed cos/sin caches; on-the-fly "
    "caches have options['rotary_max_positions'] rows (default 4096)",
    {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
