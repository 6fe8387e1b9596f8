#include "ir/constant.h"

#include <cstring>
#include <vector>

#include "ir/error.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define FASTOPT_F16C 1
#endif

namespace fastopt {

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t exp = (x >> 23) & 0xff;
  uint32_t mant = x & 0x7fffff;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (e <= 0) {  // subnormal half (or zero)
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(h);
}

namespace {

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The dtypes for_each_element reads.
bool is_numeric(int32_t dt) {
  switch (dt) {
    case kFloat:
    case kDouble:
    case kFloat16:
    case kBFloat16:
    case kInt8:
    case kUint8:
    case kInt16:
    case kUint16:
    case kInt32:
    case kUint32:
    case kInt64:
    case kUint64:
    case kBool: return true;
    default: return false;
  }
}

// The element at `p` of a numeric dtype but int64, as a double.
double element_at(int32_t dt, const uint8_t* p) {
  switch (dt) {
    case kFloat: return static_cast<double>(load<float>(p));
    case kDouble: return load<double>(p);
    case kFloat16: return static_cast<double>(half_to_float(load<uint16_t>(p)));
    case kBFloat16: {
      uint32_t bits = static_cast<uint32_t>(load<uint16_t>(p)) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return static_cast<double>(f);
    }
    case kInt8: return static_cast<double>(load<int8_t>(p));
    case kInt16: return static_cast<double>(load<int16_t>(p));
    case kUint16: return static_cast<double>(load<uint16_t>(p));
    case kInt32: return static_cast<double>(load<int32_t>(p));
    case kUint32: return static_cast<double>(load<uint32_t>(p));
    case kUint64: return static_cast<double>(load<uint64_t>(p));
    default: return static_cast<double>(load<uint8_t>(p));  // kUint8, kBool
  }
}

// Calls fn(double, int64) for each element; false for non-numeric types.
template <typename F>
bool for_each_element(const Tensor& t, uint64_t max_elements, F&& fn) {
  const int32_t dt = t.dtype();
  uint64_t n = t.numel();
  if (n > max_elements || !is_numeric(dt)) return false;
  ByteRef bytes = t.bytes();
  const uint8_t* p = bytes.data();
  const uint64_t size = static_cast<uint64_t>(dtype_bits(dt) / 8);
  if (bytes.size != n * size) return false;
  for (uint64_t i = 0; i < n; ++i, p += size) {
    if (dt == kInt64) {
      fn(static_cast<double>(load<int64_t>(p)), load<int64_t>(p));
    } else {
      fn(element_at(dt, p));
    }
  }
  return true;
}

}  // namespace

bool fixed_initializer(const Value* v) {
  if (!v || !v->initializer()) return false;
  if (!v->is_graph_input()) return true;
  const Model* m = v->graph() ? v->graph()->model() : nullptr;
  return m && m->ir_version && *m->ir_version < 4;
}

std::shared_ptr<const Tensor> constant_tensor(const Value* v) {
  if (!v) return nullptr;
  if (fixed_initializer(v)) return v->initializer();
  Node* p = v->producer();
  if (!p || p->op_type != "Constant" ||
      !(p->domain.value.empty() || p->domain.value == "ai.onnx")) {
    return nullptr;
  }
  for (const auto& a : p->attributes) {
    if (a.name == "value" && a.t) return a.t;
    if (a.name == "value_float" && a.f) return make_float_tensor({*a.f}, {});
    if (a.name == "value_floats") {
      return make_float_tensor(a.floats, {static_cast<int64_t>(a.floats.size())});
    }
    if (a.name == "value_int" && a.i) return make_int64_tensor({*a.i}, {});
    if (a.name == "value_ints") {
      return make_int64_tensor(a.ints, {static_cast<int64_t>(a.ints.size())});
    }
  }
  return nullptr;
}

const Tensor* constant_tensor_view(const Value* v) {
  if (!v) return nullptr;
  if (fixed_initializer(v)) return v->initializer().get();
  Node* p = v->producer();
  if (!p || p->op_type != "Constant") return nullptr;
  const Attribute* a = p->attribute("value");
  return a && a->t && p->attributes.size() == 1 ? a->t.get() : nullptr;
}

bool decode_doubles(const Tensor& t, uint64_t max_elements, std::vector<double>& out) {
  out.clear();
  return for_each_element(t, max_elements, [&](double d, int64_t = 0) { out.push_back(d); });
}

std::optional<std::vector<double>> tensor_doubles(const Tensor& t, uint64_t max_elements) {
  std::vector<double> out;
  if (!decode_doubles(t, max_elements, out)) return std::nullopt;
  return out;
}

std::optional<std::vector<int64_t>> tensor_ints(const Tensor& t, uint64_t max_elements) {
  const int32_t dt = t.dtype();
  if (dt == kFloat || dt == kDouble || dt == kFloat16 || dt == kBFloat16) return std::nullopt;
  std::vector<int64_t> out;
  bool fits = true;  // a uint64 past 2^63 has no int64 value (the cast would be undefined)
  bool ok = for_each_element(t, max_elements, [&](double d, int64_t exact = INT64_MIN) {
    if (dt != kInt64 && !(d >= -9223372036854775808.0 && d < 9223372036854775808.0)) {
      fits = false;
      return;
    }
    out.push_back(dt == kInt64 ? exact : static_cast<int64_t>(d));
  });
  if (!ok || !fits) return std::nullopt;
  return out;
}

std::optional<std::vector<double>> constant_doubles(const Value* v, uint64_t max_elements) {
  auto t = constant_tensor(v);
  if (!t) return std::nullopt;
  return tensor_doubles(*t, max_elements);
}

std::optional<std::vector<int64_t>> constant_ints(const Value* v, uint64_t max_elements) {
  auto t = constant_tensor(v);
  if (!t) return std::nullopt;
  return tensor_ints(*t, max_elements);
}

std::optional<double> constant_scalar(const Value* v) {
  auto d = constant_doubles(v, 1);
  if (!d || d->size() != 1) return std::nullopt;
  return (*d)[0];
}

int32_t value_dtype(const Value* v) {
  if (!v) return 0;
  if (v->type.is_tensor && v->type.elem_type) return v->type.elem_type;
  if (v->initializer()) return v->initializer()->dtype();
  if (auto t = constant_tensor(v)) return t->dtype();
  return 0;
}

int value_rank(const Value* v) {
  if (!v) return -1;
  if (v->type.is_tensor && v->type.has_shape) return static_cast<int>(v->type.dims.size());
  if (auto t = constant_tensor(v)) return static_cast<int>(t->dims.size());
  return -1;
}

namespace {

void floats_to_halves_scalar(const float* in, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
}

const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = half_to_float(static_cast<uint16_t>(h));
    return t;
  }();
  return table.data();
}

