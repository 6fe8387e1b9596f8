#include "passes/rotary/rotary_interleaved.h"

#include <algorithm>
#include <vector>

#include "ir/constant.h"

namespace fastopt::passes::rotary {
namespace {

std::optional<int64_t> single(const Value* v) {
  auto c = v ? constant_ints(v) : std::nullopt;
  if (!c || c->size() != 1) return std::nullopt;
  return (*c)[0];
}

// A Slice with constant start, end and step on the last axis of its input (axes -1, or the
// last index where the rank is known).
struct LastAxisSlice {
  int64_t start, end, step;
};

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

Repeated repeated_twice(const Value* v) {
  Node* rs = made_by(v, "Reshape");
  if (!rs) return {};
  Value* grown = rs->inputs()[0];
  Node* rep = made_by(grown, "Tile");
  if (!rep) rep = made_by(grown, "Expand");
  if (!rep) return {};
  auto reps = constant_ints(rep->inputs()[1]);
  if (!reps || reps->size() < 2 || reps->back() != 2) return {};
  for (size_t i = 0; i + 1 < reps->size(); ++i) {
    if ((*reps)[i] != 1) return {};
  }
  const int64_t rank = static_cast<int64_t>(reps->size()) - 1;  // y's rank
  Node* unsq = made_by(rep->inputs()[0], "Unsqueeze");
  auto axes = unsq ? unsqueeze_axes(unsq) : std::nullopt;
  // Unsqueeze(y, last) or, merged by fold_reshapes, Unsqueeze(z, [heads axis, last]).
  if (!axes || axes->empty() || axes->size() > 2 ||
      (axes->back() != rank && !(axes->size() == 1 && axes->back() == -1))) {
    return {};
  }
  Repeated out;
  Value* z = unsq->inputs()[0];
  const int64_t z_rank = rank + 1 - static_cast<int64_t>(axes->size());
  if (value_rank(z) != -1 && value_rank(z) != z_rank) return {};
  std::vector<Source> sources = {{unsq->outputs()[0], rank + 1}, {grown, rank + 1}};
  if (axes->size() == 2) {
    out.head_axis = (*axes)[0];
    if (*out.head_axis < 0 || *out.head_axis >= rank - 1) return {};
    // The shape may read the dims of the exporter's own Unsqueeze(z, heads axis).
    for (const Use& u : z->uses()) {
      auto a = made_by(u.node->outputs()[0], "Unsqueeze") ? unsqueeze_axes(u.node) : std::nullopt;
      if (a && *a == std::vector<int64_t>{*out.head_axis}) {
        sources.push_back({u.node->outputs()[0], rank});
      }
    }
  } else {
    sources.push_back({z, rank});
  }
  const bool allowzero = int_attr(rs, "allowzero").value_or(0) != 0;
  std::optional<int64_t> width;
  if (z->type.has_shape && !z->type.dims.empty() && z->type.dims.back().value) {
    width = 2 * *z->type.dims.back().value;
  }
  if (!keeps_leading_dims(rs->inputs()[1], sources, z, rank - 1, width, allowzero, out.head_axis)) {
    return {};
  }
  out.y = z;
  return out;
}

std::string check_rotate_every_two(const Value* rot, const Value* x, int64_t d) {
  Node* rs = made_by(rot, "Reshape");
  Node* cat = rs ? made_by(rs->inputs()[0], "Concat") : nullptr;
  if (!cat || cat->inputs().size() != 2) return "the rotated x is not Reshape(Concat(a, b))";
  const auto axis = int_attr(cat, "axis");
  if (axis != -1 && axis != 4) return "the pairs are not stacked on a new last axis";
  Node* u_odd = made_by(cat->inputs()[0], "Unsqueeze");
  Node* u_even = made_by(cat->inputs()[1], "Unsqueeze");
  for (const Node* u : {u_odd, u_even}) {
    auto axes = u ? unsqueeze_axes(u) : std::nullopt;
    if (!axes || axes->size() != 1 || ((*axes)[0] != -1 && (*axes)[0] != 4)) {
      return "the pairs are not stacked on a new last axis";
    }
  }
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
  const bool allowzero = int_attr(rs, "allowzero").value_or(0) != 0;
  // The flatten keeps x's (B, ., ., D/2) dims and merges the pairs: back to x's shape.
  if (auto c = constant_ints(rs->inputs()[1])) {
    if (c->size() != 4 || (c->back() != d && c->back() != -1)) {
      return "the stacked pairs are not flattened back to (.., D)";
    }
    for (size_t i = 0; i < 3; ++i) {
      if ((*c)[i] == -1) return "the stacked pairs are not flattened back to x's shape";
    }
    return "";
  }
  if (keeps_leading_dims(rs->inputs()[1], {{cat->outputs()[0], 5}, {u_odd->outputs()[0], 5}}, x, 3,
                         d, allowzero)) {
    return "";
  }
  // Dynamo writes the target shape from the graph inputs' dims: a Concat of 1-element pieces,
  // the last D and no -1 (the pieces from Shape -> Gather are the dims exporters copy).
  Node* pieces = made_by(rs->inputs()[1], "Concat");
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

std::optional<InterleavedSource> trace_interleaved(Value* v, const std::string& fn,
                                                   std::string* why, bool repeated_pairs) {
  InterleavedSource out;
  CosSinSource& s = out.source;
  s.dtype = value_dtype(v);
  std::vector<int32_t> casts;
  // Half-width values (no repeated pairs) are read as if the repeat were already passed.
  bool repeated = !repeated_pairs, unsqueezed = false;
  std::optional<int64_t> first_cols;  // a Slice [0:w] of the values (glm's [..., :r/2])
  Value* cur = v;
  for (int hops = 0; hops < 16; ++hops) {
    Node* n = cur->producer();
    if (!n) break;
    if (made_by(cur, "Cast")) {
      casts.push_back(static_cast<int32_t>(int_attr(n, "to").value_or(0)));
      cur = n->inputs()[0];
    } else if (Repeated r = !repeated ? repeated_twice(cur) : Repeated{}; r.y) {
      repeated = true;
      cur = r.y;
      if (r.head_axis) {  // the heads' Unsqueeze merged into the repeat's
        if (unsqueezed || (*r.head_axis != 1 && *r.head_axis != 2)) {
          *why = "the " + fn + " is not unsqueezed once at axis 1 or 2 for the heads";
          return std::nullopt;
        }
        unsqueezed = true;
        out.seq_axis = *r.head_axis == 1 ? 2 : 1;
      }
    } else if (!unsqueezed && made_by(cur, "Unsqueeze")) {
      auto axes = unsqueeze_axes(n);
      const int in_rank = value_rank(n->inputs()[0]);
      if (!axes || axes->size() != 1 || ((*axes)[0] != 1 && (*axes)[0] != 2) ||
          (in_rank != -1 && in_rank != 3)) {
        *why = "the " + fn + " (B, S, D) is not unsqueezed at axis 1 or 2 for the heads";
        return std::nullopt;
      }
      unsqueezed = true;
      out.seq_axis = (*axes)[0] == 1 ? 2 : 1;
      cur = n->inputs()[0];
    } else if (Node* sl = !first_cols ? made_by(cur, "Slice") : nullptr) {
      auto b = last_axis_slice(sl);
      if (!b || b->start != 0 || b->step != 1 || b->end <= 0) break;
      first_cols = b->end;
      cur = sl->inputs()[0];
    } else {
      break;
    }
  }
  const std::string not_repeated = "the " + fn + " operand is not repeat_interleave(2) of a " +
                                   "(B, S, D/2) " + fn + " unsqueezed for the heads";
  if (!unsqueezed) {
    *why = not_repeated;
    return std::nullopt;
  }
  for (int32_t to : casts) {
    if (to == kFloat16) s.via_half = true;
    if (to != kFloat && to != kFloat16) {
      *why = "the " + fn + " is cast to " + dtype_name(to) + " (caches: float, float16)";
      return std::nullopt;
    }
  }
  // gptj: columns of a gathered table (Split, a Slice, or the [..., :w] taken above).
  Node* split = made_by(cur, "Split");
  Node* cols = split ? nullptr : made_by(cur, "Slice");
  const Value* peeled = cur;
  while (Node* c = made_by(peeled, "Cast")) peeled = c->inputs()[0];
  const bool leading =
      !split && !cols && first_cols && (made_by(peeled, "Gather") || made_by(peeled, "GatherND"));
  if (split || cols || leading) {
    if (!repeated) {
      *why = not_repeated;
      return std::nullopt;
    }
    Value* whole = split ? split->inputs()[0] : cols ? cols->inputs()[0] : cur;
    int64_t column = 0, width = 0;
    if (leading) {
      width = *first_cols;
    } else if (cols) {
      auto b = last_axis_slice(cols);
      if (!b || b->step != 1 || b->start < 0 || b->end <= b->start) {
        *why = "the " + fn + " columns are not a constant Slice of the table";
        return std::nullopt;
      }
      column = b->start;
      width = b->end - b->start;  // clipped against the table below
    } else {
      const int64_t axis = int_attr(split, "axis").value_or(0);
      if (axis != -1 && !(value_rank(whole) > 0 && axis == value_rank(whole) - 1)) {
        *why = "the " + fn + " table is not split along its last axis";
        return std::nullopt;
      }
      std::optional<std::vector<int64_t>> sizes;
      if (split->inputs().size() > 1 && split->inputs()[1]) {
        sizes = constant_ints(split->inputs()[1]);
      }
      size_t k = 0;
      while (k < split->outputs().size() && split->outputs()[k] != cur) ++k;
      if (sizes && sizes->size() == split->outputs().size()) {
        for (size_t i = 0; i < k; ++i) column += (*sizes)[i];
        width = (*sizes)[k];
      } else if (!sizes && split->outputs().size() == 2) {
        width = -1;  // equal halves of the table: known below
        column = static_cast<int64_t>(k);
      } else {
        *why = "the " + fn + " table's Split sizes are not constant";
        return std::nullopt;
      }
    }
    Value* src = whole;
    std::vector<int32_t> inner_casts;
    while (Node* c = made_by(src, "Cast")) {
      inner_casts.push_back(static_cast<int32_t>(int_attr(c, "to").value_or(0)));
      src = c->inputs()[0];
    }
    Node* gather = made_by(src, "Gather");
    Node* gnd = gather ? nullptr : made_by(src, "GatherND");
    Value* table = nullptr;
    if (gather && int_attr(gather, "axis").value_or(0) == 0) {
      table = gather->inputs()[0];
      s.positions = gather->inputs()[1];
    } else if (gnd && int_attr(gnd, "batch_dims").value_or(0) == 0) {
      // GatherND(table, Unsqueeze(pos, -1)) reads the rows pos: Gather(table, pos).
      Node* u = made_by(gnd->inputs()[1], "Unsqueeze");
      auto axes = u ? unsqueeze_axes(u) : std::nullopt;
      if (axes && axes->size() == 1 && ((*axes)[0] == -1 || (*axes)[0] == 2) &&
          value_rank(u->inputs()[0]) == 2) {
        table = gnd->inputs()[0];
        s.positions = u->inputs()[0];
      }
    }
    auto t = table ? constant_tensor(table) : nullptr;
    if (!t || t->dims.size() != 2) {
      *why = "the " + fn +
             " columns are not split from a constant (M, r) table gathered by the "
             "positions";
      return std::nullopt;
    }
    if (width == -1) {
      width = t->dims[1] / 2;
      column *= width;
    }
    width = std::min(width, t->dims[1] - column);
    if (first_cols) width = std::min(width, *first_cols);
    if (width <= 0) {
      *why = "the " + fn + " columns of the table are empty";
      return std::nullopt;
    }
    for (int32_t to : inner_casts) casts.push_back(to);
    if (s.dtype == 0) s.dtype = casts.empty() ? t->dtype() : casts.front();
    bool same = t->dtype() == s.dtype;
    for (int32_t to : casts) same = same && to == s.dtype;
    if (!same) {
      *why = "the " + fn + " table's dtype differs from the input's";
      return std::nullopt;
    }
    s.kind = CosSinSource::Kind::kTable;
    s.table = t;
    s.table_column = column;
    s.half = width;
    return out;
  }
  if (!take_scaling(&cur, fn, &s, why)) return std::nullopt;
  Node* trig = made_by(cur, fn.c_str());
  if (!trig) {
    *why = "the " + fn + " operand comes neither from " + fn + "(angles) nor from a table";
    return std::nullopt;
  }
  if (s.dtype == 0) s.dtype = casts.empty() ? kFloat : casts.front();
  Value* angles = trig->inputs()[0];
  s.angles = angles;
  Value* f = nullptr;
  if (Node* cat = made_by(angles, "Concat")) {
    // glm: Concat(f, f) read through [..., :half].
    const auto axis = int_attr(cat, "axis");
    if (cat->inputs().size() != 2 || cat->inputs()[0] != cat->inputs()[1] ||
        !(axis == -1 || axis == 2) || !first_cols || !repeated) {
      *why = "the angles are not Concat(f, f, axis -1) read through [..., :D/2]";
      return std::nullopt;
    }
    f = cat->inputs()[0];
  } else if (Repeated r = repeated_twice(angles); r.y && !r.head_axis) {
    // cohere: Cos(repeat_interleave(f)), the repeat before the Cos.
    Value* y = r.y;
    if (first_cols || repeated) {
      *why = "the repeated angles are sliced or repeated again";
      return std::nullopt;
    }
    f = y;
  } else {
    *why = "the angles are neither Concat(f, f) nor repeat_interleave(f)";
    return std::nullopt;
  }
  if (!trace_frequencies(f, &s, why)) return std::nullopt;
  if (first_cols && *first_cols != s.half) {
    *why = "the " + fn + " is sliced to " + std::to_string(*first_cols) + " columns, not the " +
           std::to_string(s.half) + " frequencies";
    return std::nullopt;
  }
  return out;
}

}  // namespace fastopt::passes::rotary
