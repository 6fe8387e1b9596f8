#include "passes/rotary/rotary_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ir/constant.h"

namespace fastopt::passes::rotary {

std::optional<std::vector<int64_t>> unsqueeze_axes(const Node* n) {
  if (n->inputs().size() > 1 && n->inputs()[1]) return constant_ints(n->inputs()[1]);
  if (const Attribute* a = n->attribute("axes")) return a->ints;
  return std::nullopt;
}

namespace {

bool unsqueezes_at(const Node* n, int64_t axis, int64_t alt_axis) {
  auto axes = unsqueeze_axes(n);
  return axes && axes->size() == 1 && ((*axes)[0] == axis || (*axes)[0] == alt_axis);
}

// Unsqueeze axes {0, axis} (alt_axis: the same axis counted from the end), in any order.
bool unsqueezes_at_two(const Node* n, int64_t axis, int64_t alt_axis) {
  auto axes = unsqueeze_axes(n);
  if (!axes || axes->size() != 2) return false;
  const int64_t a = (*axes)[0], b = (*axes)[1];
  auto is_axis = [&](int64_t x) { return x == axis || x == alt_axis; };
  return (a == 0 && is_axis(b)) || (b == 0 && is_axis(a));
}

// A constant whose dims are all 1 except one, of size `numel`: that dim's index, or -1.
int single_axis(const Tensor& t) {
  int axis = -1;
  for (size_t i = 0; i < t.dims.size(); ++i) {
    if (t.dims[i] == 1 && t.numel() != 1) continue;
    if (axis >= 0) return -1;
    axis = static_cast<int>(i);
  }
  return axis;
}

std::optional<std::vector<float>> float_values(const Value* v, uint64_t max) {
  auto t = constant_tensor(v);
  if (!t || t->dtype() != kFloat) return std::nullopt;
  auto d = tensor_doubles(*t, max);
  if (!d) return std::nullopt;
  return std::vector<float>(d->begin(), d->end());  // exact: the values were floats
}

// The tail both frequency forms share: `cast` (Cast to float) of Unsqueeze(positions, axis |
// alt_axis), and `inv` a float constant. Fills inv_freq and positions.
bool take_positions(const Node* cast, const Value* inv, int64_t axis, int64_t alt_axis,
                    const char* unsqueeze_why, CosSinSource* s, std::string* why) {
  if (!cast || int_attr(cast, "to") != kFloat) {
    *why = "the positions are not cast to float (the angles must be computed in fp32)";
    return false;
  }
  Node* unsq = made_by(cast->inputs()[0], "Unsqueeze");
  // (S) positions unsqueezed at {0, axis} at once read as (1, S) positions at `axis`
  // (modernbert's Range(0, S)[None, :, None]).
  const bool one_d = unsq && axis == 2 && value_rank(unsq->inputs()[0]) == 1 &&
                     unsqueezes_at_two(unsq, axis, alt_axis);
  if (!unsq || (!one_d && !unsqueezes_at(unsq, axis, alt_axis))) {
    *why = unsqueeze_why;
    return false;
  }
  s->positions_1d = one_d;
  auto values = float_values(inv, 1 << 16);
  if (!values || (s->switch_cond && s->switched_inv_freq.size() != values->size())) {
    *why = "the inverse frequencies are not a float constant";
    return false;
  }
  s->inv_freq = std::move(*values);
  s->positions = unsq->inputs()[0];
  return true;
}

// LongRoPE's switch: Where(Greater(Add(ReduceMax(pos), c), t), long, short) with float vector
// constants; fills the switch fields and returns `short`, or null (why set) when `v` is not one.
Value* trace_switch(Value* v, CosSinSource* s, std::string* why) {
  Node* where = made_by(v, "Where");
  if (!where) return nullptr;
  *why =
      "the inverse frequencies switch tables (Where) other than on Greater(max(positions) + "
      "c, t)";
  Value* cond = where->inputs()[0];
  Node* gt = made_by(cond, "Greater");
  auto t = gt ? constant_scalar(gt->inputs()[1]) : std::nullopt;
  Node* add = gt ? made_by(gt->inputs()[0], "Add") : nullptr;
  if (!t || !add || value_rank(cond) > 0) return nullptr;
  for (int i = 0; i < 2; ++i) {
    Node* max = made_by(add->inputs()[i], "ReduceMax");
    auto c = constant_scalar(add->inputs()[1 - i]);
    if (!max || !c || int_attr(max, "keepdims").value_or(1) != 0) continue;
    const bool all_axes = max->inputs().size() < 2 || !max->inputs()[1];
    if (!all_axes || max->attribute("axes")) continue;  // the max over every position
    auto hi = float_values(where->inputs()[1], 1 << 16);
    auto lo = constant_tensor(where->inputs()[2]);
    if (!hi || !lo) {
      *why = "the switched inverse frequencies are not float constants";
      return nullptr;
    }
    s->switch_cond = cond;
    s->switched_inv_freq = std::move(*hi);
    // Off while max + c <= t: every position p <= t - c reads the first table.
    s->switch_rows = static_cast<int64_t>(std::floor(*t - *c)) + 1;
    why->clear();
    return where->inputs()[2];
  }
  return nullptr;
}

// Mul form: f = Cast(float)(Unsqueeze(pos, 2)) * inv_freq.
bool trace_mul(const Node* mul, CosSinSource* s, std::string* why) {
  for (int i = 0; i < 2; ++i) {
    Value* inv = mul->inputs()[i];
    Node* cast = made_by(mul->inputs()[1 - i], "Cast");
    if (cast && !s->switch_cond && made_by(inv, "Where")) {
      Value* short_inv = trace_switch(inv, s, why);
      if (!short_inv) return false;
      inv = short_inv;
    }
    auto t = constant_tensor(inv);
    if (!t || !cast) continue;
    if (t->dims.empty() || single_axis(*t) != static_cast<int>(t->dims.size()) - 1) {
      *why = "the inverse frequencies are not a vector along the last axis";
      return false;
    }
    return take_positions(cast, inv, 2, -1,
                          "the positions do not reach the frequencies through Unsqueeze(axis 2)", s,
                          why);
  }
  *why = "the angles are not Mul(Cast(Unsqueeze(positions)), constant inv_freq)";
  return false;
}

// MatMul form: f = Transpose(0,2,1)(MatMul([Expand](inv_freq (1,D/2,1)), Cast(Unsqueeze(pos,1)))).
bool trace_matmul(const Node* transpose, CosSinSource* s, std::string* why) {
  const Attribute* perm = transpose->attribute("perm");
  Node* mm = made_by(transpose->inputs()[0], "MatMul");
  if (!perm || perm->ints != std::vector<int64_t>{0, 2, 1} || !mm) {
    *why = "the angles are not Transpose(0,2,1)(MatMul(inv_freq, positions))";
    return false;
  }
  Value* inv = mm->inputs()[0];
  if (Node* e = made_by(inv, "Expand")) inv = e->inputs()[0];  // broadcast over the batch
  auto t = constant_tensor(inv);
  if (!t || t->dims.size() != 3 || t->dims[0] != 1 || t->dims[2] != 1) {
    *why = "the inverse frequencies are not a constant (1, D/2, 1)";
    return false;
  }
  return take_positions(made_by(mm->inputs()[1], "Cast"), inv, 1, 1,
                        "the positions do not reach the MatMul through Unsqueeze(axis 1)", s, why);
}

// Source B: Gather(table | Slice(table, 0, n, axis 0), pos).
bool trace_table(const Node* gather, CosSinSource* s, std::string* why) {
  if (int_attr(gather, "axis").value_or(0) != 0) {
    *why = "the table Gather is not along axis 0";
    return false;
  }
  Value* table = gather->inputs()[0];
  if (Node* sl = made_by(table, "Slice")) {
    // table[:n] keeps row indices: the Gather reads the same rows of the whole table.
    const auto& in = sl->inputs();
    auto starts = in.size() > 1 ? constant_ints(in[1]) : std::nullopt;
    auto axes = in.size() > 3 && in[3] ? constant_ints(in[3]) : std::vector<int64_t>{0};
    auto steps = in.size() > 4 && in[4] ? constant_ints(in[4]) : std::vector<int64_t>{1};
    if (!starts || *starts != std::vector<int64_t>{0} || axes != std::vector<int64_t>{0} ||
        steps != std::vector<int64_t>{1}) {
      *why = "the table is sliced other than [0:n] along axis 0";
      return false;
    }
    table = in[0];
  }
  auto t = constant_tensor(table);
  if (!t || t->dims.size() != 2 || t->dims[1] % 2 != 0) {
    *why = "the gathered table is not a constant (M, D) with D even";
    return false;
  }
  s->kind = CosSinSource::Kind::kTable;
  s->table = t;
  s->half = t->dims[1] / 2;
  s->positions = gather->inputs()[1];
  return true;
}

}  // namespace

bool take_scaling(Value** cur, const std::string& fn, CosSinSource* s, std::string* why) {
  Node* mul = made_by(*cur, "Mul");  // attention_scaling
  if (!mul) return true;
  for (int i = 0; i < 2 && !s->scaling; ++i) {
    if (auto c = constant_scalar(mul->inputs()[i]);
        c && made_by(mul->inputs()[1 - i], fn.c_str())) {
      s->scaling = static_cast<float>(*c);
      *cur = mul->inputs()[1 - i];
    }
  }
  if (!s->scaling) {
    *why = "the " + fn + " is multiplied by something other than a scalar constant";
    return false;
  }
  return true;
}

bool take_cache_casts(const std::vector<int32_t>& casts, const std::string& fn, CosSinSource* s,
                      std::string* why) {
  for (int32_t to : casts) {
    if (to == kFloat16) s->via_half = true;
    if (to != kFloat && to != kFloat16) {
      *why = "the " + fn + " is cast to " + dtype_name(to) + " (caches: float, float16)";
      return false;
    }
  }
  return true;
}

namespace {

// Cast? -> Unsqueeze(1) -> Cast? from `*cur` back: the casts (outermost first), which say how
// the fp32 values were rounded; `*cur` ends before the first other op.
std::vector<int32_t> peel_casts_and_unsqueeze(Value** cur, bool* unsqueezed) {
  std::vector<int32_t> casts;
  while (Node* n = (*cur)->producer()) {
    if (made_by(*cur, "Cast")) {
      casts.push_back(static_cast<int32_t>(int_attr(n, "to").value_or(0)));
    } else if (!*unsqueezed && made_by(*cur, "Unsqueeze") && unsqueezes_at(n, 1, 1)) {
      *unsqueezed = true;
    } else {
      break;
    }
    *cur = n->inputs()[0];
  }
  return casts;
}

// A gathered table in the input's dtype, every Cast keeping it.
bool take_gathered_table(Node* gather, const std::vector<int32_t>& casts, const std::string& fn,
                         CosSinSource* s, std::string* why) {
  if (!trace_table(gather, s, why)) return false;
  if (s->dtype == 0) s->dtype = casts.empty() ? s->table->dtype() : casts.front();
  bool same = s->table->dtype() == s->dtype;
  for (int32_t to : casts) same = same && to == s->dtype;
  if (!same) {
    *why = "the " + fn + " table's dtype differs from the input's";
    return false;
  }
  return true;
}

// angles = Concat(f, f, -1): rotate_half's layout repeats the frequencies f.
bool take_angles(const Node* trig, CosSinSource* s, std::string* why) {
  Node* cat = made_by(trig->inputs()[0], "Concat");
  const auto axis = cat ? int_attr(cat, "axis") : std::nullopt;
  if (!cat || cat->inputs().size() != 2 || cat->inputs()[0] != cat->inputs()[1] ||
      !(axis == -1 || axis == 2)) {
    *why = "the angles are not Concat(f, f, axis -1)";
    return false;
  }
  s->angles = cat->outputs()[0];
  return trace_frequencies(cat->inputs()[0], s, why);
}

}  // namespace

std::optional<CosSinSource> trace_cos_sin(Value* v, const std::string& fn, std::string* why) {
  CosSinSource s;
  s.dtype = value_dtype(v);
  Value* cur = v;
  bool unsqueezed = false;
  const std::vector<int32_t> casts = peel_casts_and_unsqueeze(&cur, &unsqueezed);
  if (!unsqueezed) {
    *why = "the " + fn + " operand is not Unsqueeze(axis 1) of a (B, S, D) " + fn;
    return std::nullopt;
  }
  if (!take_cache_casts(casts, fn, &s, why)) return std::nullopt;
  if (Node* gather = made_by(cur, "Gather")) {
    if (!take_gathered_table(gather, casts, fn, &s, why)) return std::nullopt;
    return s;
  }
  if (!take_scaling(&cur, fn, &s, why)) return std::nullopt;
  Node* trig = made_by(cur, fn.c_str());
  if (!trig) {
    *why = "the " + fn + " operand comes neither from " + fn + "(angles) nor from a table Gather";
    return std::nullopt;
  }
  // fp32: the angles come from Cast(float) positions times float inv_freq (checked below).
  if (s.dtype == 0) s.dtype = casts.empty() ? kFloat : casts.front();  // no type info
  if (!take_angles(trig, &s, why)) return std::nullopt;
  return s;
}

bool trace_frequencies(Value* f, CosSinSource* s, std::string* why) {
  if (Node* mul = made_by(f, "Mul")) {
    if (!trace_mul(mul, s, why)) return false;
  } else if (Node* tr = made_by(f, "Transpose")) {
    if (!trace_matmul(tr, s, why)) return false;
  } else {
    *why = "the frequencies f are neither a Mul nor a Transpose(MatMul)";
    return false;
  }
  s->half = static_cast<int64_t>(s->inv_freq.size());
  return true;
}

int64_t switch_table_rows(const CosSinSource& s, int64_t max_positions) {
  return std::max(max_positions, s.switch_rows);
}

namespace {

template <typename T>
void append_bytes(std::string* key, const T& v) {
  key->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// glibc's sincosf gives sinf's and cosf's results bit for bit (the same reduction and
// polynomials; checked on all 2^32 floats) at about the cost of one of them.
void sin_cos(float x, float* s, float* c) {
#ifdef __GLIBC__
  ::sincosf(x, s, c);
#else
  *s = std::sin(x);
  *c = std::cos(x);
#endif
}

}  // namespace

std::string trig_key(const CosSinSource& s, int64_t max_positions) {
  std::string key;
  append_bytes(&key, max_positions);
  append_bytes(&key, s.scaling.has_value());
  append_bytes(&key, s.scaling.value_or(0.0f));  // the bits: equal keys mean equal values
  append_bytes(&key, s.inv_freq.size());
  key.append(reinterpret_cast<const char*>(s.inv_freq.data()), s.inv_freq.size() * 4);
  if (s.switch_cond) {
    append_bytes(&key, s.switch_rows);
    key.append(reinterpret_cast<const char*>(s.switched_inv_freq.data()),
               s.switched_inv_freq.size() * 4);
  }
  return key;
}

TrigTables trig_tables(const CosSinSource& s, int64_t max_positions) {
  const int64_t table = s.switch_cond ? switch_table_rows(s, max_positions) : max_positions;
  TrigTables t;
  t.rows = s.switch_cond ? 2 * table : table;
  t.half = s.half;
  const size_t n = static_cast<size_t>(t.rows) * static_cast<size_t>(s.half);
  t.cos.resize(n);
  t.sin.resize(n);
  size_t k = 0;
  for (int64_t row = 0; row < t.rows; ++row) {
    const bool on = row >= table;
    const float p = static_cast<float>(on ? row - table : row);
    const float* inv = (on ? s.switched_inv_freq : s.inv_freq).data();
    for (int64_t i = 0; i < s.half; ++i, ++k) {
      // The graph's order of fp32 operations: Cast(p) * inv_freq, Cos/Sin, * scaling.
      sin_cos(p * inv[i], &t.sin[k], &t.cos[k]);
    }
  }
  if (s.scaling) {
    const float f = *s.scaling;
    for (size_t i = 0; i < n; ++i) {
      t.cos[i] *= f;
      t.sin[i] *= f;
    }
  }
  return t;
}

std::shared_ptr<Tensor> frequency_cache(const TrigTables& t, bool cos, int32_t dtype,
                                        bool via_half) {
  const std::vector<float>& v = cos ? t.cos : t.sin;
  const bool half = dtype == kFloat16;
  std::string bytes(v.size() * (half ? 2 : 4), '\0');
  if (half || via_half) {
    // A round trip through float16 before a float16 cache changes nothing (float_to_half of
    // half_to_float(h) is h).
    std::vector<uint16_t> h(v.size());
    floats_to_halves(v.data(), v.size(), h.data());
    if (half) {
      std::memcpy(bytes.data(), h.data(), h.size() * 2);
      return make_tensor(dtype, {t.rows, t.half}, std::move(bytes));
    }
    for (size_t i = 0; i < v.size(); ++i) {
      const float f = half_to_float(h[i]);
      std::memcpy(&bytes[i * 4], &f, 4);
    }
  } else {
    std::memcpy(bytes.data(), v.data(), v.size() * 4);
  }
  return make_tensor(dtype, {t.rows, t.half}, std::move(bytes));
}

std::shared_ptr<Tensor> table_cache(const CosSinSource& s) {
  const Tensor& t = *s.table;
  const int64_t rows = t.dims[0], cols = t.dims[1];
  const size_t esize = static_cast<size_t>(dtype_bits(t.dtype()) / 8);
  if (esize == 0) return nullptr;
  const ByteRef src = t.bytes();
  const size_t row_bytes = static_cast<size_t>(cols) * esize, half_bytes = row_bytes / 2;
  std::string bytes;
  bytes.reserve(static_cast<size_t>(rows) * static_cast<size_t>(s.half) * esize);
  for (int64_t r = 0; r < rows; ++r) {
    const char* row =
        reinterpret_cast<const char*>(src.data()) + static_cast<size_t>(r) * row_bytes;
    if (s.table_column >= 0) {  // the source's own columns
      if (s.table_column + s.half > cols) return nullptr;
      bytes.append(row + static_cast<size_t>(s.table_column) * esize,
                   static_cast<size_t>(s.half) * esize);
      continue;
    }
    // rotate_half needs cos[..., :D/2] == cos[..., D/2:] bit for bit.
    if (std::memcmp(row, row + half_bytes, half_bytes) != 0) return nullptr;
    bytes.append(row, half_bytes);
  }
  return make_tensor(t.dtype(), {rows, s.half}, std::move(bytes));
}

}  // namespace fastopt::passes::rotary
