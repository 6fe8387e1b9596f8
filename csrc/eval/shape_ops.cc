// The evaluator's shape and data-movement ops: Shape, Size, Gather, GatherND, Unsqueeze,
// Squeeze, Flatten, Reshape, Concat, Transpose, Slice, Where, Expand, ConstantOfShape, Range.
// Data movement works on element bytes; Reshape-like ops return views of their input's bytes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "eval/evaluator_class.h"

namespace fastopt::eval {

Result Evaluator::shape() {
  auto x = in(0, false);
  if (!x) return std::nullopt;
  const int64_t r = static_cast<int64_t>(x->dims.size());
  int64_t start = 0, end = r;
  if (opset_ >= 15) {
    start = attr_i("start").value_or(0);
    end = attr_i("end").value_or(r);
  }
  auto clampi = [r](int64_t v) { return std::clamp(v < 0 ? v + r : v, int64_t{0}, r); };
  start = clampi(start);
  end = clampi(end);
  std::vector<int64_t> d;
  for (int64_t i = start; i < end; ++i) d.push_back(x->dims[i]);
  return one(make_int64_tensor(d, {static_cast<int64_t>(d.size())}));
}

Result Evaluator::size() {
  auto x = in(0, false);
  if (!x) return std::nullopt;
  return one(make_int64_tensor({static_cast<int64_t>(x->numel)}, {}));
}

// ---- data movement ----
Result Evaluator::gather() {
  auto data = in(0), idx = in(1);
  if (!data || !idx || (idx->dtype != kInt32 && idx->dtype != kInt64)) return std::nullopt;
  const int64_t r = static_cast<int64_t>(data->dims.size());
  auto ax = axis(attr_i("axis").value_or(0), r);
  if (!ax) return std::nullopt;
  Dims out(data->dims.begin(), data->dims.begin() + *ax);
  out.insert(out.end(), idx->dims.begin(), idx->dims.end());
  out.insert(out.end(), data->dims.begin() + *ax + 1, data->dims.end());
  if (!fits(data->dtype, out)) return std::nullopt;
  const int64_t dim = data->dims[*ax];
  const uint64_t outer = product(data->dims, 0, *ax);
  const uint64_t inner = product(data->dims, *ax + 1) * data->esize;
  std::string bytes;
  bytes.reserve(outer * idx->numel * inner);
  for (uint64_t o = 0; o < outer; ++o) {
    for (uint64_t k = 0; k < idx->numel; ++k) {
      int64_t i = idx->i64(k);
      if (i < -dim || i >= dim) return std::nullopt;
      if (i < 0) i += dim;
      const uint8_t* src = data->bytes.data() + (o * dim + i) * inner;
      bytes.append(reinterpret_cast<const char*>(src), inner);
    }
  }
  return one(owned(data->dtype, std::move(out), std::move(bytes)));
}

// GatherND with batch_dims 0: index tuples of the last axis of `indices` pick slices.
Result Evaluator::gather_nd() {
  auto data = in(0), idx = in(1);
  if (!data || !idx || idx->dtype != kInt64 || attr_i("batch_dims").value_or(0) != 0) {
    return std::nullopt;
  }
  const size_t r = data->dims.size();
  if (idx->dims.empty()) return std::nullopt;
  const int64_t k = idx->dims.back();
  if (k < 1 || static_cast<size_t>(k) > r) return std::nullopt;
  Dims out(idx->dims.begin(), idx->dims.end() - 1);
  out.insert(out.end(), data->dims.begin() + k, data->dims.end());
  if (!fits(data->dtype, out)) return std::nullopt;
  const uint64_t inner = product(data->dims, k) * data->esize;
  const uint64_t tuples = idx->numel / static_cast<uint64_t>(k);
  std::string bytes;
  bytes.reserve(tuples * inner);
  for (uint64_t t = 0; t < tuples; ++t) {
    uint64_t offset = 0;
    for (int64_t a = 0; a < k; ++a) {
      const int64_t dim = data->dims[static_cast<size_t>(a)];
      int64_t i = idx->i64(t * static_cast<uint64_t>(k) + static_cast<uint64_t>(a));
      if (i < -dim || i >= dim) return std::nullopt;
      if (i < 0) i += dim;
      offset = offset * static_cast<uint64_t>(dim) + static_cast<uint64_t>(i);
    }
    bytes.append(reinterpret_cast<const char*>(data->bytes.data() + offset * inner), inner);
  }
  return one(owned(data->dtype, std::move(out), std::move(bytes)));
}

std::optional<std::vector<int64_t>> Evaluator::axes_operand() const {
  // Squeeze/Unsqueeze: an attribute before opset 13, an input from 13 on.
  if (opset_ >= 13) return has_input(1) ? ints_in(1) : std::nullopt;
  return attr_ints("axes");
}

Result Evaluator::unsqueeze() {
  auto x = in(0, false);
  auto axes = axes_operand();
  if (!x || !axes) return std::nullopt;
  const int64_t out_rank = static_cast<int64_t>(x->dims.size() + axes->size());
  std::vector<bool> inserted(out_rank, false);
  for (int64_t a : *axes) {
    auto ax = axis(a, out_rank);
    if (!ax || inserted[*ax]) return std::nullopt;
    inserted[*ax] = true;
  }
  Dims out;
  size_t next = 0;
  for (int64_t i = 0; i < out_rank; ++i) out.push_back(inserted[i] ? 1 : x->dims[next++]);
  if (!view_fits(*x)) return std::nullopt;
  return one(view(*x, std::move(out)));
}

Result Evaluator::squeeze() {
  auto x = in(0, false);
  if (!x) return std::nullopt;
  const int64_t r = static_cast<int64_t>(x->dims.size());
  std::vector<bool> drop(r, false);
  const bool has_axes = opset_ >= 13 ? has_input(1) : n_.attribute("axes") != nullptr;
  if (has_axes) {
    auto axes = axes_operand();
    if (!axes) return std::nullopt;
    for (int64_t a : *axes) {
      auto ax = axis(a, r);
      if (!ax || x->dims[*ax] != 1) return std::nullopt;
      drop[*ax] = true;
    }
  } else {
    for (int64_t i = 0; i < r; ++i) drop[i] = x->dims[i] == 1;
  }
  Dims out;
  for (int64_t i = 0; i < r; ++i) {
    if (!drop[i]) out.push_back(x->dims[i]);
  }
  if (!view_fits(*x)) return std::nullopt;
  return one(view(*x, std::move(out)));
}

Result Evaluator::flatten() {
  auto x = in(0, false);
  if (!x) return std::nullopt;
  const int64_t r = static_cast<int64_t>(x->dims.size());
  int64_t a = attr_i("axis").value_or(1);
  if (a < -r || a > r) return std::nullopt;
  if (a < 0) a += r;
  Dims out{static_cast<int64_t>(product(x->dims, 0, a)), static_cast<int64_t>(product(x->dims, a))};
  if (!view_fits(*x)) return std::nullopt;
  return one(view(*x, std::move(out)));
}

Result Evaluator::reshape() {
  auto x = in(0, false);
  auto shape = ints_in(1);
  if (!x || !shape) return std::nullopt;
  const bool allowzero = opset_ >= 14 && attr_i("allowzero").value_or(0) != 0;
  Dims out;
  int infer = -1;
  uint64_t known = 1;
  for (size_t i = 0; i < shape->size(); ++i) {
    int64_t s = (*shape)[i];
    if (s == 0 && !allowzero) {
      if (i >= x->dims.size()) return std::nullopt;
      s = x->dims[i];
    }
    if (s == -1) {
      if (infer >= 0) return std::nullopt;
      infer = static_cast<int>(i);
      out.push_back(-1);
      continue;
    }
    if (s < 0) return std::nullopt;
    out.push_back(s);
    known *= static_cast<uint64_t>(s);
  }
  if (infer >= 0) {
    if (known == 0 || x->numel % known != 0) return std::nullopt;
    out[infer] = static_cast<int64_t>(x->numel / known);
  }
  auto n = checked_numel(out);
  if (!n || *n != x->numel || !view_fits(*x)) return std::nullopt;
  return one(view(*x, std::move(out)));
}

Result Evaluator::concat() {
  std::vector<Arr> xs;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    auto a = in(i);
    if (!a) return std::nullopt;
    xs.push_back(std::move(*a));
  }
  if (xs.empty() || !attr_i("axis")) return std::nullopt;
  const Arr& first = xs[0];
  const int64_t r = static_cast<int64_t>(first.dims.size());
  auto ax = axis(*attr_i("axis"), r);
  if (!ax) return std::nullopt;
  Dims out = first.dims;
  out[*ax] = 0;
  for (const Arr& a : xs) {
    if (a.dtype != first.dtype || a.dims.size() != first.dims.size()) return std::nullopt;
    for (int64_t d = 0; d < r; ++d) {
      if (d != *ax && a.dims[d] != first.dims[d]) return std::nullopt;
    }
    out[*ax] += a.dims[*ax];
  }
  if (!fits(first.dtype, out)) return std::nullopt;
  const uint64_t outer = product(first.dims, 0, *ax);
  const uint64_t inner = product(first.dims, *ax + 1) * first.esize;
  std::string bytes;
  for (uint64_t o = 0; o < outer; ++o) {
    for (const Arr& a : xs) {
      const uint64_t chunk = static_cast<uint64_t>(a.dims[*ax]) * inner;
      bytes.append(reinterpret_cast<const char*>(a.bytes.data() + o * chunk), chunk);
    }
  }
  return one(owned(first.dtype, std::move(out), std::move(bytes)));
}

