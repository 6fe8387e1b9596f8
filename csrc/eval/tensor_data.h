// Element access for the evaluator: constant tensors as typed element arrays, element stores,
// broadcasting. Internal to csrc/eval.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "ir/graph.h"

namespace fastopt::eval {

// Equal, Less, Greater, LessOrEqual, GreaterOrEqual on two elements.
template <typename T>
bool compare(const std::string& op, T a, T b) {
  return op == "Equal"         ? a == b
         : op == "Less"        ? a < b
         : op == "Greater"     ? a > b
         : op == "LessOrEqual" ? a <= b
                               : a >= b;
}

using Tensors = std::vector<std::shared_ptr<Tensor>>;
using Result = std::optional<Tensors>;
using Dims = std::vector<int64_t>;

inline bool standard_domain(const Node& n) {
  return n.domain.value.empty() || n.domain.value == "ai.onnx";
}

// ---- element access ----

inline bool is_float(int32_t t) {
  return t == kFloat || t == kDouble || t == kFloat16 || t == kBFloat16;
}
// Integer types whose values fit int64 (uint64 does not), and bool.
inline bool is_int(int32_t t) {
  switch (t) {
    case kInt8:
    case kInt16:
    case kInt32:
    case kInt64:
    case kUint8:
    case kUint16:
    case kUint32:
    case kBool: return true;
    default: return false;
  }
}
// Types with whole-byte elements: data movement works on their bytes.
inline bool is_bytewise(int32_t t) {
  return t != kString && dtype_bits(t) >= 8;
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// A constant input: its tensor and little-endian element bytes (a view).
struct Arr {
  std::shared_ptr<const Tensor> tensor;
  int32_t dtype = 0;
  Dims dims;
  ByteRef bytes;
  uint64_t numel = 0;
  size_t esize = 0;

  const uint8_t* at(uint64_t i) const { return bytes.data() + i * esize; }
  double f(uint64_t i) const {
    const uint8_t* p = at(i);
    switch (dtype) {
      case kFloat: return load<float>(p);
      case kDouble: return load<double>(p);
      case kFloat16: return half_to_float(load<uint16_t>(p));
      case kBFloat16: {
        uint32_t bits = static_cast<uint32_t>(load<uint16_t>(p)) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        return v;
      }
      default: return static_cast<double>(i64(i));
    }
  }
  int64_t i64(uint64_t i) const {
    const uint8_t* p = at(i);
    switch (dtype) {
      case kInt8: return load<int8_t>(p);
      case kInt16: return load<int16_t>(p);
      case kInt32: return load<int32_t>(p);
      case kInt64: return load<int64_t>(p);
      case kUint8: return load<uint8_t>(p);
      case kBool: return load<uint8_t>(p) != 0;
      case kUint16: return load<uint16_t>(p);
      case kUint32: return load<uint32_t>(p);
      case kUint64: return static_cast<int64_t>(load<uint64_t>(p));
      default: return 0;
    }
  }
};

std::optional<Arr> to_arr(std::shared_ptr<const Tensor> t, bool need_bytes);

void put_int(std::string& out, int32_t dt, int64_t v);

// `v` as the `dt` element it would be after a store (narrow integer types wrap).
int64_t wrap(int32_t dt, int64_t v);

void put_float(std::string& out, int32_t dt, double v);

// Product of d[from:to] (to: the end when negative).
uint64_t product(const Dims& d, int64_t from = 0, int64_t to = -1);

// Element count of `d`, or nullopt when a dim is negative or the count is absurd.
std::optional<uint64_t> checked_numel(const Dims& d);

// Row-major strides (in elements).
std::vector<uint64_t> strides_of(const Dims& d);

// Numpy-style broadcast of several shapes.
std::optional<Dims> broadcast(const std::vector<const Dims*>& shapes);

// Strides of `in` (in elements) indexed by the output's dims: 0 where broadcast.
std::vector<uint64_t> broadcast_strides(const Dims& in, const Dims& out);

std::shared_ptr<Tensor> owned(int32_t dtype, Dims dims, std::string bytes);

// The input's tensor with other dims: its bytes (and storage: raw, external or typed) shared.
std::shared_ptr<Tensor> view(const Arr& a, Dims dims);

// Calls fn(offsets) for every element of `out` in row-major order, with the element offset in
// each input (strides from broadcast_strides).
template <typename F>
void for_each_broadcast(const Dims& out, const std::vector<std::vector<uint64_t>>& strides,
                        F&& fn) {
  const uint64_t n = product(out);
  std::vector<int64_t> idx(out.size(), 0);
  std::vector<uint64_t> offs(strides.size(), 0);
  for (uint64_t e = 0; e < n; ++e) {
    fn(offs);
    for (size_t d = out.size(); d-- > 0;) {
      if (++idx[d] < out[d]) {
        for (size_t k = 0; k < strides.size(); ++k) offs[k] += strides[k][d];
        break;
      }
      for (size_t k = 0; k < strides.size(); ++k) {
        offs[k] -= strides[k][d] * static_cast<uint64_t>(out[d] - 1);
      }
      idx[d] = 0;
    }
  }
}

}  // namespace fastopt::eval
