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

// Flat heads (bloom's baddbmm; heads folded into the batch, deberta-v2 too): the pieces
// fuse_attention's walk and its Reshape-rooted rule call, kept here with the proofs they need.
//
// The flat rule's candidate: `root` = Reshape(MatMul(Reshape(probs4 [-> Cast]), v3)) with a
// Softmax under probs4; the MatMul, or null when `root` is no candidate.
Node* flat_candidate(Node* root);
// Why the flat output (the candidate MatMul's, read by `root`) cannot go: a graph output, or
// read by anything but `root` and Shape nodes; empty when it can.
std::string flat_output_refusal(const Value* flat, const Node* root);
// Whether Shape reads of the flat output may read flat Q `q3` instead (the same (B*H, S, D)
// when Dv == D, as TorchScript's head merge reads it).
bool flat_output_shape_is_q3(const Value* flat, const Value* q3, analysis::ShapeFacts& facts);
// Whether the flat rule's root output `out` is (B, H, S, Dv) of Q and V (y replaces it as is).
bool flat_output_is_4d(const Value* out, const Value* q, const Value* v,
                       analysis::ShapeFacts& facts);
// After the rewrite: Shape reads of the flat output (`root`'s input 0) read `q3` instead.
void shape_reads_to_q3(Node* root, Value* q3);
// Why the walk refuses intermediate `x` read by `user` outside the attention; for flat heads it
// names deberta-v2's disentangled attention (Q/K also feeding score terms not proven its own).
std::string intermediate_use_refusal(const Value* x, const Node* user, bool flat);
// K^T of flat heads, Transpose(k3, (0, 2, 1)): the Transpose, or null.
Node* flat_kt_transpose(const Value* kt);
// The flat scores' views: scores3 (B*H, S, T) -Reshape-> scores4 (B, H, S, T) [Softmax] probs4
// -Reshape-> probs3 (B*H, S, T), H = dim 1 of `q`. Empty when the Reshapes split and merge
// (B, H) head for head and `bias` (on scores3, or null) has a 4-D form (*bias_form), else why.
std::string check_flat_views(const Value* scores3, const Value* scores4, const Value* probs4,
                             const Value* probs3, const Value* q, const Value* bias,
                             FlatBias* bias_form, int64_t opset, analysis::ShapeFacts& facts);

// ALiBi's terms on the scores as fuse_attention's walk meets them.
// A second additive term `bias` on scores of dtype `score_dtype` (flat: the scores are 3-D):
// empty when it can be the bias, else why.
std::string bias_refusal(const Value* bias, int32_t score_dtype, bool flat);
// masked_fill, Where(masked (bool), value <= masked_below, scores): empty when `w` is one that
// fuses (not on flat scores), else why.
std::string masked_fill_refusal(const Node* w, bool flat, double masked_below);

// The internal op's additive mask from a bias and the export's mask:
//   additive mask m      -> Add(bias, m)
//   masked_fill (cond c: true = masked, value neg) -> Where(c, neg, bias)
//   no mask              -> bias
Value* combine(pattern::Rewriter& rw, Value* bias, Value* additive_mask, Value* masked_cond,
               Value* masked_value);

}  // namespace fastopt::passes::alibi
