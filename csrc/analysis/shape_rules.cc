// Shape rules for the ops that move data around or compute shapes: Constant, Shape, Size,
// Gather, Unsqueeze, Squeeze, Concat, Slice, Reshape, Flatten, Transpose, Expand,
// ConstantOfShape, Range, Cast, Identity, Split. Shape values flow through the integer ones.
#include <algorithm>
#include <climits>

#include "analysis/rule_util.h"
#include "eval/ort_semantics.h"
#include "ir/constant.h"
#include "ir/dtype.h"

namespace fastopt::analysis::rules {
namespace {

bool int_type(int32_t t) {
  return t == kInt64 || t == kInt32;
}

bool constant(const Node& n, RuleContext&, std::vector<Facts>& out) {
  for (const Attribute& a : n.attributes) {
    if (a.ref_attr_name.present) return false;
    Facts f;
    f.ranked = true;
    if (a.name == "value" && a.t) {
      f.dtype = a.t->dtype();
      for (int64_t d : a.t->dims) f.dims.push_back(DimExpr::constant(d));
      if ((int_type(f.dtype) || f.dtype == kBool) && a.t->dims.size() <= 1) {
        if (auto v = tensor_ints(*a.t, kMaxShapeValue)) {
          f.has_value = true;
          for (int64_t x : *v) f.value.push_back(DimExpr::constant(x));
        }
      }
    } else if (a.name == "value_int" && a.i) {
      f.dtype = kInt64;
      f.has_value = true;
      f.value = {DimExpr::constant(*a.i)};
    } else if (a.name == "value_ints") {
      f.dtype = kInt64;
      f.dims = {DimExpr::constant(static_cast<int64_t>(a.ints.size()))};
      if (a.ints.size() <= kMaxShapeValue) {
        f.has_value = true;
        for (int64_t x : a.ints) f.value.push_back(DimExpr::constant(x));
      }
    } else if (a.name == "value_float") {
      f.dtype = kFloat;
    } else if (a.name == "value_floats") {
      f.dtype = kFloat;
      f.dims = {DimExpr::constant(static_cast<int64_t>(a.floats.size()))};
    } else {
      continue;
    }
    out[0] = std::move(f);
    return true;
  }
  return false;
}

bool shape(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = kInt64;
  o.ranked = true;
  if (!x.ranked) {
    o.dims = {ctx.fresh_dim()};
    return true;
  }
  const int64_t r = static_cast<int64_t>(x.dims.size());
  int64_t start = 0, end = r;
  if (ctx.opset() >= 15) {
    start = attr_i(n, "start").value_or(0);
    end = attr_i(n, "end").value_or(r);
  }
  auto clampi = [r](int64_t v) { return std::clamp(v < 0 ? v + r : v, int64_t{0}, r); };
  start = clampi(start);
  end = std::max(start, clampi(end));
  o.dims = {DimExpr::constant(end - start)};
  o.has_value = static_cast<size_t>(end - start) <= kMaxShapeValue;
  if (o.has_value) o.value.assign(x.dims.begin() + start, x.dims.begin() + end);
  return true;
}

bool size(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  out[0].dtype = kInt64;
  out[0].ranked = true;
  if (x.ranked) {
    if (auto p = product(x.dims, 0, x.dims.size())) {
      out[0].has_value = true;
      out[0].value = {*p};
    }
  }
  return true;
}

bool gather(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& data = ctx.in(0);
  const Facts& idx = ctx.in(1);
  Facts& o = out[0];
  o.dtype = data.dtype;
  if (!data.ranked || !idx.ranked) return true;
  const int64_t r = static_cast<int64_t>(data.dims.size());
  auto axis = norm_axis(attr_i(n, "axis").value_or(0), r);
  if (!axis) return false;
  o.ranked = true;
  o.dims.assign(data.dims.begin(), data.dims.begin() + *axis);
  o.dims.insert(o.dims.end(), idx.dims.begin(), idx.dims.end());
  o.dims.insert(o.dims.end(), data.dims.begin() + *axis + 1, data.dims.end());
  if (data.has_value && *axis == 0 && r == 1) {
    if (auto ii = ctx.ints(1)) {
      const int64_t len = static_cast<int64_t>(data.value.size());
      std::vector<DimExpr> v;
      for (int64_t i : *ii) {
        if (i < -len || i >= len) return true;
        v.push_back(data.value[static_cast<size_t>(i < 0 ? i + len : i)]);
      }
      o.has_value = true;
      o.value = std::move(v);
    }
  }
  return true;
}

// Axes from the attribute (older opsets) or input 1.
std::optional<std::vector<int64_t>> axes_of(const Node& n, RuleContext& ctx, size_t input) {
  if (auto a = attr_is(n, "axes")) return a;
  if (ctx.present(input)) return ctx.ints(input);
  return std::vector<int64_t>{};
}

bool unsqueeze(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = x.dtype;
  auto axes = axes_of(n, ctx, 1);
  if (!x.ranked || !axes || axes->empty()) return true;
  const int64_t r = static_cast<int64_t>(x.dims.size() + axes->size());
  std::vector<bool> is_new(static_cast<size_t>(r), false);
  for (int64_t a : *axes) {
    auto na = norm_axis(a, r);
    if (!na || is_new[static_cast<size_t>(*na)]) return false;
    is_new[static_cast<size_t>(*na)] = true;
  }
  o.ranked = true;
  size_t k = 0;
  for (int64_t i = 0; i < r; ++i) {
    o.dims.push_back(is_new[static_cast<size_t>(i)] ? DimExpr::constant(1) : x.dims[k++]);
  }
  if (x.has_value && r <= 1) {
    o.has_value = true;
    o.value = x.value;
  }
  return true;
}

bool squeeze(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = x.dtype;
  auto axes = axes_of(n, ctx, 1);
  if (!x.ranked || !axes) return true;
  const int64_t r = static_cast<int64_t>(x.dims.size());
  std::vector<bool> drop(static_cast<size_t>(r), false);
  if (axes->empty()) {  // every dim of size 1: only when all dims are numbers
    for (int64_t i = 0; i < r; ++i) {
      auto c = x.dims[static_cast<size_t>(i)].constant_value();
      if (!c) return true;
      drop[static_cast<size_t>(i)] = *c == 1;
    }
  }
  for (int64_t a : *axes) {
    auto na = norm_axis(a, r);
    if (!na) return false;
    drop[static_cast<size_t>(*na)] = true;
  }
  o.ranked = true;
  for (int64_t i = 0; i < r; ++i) {
    if (!drop[static_cast<size_t>(i)]) o.dims.push_back(x.dims[static_cast<size_t>(i)]);
  }
  if (x.has_value && o.dims.size() <= 1) {
    o.has_value = true;
    o.value = x.value;
  }
  return true;
}

bool concat(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  Facts& o = out[0];
  size_t rank = 0;
  bool ranked = false;
  for (size_t i = 0; i < ctx.num_inputs(); ++i) {
    const Facts& f = ctx.in(i);
    if (!o.dtype) o.dtype = f.dtype;
    if (f.ranked) {
      ranked = true;
      rank = f.dims.size();
    }
  }
  if (!ranked) return true;
  auto axis = norm_axis(attr_i(n, "axis").value_or(0), static_cast<int64_t>(rank));
  if (!axis) return false;
  o.ranked = true;
  o.dims.assign(rank, DimExpr::constant(0));
  std::vector<bool> set(rank, false);
  bool values = rank == 1;
  for (size_t i = 0; i < ctx.num_inputs(); ++i) {
    const Facts& f = ctx.in(i);
    values = values && f.has_value;
    if (values) o.value.insert(o.value.end(), f.value.begin(), f.value.end());
    if (!f.ranked) {
      o.dims[static_cast<size_t>(*axis)] = ctx.fresh_dim();
      set[static_cast<size_t>(*axis)] = true;
      continue;
    }
    if (f.dims.size() != rank) return false;
    for (size_t d = 0; d < rank; ++d) {
      if (d == static_cast<size_t>(*axis)) {
        auto s = DimExpr::add(o.dims[d], f.dims[d]);
        o.dims[d] = s ? *s : ctx.fresh_dim();
      } else if (!set[d]) {
        o.dims[d] = f.dims[d];
        set[d] = true;
      }
    }
  }
  o.has_value = values && o.value.size() <= kMaxShapeValue;
  if (!o.has_value) o.value.clear();
  return true;
}

// Length of x[start:end:step] over a dim n, exactly (nullopt when it depends on unknowns).
std::optional<DimExpr> slice_length(const DimExpr& n, const DimExpr& start, const DimExpr& end,
                                    int64_t step, std::vector<DimExpr>* picked,
                                    const std::vector<DimExpr>* elems) {
  auto cn = n.constant_value(), cs = start.constant_value(), ce = end.constant_value();
  if (cn && cs && ce) {
    // ONNX Runtime's selection; unknown where ONNX's spec selects otherwise (the model's
    // meaning is then the runtime's choice, not a fact).
    const eval::ort::SliceAxis a = eval::ort::slice_axis(*cn, *cs, *ce, step);
    if (!a.spec_agrees) return std::nullopt;
    if (picked && elems && elems->size() == static_cast<size_t>(*cn)) {
      for (int64_t k = 0; k < a.count; ++k) {  // a.start + k * step stays in [0, n)
        picked->push_back((*elems)[static_cast<size_t>(a.start + k * step)]);
      }
    }
    return DimExpr::constant(a.count);
  }
  if (step != 1) return std::nullopt;
  // x[0:end] with end >= n (INT_MAX style), or x[0:n]: the whole dim.
  if (cs && *cs == 0 && ((ce && *ce >= INT32_MAX) || end == n)) return n;
  // x[s:] for s a number no larger than a number-free n is not provable (n may be < s).
  return std::nullopt;
}

bool slice(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = x.dtype;
  if (!x.ranked) return true;
  const int64_t r = static_cast<int64_t>(x.dims.size());
  std::vector<DimExpr> starts, ends;
  std::optional<std::vector<int64_t>> axes, steps;
  if (ctx.opset() < 10) {
    auto s = attr_is(n, "starts"), e = attr_is(n, "ends");
    if (!s || !e) return false;
    for (int64_t v : *s) starts.push_back(DimExpr::constant(v));
    for (int64_t v : *e) ends.push_back(DimExpr::constant(v));
    axes = attr_is(n, "axes");
  } else {
    const Facts &fs = ctx.in(1), &fe = ctx.in(2);
    if (ctx.present(3)) {
      axes = ctx.ints(3);
      if (!axes) return true;
    }
    if (ctx.present(4)) {
      steps = ctx.ints(4);
      if (!steps) return true;
    }
    if (!fs.has_value || !fe.has_value) {
      // Unknown bounds: the sliced axes (when known) get fresh dims.
      o.ranked = true;
      o.dims = x.dims;
      if (!axes) {
        if (!fs.ranked || fs.dims.size() != 1) return true;
        auto cnt = fs.dims[0].constant_value();
        if (!cnt || *cnt != r) {  // which axes is unknown unless all are sliced
          o.dims.clear();
          o.ranked = false;
          return true;
        }
        for (auto& d : o.dims) d = ctx.fresh_dim();
        return true;
      }
      for (int64_t a : *axes) {
        auto na = norm_axis(a, r);
        if (!na) return false;
        o.dims[static_cast<size_t>(*na)] = ctx.fresh_dim();
      }
      return true;
    }
    starts = fs.value;
    ends = fe.value;
  }
  if (starts.size() != ends.size()) return false;
  if (!axes) {
    axes.emplace();
    for (size_t i = 0; i < starts.size(); ++i) axes->push_back(static_cast<int64_t>(i));
  }
  if (axes->size() != starts.size() || (steps && steps->size() != starts.size())) return false;
  o.ranked = true;
  o.dims = x.dims;
  const bool values = x.has_value && r == 1;
  std::vector<DimExpr> picked;
  for (size_t i = 0; i < axes->size(); ++i) {
    auto na = norm_axis((*axes)[i], r);
    if (!na) return false;
    const int64_t step = steps ? (*steps)[i] : 1;
    if (step == 0) return false;
    auto len = slice_length(x.dims[static_cast<size_t>(*na)], starts[i], ends[i], step,
                            values ? &picked : nullptr, values ? &x.value : nullptr);
    o.dims[static_cast<size_t>(*na)] = len ? *len : ctx.fresh_dim();
    if (values && len && picked.size() == static_cast<size_t>(len->constant_value().value_or(-1))) {
      o.has_value = true;
      o.value = picked;
    } else if (values && len && x.dims[0] == *len) {
      o.has_value = true;
      o.value = x.value;
    }
  }
  return true;
}

bool reshape(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = x.dtype;
  std::vector<DimExpr> target;
  if (ctx.opset() < 5) {
    auto s = attr_is(n, "shape");
    if (!s) return false;
    for (int64_t v : *s) target.push_back(DimExpr::constant(v));
  } else {
    const Facts& s = ctx.in(1);
    if (!s.has_value) {
      if (s.ranked && s.dims.size() == 1) {
        if (auto c = s.dims[0].constant_value()) {
          o.ranked = true;
          for (int64_t i = 0; i < *c; ++i) o.dims.push_back(ctx.fresh_dim());
        }
      }
      return true;
    }
    target = s.value;
  }
  const bool allowzero = attr_i(n, "allowzero").value_or(0) != 0;
  o.ranked = true;
  int infer = -1;
  DimExpr known = DimExpr::constant(1);
  bool known_ok = true;
  for (size_t i = 0; i < target.size(); ++i) {
    DimExpr d = target[i];
    auto c = d.constant_value();
    if (c && *c == -1) {
      if (infer >= 0) return false;
      infer = static_cast<int>(i);
      o.dims.push_back(DimExpr::constant(-1));  // placeholder
      continue;
    }
    if (c && *c == 0 && !allowzero) {
      if (!x.ranked || i >= x.dims.size()) {
        d = ctx.fresh_dim();
      } else {
        d = x.dims[i];
      }
    } else if (!c && !ctx.symbols().nonneg(d)) {
      d = ctx.fresh_dim();  // an unknown element could be -1 or 0
    } else if (c && *c < 0) {
      return false;
    }
    o.dims.push_back(d);
    auto k = DimExpr::mul(known, d);
    if (k)
      known = *k;
    else
      known_ok = false;
  }
  if (infer >= 0) {
    std::optional<DimExpr> total;
    if (x.ranked) total = product(x.dims, 0, x.dims.size());
    std::optional<DimExpr> q;
    if (total && known_ok) q = DimExpr::div_exact(*total, known);
    o.dims[static_cast<size_t>(infer)] = q ? *q : ctx.fresh_dim();
  }
  if (x.has_value && o.dims.size() <= 1) {
    o.has_value = true;
    o.value = x.value;
  }
  return true;
}

bool flatten(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = x.dtype;
  if (!x.ranked) {
    o = fresh_ranked(ctx, x.dtype, 2);
    return true;
  }
  const int64_t r = static_cast<int64_t>(x.dims.size());
  int64_t k = attr_i(n, "axis").value_or(1);
  if (k < 0) k += r;
  if (k < 0 || k > r) return false;
  auto a = product(x.dims, 0, static_cast<size_t>(k));
  auto b = product(x.dims, static_cast<size_t>(k), x.dims.size());
  o.ranked = true;
  o.dims = {a ? *a : ctx.fresh_dim(), b ? *b : ctx.fresh_dim()};
  return true;
}

bool transpose(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  Facts& o = out[0];
  o.dtype = x.dtype;
  if (!x.ranked) return true;
  const size_t r = x.dims.size();
  std::vector<int64_t> perm;
  if (auto p = attr_is(n, "perm")) {
    perm = *p;
  } else {
    for (size_t i = 0; i < r; ++i) perm.push_back(static_cast<int64_t>(r - 1 - i));
  }
  if (perm.size() != r) return false;
  o.ranked = true;
  for (int64_t p : perm) {
    auto a = norm_axis(p, static_cast<int64_t>(r));
    if (!a) return false;
    o.dims.push_back(x.dims[static_cast<size_t>(*a)]);
  }
  return true;
}

// Tile: dim i times repeats[i] (gptj's repeat_interleave exports as Unsqueeze -> Tile ->
// Reshape); the rank alone when the repeats are not known.
bool tile(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  const Facts& r = ctx.in(1);
  Facts& o = out[0];
  o.dtype = x.dtype;
  if (!x.ranked) return true;
  o = fresh_ranked(ctx, x.dtype, x.dims.size());
  if (!r.has_value || r.value.size() != x.dims.size()) return true;
  for (size_t i = 0; i < x.dims.size(); ++i) {
    auto d = DimExpr::mul(x.dims[i], r.value[i]);
    o.dims[i] = d && ctx.symbols().nonneg(*d) ? *d : ctx.fresh_dim();
  }
  return true;
}

bool expand(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  const Facts& s = ctx.in(1);
  Facts& o = out[0];
  o.dtype = x.dtype;
  if (!s.has_value) {
    if (s.ranked && s.dims.size() == 1 && x.ranked) {
      if (auto c = s.dims[0].constant_value()) {
        o = fresh_ranked(ctx, x.dtype, std::max<size_t>(x.dims.size(), size_t(*c)));
      }
    }
    return true;
  }
  Facts target;
  target.ranked = true;
  for (const DimExpr& d : s.value) {
    target.dims.push_back(ctx.symbols().nonneg(d) ? d : ctx.fresh_dim());
  }
  auto b = broadcast(ctx, {&x, &target});
  if (b) {
    o.ranked = true;
    o.dims = *b;
  }
  if (x.has_value && x.value.size() == 1 && o.ranked && o.dims.size() == 1) {
    if (auto c = o.dims[0].constant_value(); c && *c <= int64_t(kMaxShapeValue)) {
      o.has_value = true;
      o.value.assign(static_cast<size_t>(*c), x.value[0]);
    }
  }
  return true;
}

bool constant_of_shape(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& s = ctx.in(0);
  Facts& o = out[0];
  o.dtype = kFloat;
  std::optional<int64_t> fill;
  if (const Attribute* a = n.attribute("value"); a && a->t) {
    o.dtype = a->t->dtype();
    if (int_type(o.dtype)) {
      if (auto v = tensor_ints(*a->t, 1); v && v->size() == 1) fill = (*v)[0];
    }
  } else {
    fill = std::nullopt;
  }
  if (s.has_value) {
    o.ranked = true;
    for (const DimExpr& d : s.value)
      o.dims.push_back(ctx.symbols().nonneg(d) ? d : ctx.fresh_dim());
    if (fill && o.dims.size() == 1) {
      if (auto c = o.dims[0].constant_value(); c && *c <= int64_t(kMaxShapeValue)) {
        o.has_value = true;
        o.value.assign(static_cast<size_t>(*c), DimExpr::constant(*fill));
      }
    }
  } else if (s.ranked && s.dims.size() == 1) {
    if (auto c = s.dims[0].constant_value()) o = fresh_ranked(ctx, o.dtype, size_t(*c));
  }
  return true;
}

bool range(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  Facts& o = out[0];
  o.dtype = ctx.in(0).dtype;
  o.ranked = true;
  auto v = [&](size_t i) -> std::optional<DimExpr> {
    const Facts& f = ctx.in(i);
    if (!f.has_value || f.value.size() != 1) return std::nullopt;
    return f.value[0];
  };
  auto start = v(0), limit = v(1), delta = v(2);
  std::optional<DimExpr> len;
  if (start && limit && delta) {
    auto cs = start->constant_value(), cl = limit->constant_value(), cd = delta->constant_value();
    if (cs && cl && cd) {
      // ONNX Runtime's length (in doubles); unknown where it is undefined (overflow).
      if (auto n = eval::ort::range_count(o.dtype, *cs, *cl, *cd)) len = DimExpr::constant(*n);
    } else if (cd && *cd == 1) {
      // limit - start elements when limit >= start; proven when start is 0 and limit a size.
      if (cs && *cs == 0 && ctx.symbols().nonneg(*limit)) len = *limit;
    }
  }
  o.dims = {len ? *len : ctx.fresh_dim()};
  return true;
}

bool cast(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  auto to = attr_i(n, "to");
  if (!to) return false;
  const Facts& x = ctx.in(0);
  const int32_t t = static_cast<int32_t>(*to);
  out[0] = same_as(x, t);
  if (x.has_value && int_type(t) && int_type(x.dtype)) {
    out[0].has_value = true;
    out[0].value = x.value;
    // A number narrowed to int32 wraps, as in ONNX Runtime (INT64_MAX -> -1). Symbolic
    // elements (sizes) are assumed to fit, as exporters that cast shapes to int32 assume.
    for (DimExpr& e : out[0].value) {
      if (auto c = e.constant_value()) e = DimExpr::constant(eval::ort::wrap_to(t, *c));
    }
  }
  return true;
}

bool identity(const Node&, RuleContext& ctx, std::vector<Facts>& out) {
  out[0] = ctx.in(0);
  return true;
}

bool split(const Node& n, RuleContext& ctx, std::vector<Facts>& out) {
  const Facts& x = ctx.in(0);
  for (auto& o : out) o.dtype = x.dtype;
  if (!x.ranked) return true;
  const int64_t r = static_cast<int64_t>(x.dims.size());
  auto axis = norm_axis(attr_i(n, "axis").value_or(0), r);
  if (!axis) return false;
  std::optional<std::vector<int64_t>> sizes = attr_is(n, "split");
  if (!sizes && ctx.present(1)) sizes = ctx.ints(1);
  const size_t k = out.size();
  std::vector<DimExpr> lens;
  if (sizes) {
    if (sizes->size() != k) return false;
    for (int64_t s : *sizes) lens.push_back(DimExpr::constant(s));
  } else if (!ctx.present(1)) {
    const DimExpr& d = x.dims[static_cast<size_t>(*axis)];
    auto c = d.constant_value();
    if (c && k) {  // equal parts, the last one smaller (opset 18 num_outputs)
      const int64_t part = (*c + static_cast<int64_t>(k) - 1) / static_cast<int64_t>(k);
      for (size_t i = 0; i < k; ++i) {
        lens.push_back(DimExpr::constant(
            std::max<int64_t>(0, std::min(part, *c - part * static_cast<int64_t>(i)))));
      }
    } else if (auto q = DimExpr::div_exact(d, DimExpr::constant(static_cast<int64_t>(k)))) {
      lens.assign(k, *q);
    }
  }
  for (size_t i = 0; i < k; ++i) {
    out[i].ranked = true;
    out[i].dims = x.dims;
    out[i].dims[static_cast<size_t>(*axis)] = i < lens.size() ? lens[i] : ctx.fresh_dim();
  }
  return true;
}

}  // namespace

void add_shape_rules(RuleTable& t) {
  t.insert(t.end(), {{"Constant", constant},
                     {"Shape", shape},
                     {"Size", size},
                     {"Gather", gather},
                     {"Unsqueeze", unsqueeze},
                     {"Squeeze", squeeze},
                     {"Concat", concat},
                     {"Slice", slice},
                     {"Reshape", reshape},
                     {"Flatten", flatten},
                     {"Transpose", transpose},
                     {"Expand", expand},
                     {"Tile", tile},
                     {"ConstantOfShape", constant_of_shape},
                     {"Range", range},
                     {"Cast", cast},
                     {"Identity", identity},
                     {"Split", split}});
}

}  // namespace fastopt::analysis::rules
