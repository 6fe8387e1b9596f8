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
#include "passes/fusion_util.h"
#include "pattern/rewrite.h"

namespace fastopt::passes::norm {

using passes::dims_of;  // (fusion_util.h)

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

// ReduceMean over the last axis only, keepdims = 1 (0 with `keepdims` false; axes as attribute
// before opset 18, as a constant input from 18 on). `rank` is the input's rank, or -1 when unknown.
inline std::optional<std::string> check_last_axis_mean(const Node* n, int rank,
                                                       bool keepdims = true) {
  const Attribute* keep = n->attribute("keepdims");
  const bool kept = !keep || !keep->i || *keep->i != 0;
  if (kept != keepdims) return keepdims ? "ReduceMean has keepdims = 0" : "ReduceMean keeps dims";
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
