// Reasoning about the sizes of attention tensors when shape inference left them symbolic or
// unknown (it fails on TorchScript head splits, whose Reshape targets are computed from Shape
// ops). Sizes are read from value types first, then worked out through the ops that produced
// the value: Transpose, Reshape targets built by Concat/Unsqueeze/Gather(Shape) chains, Slice,
// elementwise broadcasts.
#pragma once

#include <cstdint>
#include <optional>

#include "ir/graph.h"

namespace fastopt::passes {

// Size of dimension `axis` (negative counts from the end) of `v`, or nullopt when unknown.
std::optional<int64_t> resolve_dim(const Value* v, int axis);

// Element `index` of a 1-D int64 shape tensor (a constant, or a Concat of constant and
// Shape-derived pieces), or nullopt.
std::optional<int64_t> shape_element(const Value* shape, int index);

// Number of elements of a 1-D shape tensor, or nullopt.
std::optional<int64_t> shape_length(const Value* shape);

// Element type / rank of `v` from its type, else from its producers (values made by earlier
// fusions, e.g. a fused RotaryEmbedding's output, carry no type). 0 / -1 when unknown.
int32_t dtype_of(const Value* v);
int rank_of(const Value* v);

}  // namespace fastopt::passes
