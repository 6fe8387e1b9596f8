// Attention sinks (gpt-oss): one learned logit per head that joins every row's softmax and is
// dropped after it, so that a row may put weight on "no key". Both torch.onnx exporters write
// HF's eager form:
//
//   scores (B,H,S,T) --+
//                      Concat(axis -1) -> [Sub(x, ReduceMax(x, -1))] -> Softmax(-1)
//   Expand(sinks (1,H,1,1), (B,H,S,1)) -+                                  |
//                                                        Slice(axis -1, 0 : -1) -> MatMul(., V)
//
// i.e. p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h)) over the T keys. GroupQueryAttention's
// head_sink input computes exactly this in ONNX Runtime 1.32 (CPU: max diff 9e-8 against the
// formula), so the internal op carries the logits as its input 4, `sinks` (Hq), in Q's dtype.
// A row whose every key is masked (-inf, or a value absorbing the scores) puts all its weight
// on the sink and gives 0, the internal op's default for such rows.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes::attention_sinks {

struct Sinks {
  Node* softmax = nullptr;   // the Softmax over [scores, sink]
  Value* scores = nullptr;   // the Concat's first input (B, H, S, T)
  Value* logits = nullptr;   // the constant sink column's source, (1, H, 1, 1) or (H, 1, 1)
  std::vector<Node*> nodes;  // Slice, Softmax, [Sub, ReduceMax], Concat, [Expand]
};

// `probs` = Slice(Softmax([Sub(x, ReduceMax(x))] x = Concat(scores, column)), 0 : -1 on the last
// axis) with a constant per-head column: the match; nullopt when `probs` is no Slice at all;
// `why` says what did not fit when it is one and the rest is not the form above.
std::optional<Sinks> match_sinks(Value* probs, std::string& why);

// The sink logits as a 1-D (H) tensor of `dtype` (the constant's own bytes), or null when the
// constant's dtype differs or it does not hold `heads` values.
std::shared_ptr<Tensor> head_logits(const Value* logits, int32_t dtype, int64_t heads);

// softmax over [s, sink_h] on the last axis with the sink's column dropped: the probabilities
// over the keys (decompose_attention's form, as the exporters write it).
Value* softmax_with_sinks(pattern::Rewriter& rw, Value* s, Value* sinks);

}  // namespace fastopt::passes::attention_sinks
