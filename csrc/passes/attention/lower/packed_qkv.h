// Packed QKV for com.microsoft Attention (encoders; lower_attention_ort.cc says when it is used):
//
//   x -MatMul(Wq)(+bq)?- q3 -split- Q -+
//   x -MatMul(Wk)(+bk)?- k3 -split- K -+- Attention ==>  Attention(x, [Wq|Wk|Wv], [bq|bk|bv],
//   x -MatMul(Wv)(+bv)?- v3 -split- V -+                    -, -, bias; num_heads, scale,
//                                mask? -+                    unidirectional?, qkv_hidden_sizes?)
//
// Weights must be constant 2-D of Q's dtype, biases 1-D (a missing one packs as zeros: the one
// place bytes are copied, into two new initializers). The projections must feed nothing but the
// head split, or only shapes besides it (which then read x: same shape when the weight is
// square), so that they go dead.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes {

// One projection of the shared input: out = MatMul(x, w) (+ Add(b) of a 1-D constant)?.
struct Projection {
  Value* x = nullptr;
  Value* out = nullptr;  // the 3-D value the head split reads
  std::shared_ptr<const Tensor> w, b;
  int64_t n() const { return w->dims[1]; }
};

// Q, K, V (inputs 0-2 of the internal Attention `node` in `g`) projected from one 3-D input by
// constant weights (Hq == Hkv == heads checked by the caller): the projections (q, k, v order),
// or nullopt with *why.
std::optional<std::vector<Projection>> packed_qkv(const Graph& g, const Node* node, int64_t heads,
                                                  int32_t dtype, std::string* why);

// Builds Attention(x, packed weight, packed bias, -, -, bias?) for `node` from packed_qkv's
// projections; readers of a projection's shape alone move to x. Returns the (B, S, Hq*Dv) output.
Value* build_packed_attention(pattern::Rewriter& rw, const Node* node,
                              const std::vector<Projection>& ps, int64_t heads, float scale,
                              bool causal, Value* bias);

}  // namespace fastopt::passes
