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
#include "passes/rotary/rotary_emit.h"
#include "passes/rotary/rotary_interleaved.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

using rotary::int_attr;
using rotary::made_by;

using namespace rotary_emit;

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
