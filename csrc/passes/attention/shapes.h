// The attention family's shape helpers (one set for fusion, lowering and the KV cache).
//
// Reasoning about the sizes of attention tensors when shape inference left them symbolic or
// unknown (it fails on TorchScript head splits, whose Reshape targets are computed from Shape
// ops). Sizes are read from value types first, then worked out through the ops that produced
// the value: Transpose, Reshape targets built by Concat/Unsqueeze/Gather(Shape) chains, Slice,
// elementwise broadcasts.
#pragma once

#include <cstddef>
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

// ---- from value types alone (symbolic dims included) ----

// Dim `axis` of the type recorded on `v` when that type has `rank` dims, else null.
const Dim* dim_at(const Value* v, size_t rank, size_t axis);
// Both dims present and the same (a value, or one symbol); false when either is null.
bool same_dim(const Dim* a, const Dim* b);

// ---- through producers ----

// A node of the default domain ("" or "ai.onnx").
bool is_standard(const Node* n);

// Which dim a 1-element int64 value copies: the z of Shape(z) with *index set, when `v` is
// Unsqueeze(Gather(Shape(z), i scalar)), Gather(Shape(z), [i]), Slice(Shape(z), [i], [i+1]) or
// Shape(z, start=i, end=i+1); else null. (shape_element above gives the value, this the source.)
const Value* shape_dim_source(const Value* v, int64_t* index);

// Whether only shapes are read from `v`, apart from `replaced` (a node being rewritten): every
// use is a Shape, or a Reshape (data input) or Transpose whose output is in turn read only for
// its shape.
bool read_only_for_shape(const Value* v, const Node* replaced);

}  // namespace fastopt::passes