Result Evaluator::transpose() {
  auto x = in(0);
  if (!x) return std::nullopt;
  const size_t r = x->dims.size();
  std::vector<int64_t> perm;
  if (auto p = attr_ints("perm")) {
    perm = *p;
  } else {
    for (size_t i = r; i-- > 0;) perm.push_back(static_cast<int64_t>(i));
  }
  if (perm.size() != r) return std::nullopt;
  std::vector<bool> seen(r, false);
  for (int64_t p : perm) {
    if (p < 0 || p >= static_cast<int64_t>(r) || seen[p]) return std::nullopt;
    seen[p] = true;
  }
  Dims out;
  for (int64_t p : perm) out.push_back(x->dims[p]);
  if (!fits(x->dtype, out)) return std::nullopt;
  std::vector<uint64_t> own = strides_of(x->dims), s(r);
  for (size_t i = 0; i < r; ++i) s[i] = own[perm[i]];
  std::string bytes;
  bytes.reserve(x->numel * x->esize);
  for_each_broadcast(out, {s}, [&](const std::vector<uint64_t>& o) {
    bytes.append(reinterpret_cast<const char*>(x->at(o[0])), x->esize);
  });
  return one(owned(x->dtype, std::move(out), std::move(bytes)));
}

Result Evaluator::slice() {
  auto x = in(0);
  if (!x) return std::nullopt;
  std::optional<std::vector<int64_t>> starts, ends, axes, steps;
  if (opset_ < 10) {
    starts = attr_ints("starts");
    ends = attr_ints("ends");
    axes = attr_ints("axes");
  } else {
    starts = ints_in(1);
    ends = ints_in(2);
    if (has_input(3) && !(axes = ints_in(3))) return std::nullopt;
    if (has_input(4) && !(steps = ints_in(4))) return std::nullopt;
  }
  if (!starts || !ends || starts->size() != ends->size()) return std::nullopt;
  const size_t k = starts->size();
  const int64_t r = static_cast<int64_t>(x->dims.size());
  if (!axes) {
    axes.emplace();
    for (size_t i = 0; i < k; ++i) axes->push_back(static_cast<int64_t>(i));
  }
  if (!steps) steps = std::vector<int64_t>(k, 1);
  if (axes->size() != k || steps->size() != k) return std::nullopt;
  std::vector<int64_t> begin(r, 0), step(r, 1);
  Dims out = x->dims;
  std::vector<bool> seen(r, false);
  for (size_t i = 0; i < k; ++i) {
    auto ax = axis((*axes)[i], r);
    const int64_t st = (*steps)[i];
    if (!ax || seen[*ax] || st == 0 || st == std::numeric_limits<int64_t>::min()) {
      return std::nullopt;
    }
    seen[*ax] = true;
    const int64_t dim = x->dims[*ax];
    const ort::SliceAxis a = ort::slice_axis(dim, (*starts)[i], (*ends)[i], st);
    if (!a.spec_agrees) {
      return refuse("onnx_and_ort_differ",
                    "Slice bounds on which ONNX's spec and ONNX Runtime select different "
                    "elements (an end of INT_MAX with a negative step, or a negative step over "
                    "an empty axis)");
    }
    const int64_t s = a.start, count = a.count;
    begin[*ax] = s;
    step[*ax] = st;
    out[*ax] = count;
  }
  if (!fits(x->dtype, out)) return std::nullopt;
  std::vector<uint64_t> own = strides_of(x->dims), s(r);
  uint64_t base = 0;
  for (int64_t d = 0; d < r; ++d) {
    if (out[d] == 0) break;
    base += static_cast<uint64_t>(begin[d]) * own[d];
    s[d] = static_cast<uint64_t>(step[d]) * own[d];  // wraps for negative steps: offsets
  }  // are computed modulo 2^64
  std::string bytes;
  for_each_broadcast(out, {s}, [&](const std::vector<uint64_t>& o) {
    bytes.append(reinterpret_cast<const char*>(x->at(base + o[0])), x->esize);
  });
  return one(owned(x->dtype, std::move(out), std::move(bytes)));
}

