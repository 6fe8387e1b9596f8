#include "passes/rotary/rotary_interleaved.h"

#include <algorithm>
#include <vector>

#include "ir/constant.h"

namespace fastopt::passes::rotary {

std::optional<int64_t> single(const Value* v) {
  auto c = v ? constant_ints(v) : std::nullopt;
  if (!c || c->size() != 1) return std::nullopt;
  return (*c)[0];
}

std::optional<LastAxisSlice> last_axis_slice(const Node* sl) {
  const auto& in = sl->inputs();
  if (in.size() < 4 || !in[3]) return std::nullopt;
  auto axis = single(in[3]);
  const int rank = value_rank(in[0]);
  if (!axis || !(*axis == -1 || (rank > 0 && *axis == rank - 1))) return std::nullopt;
  auto start = single(in[1]), end = single(in[2]);
  auto step = in.size() > 4 && in[4] ? single(in[4]) : std::optional<int64_t>(1);
  if (!start || !end || !step) return std::nullopt;
  return LastAxisSlice{*start, *end, *step};
}

namespace {

// A value of a known rank whose first dims a shape copies.
struct Source {
  const Value* v;
  int64_t rank;
};

// The end of a slice of Shape(src) that keeps its first n dims: n, or n - rank counted back.
bool keeps_first(const Source& src, std::optional<int64_t> end, int64_t n) {
  return end && (*end == n || *end == n - src.rank);
}

const Source* find_source(const std::vector<Source>& sources, const Value* v) {
  for (const Source& s : sources) {
    if (s.v == v) return &s;
  }
  return nullptr;
}

bool is_shape_of(const Value* v, const std::vector<Source>& sources, int64_t n) {
  // Shape(t, start 0, end n) or Slice(Shape(t), 0, n).
  if (Node* sh = made_by(v, "Shape")) {
    const Source* src = find_source(sources, sh->inputs()[0]);
    return src && int_attr(sh, "start").value_or(0) == 0 &&
           keeps_first(*src, int_attr(sh, "end"), n);
  }
  Node* sl = made_by(v, "Slice");
  if (!sl || sl->inputs().size() < 3) return false;
  Node* sh = made_by(sl->inputs()[0], "Shape");
  const auto& in = sl->inputs();
  const bool axis0 = in.size() < 4 || !in[3] || single(in[3]) == 0;
  const bool step1 = in.size() < 5 || !in[4] || single(in[4]) == 1;
  const Source* src = sh ? find_source(sources, sh->inputs()[0]) : nullptr;
  return src && !sh->attribute("start") && !sh->attribute("end") && single(in[1]) == 0 &&
         keeps_first(*src, single(in[2]), n) && axis0 && step1;
}

// `shape` keeps the first n dims of `sources` (all of which share them) and ends in -1 or
// `last`: Concat(Shape slice [0:n], [-1 | last]), or constants that agree with `ref`'s known
// dims (0 copies a dim unless allowzero).
// `inserted`: ref lacks that dim (a size-1 axis the shape must keep as 1).
bool keeps_leading_dims(const Value* shape, const std::vector<Source>& sources, const Value* ref,
                        int64_t n, std::optional<int64_t> last, bool allowzero,
                        std::optional<int64_t> inserted = std::nullopt) {
  auto ok_last = [&](int64_t e) { return e == -1 || (last && e == *last); };
  if (auto c = constant_ints(shape)) {
    if (static_cast<int64_t>(c->size()) != n + 1 || !ok_last(c->back())) return false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = (*c)[static_cast<size_t>(i)];
      if (e == 0 && !allowzero) continue;
      if (inserted && i == *inserted) {
        if (e != 1) return false;
        continue;
      }
      const int64_t at = inserted && i > *inserted ? i - 1 : i;
      const auto& d = ref->type.dims;
      if (!ref->type.has_shape || static_cast<int64_t>(d.size()) <= at || !d[at].value ||
          *d[at].value != e) {
        return false;
      }
    }
    return true;
  }
  Node* cat = made_by(shape, "Concat");
  if (!cat || cat->inputs().size() != 2) return false;
  auto tail = single(cat->inputs()[1]);
  return tail && ok_last(*tail) && is_shape_of(cat->inputs()[0], sources, n);
}

}  // namespace

