// ALiBi attention (bloom, mpt): the pieces fuse_attention needs beyond the sdpa forms.
//
// Both families add a bias slopes[h] * key_position to the scores besides the causal/padding
// mask, and neither calls sdpa, so the exporters write their eager attention:
//
//   bloom (baddbmm over flat heads, both exporters):
//     q3 = Reshape(q (B,H,S,D), (B*H,S,D))   k3t = Transpose(Reshape(k, (B*H,T,D)), (0,2,1))
//     s3 = Add(Mul(MatMul(q3, k3t), c), alibi (B*H,1,T))      alibi from cumsum(attention_mask)
//     p  = Softmax(Add(Reshape(s3, (B,H,S,T)), Where(allowed, 0, lowest)))  [Cast fp32 / back]
//     y  = Reshape(MatMul(Reshape(p, (B*H,S,T)), Reshape(v, (B*H,T,D))), (B,H,S,D))
//   mpt (4-D; masked_fill):
//     p  = Softmax(Where(masked, lowest, Add(Mul(MatMul(q, kt), c), Slice(table (H,1,L)))))
//
// The bias is kept as it is computed (a graph value: bloom's positions come from the mask's
// cumsum, so right-padded and holed rows keep their exact positions), reshaped to 4-D where the
// scores are flat, and folded into the internal op's additive mask: mask' = bias + mask (or
// Where(masked, lowest, bias) for masked_fill). For every key the mask keeps the sum is the
// export's own, so the scores match exactly; masked keys stay at the masking value (or that plus
// a bias, which exp() still takes to 0).
#pragma once

#include <string>

#include "analysis/shape_facts.h"
#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes::alibi {

// x4 (B, H, L, D) when `x3` is Reshape(x4) to (B*H, L, D) (proven by shape facts), else null.
// `reshape` receives the Reshape node.
Value* unflatten_heads(Value* x3, analysis::ShapeFacts& facts, Node** reshape);

// Whether `x4` = Reshape(x3) splits (B*H, S, T) into (B, H, S, T) with H = `heads` (dim 1 of
// `heads_of`): the flat scores' view as 4-D scores, head for head.
bool splits_heads(const Value* x3, const Value* x4, const Value* heads_of,
                  analysis::ShapeFacts& facts);
// Whether `x3` = Reshape(x4) merges (B, H, S, T) into (B*H, S, T).
bool merges_heads(const Value* x4, const Value* x3, analysis::ShapeFacts& facts);

// How a bias added to flat (B*H, S, T) scores becomes (B|1, H|1, ., T): kReshape when its dim 0
// is B*H, kUnsqueeze when it is 1; kNone (with *why) when neither is proven.
enum class FlatBias { kNone, kReshape, kUnsqueeze };
FlatBias flat_bias_form(const Value* bias3, const Value* scores3, analysis::ShapeFacts& facts,
                        std::string* why);
// Builds the 4-D bias for `form` (heads = H).
Value* bias_4d(pattern::Rewriter& rw, Value* bias3, FlatBias form, int64_t heads);

// The internal op's additive mask from a bias and the export's mask:
//   additive mask m      -> Add(bias, m)
//   masked_fill (cond c: true = masked, value neg) -> Where(c, neg, bias)
//   no mask              -> bias
Value* combine(pattern::Rewriter& rw, Value* bias, Value* additive_mask, Value* masked_cond,
               Value* masked_value);

}  // namespace fastopt::passes::alibi