void halves_by_table(const uint8_t* p, size_t n, float* out) {
  const float* table = half_table();
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = table[h];
  }
}

#ifdef FASTOPT_F16C
// The CPU's half -> float conversion, 8 at a time: the table's floats bit for bit for all
// 65536 inputs but NaN payloads (NaNs stay NaN), 4-10x faster than its lookups (measured on
// 1M-element buffers); a 7B fp16 model converts 6.7 G elements.
__attribute__((target("avx,f16c"))) void halves_to_floats_f16c(const uint8_t* p, size_t n,
                                                               float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  halves_by_table(p + 2 * i, n - i, out + i);
}

// VCVTPS2PH with round-to-nearest-even gives float_to_half's bits for every non-NaN float
// (overflow to inf, subnormal halves, signed zeros); a NaN keeps part of its payload there, so
// groups with one go through float_to_half.
__attribute__((target("avx,f16c"))) void floats_to_halves_f16c(const float* in, size_t n,
                                                               uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(in + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) {
      floats_to_halves_scalar(in + i, 8, out + i);
      continue;
    }
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  floats_to_halves_scalar(in + i, n - i, out + i);
}

bool has_f16c() {
  // F16C from CPUID leaf 1 (clang before 15 does not know "f16c" in __builtin_cpu_supports).
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }();
  return yes;
}
#endif

}  // namespace

void halves_to_floats(const uint8_t* halves, size_t n, float* out) {
#ifdef FASTOPT_F16C
  if (has_f16c()) return halves_to_floats_f16c(halves, n, out);
#endif
  halves_by_table(halves, n, out);
}

void floats_to_halves(const float* in, size_t n, uint16_t* out) {
#ifdef FASTOPT_F16C
  if (has_f16c()) return floats_to_halves_f16c(in, n, out);
#endif
  floats_to_halves_scalar(in, n, out);
}

std::shared_ptr<Tensor> make_tensor(int32_t dtype, std::vector<int64_t> dims, std::string bytes) {
  auto t = std::make_shared<Tensor>();
  t->data_type = dtype;
  t->dims = std::move(dims);
  t->raw = ByteRef::owned(std::move(bytes));
  t->has_raw_field = true;
  t->storage = Tensor::Storage::kRaw;
  if (t->expected_bytes() != t->raw.size) throw ModelError("tensor bytes do not match its shape");
  return t;
}

std::shared_ptr<Tensor> make_int64_tensor(const std::vector<int64_t>& values,
                                          std::vector<int64_t> dims) {
  std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * 8);
  return make_tensor(kInt64, std::move(dims), std::move(bytes));
}

std::shared_ptr<Tensor> make_float_tensor(const std::vector<float>& values,
                                          std::vector<int64_t> dims) {
  std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  return make_tensor(kFloat, std::move(dims), std::move(bytes));
}

}  // namespace fastopt