namespace {

// The Tile or Expand of repeat_interleave by (1, .., 1, 2): y's rank, or nullopt.
std::optional<int64_t> repeat_rank(const Node* rep) {
  auto reps = constant_ints(rep->inputs()[1]);
  if (!reps || reps->size() < 2 || reps->back() != 2) return std::nullopt;
  for (size_t i = 0; i + 1 < reps->size(); ++i) {
    if ((*reps)[i] != 1) return std::nullopt;
  }
  return static_cast<int64_t>(reps->size()) - 1;
}

// Unsqueeze(y, last) or, merged by fold_reshapes, Unsqueeze(z, [heads axis, last]): its axes.
std::optional<std::vector<int64_t>> repeat_unsqueeze_axes(const Node* unsq, int64_t rank) {
  auto axes = unsq ? unsqueeze_axes(unsq) : std::nullopt;
  if (!axes || axes->empty() || axes->size() > 2 ||
      (axes->back() != rank && !(axes->size() == 1 && axes->back() == -1))) {
    return std::nullopt;
  }
  return axes;
}

// The values whose leading dims the repeat's shape may copy; with a heads axis also the
// exporter's own Unsqueeze(z, heads axis).
std::vector<Source> repeat_sources(const Node* unsq, const Value* grown, const Value* z,
                                   int64_t rank, std::optional<int64_t> head_axis) {
  std::vector<Source> sources = {{unsq->outputs()[0], rank + 1}, {grown, rank + 1}};
  if (!head_axis) {
    sources.push_back({z, rank});
    return sources;
  }
  for (const Use& u : z->uses()) {
    auto a = made_by(u.node->outputs()[0], "Unsqueeze") ? unsqueeze_axes(u.node) : std::nullopt;
    if (a && *a == std::vector<int64_t>{*head_axis})
      sources.push_back({u.node->outputs()[0], rank});
  }
  return sources;
}

}  // namespace

Repeated repeated_twice(const Value* v) {
  Node* rs = made_by(v, "Reshape");
  if (!rs) return {};
  Value* grown = rs->inputs()[0];
  Node* rep = made_by(grown, "Tile");
  if (!rep) rep = made_by(grown, "Expand");
  auto rank = rep ? repeat_rank(rep) : std::nullopt;  // y's rank
  if (!rank) return {};
  Node* unsq = made_by(rep->inputs()[0], "Unsqueeze");
  auto axes = repeat_unsqueeze_axes(unsq, *rank);
  if (!axes) return {};
  Repeated out;
  Value* z = unsq->inputs()[0];
  const int64_t z_rank = *rank + 1 - static_cast<int64_t>(axes->size());
  if (value_rank(z) != -1 && value_rank(z) != z_rank) return {};
  if (axes->size() == 2) {
    out.head_axis = (*axes)[0];
    if (*out.head_axis < 0 || *out.head_axis >= *rank - 1) return {};
  }
  const std::vector<Source> sources = repeat_sources(unsq, grown, z, *rank, out.head_axis);
  const bool allowzero = int_attr(rs, "allowzero").value_or(0) != 0;
  std::optional<int64_t> width;
  if (z->type.has_shape && !z->type.dims.empty() && z->type.dims.back().value) {
    width = 2 * *z->type.dims.back().value;
  }
  if (!keeps_leading_dims(rs->inputs()[1], sources, z, *rank - 1, width, allowzero,
                          out.head_axis)) {
    return {};
  }
  out.y = z;
  return out;
}

