// One rule per op family for the sequence-axis dataflow (positionwise.h): where each output
// carries the positions, or why the op mixes them. A rule runs only when an input carries the
// tokens (seq); an op without a rule is refused by the caller.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/positionwise.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::kv_cache {

using analysis::DimExpr;

int normalize_axis(int64_t axis, int rank) {
  const int64_t a = axis < 0 ? axis + rank : axis;
  return a < 0 || a >= rank ? -1 : static_cast<int>(a);
}

namespace {

constexpr const char* kLastWithSeq =
    "it combines one position's value (selected from the end of the sequence) with every "
    "position";

int rank_of(SeqContext& c, const Value* v) {
  return v ? c.facts.rank(v) : -1;
}

bool same_place(const SeqState& a, const SeqState& b) {
  return a.axis == b.axis && a.outer == b.outer && a.inner == b.inner;
}

// Every input from `carriers` on (the first inputs carry the data) must not depend on the
// tokens.
bool others_free(SeqContext& c, size_t carriers, const char* what) {
  for (size_t i = carriers; i < c.in.size(); ++i) {
    if (c.in[i].kind == SeqState::kFree) continue;
    return c.refuse(std::string("its ") + what + " (input " + std::to_string(i) +
                    ") depends on the tokens");
  }
  return true;
}

// The seq input among the first `carriers` (all that carry the tokens agree on the place), or
// nullopt with the reason set.
std::optional<SeqState> carried(SeqContext& c, size_t carriers) {
  std::optional<SeqState> found;
  for (size_t i = 0; i < carriers && i < c.in.size(); ++i) {
    const SeqState& s = c.in[i];
    if (s.kind == SeqState::kLast) {
      c.refuse(kLastWithSeq);
      return std::nullopt;
    }
    if (s.kind != SeqState::kSeq) continue;
    if (found && !same_place(*found, s)) {
      c.refuse("its inputs carry the sequence on different axes");
      return std::nullopt;
    }
    found = s;
  }
  if (!found) c.refuse("the input that carries the tokens is not one it keeps per position");
  return found;
}

// Broadcasting elementwise ops (unary ones too): a position of the output reads that position
// of every operand; operands without the tokens (weights, constants) broadcast.
bool elementwise(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const int r = rank_of(c, n.outputs()[0]);
  if (r < 0) return c.refuse("its output rank is unknown");
  std::optional<SeqState> res;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const SeqState& s = c.in[i];
    if (s.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
    if (s.kind != SeqState::kSeq) continue;
    const int ri = rank_of(c, n.inputs()[i]);
    if (ri < 0) return c.refuse("an operand's rank is unknown");
    SeqState m = s;
    m.axis = s.axis + (r - ri);
    if (res && !same_place(*res, m)) {
      return c.refuse(
          "its operands carry the sequence on different axes (it pairs different "
          "positions)");
    }
    res = m;
  }
  out.assign(n.outputs().size(), *res);
  return true;
}

// MatMul: each position's rows times a weight, or a batched product per token (MoE experts
// gathered per token: the tokens on a batch axis of both). The tokens on the rows of one and the
// columns of the other (Q K^T, P V of an attention that did not fuse) or on the contracted axis
// mix positions.
bool matmul(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const SeqState& a = c.in[0];
  const SeqState& b = c.in[1];
  if (a.kind == SeqState::kLast || b.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  const int ra = rank_of(c, n.inputs()[0]), rb = rank_of(c, n.inputs()[1]);
  const int r = rank_of(c, n.outputs()[0]);
  if (ra < 0 || rb < 0 || r < 0) return c.refuse("an operand's rank is unknown");
  std::optional<SeqState> res;
  bool rows = false, cols = false;
  if (a.kind == SeqState::kSeq) {
    if (ra < 2 || a.axis == ra - 1) return c.refuse("it contracts over the sequence axis");
    rows = a.axis == ra - 2;
    res = a;
    res->axis = a.axis + (r - ra);
  }
  if (b.kind == SeqState::kSeq) {
    if (rb < 2 || b.axis == rb - 2) return c.refuse("it contracts over the sequence axis");
    cols = b.axis == rb - 1;
    SeqState m = b;
    m.axis = cols ? r - 1 : b.axis + (r - rb);
    if (res && (rows || cols || !same_place(*res, m))) {
      c.priority = 1;  // the likeliest cause: named before the mask ops such a layer has
      return c.refuse(
          "it multiplies two values that both carry the tokens (the scores Q K^T or the "
          "probabilities times V of an attention that did not fuse, or another product across "
          "positions)");
    }
    res = m;
  }
  out.assign(1, *res);
  return true;
}

// Quantized / fused MatMuls whose first input is the activation (..., K) and whose other inputs
// are weights: position-wise when the tokens are not on K.
bool activation_matmul(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (int_attr_or(&n, "transA", 0) || int_attr_or(&n, "transBatchA", 0)) {
    return c.refuse("its activation input is transposed");
  }
  if (!others_free(c, 1, "weight")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int ra = rank_of(c, n.inputs()[0]), r = rank_of(c, n.outputs()[0]);
  if (ra < 0 || r < 0) return c.refuse("an operand's rank is unknown");
  if (s->axis == ra - 1) return c.refuse("it contracts over the sequence axis");
  s->axis += r - ra;
  out.assign(1, *s);
  return true;
}

bool gemm(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const bool ta = int_attr_or(&n, "transA", 0) != 0, tb = int_attr_or(&n, "transB", 0) != 0;
  const SeqState& a = c.in[0];
  const SeqState& b = c.in[1];
  if (a.kind != SeqState::kFree && b.kind != SeqState::kFree) {
    return c.refuse("it multiplies two values that both carry the tokens");
  }
  std::optional<SeqState> res;
  if (a.kind == SeqState::kSeq) {
    if (a.axis != (ta ? 1 : 0)) return c.refuse("it contracts over the sequence axis");
    res = a;
    res->axis = 0;
  } else if (b.kind == SeqState::kSeq) {
    if (b.axis != (tb ? 0 : 1)) return c.refuse("it contracts over the sequence axis");
    res = b;
    res->axis = 1;
  } else if (a.kind == SeqState::kLast || b.kind == SeqState::kLast) {
    return c.refuse(kLastWithSeq);
  }
  if (c.in.size() > 2 && c.in[2].kind != SeqState::kFree) {  // C broadcasts to (M, N)
    const SeqState& s = c.in[2];
    const int rc = rank_of(c, n.inputs()[2]);
    if (s.kind == SeqState::kLast || rc < 0) return c.refuse(kLastWithSeq);
    SeqState m = s;
    m.axis = s.axis + (2 - rc);
    if (res && !same_place(*res, m)) return c.refuse("its inputs pair different positions");
    res = m;
  }
  out.assign(1, *res);
  return true;
}

bool transpose(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = rank_of(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  std::vector<int64_t> perm;
  if (const Attribute* p = n.attribute("perm")) perm = p->ints;
  if (perm.empty()) {
    for (int i = r - 1; i >= 0; --i) perm.push_back(i);
  }
  for (size_t j = 0; j < perm.size(); ++j) {
    if (perm[j] == s->axis) {
      s->axis = static_cast<int>(j);
      out.assign(1, *s);
      return true;
    }
  }
  return c.refuse("its permutation drops the sequence axis");
}

std::optional<DimExpr> dims_product(SeqContext& c, const Value* v, int from, int to) {
  DimExpr p = DimExpr::constant(1);
  for (int i = from; i < to; ++i) {
    auto d = c.facts.dim(v, i);
    if (!d) return std::nullopt;
    auto q = DimExpr::mul(p, *d);
    if (!q) return std::nullopt;
    p = *q;
  }
  return p;
}

// Reshape, Flatten, Squeeze, Unsqueeze keep the elements in order: each position's elements stay
// one block when some output axis splits as outer' x S x inner' with the same number of
// elements before the block (proven on the symbolic dims).
bool regroup(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "shape")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const Value* x = n.inputs()[0];
  const Value* y = n.outputs()[0];
  const int ri = rank_of(c, x), ro = rank_of(c, y);
  if (ri < 0 || ro < 0) return c.refuse("its ranks are unknown");
  // The positions' count as this value's dims spell it (S, or a symbol the analysis made where it
  // lost S, e.g. after a Slice it cannot size).
  auto axis_dim = c.facts.dim(x, s->axis);
  auto spread = DimExpr::mul(s->outer, s->inner);
  auto len = axis_dim && spread ? DimExpr::div_exact(*axis_dim, *spread) : std::nullopt;
  if (!len) return c.refuse("the sequence axis' length is unknown");
  auto before = dims_product(c, x, 0, s->axis);
  auto outer = before ? DimExpr::mul(*before, s->outer) : std::nullopt;
  if (!outer) return c.refuse("the dims before the sequence axis are unknown");
  for (int b = 0; b < ro; ++b) {
    auto prefix = dims_product(c, y, 0, b);
    auto d = c.facts.dim(y, b);
    if (!prefix || !d) break;
    auto q = DimExpr::div_exact(*outer, *prefix);
    if (!q) continue;
    auto qs = DimExpr::mul(*q, *len);
    auto r = qs ? DimExpr::div_exact(*d, *qs) : std::nullopt;
    if (!r) continue;
    SeqState res = SeqState::seq(b);
    res.outer = *q;
    res.inner = *r;
    out.assign(n.outputs().size(), res);
    return true;
  }
  return c.refuse("its output shape is not proven to keep each position's elements together");
}

// Element k of a small integer value as a symbolic dim (constants and shape values; a Neg the
// analysis does not carry values through, as TorchScript's -S start, negated here), or nullopt.
std::optional<DimExpr> element_of(SeqContext& c, const Value* v, size_t k, int depth = 0) {
  if (!v) return std::nullopt;
  if (const std::vector<DimExpr>* e = c.facts.shape_value(v)) {
    if (k < e->size()) return (*e)[k];
  }
  const Node* p = v->producer();
  if (!p || !p->domain.value.empty() || p->inputs().empty() || depth > 3) return std::nullopt;
  if (p->op_type == "Unsqueeze" || p->op_type == "Squeeze" || p->op_type == "Reshape") {
    return element_of(c, p->inputs()[0], k, depth + 1);
  }
  if (p->op_type != "Neg") return std::nullopt;
  auto x = element_of(c, p->inputs()[0], k, depth + 1);
  return x ? DimExpr::sub(DimExpr::constant(0), *x) : std::nullopt;
}

std::optional<DimExpr> element(SeqContext& c, const Node& n, size_t input, size_t k) {
  if (input >= n.inputs().size()) return std::nullopt;
  return element_of(c, n.inputs()[input], k);
}

std::optional<std::vector<int64_t>> ints_of(const Node& n, size_t input, const char* attr,
                                            int64_t opset, int64_t first_input_opset) {
  if (opset >= first_input_opset) {
    if (input < n.inputs().size() && n.inputs()[input]) return constant_ints(n.inputs()[input]);
    return std::vector<int64_t>{};
  }
  if (const Attribute* a = n.attribute(attr)) return a->ints;
  return std::vector<int64_t>{};
}

bool is_end(const std::optional<DimExpr>& e, const DimExpr& seq,
            const std::optional<DimExpr>& len) {
  if (!e) return false;
  if (*e == seq || (len && *e == *len)) return true;
  auto v = e->constant_value();
  return v && *v >= std::numeric_limits<int32_t>::max();
}

// Slice: along other axes it keeps each position's slice; along the sequence only the whole
// range (identity) or the last position (the last-token logits of some exports) are kept.
bool slice(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "bounds")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = rank_of(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  const bool inputs = c.opset >= 10;
  std::vector<int64_t> axes;
  size_t count = 0;
  if (inputs) {
    const int rs = rank_of(c, n.inputs()[1]);
    auto len = rs == 1 ? c.facts.known_dim(n.inputs()[1], 0) : std::nullopt;
    if (!len) return c.refuse("its starts are unknown");
    count = static_cast<size_t>(*len);
    auto a = ints_of(n, 3, "axes", c.opset, 10);
    if (!a) return c.refuse("its axes are not constant");
    axes = *a;
  } else {
    const Attribute* st = n.attribute("starts");
    count = st ? st->ints.size() : 0;
    if (const Attribute* a = n.attribute("axes")) axes = a->ints;
  }
  if (axes.empty()) {
    for (size_t k = 0; k < count; ++k) axes.push_back(static_cast<int64_t>(k));
  }
  for (size_t k = 0; k < axes.size(); ++k) {
    if (normalize_axis(axes[k], r) != s->axis) continue;
    std::optional<DimExpr> start, end, step = DimExpr::constant(1);
    if (inputs) {
      start = element(c, n, 1, k);
      end = element(c, n, 2, k);
      if (n.inputs().size() > 4 && n.inputs()[4]) step = element(c, n, 4, k);
    } else {
      const Attribute* st = n.attribute("starts");
      const Attribute* en = n.attribute("ends");
      if (st && k < st->ints.size()) start = DimExpr::constant(st->ints[k]);
      if (en && k < en->ints.size()) end = DimExpr::constant(en->ints[k]);
    }
    const bool unit = step && *step == DimExpr::constant(1) && !s->flattened();
    // x[:, -S:] (LFM2's mask over the conv input) is all of it too
    const auto len = c.facts.dim(n.inputs()[0], s->axis);
    const auto minus_s = DimExpr::sub(DimExpr::constant(0), c.seq);
    const auto minus_len = len ? DimExpr::sub(DimExpr::constant(0), *len) : std::nullopt;
    const bool from_first =
        start && (*start == DimExpr::constant(0) || (minus_s && *start == *minus_s) ||
                  (minus_len && *start == *minus_len));
    if (unit && from_first && is_end(end, c.seq, len)) continue;
    if (unit && start && *start == DimExpr::constant(-1) && is_end(end, c.seq, len)) {
      out.assign(1, SeqState::last());
      return true;
    }
    return c.refuse(
        "it slices the sequence axis (a token shift, or positions read from other positions)");
  }
  out.assign(1, *s);
  return true;
}

bool gather(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const SeqState& d = c.in[0];
  const SeqState& i = c.in[1];
  if (d.kind == SeqState::kLast || i.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  if (d.kind == SeqState::kSeq && i.kind == SeqState::kSeq) {
    return c.refuse("it gathers token-carrying values at token-dependent indices");
  }
  const int rd = rank_of(c, n.inputs()[0]), ri = rank_of(c, n.inputs()[1]);
  if (rd < 0 || ri < 0) return c.refuse("an operand's rank is unknown");
  const int axis = normalize_axis(int_attr_or(&n, "axis", 0), rd);
  if (axis < 0) return c.refuse("its axis is out of range");
  if (i.kind == SeqState::kSeq) {  // a lookup per token: embeddings, rotary tables
    SeqState res = i;
    res.axis = axis + i.axis;
    out.assign(1, res);
    return true;
  }
  if (axis != d.axis) {
    SeqState res = d;
    res.axis = d.axis < axis ? d.axis : d.axis + ri - 1;
    out.assign(1, res);
    return true;
  }
  auto idx = constant_ints(n.inputs()[1]);
  if (ri == 0 && idx && idx->size() == 1 && (*idx)[0] == -1 && !d.flattened()) {
    out.assign(1, SeqState::last());
    return true;
  }
  return c.refuse("it gathers along the sequence axis (positions read from other positions)");
}

// GatherND (batch_dims 0): out = indices.shape[:-1] + data.shape[k:], k = indices.shape[-1].
// Per-token lookups in a table (MoE experts' weights) or a fixed index into leading axes of a
// token-carrying value (dynamo's falcon picks q/k/v from a stacked (3, B, S, D) view).
bool gather_nd(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const SeqState& d = c.in[0];
  const SeqState& i = c.in[1];
  if (d.kind == SeqState::kLast || i.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  if (d.kind == SeqState::kSeq && i.kind == SeqState::kSeq) {
    return c.refuse("it gathers token-carrying values at token-dependent indices");
  }
  if (int_attr_or(&n, "batch_dims", 0) != 0) return c.refuse("it has batch_dims");
  const int ri = rank_of(c, n.inputs()[1]);
  auto k = ri >= 1 ? c.facts.known_dim(n.inputs()[1], ri - 1) : std::nullopt;
  if (!k) return c.refuse("its index depth is unknown");
  SeqState res = i.kind == SeqState::kSeq ? i : d;
  if (i.kind == SeqState::kSeq) {
    if (i.axis == ri - 1) return c.refuse("its index tuples run along the sequence axis");
  } else {
    if (d.axis < *k) return c.refuse("it gathers along the sequence axis");
    res.axis = (ri - 1) + (d.axis - static_cast<int>(*k));
  }
  out.assign(1, res);
  return true;
}

// The op's reduced / normalized axis from attribute `attr` (default `fallback`), refused when it
// is the sequence axis.
bool off_sequence_axis(const Node& n, SeqContext& c, const SeqState& s, const char* attr,
                       int64_t fallback, const char* what) {
  const int r = rank_of(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  const int axis = normalize_axis(int_attr_or(&n, attr, fallback), r);
  if (axis < 0) return c.refuse("its axis is out of range");
  if (axis == s.axis) return c.refuse(std::string("it ") + what + " over the sequence axis");
  return true;
}

bool softmax(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  auto s = carried(c, 1);
  if (!s) return false;
  if (c.opset < 13) {  // flattens from axis (default 1): the sequence must stay before it
    const int r = rank_of(c, n.inputs()[0]);
    const int axis = normalize_axis(int_attr_or(&n, "axis", 1), r);
    if (r < 0 || axis < 0 || s->axis >= axis) {
      return c.refuse("it normalizes over axes that include the sequence axis");
    }
  } else if (!off_sequence_axis(n, c, *s, "axis", -1, "normalizes")) {
    return false;
  }
  out.assign(n.outputs().size(), *s);
  return true;
}

// ReduceX, ArgMax/ArgMin: reducing the sequence (a mean over the tokens) mixes positions.
bool reduce(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "axes")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = rank_of(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  const bool arg = n.op_type == "ArgMax" || n.op_type == "ArgMin";
  const int64_t axes_input_opset = n.op_type == "ReduceSum" ? 13 : 18;
  std::vector<int64_t> axes;
  if (arg) {
    axes = {int_attr_or(&n, "axis", 0)};
  } else {
    auto a = ints_of(n, 1, "axes", c.opset, axes_input_opset);
    if (!a) return c.refuse("its axes are not constant");
    axes = *a;
    if (axes.empty()) {
      if (int_attr_or(&n, "noop_with_empty_axes", 0)) {
        out.assign(1, *s);
        return true;
      }
      return c.refuse("it reduces over every axis, the sequence included");
    }
  }
  const bool keep = int_attr_or(&n, "keepdims", 1) != 0;
  int removed_before = 0;
  for (int64_t a : axes) {
    const int ax = normalize_axis(a, r);
    if (ax < 0) return c.refuse("its axes are out of range");
    if (ax == s->axis) return c.refuse("it reduces over the sequence axis (across the tokens)");
    removed_before += ax < s->axis ? 1 : 0;
  }
  if (!keep) s->axis -= removed_before;
  out.assign(1, *s);
  return true;
}

bool topk(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "k")) return false;
  auto s = carried(c, 1);
  if (!s || !off_sequence_axis(n, c, *s, "axis", -1, "selects")) return false;
  out.assign(n.outputs().size(), *s);
  return true;
}

bool split(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "split sizes")) return false;
  auto s = carried(c, 1);
  if (!s || !off_sequence_axis(n, c, *s, "axis", 0, "splits")) return false;
  out.assign(n.outputs().size(), *s);
  return true;
}

bool cumsum(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "axis")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = rank_of(c, n.inputs()[0]);
  auto axis = n.inputs().size() > 1 ? constant_ints(n.inputs()[1]) : std::nullopt;
  if (r < 0 || !axis || axis->size() != 1) return c.refuse("its axis is not constant");
  const int a = normalize_axis((*axis)[0], r);
  if (a < 0 || a == s->axis) {
    return c.refuse("it accumulates over the sequence axis (a running sum across the tokens)");
  }
  out.assign(1, *s);
  return true;
}

bool concat(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  SeqState res;
  bool found = false;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const SeqState& s = c.in[i];
    if (s.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
    if (s.kind != SeqState::kSeq) continue;
    if (found && !same_place(res, s)) return c.refuse("its inputs carry the sequence apart");
    res = s;
    found = true;
  }
  const int r = rank_of(c, n.outputs()[0]);
  const int axis = normalize_axis(int_attr_or(&n, "axis", 0), r);
  if (axis < 0) return c.refuse("its axis is unknown");
  if (axis == res.axis) {
    return c.refuse(
        "it concatenates along the sequence axis (a token shift, or positions built from "
        "other positions)");
  }
  out.assign(1, res);
  return true;
}

// Norms over the trailing axes [axis, rank): the sequence must stay before them.
bool norm(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const bool skip = n.op_type.rfind("Skip", 0) == 0;
  const size_t carriers = skip ? 2 : 1;
  if (!others_free(c, carriers, "scale or bias")) return false;
  auto s = carried(c, carriers);
  if (!s) return false;
  const int r = rank_of(c, n.inputs()[0]);
  const int axis = normalize_axis(skip ? -1 : int_attr_or(&n, "axis", -1), r);
  if (r < 0 || axis < 0) return c.refuse("its axis is unknown");
  if (s->axis >= axis) return c.refuse("it normalizes over the sequence axis");
  out.assign(n.outputs().size(), *s);
  return true;
}

// RotaryEmbedding rotates each position by its own position id (any layout of X).
bool rotary(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  for (const SeqState& s : c.in) {
    if (s.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  }
  if (c.in[0].kind != SeqState::kSeq) {
    return c.refuse("it rotates a value without the tokens by per-token positions");
  }
  (void)n;
  out.assign(n.outputs().size(), c.in[0]);
  return true;
}

bool pad(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "pads")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = rank_of(c, n.inputs()[0]);
  auto pads = ints_of(n, 1, "pads", c.opset, 11);
  std::vector<int64_t> axes;
  if (c.opset >= 18 && n.inputs().size() > 3 && n.inputs()[3]) {
    auto a = constant_ints(n.inputs()[3]);
    if (!a) return c.refuse("its axes are not constant");
    axes = *a;
  } else {
    for (int i = 0; i < r; ++i) axes.push_back(i);
  }
  if (r < 0 || !pads || pads->size() != 2 * axes.size()) return c.refuse("its pads are unknown");
  for (size_t k = 0; k < axes.size(); ++k) {
    if (normalize_axis(axes[k], r) != s->axis) continue;
    if ((*pads)[k] != 0 || (*pads)[k + axes.size()] != 0) {
      return c.refuse("it pads the sequence axis (a token shift)");
    }
  }
  out.assign(1, *s);
  return true;
}

// Tile repeats whole copies: each element still belongs to one position (outer grows).
bool tile(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "repeats")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const std::vector<DimExpr>* reps = c.facts.shape_value(n.inputs()[1]);
  if (!reps || static_cast<size_t>(s->axis) >= reps->size())
    return c.refuse("its repeats are unknown");
  auto outer = DimExpr::mul(s->outer, (*reps)[static_cast<size_t>(s->axis)]);
  if (!outer) return c.refuse("its repeats are unknown");
  s->outer = *outer;
  out.assign(1, *s);
  return true;
}