Result Evaluator::where() {
  auto c = in(0), a = in(1), b = in(2);
  if (!c || !a || !b || c->dtype != kBool || a->dtype != b->dtype || opset_ < 9) {
    return std::nullopt;
  }
  auto out = broadcast({&c->dims, &a->dims, &b->dims});
  if (!out || !fits(a->dtype, *out)) return std::nullopt;
  std::string bytes;
  for_each_broadcast(*out,
                     {broadcast_strides(c->dims, *out), broadcast_strides(a->dims, *out),
                      broadcast_strides(b->dims, *out)},
                     [&](const std::vector<uint64_t>& o) {
                       const uint8_t* src = *c->at(o[0]) ? a->at(o[1]) : b->at(o[2]);
                       bytes.append(reinterpret_cast<const char*>(src), a->esize);
                     });
  return one(owned(a->dtype, std::move(*out), std::move(bytes)));
}

// OneHot (opset 9, 11): indices and depth int64, values [off, on] int64 or float (combinations
// ONNX Runtime's CPU kernel registers); an index outside [-depth, depth) gives a row of `off`
// (negative ones count from the end from opset 11 on).
Result Evaluator::one_hot() {
  auto idx = in(0), depth = in(1), values = in(2);
  if (!idx || !depth || !values || opset_ < 9) return std::nullopt;
  if (idx->dtype != kInt64 || depth->dtype != kInt64 ||
      (values->dtype != kInt64 && values->dtype != kFloat)) {
    return unsupported();
  }
  if (depth->numel != 1 || values->numel != 2) return std::nullopt;
  const int64_t d = depth->i64(0);
  const int64_t rank = static_cast<int64_t>(idx->dims.size());
  const auto ax = axis(attr_i("axis").value_or(-1), rank + 1);
  if (d <= 0 || !ax || rank == 0) return std::nullopt;  // indices of rank 0: invalid
  Dims dims = idx->dims;
  dims.insert(dims.begin() + *ax, d);
  if (!fits(values->dtype, dims)) return std::nullopt;
  // Output [outer, d, inner]: indices [outer, inner] split at the new axis.
  const uint64_t inner = product(idx->dims, *ax), outer = idx->numel / std::max<uint64_t>(inner, 1);
  const auto on = reinterpret_cast<const char*>(values->at(1));
  const auto off = reinterpret_cast<const char*>(values->at(0));
  std::string bytes;
  bytes.reserve(static_cast<size_t>(outer * static_cast<uint64_t>(d) * inner * values->esize));
  for (uint64_t o = 0; o < outer; ++o) {
    for (int64_t k = 0; k < d; ++k) {
      for (uint64_t i = 0; i < inner; ++i) {
        int64_t v = idx->i64(o * inner + i);
        if (v < 0 && opset_ >= 11) v += d;
        bytes.append(v == k ? on : off, values->esize);
      }
    }
  }
  return one(owned(values->dtype, std::move(dims), std::move(bytes)));
}

