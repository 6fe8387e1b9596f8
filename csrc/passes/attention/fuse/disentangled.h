// deberta-v2's disentangled attention (both exporters), on heads folded into the batch:
//
//   q3 = Reshape(q (B,H,S,D), (B*H,S,D))          k3 = Reshape(k (B,H,T,D), (B*H,T,D))
//   content = MatMul(q3, Transpose(k3) / c)        c = sqrt(D * scale_factor)
//   c2p = GatherElements(MatMul(q3, Transpose(pos_k)), c2p_index) / c
//   p2c = Transpose(GatherElements(MatMul(k3, Transpose(pos_q)), p2c_index)) / c
//   s4  = Reshape(content + (c2p + p2c), (B,H,S,T))      [TorchScript: (0 + c2p) + p2c]
//   y   = Reshape(MatMul(Reshape(Softmax(Where(masked, lowest, s4))), v3), (B,H,S,D))
//
// The content term is attention with scale 1/c; the position terms are a bias on the scores
// that the graph computes from the same flat Q and K and the relative embeddings (pos_k, pos_q
// are projections of them). fuse_attention's flat-heads rule (alibi.h) takes the sum as the
// attention bias, kept as it is computed: the scores are the export's own. What this file adds
// is the proof that Q's and K's other reads are those position terms and nothing else, so the
// fused op leaves no second attention behind.
#pragma once

#include "ir/graph.h"

namespace fastopt::passes::disentangled {

// Whether `user`, a reader of flat Q or K `x3`, computes a position term of `bias`:
//   MatMul(x3, r) -> GatherElements(axis -1) -> [Transpose(0,2,1)] -> [Mul|Div scalar]
//   -> Add ... -> bias
// with every value on the way read once (by the next step).
bool reads_for_position_term(const Value* x3, const Node* user, const Value* bias);

}  // namespace fastopt::passes::disentangled
