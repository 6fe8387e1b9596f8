// The sequence-axis rules of layout ops (positionwise.h): transposes, reshapes, slices, gathers,
// concatenations, splits, pads, tiles. They keep each position's elements apart, or move data
// between positions (a token shift: Slice + Pad / Concat along the tokens), which is refused.
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/positionwise.h"

namespace fastopt::passes::kv_cache {

using analysis::DimExpr;

namespace {

bool transpose(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = seq_rank(c, n.inputs()[0]);
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
  const int ri = seq_rank(c, x), ro = seq_rank(c, y);
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

bool is_end(const std::optional<DimExpr>& e, const DimExpr& seq,
            const std::optional<DimExpr>& len) {
  if (!e) return false;
  if (*e == seq || (len && *e == *len)) return true;
  auto v = e->constant_value();
  return v && *v >= std::numeric_limits<int32_t>::max();
}

// The axes a Slice cuts (inputs from opset 10, attributes before; all of them when none are
// given); false with the refusal when they are not known.
bool slice_axes(const Node& n, SeqContext& c, std::vector<int64_t>& axes) {
  size_t count = 0;
  if (c.opset >= 10) {
    const int rs = seq_rank(c, n.inputs()[1]);
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
  return true;
}

// Start, end and step of a Slice's k-th axis, where they are known.
struct SliceBounds {
  std::optional<DimExpr> start, end, step = DimExpr::constant(1);
};

SliceBounds slice_bounds(const Node& n, SeqContext& c, size_t k) {
  SliceBounds b;
  if (c.opset >= 10) {
    b.start = element(c, n, 1, k);
    b.end = element(c, n, 2, k);
    if (n.inputs().size() > 4 && n.inputs()[4]) b.step = element(c, n, 4, k);
  } else {
    const Attribute* st = n.attribute("starts");
    const Attribute* en = n.attribute("ends");
    if (st && k < st->ints.size()) b.start = DimExpr::constant(st->ints[k]);
    if (en && k < en->ints.size()) b.end = DimExpr::constant(en->ints[k]);
  }
  return b;
}

// Slice: along other axes it keeps each position's slice; along the sequence only the whole
// range (identity) or the last position (the last-token logits of some exports) are kept.
bool slice(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "bounds")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = seq_rank(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  std::vector<int64_t> axes;
  if (!slice_axes(n, c, axes)) return false;
  for (size_t k = 0; k < axes.size(); ++k) {
    if (normalize_axis(axes[k], r) != s->axis) continue;
    const auto [start, end, step] = slice_bounds(n, c, k);
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
  const int rd = seq_rank(c, n.inputs()[0]), ri = seq_rank(c, n.inputs()[1]);
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
  const int ri = seq_rank(c, n.inputs()[1]);
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
  const int r = seq_rank(c, n.outputs()[0]);
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

bool split(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "split sizes")) return false;
  auto s = carried(c, 1);
  if (!s || !off_sequence_axis(n, c, *s, "axis", 0, "splits")) return false;
  out.assign(n.outputs().size(), *s);
  return true;
}

bool pad(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "pads")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = seq_rank(c, n.inputs()[0]);
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
  const int r = seq_rank(c, n.outputs()[0]);
  const int a = normalize_axis(int_attr_or(&n, "axis", -1), r);
  if (a < 0) return c.refuse("its axis is unknown");
  s->axis += a <= s->axis ? 1 : 0;
  out.assign(1, *s);
  return true;
}

// The Range(0, S) whose values are component `axis` of every index tuple, each element's own
// position along that axis (TorchScript's slice_scatter builds a full index grid: Concat(...,
// Unsqueeze(c_j, -1), ..., axis -1), c_j = Expand(Range(0, S) reshaped to S on axis j, 1
// elsewhere, broadcast from the right)); null when that is not proven.
// Component `axis` of the index tuples Concat(..., Unsqueeze(c_j, -1), ..., axis -1): c_j, or
// null when `indices` is not built so.
const Value* index_component(SeqContext& c, const Value* indices, int axis, int rank) {
  const Node* cat = indices ? indices->producer() : nullptr;
  if (!cat || cat->op_type != "Concat" || !cat->domain.value.empty() ||
      normalize_axis(int_attr_or(cat, "axis", 0), rank + 1) != rank ||
      cat->inputs().size() != static_cast<size_t>(rank)) {
    return nullptr;
  }
  const Value* v = cat->inputs()[static_cast<size_t>(axis)];
  const Node* p = v ? v->producer() : nullptr;
  if (!p || p->op_type != "Unsqueeze" || seq_rank(c, p->inputs()[0]) != rank) return nullptr;
  return p->inputs()[0];
}

// Whether v is (.., S, 1, .., 1) with S on `axis` of a rank-`rank` grid, broadcast from the
// right: S on axis - (rank - r).
bool sequence_line(SeqContext& c, const Value* v, int axis, int rank) {
  const int r = seq_rank(c, v);
  bool line = r >= 1 && r <= rank && axis - (rank - r) >= 0;
  for (int i = 0; i < r && line; ++i) {
    auto d = c.facts.dim(v, i);
    line = d && (i == axis - (rank - r) ? c.facts.equal(*d, c.seq) : *d == DimExpr::constant(1));
  }
  return line;
}

const Node* own_position_component(SeqContext& c, const Value* indices, int axis, int rank) {
  const Value* v = index_component(c, indices, axis, rank);
  const Node* p = nullptr;
  for (int steps = 0; v && steps < 6; ++steps) {  // Expand / Cast of (.., S, 1, .., 1)
    if (sequence_line(c, v, axis, rank)) break;
    p = v->producer();
    if (!p || (p->op_type != "Expand" && p->op_type != "Cast")) return nullptr;
    v = p->inputs()[0];
  }
  for (int steps = 0; v && steps < 6; ++steps) {  // reshaped from the 1-D Range: same order
    p = v->producer();
    if (!p || !p->domain.value.empty()) return nullptr;
    if (p->op_type == "Range") {
      auto start = constant_scalar(p->inputs()[0]);
      auto delta = constant_scalar(p->inputs()[2]);
      return start && *start == 0 && delta && *delta == 1 ? p : nullptr;
    }
    if (p->op_type != "Unsqueeze" && p->op_type != "Reshape" && p->op_type != "Cast") {
      return nullptr;
    }
    v = p->inputs()[0];
  }
  return nullptr;
}

// ScatterND with fixed indices into the leading k axes of data (dynamo's slice_scatter: MLA
// assembles its keys' head dim from parts): updates = indices.shape[:-1] + data.shape[k:], so the
// tokens stay on their axis when they are not among the k indexed ones.
bool scatter_nd(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (c.in[1].kind != SeqState::kFree) return c.refuse("its indices depend on the tokens");
  const SeqState& d = c.in[0];
  const SeqState& u = c.in[2];
  if (d.kind == SeqState::kLast || u.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  const int ri = seq_rank(c, n.inputs()[1]);
  auto k = ri >= 1 ? c.facts.known_dim(n.inputs()[1], ri - 1) : std::nullopt;
  if (!k) return c.refuse("its index depth is unknown");
  const int depth = static_cast<int>(*k);
  std::optional<SeqState> res;
  if (d.kind == SeqState::kSeq) res = d;
  const int rank = seq_rank(c, n.inputs()[0]);
  if (u.kind == SeqState::kSeq && u.axis < ri - 1) {  // the tokens among the tuples' axes
    SeqState m = u;  // a full grid lays the tuples out like data's leading axes
    const Node* range =
        !u.flattened() ? own_position_component(c, n.inputs()[1], u.axis, rank) : nullptr;
    if (!range || depth != rank || (res && !same_place(*res, m))) {
      return c.refuse("it writes values of some positions into others");
    }
    c.relative_ranges.push_back(range);  // positions relative to the new tokens: right
    out.assign(1, m);
    return true;
  }
  if (u.kind == SeqState::kSeq) {
    SeqState m = u;
    m.axis = u.axis - (ri - 1) + depth;
    if (res && !same_place(*res, m))
      return c.refuse("it writes values of some positions into others");
    res = m;
  }
  if (res->axis < depth) return c.refuse("it scatters along the sequence axis");
  out.assign(1, *res);
  return true;
}

}  // namespace

void add_layout_rules(std::unordered_map<std::string, SeqRule>& rules) {
  rules["|Transpose"] = transpose;
  for (const char* op : {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}) {
    rules[std::string("|") + op] = regroup;
  }
  rules["|Slice"] = slice;
  rules["|Gather"] = gather;
  rules["|GatherND"] = gather_nd;
  rules["|ScatterND"] = scatter_nd;
  rules["|Concat"] = concat;
  rules["|Split"] = split;
  rules["|Pad"] = pad;
  rules["|Tile"] = tile;
  rules["|OneHot"] = one_hot;
}

}  // namespace fastopt::passes::kv_cache