Result Evaluator::expand() {
  auto x = in(0);
  auto shape = ints_in(1);
  if (!x || !shape || opset_ < 8) return std::nullopt;
  auto out = broadcast({&x->dims, &*shape});
  if (!out || !fits(x->dtype, *out)) return std::nullopt;
  std::string bytes;
  for_each_broadcast(*out, {broadcast_strides(x->dims, *out)}, [&](const std::vector<uint64_t>& o) {
    bytes.append(reinterpret_cast<const char*>(x->at(o[0])), x->esize);
  });
  return one(owned(x->dtype, std::move(*out), std::move(bytes)));
}

Result Evaluator::constant_of_shape() {
  auto shape = ints_in(0);
  if (!shape || opset_ < 9 || inputs_[0]->dims.size() != 1) return std::nullopt;
  int32_t dtype = kFloat;
  std::string value(4, '\0');
  if (const Attribute* a = n_.attribute("value")) {
    if (!a->t) return std::nullopt;
    auto v = to_arr(a->t, true);
    if (!v || v->numel != 1) return std::nullopt;
    dtype = v->dtype;
    value.assign(reinterpret_cast<const char*>(v->bytes.data()), v->esize);
  }
  Dims out = *shape;
  if (!fits(dtype, out)) return std::nullopt;
  const uint64_t n = *checked_numel(out);
  std::string bytes;
  bytes.reserve(n * value.size());
  for (uint64_t i = 0; i < n; ++i) bytes += value;
  return one(owned(dtype, std::move(out), std::move(bytes)));
}

