// ONNX Runtime's integer semantics (see ort_semantics.h).
#include "eval/ort_semantics.h"

#include <cmath>
#include <limits>

#include "ir/dtype.h"

namespace fastopt::eval::ort {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// ORT's clamp: the low bound first (so [0, -1] gives 0 below 0 and -1 above).
int64_t ort_clamp(int64_t v, int64_t lo, int64_t hi) {
  if (v < lo) return lo;
  if (v > hi) return hi;
  return v;
}

// The spec's count: start clamped into [0, dim] ([0, dim-1] for a negative step), end into
// [0, dim] ([-1, dim-1]); exact integer arithmetic.
int64_t spec_count(int64_t dim, int64_t s, int64_t e, int64_t step) {
  if (step > 0) {
    s = ort_clamp(s, 0, dim);
    e = ort_clamp(e, 0, dim);
    return e > s ? (e - s - 1) / step + 1 : 0;
  }
  if (dim == 0) return 0;
  s = ort_clamp(s, 0, dim - 1);
  e = ort_clamp(e, -1, dim - 1);
  if (s <= e) return 0;
  // -step overflows for INT64_MIN, whose one element is start (s - e - 1 < 2^63).
  return step == kInt64Min ? 1 : (s - e - 1) / -step + 1;
}

}  // namespace

SliceAxis slice_axis(int64_t dim, int64_t start, int64_t end, int64_t step) {
  // Negative bounds count from the end (no overflow: dim >= 0).
  const int64_t s = start < 0 ? start + dim : start;
  const bool to_end = end == kInt32Max || end == kInt64Max;
  const int64_t e = end < 0 ? end + dim : end;
  SliceAxis out;
  // ORT (slice_helper.h, PrepareForComputeHelper with steps).
  out.start = step < 0 ? ort_clamp(s, 0, dim - 1) : ort_clamp(s, 0, dim);
  const int64_t ort_end =
      to_end ? (step < 0 ? -1 : dim) : (step < 0 ? ort_clamp(e, -1, dim) : ort_clamp(e, 0, dim));
  // Both bounds lie in [-1, dim]: the difference is small and exact in a double.
  const double q = std::ceil(static_cast<double>(ort_end - out.start) / static_cast<double>(step));
  out.count = q > 0 ? static_cast<int64_t>(q) : 0;
  // The spec's first index is ORT's whenever the axis is not empty (when it is, the spec
  // selects nothing).
  out.spec_agrees = spec_count(dim, s, e, step) == out.count;
  return out;
}

std::optional<int64_t> range_count(int32_t dtype, int64_t start, int64_t limit, int64_t delta) {
  if (delta == 0 || (dtype != kInt16 && dtype != kInt32 && dtype != kInt64)) return std::nullopt;
  // ORT 1.32 counts exactly, ceil((limit - start) / delta), also where limit - start
  // overflows the type (measured: Range(INT64_MIN, INT64_MAX, INT64_MAX) has 3 elements;
  // ceil(double(limit - start) / delta), the older kernel's formula, is 2 past 2^53). Every
  // element start + k * delta (k < count) then lies between start and limit: in the type.
  if (limit == start || (limit > start) != (delta > 0)) return 0;
  // Magnitudes as unsigned: |limit - start| < 2^64, |INT64_MIN| = 2^63.
  const uint64_t span = limit > start ? static_cast<uint64_t>(limit) - static_cast<uint64_t>(start)
                                      : static_cast<uint64_t>(start) - static_cast<uint64_t>(limit);
  const uint64_t step =
      delta > 0 ? static_cast<uint64_t>(delta) : uint64_t{0} - static_cast<uint64_t>(delta);
  const uint64_t n = span / step + (span % step != 0 ? 1 : 0);
  if (n > static_cast<uint64_t>(kInt64Max)) return std::nullopt;
  return static_cast<int64_t>(n);
}

std::optional<int64_t> divide(int32_t dtype, int64_t a, int64_t b) {
  if (b == 0) return std::nullopt;
  if (b == -1) {
    if (dtype == kInt64 && a == kInt64Min) return std::nullopt;
    if (dtype == kInt32 && a == INT32_MIN) return std::nullopt;
    if (a == kInt64Min) return std::nullopt;  // not a value of a narrower type
  }
  return wrap_to(dtype, a / b);
}

int64_t wrap_to(int32_t dtype, int64_t v) {
  switch (dtype) {
    case kInt8: return static_cast<int8_t>(v);
    case kUint8: return static_cast<uint8_t>(v);
    case kInt16: return static_cast<int16_t>(v);
    case kUint16: return static_cast<uint16_t>(v);
    case kInt32: return static_cast<int32_t>(v);
    case kUint32: return static_cast<uint32_t>(v);
    case kBool: return v != 0;
    default: return v;
  }
}

}  // namespace fastopt::eval::ort