bool one_hot(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "depth or values")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = rank_of(c, n.outputs()[0]);
  const int a = normalize_axis(int_attr_or(&n, "axis", -1), r);
  if (a < 0) return c.refuse("its axis is unknown");
  s->axis += a <= s->axis ? 1 : 0;
  out.assign(1, *s);
  return true;
}

constexpr const char* kConvolution =
    "it convolves along the sequence axis: a convolution over the tokens (a conv/SSM hybrid "
    "layer, such as LFM2's short convolutions or Mamba's) needs a cached state of its own (the "
    "last inputs carried from step to step), which add_kv_cache does not build";

// Convolutions and pools slide over axes 2..: position-wise only when the tokens are the batch.
bool convolution(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "weight")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  if (s->axis >= 2) return c.refuse(kConvolution);
  if (s->axis == 1) return c.refuse("it mixes its channels, which carry the sequence");
  out.assign(n.outputs().size(), *s);
  return true;
}

// The attention the rewrite caches: Q per position, K/V over the positions (self, cached) or
// the encoder's (cross); the mask is proven and replaced (mask_proof.h), never read here.
bool internal_attention(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const SeqState& q = c.in[0];
  if (q.kind != SeqState::kSeq || q.axis != 2 || q.flattened()) {
    return c.refuse("its query is not (B, H, S, D) with one position per row");
  }
  for (size_t i : {1, 2}) {
    const SeqState& kv = c.in[i];
    if (kv.kind == SeqState::kFree) continue;  // cross-attention: the encoder's keys
    if (kv.kind != SeqState::kSeq || !same_place(kv, q)) {
      return c.refuse("its keys or values are not (B, Hkv, S, D) over the query's positions");
    }
  }
  if (c.in.size() > 4 && c.in[4].kind != SeqState::kFree) {
    return c.refuse("its sinks depend on the tokens");
  }
  (void)n;
  out.assign(1, q);
  return true;
}

}  // namespace

