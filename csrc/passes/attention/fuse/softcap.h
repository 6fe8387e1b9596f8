// Logit soft-capping (gemma2's attn_logit_softcapping) as both torch.onnx exporters write it:
//
//   s (scaled scores) -> Div(c) | Mul(1/c) -> Tanh -> Mul(c) -> [Add(mask)] -> Softmax
//
// i.e. c * tanh(s / c), applied after the scale and before the mask. GroupQueryAttention's and
// Attention-23's `softcap` attribute compute exactly this in ONNX Runtime 1.32
// (tests/ort_behaviour/test_softcap_order.py; bench/results/softcap.md), so the internal op carries
// it as `softcap` = c.
#pragma once

#include <optional>
#include <vector>

#include "ir/graph.h"

namespace fastopt::passes::attention_softcap {

struct Softcap {
  double cap = 0;            // c > 0
  Value* capped = nullptr;   // s: what the cap is applied to
  std::vector<Node*> nodes;  // Mul, Tanh, Div|Mul (from the output back)
};

// `x` = Mul(Tanh(Div(s, c) | Mul(s, 1/c)), c) (Mul inputs in either order) with c one positive
// finite constant: the cap and s. nullopt when `x` is anything else.
std::optional<Softcap> match_softcap(Value* x);

}  // namespace fastopt::passes::attention_softcap