namespace {

// Unsqueeze(a, -1) and Unsqueeze(b, -1) stacked on a new last axis; "" or the reason.
std::string stacked_pairs_problem(const Node* cat, const Node* u_odd, const Node* u_even) {
  const auto axis = int_attr(cat, "axis");
  if (axis != -1 && axis != 4) return "the pairs are not stacked on a new last axis";
  for (const Node* u : {u_odd, u_even}) {
    auto axes = u ? unsqueeze_axes(u) : std::nullopt;
    if (!axes || axes->size() != 1 || ((*axes)[0] != -1 && (*axes)[0] != 4)) {
      return "the pairs are not stacked on a new last axis";
    }
  }
  return "";
}

// The stacked values: -x[..., 1::2] and x[..., 0::2] (D: x's last dim).
std::string odd_even_problem(const Node* u_odd, const Node* u_even, const Value* x, int64_t d) {
  Node* neg = made_by(u_odd->inputs()[0], "Neg");
  Node* odd = neg ? made_by(neg->inputs()[0], "Slice") : nullptr;
  Node* even = made_by(u_even->inputs()[0], "Slice");
  auto so = odd ? last_axis_slice(odd) : std::nullopt;
  auto se = even ? last_axis_slice(even) : std::nullopt;
  if (!so || !se || odd->inputs()[0] != x || even->inputs()[0] != x) {
    return "the rotated x is not stack(-x[..., 1::2], x[..., 0::2])";
  }
  if (so->start != 1 || se->start != 0 || so->step != 2 || se->step != 2 || so->end < d ||
      se->end < d) {
    return "the slices are not x[..., 1::2] and x[..., 0::2]";
  }
  return "";
}

// A constant flatten shape: 4 elements, the last D (or -1), no -1 before.
std::string constant_flatten_problem(const std::vector<int64_t>& c, int64_t d) {
  if (c.size() != 4 || (c.back() != d && c.back() != -1)) {
    return "the stacked pairs are not flattened back to (.., D)";
  }
  for (size_t i = 0; i < 3; ++i) {
    if (c[i] == -1) return "the stacked pairs are not flattened back to x's shape";
  }
  return "";
}

// Dynamo writes the target shape from the graph inputs' dims: a Concat of 1-element pieces,
// the last D and no -1 (the pieces from Shape -> Gather are the dims exporters copy).
std::string pieces_flatten_problem(const Value* shape, int64_t d) {
  Node* pieces = made_by(shape, "Concat");
  if (!pieces || pieces->inputs().size() != 4 || single(pieces->inputs()[3]) != d) {
    return "the stacked pairs are not flattened back to (.., D)";
  }
  for (size_t i = 0; i < 3; ++i) {
    const Value* p = pieces->inputs()[i];
    if (auto e = single(p); e && *e < 0) return "the flatten's shape has a -1 before D";
    if (value_rank(p) != 1) return "the flatten's shape is not made of 1-element pieces";
  }
  return "";
}

}  // namespace

std::string check_rotate_every_two(const Value* rot, const Value* x, int64_t d) {
  Node* rs = made_by(rot, "Reshape");
  Node* cat = rs ? made_by(rs->inputs()[0], "Concat") : nullptr;
  if (!cat || cat->inputs().size() != 2) return "the rotated x is not Reshape(Concat(a, b))";
  Node* u_odd = made_by(cat->inputs()[0], "Unsqueeze");
  Node* u_even = made_by(cat->inputs()[1], "Unsqueeze");
  std::string why = stacked_pairs_problem(cat, u_odd, u_even);
  if (why.empty()) why = odd_even_problem(u_odd, u_even, x, d);
  if (!why.empty()) return why;
  // The flatten keeps x's (B, ., ., D/2) dims and merges the pairs: back to x's shape.
  const Value* shape = rs->inputs()[1];
  if (auto c = constant_ints(shape)) return constant_flatten_problem(*c, d);
  const bool allowzero = int_attr(rs, "allowzero").value_or(0) != 0;
  if (keeps_leading_dims(shape, {{cat->outputs()[0], 5}, {u_odd->outputs()[0], 5}}, x, 3, d,
                         allowzero)) {
    return "";
  }
  return pieces_flatten_problem(shape, d);
}

std::string check_even_odd(const Node* even, const Node* odd, const Value* x, int64_t d) {
  auto se = last_axis_slice(even), so = last_axis_slice(odd);
  if (!se || !so || even->inputs()[0] != x || odd->inputs()[0] != x) {
    return "the halves are not constant last-axis Slices of x";
  }
  if (se->start != 0 || so->start != 1 || se->step != 2 || so->step != 2 || se->end < d ||
      so->end < d) {
    return "the halves are not x[..., 0::2] and x[..., 1::2]";
  }
  return "";
}

}  // namespace fastopt::passes::rotary
