// Helpers shared by the normalization fusions (fuse_layer_norm, fuse_rms_norm, fuse_skip_norm):
// shapes of values, the "reduce over the last axis, keep dims" check, and scale constants in the
// dtype the fused op needs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/constant.h"
#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes::norm {

// Dims of `v` from its type or its constant tensor; nullopt when the shape is unknown.
inline std::optional<std::vector<Dim>> dims_of(const Value* v) {
  if (v->type.is_tensor && v->type.has_shape) return v->type.dims;
  if (auto t = constant_tensor(v)) {
    std::vector<Dim> out;
    for (int64_t d : t->dims) out.push_back(Dim{d, std::nullopt});
    return out;
  }
  return std::nullopt;
}

// The last dim of `v` when it is a known number, else nullopt.
inline std::optional<int64_t> last_dim(const Value* v) {
  auto d = dims_of(v);
  if (!d || d->empty() || !d->back().value) return std::nullopt;
  return *d->back().value;
}

// False only when both dims are known numbers that differ: unknown dims may still agree at run
// time (the fused kernels check their input shapes and fail loudly if they do not).
inline bool may_equal(const Dim& a, const Dim& b) {
  return !(a.value && b.value && *a.value != *b.value);
}

inline bool is_float_type(int32_t t) {
  return t == kFloat || t == kFloat16 || t == kDouble || t == kBFloat16;
}

// ReduceMean over the last axis only, keepdims = 1 (axes as attribute before opset 18, as a
// constant input from 18 on). `rank` is the input's rank, or -1 when unknown.
inline std::optional<std::string> check_last_axis_mean(const Node* n, int rank) {
  const Attribute* keep = n->attribute("keepdims");
  if (keep && keep->i && *keep->i != 1) return "ReduceMean has keepdims = 0";
  std::vector<int64_t> axes;
  if (const Attribute* a = n->attribute("axes")) {
    axes = a->ints;
  } else if (n->inputs().size() > 1 && n->inputs()[1]) {
    auto v = constant_ints(n->inputs()[1]);
    if (!v) return "ReduceMean's axes are not a constant";
    axes = *v;
  } else {
    return "ReduceMean reduces every axis (no axes)";
  }
  if (axes.size() != 1) return "ReduceMean reduces more than one axis";
  if (axes[0] == -1 || (rank > 0 && axes[0] == rank - 1)) return std::nullopt;
  return "ReduceMean's axis is not the last one";
}

// float -> IEEE half bits, round to nearest even (overflow to inf).
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (abs < 0x38800000u) {                                               // subnormal half (or zero)
    float a;
    std::memcpy(&a, &abs, 4);
    const float scaled = a * 16777216.0f;  // 2^24: units of the smallest subnormal
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  uint32_t mant = abs + 0xc8000000u;     // rebias exponent 127 -> 15 (shifted by 13)
  mant += 0x0fffu + ((abs >> 13) & 1u);  // round to nearest even
  return static_cast<uint16_t>(sign | (mant >> 13));
}

// The elements of `t` re-encoded as `dtype` (float, float16 or double); null when `t` is not a
// numeric tensor of at most `max_elements`.
inline std::shared_ptr<Tensor> convert_tensor(const Tensor& t, int32_t dtype,
                                              uint64_t max_elements = uint64_t{1} << 24) {
  auto values = tensor_doubles(t, max_elements);
  if (!values) return nullptr;
  std::string bytes;
  for (double v : *values) {
    if (dtype == kFloat) {
      const float f = static_cast<float>(v);
      bytes.append(reinterpret_cast<const char*>(&f), 4);
    } else if (dtype == kDouble) {
      bytes.append(reinterpret_cast<const char*>(&v), 8);
    } else if (dtype == kFloat16) {
      const uint16_t h = float_to_half(static_cast<float>(v));
      bytes.append(reinterpret_cast<const char*>(&h), 2);
    } else {
      return nullptr;
    }
  }
  return make_tensor(dtype, t.dims, std::move(bytes));
}

// A 1-D constant of `size` elements as a scale/bias input of dtype `dtype`: the value itself when
// its dtype already matches (no copy), else a converted initializer. Fails with a reason.
struct ScaleResult {
  Value* value = nullptr;
  bool converted = false;
  std::string error;
};
inline ScaleResult scale_input(pattern::Rewriter& rw, Value* v, int64_t size, int32_t dtype,
                               const std::string& what) {
  auto t = constant_tensor(v);
  if (!t) return {nullptr, false, what + " is not a constant"};
  if (t->dims.size() != 1) return {nullptr, false, what + " is not 1-D"};
  if (t->dims[0] != size) return {nullptr, false, what + "'s size differs from the normalized dim"};
  if (t->dtype() == dtype) return {v, false, ""};
  auto converted = convert_tensor(*t, dtype);
  if (!converted) {
    return {nullptr, false, what + " cannot be converted to " + dtype_name(dtype)};
  }
  return {rw.initializer(v->name(), converted), true, ""};
}

// axis -1, epsilon, stash_type 1 (fp32 compute): the attributes of every norm these passes emit.
inline std::vector<Attribute> norm_attrs(double epsilon) {
  std::vector<Attribute> a;
  a.push_back(pattern::attr_int("axis", -1));
  a.push_back(pattern::attr_float("epsilon", static_cast<float>(epsilon)));
  a.push_back(pattern::attr_int("stash_type", 1));
  return a;
}

// A 1-D tensor of ones (the scale of a norm without a weight).
inline std::shared_ptr<Tensor> ones(int32_t dtype, int64_t size) {
  auto one = make_float_tensor(std::vector<float>(static_cast<size_t>(size), 1.0f), {size});
  return dtype == kFloat ? one : convert_tensor(*one, dtype);
}

}  // namespace fastopt::passes::norm
