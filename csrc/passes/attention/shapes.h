// The attention family's questions about sizes, asked of the one shape analysis
// (analysis/shape_facts.h): dtype, rank, a dim, an element of a shape tensor, "the same length".
//
// Values of the main graph are answered by the model's memoized ShapeFacts (symbolic dims,
// Reshape targets computed from Shape ops, -1 resolved, equality of dims through every op it has
// a rule for); values of subgraphs and functions, which it does not analyse, by their declared
// types and constants alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "ir/graph.h"

namespace fastopt::passes {

// Element type / rank of `v`; 0 / -1 when unknown.
int32_t dtype_of(const Value* v);
int rank_of(const Value* v);

// Size of dimension `axis` (negative counts from the end) of `v`, or nullopt when not a known
// number.
std::optional<int64_t> resolve_dim(const Value* v, int axis);

// Element `index` (negative from the end) of a 1-D integer shape tensor, or nullopt when not a
// known number.
std::optional<int64_t> shape_element(const Value* shape, int index);

// Number of elements of a shape tensor, or nullopt.
std::optional<int64_t> shape_length(const Value* shape);

// Dim `axis_a` of `a` and `axis_b` of `b` are proven equal (the same number, or the same symbolic
// expression). With `rank` > 0 both values must have that rank. False when either is unknown.
bool same_length(const Value* a, int axis_a, const Value* b, int axis_b, int rank = 0);

// A node of the default domain ("" or "ai.onnx") with well-typed attributes.
bool is_standard(const Node* n);

// The producer of `v` when it is a default-domain `op` with one output and no omitted inputs
// (and `arity` inputs, when not 0), else null.
Node* standard_producer(const Value* v, const char* op, size_t arity = 0);

// Whether only shapes are read from `v`, apart from `replaced` (a node being rewritten): every
// use is a Shape, or a Reshape (data input) or Transpose whose output is in turn read only for
// its shape.
bool read_only_for_shape(const Value* v, const Node* replaced);

}  // namespace fastopt::passes
