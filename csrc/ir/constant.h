// Reading constant values: initializers (that are not overridable graph inputs) and the outputs
// of Constant nodes. Passes and pattern constraints use these to look at small tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "ir/graph.h"

namespace fastopt {

// True when `v` is an initializer whose value cannot be overridden: not a graph input, or a
// graph input of a model with IR version < 4, where every initializer had to be listed as an
// input (ONNX Runtime treats those as constants too).
bool fixed_initializer(const Value* v);

// The tensor behind `v` when its value is fixed, or null.
std::shared_ptr<const Tensor> constant_tensor(const Value* v);

// Elements of a constant as doubles / int64s; nullopt when not constant, not numeric, or larger
// than `max_elements` (so callers never decode big weights by accident).
std::optional<std::vector<double>> constant_doubles(const Value* v, uint64_t max_elements = 64);
std::optional<std::vector<int64_t>> constant_ints(const Value* v, uint64_t max_elements = 64);
// A single-element constant.
std::optional<double> constant_scalar(const Value* v);

// Element type of `v` when known (from its type, its initializer, or a Constant producer), else 0.
int32_t value_dtype(const Value* v);
// Rank of `v` when known, else -1.
int value_rank(const Value* v);

// Like constant_tensor, without taking a reference: null for Constant nodes whose value is not a
// `value` tensor attribute (use constant_tensor for those).
const Tensor* constant_tensor_view(const Value* v);
// Decodes into `out` (reusing its storage); false when not numeric or over max_elements.
bool decode_doubles(const Tensor& t, uint64_t max_elements, std::vector<double>& out);

// Decodes a tensor's elements to double / int64 (numeric types only).
std::optional<std::vector<double>> tensor_doubles(const Tensor& t, uint64_t max_elements);
std::optional<std::vector<int64_t>> tensor_ints(const Tensor& t, uint64_t max_elements);

// IEEE half-precision bits -> float (exact).
float half_to_float(uint16_t h);
// float -> IEEE half bits, rounding to nearest even (overflow to inf, NaN stays NaN).
uint16_t float_to_half(float f);
// float_to_half of n floats (out[i] == float_to_half(in[i]) bit for bit), 8 at a time with the
// CPU's conversion (F16C) where it has one.
void floats_to_halves(const float* in, size_t n, uint16_t* out);
// half_to_float of n little-endian halves (any alignment), 8 at a time with F16C where the CPU
// has it (the same floats; NaNs stay NaN).
void halves_to_floats(const uint8_t* halves, size_t n, float* out);

// Builds a tensor owning `bytes` (little-endian elements).
std::shared_ptr<Tensor> make_tensor(int32_t dtype, std::vector<int64_t> dims, std::string bytes);
std::shared_ptr<Tensor> make_int64_tensor(const std::vector<int64_t>& values,
                                          std::vector<int64_t> dims);
std::shared_ptr<Tensor> make_float_tensor(const std::vector<float>& values,
                                          std::vector<int64_t> dims);

}  // namespace fastopt
