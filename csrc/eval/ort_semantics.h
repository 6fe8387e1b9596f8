// Integer semantics of ONNX Runtime's CPU kernels where ONNX's spec and C++ leave room: Slice
// bounds (ORT reads an end of INT32_MAX / INT64_MAX as "to the end" whatever the step's sign),
// Range lengths (exact, where limit - start overflows too), integer division (INT_MIN / -1
// traps). The evaluator (csrc/eval), the shape analysis (csrc/analysis) and fold_shapes share
// these, so a folded value is the one the runtime computes, or nothing is folded.
// Checked against ORT 1.32 by tests/fold/test_fold_semantics.py.
#pragma once

#include <cstdint>
#include <optional>

namespace fastopt::eval::ort {

// One axis of a Slice: ORT's first index and element count.
struct SliceAxis {
  int64_t start = 0;
  int64_t count = 0;
  // ONNX's spec (and its reference implementation) selects the same elements. They differ for
  // an end of INT32_MAX or INT64_MAX with a negative step (ORT: to the beginning; the spec
  // clamps it to dim - 1: nothing) and for a negative step over an empty axis.
  bool spec_agrees = true;
};

// x[start:end:step] over an axis of `dim` (>= 0) elements; step != 0 (opset < 10: step 1).
SliceAxis slice_axis(int64_t dim, int64_t start, int64_t end, int64_t step);

// The length of Range(start, limit, delta) for the integer element type `dtype` (int16, int32,
// int64; other types: nullopt): ceil((limit - start) / delta) computed exactly, as ORT 1.32 does
// (older kernels divided in doubles); nullopt for delta 0 (ORT fails) or a length past int64.
std::optional<int64_t> range_count(int32_t dtype, int64_t start, int64_t limit, int64_t delta);

// a / b (truncated) in the signed integer type `dtype` (values already in its range), or
// nullopt where ORT fails or traps: b == 0, and MIN / -1 for int32 and int64 (SIGFPE; narrower
// types are promoted to int, where -128 / -1 is 128, which wraps back to -128).
std::optional<int64_t> divide(int32_t dtype, int64_t a, int64_t b);

// `v` wrapped into the integer type `dtype` (two's complement, as ORT's static_cast does);
// `v` itself for int64 and non-integer types.
int64_t wrap_to(int32_t dtype, int64_t v);

}  // namespace fastopt::eval::ort