Result Evaluator::range() {
  auto s = in(0), l = in(1), d = in(2);
  if (!s || !l || !d || opset_ < 11) return std::nullopt;
  const int32_t dt = s->dtype;
  if (l->dtype != dt || d->dtype != dt || s->numel != 1 || l->numel != 1 || d->numel != 1 ||
      !(is_float(dt) || is_int(dt))) {
    return std::nullopt;
  }
  const bool integral = dt == kInt16 || dt == kInt32 || dt == kInt64;
  if (!integral) {
    const double start = s->f(0), limit = l->f(0), delta = d->f(0);
    if (delta == 0 || !std::isfinite(start) || !std::isfinite(limit) || !std::isfinite(delta)) {
      return std::nullopt;
    }
    const double steps = std::ceil((limit - start) / delta);
    Dims out{steps > 0 ? static_cast<int64_t>(std::min(steps, 1e12)) : 0};
    if (!fits(dt, out)) return std::nullopt;
    // ONNX Runtime accumulates float ranges in their own precision: its fallback folds them.
    return unsupported();
  }
  const int64_t start = s->i64(0), delta = d->i64(0);
  // Exact, as ONNX Runtime counts, also where limit - start overflows the type.
  auto count = ort::range_count(dt, start, l->i64(0), delta);
  if (!count) {
    return refuse("undefined_range",
                  "Range with delta 0 (ONNX Runtime fails) or a length past int64");
  }
  Dims out{*count};
  if (!fits(dt, out)) return std::nullopt;
  std::string bytes;
  for (int64_t i = 0; i < *count; ++i) {  // between start and limit; i * delta alone may
    const uint64_t v =                    // overflow: modulo 2^64
        static_cast<uint64_t>(start) + static_cast<uint64_t>(i) * static_cast<uint64_t>(delta);
    put_int(bytes, dt, static_cast<int64_t>(v));
  }
  return one(owned(dt, std::move(out), std::move(bytes)));
}

}  // namespace fastopt::eval