SeqRule find_seq_rule(const std::string& domain, const std::string& op_type) {
  static const std::unordered_map<std::string, SeqRule> kRules = [] {
    std::unordered_map<std::string, SeqRule> m;
    for (const char* op : {"Abs",
                           "Acos",
                           "Acosh",
                           "Add",
                           "And",
                           "Asin",
                           "Asinh",
                           "Atan",
                           "Atanh",
                           "BitShift",
                           "BitwiseAnd",
                           "BitwiseNot",
                           "BitwiseOr",
                           "BitwiseXor",
                           "Cast",
                           "CastLike",
                           "Ceil",
                           "Celu",
                           "Clip",
                           "Cos",
                           "Cosh",
                           "Div",
                           "Dropout",
                           "Elu",
                           "Equal",
                           "Erf",
                           "Exp",
                           "Expand",
                           "Floor",
                           "Gelu",
                           "Greater",
                           "GreaterOrEqual",
                           "HardSigmoid",
                           "HardSwish",
                           "Identity",
                           "IsInf",
                           "IsNaN",
                           "LeakyRelu",
                           "Less",
                           "LessOrEqual",
                           "Log",
                           "Max",
                           "Mean",
                           "Min",
                           "Mish",
                           "Mod",
                           "Mul",
                           "Neg",
                           "Not",
                           "Or",
                           "Pow",
                           "PRelu",
                           "Reciprocal",
                           "Relu",
                           "Round",
                           "Selu",
                           "Shrink",
                           "Sigmoid",
                           "Sign",
                           "Sin",
                           "Sinh",
                           "Softplus",
                           "Softsign",
                           "Sqrt",
                           "Sub",
                           "Sum",
                           "Tan",
                           "Tanh",
                           "ThresholdedRelu",
                           "Where",
                           "Xor"}) {
      m[std::string("|") + op] = elementwise;
    }
    for (const char* op : {"FastGelu", "Gelu", "BiasGelu", "QuickGelu", "BiasAdd"}) {
      m[std::string(kMsDomain) + "|" + op] = elementwise;
    }
    m["|MatMul"] = matmul;
    m["|Gemm"] = gemm;
    for (const char* op :
         {"MatMulNBits", "FusedMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}) {
      m[std::string(kMsDomain) + "|" + op] = activation_matmul;
    }
    m["|Transpose"] = transpose;
    for (const char* op : {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}) {
      m[std::string("|") + op] = regroup;
    }
    m["|Slice"] = slice;
    m["|Gather"] = gather;
    m["|GatherND"] = gather_nd;
    for (const char* op : {"Softmax", "LogSoftmax", "Hardmax"}) m[std::string("|") + op] = softmax;
    for (const char* op :
         {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"}) {
      m[std::string("|") + op] = reduce;
    }
    m["|TopK"] = topk;
    m["|Split"] = split;
    m["|CumSum"] = cumsum;
    m["|Concat"] = concat;
    m["|LayerNormalization"] = norm;
    m["|RMSNormalization"] = norm;
    m["|SimplifiedLayerNormalization"] = norm;  // ORT registers it in the ONNX domain
    for (const char* op : {"LayerNormalization", "SimplifiedLayerNormalization",
                           "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}) {
      m[std::string(kMsDomain) + "|" + op] = norm;
    }
    m["|RotaryEmbedding"] = rotary;
    m[std::string(kMsDomain) + "|RotaryEmbedding"] = rotary;
    m["|Pad"] = pad;
    m["|Tile"] = tile;
    m["|OneHot"] = one_hot;
    for (const char* op :
         {"Conv", "ConvInteger", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"}) {
      m[std::string("|") + op] = convolution;
    }
    m[std::string(kInternalDomain) + "|" + kInternalAttention] = internal_attention;
    return m;
  }();
  const std::string d = domain == "ai.onnx" ? "" : domain;
  auto it = kRules.find(d + "|" + op_type);
  return it == kRules.end() ? nullptr : it->second;
}

}  // namespace fastopt::passes::kv_cache
