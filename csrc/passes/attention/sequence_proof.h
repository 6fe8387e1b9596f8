// Sequence-length proofs from the graph, for the lowerings: TorchScript exports lose the dims
// that would show them in the types.
//
// The walk: Q and K of a self-attention both go back to one hidden state X through ops that
// keep its length (head split Reshape whose target's dim 1 is 0 or Shape(X)[1], Transpose,
// RotaryEmbedding, norms, Cast, MatMul by a 2-D weight, arithmetic with a rank <= 1 constant,
// Slice/Split/Concat of the last axis). Cross-attention (K from another input) or a Slice of the
// sequence axis stops the proof.
#pragma once

#include "ir/graph.h"

namespace fastopt::passes {

// S == T of a self-attention: Q (B, Hq, S, D) and K (B, Hkv, T, D) reach one value with the
// length at the same axis.
bool same_sequence(const Value* q4, const Value* k4);

// A Reshape target Concat(Shape(z)[0], Shape(z)[1], ...) whose z provably has the leading dims
// (B, S) of the 3-D `x3`.
bool copies_leading_dims(const Value* target, const Value* x3);

}  // namespace fastopt::passes
