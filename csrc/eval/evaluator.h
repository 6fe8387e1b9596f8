// The native evaluator: the ops exporters use in shape and index computations, evaluated on
// constant tensors in C++, bit-exact with ONNX Runtime's CPU kernels or declined. Used by
// constant folding (passes/fold/fold_constants.h), the mask proofs of the KV-cache rewrite and the
// bindings (for the ONNX Runtime fallback).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace fastopt::eval {

struct FoldLimits {
  uint64_t max_bytes = 1 << 20;  // no folded output is larger than this
  // An output larger than all its inputs together (ConstantOfShape, Expand, Range, broadcasts)
  // is folded only up to this size: a small constant is never expanded into a big one.
  uint64_t max_expand_bytes = 64 << 10;
  // float16 Add/Sub/Mul, and Cast to float16 from bool, float or an integer of magnitude up to
  // 2048, computed natively. Each result is exact in double and rounded once to float, then to
  // half (round to nearest even): ONNX Runtime's float path gives the same bits, since 24 >=
  // 2 * 11 + 2 makes that double rounding innocuous. Off for folding, which leaves float16
  // arithmetic to the ONNX Runtime fallback; the mask proof turns it on (transformers 4.49
  // builds a float16 model's mask in float16: a bool cast to half, multiplied, added).
  bool half_arith = false;
  // True when an output of `out_bytes` computed from `in_bytes` of inputs is within the limits.
  bool allows(uint64_t out_bytes, uint64_t in_bytes) const {
    return out_bytes <= max_bytes && (out_bytes <= max_expand_bytes || out_bytes <= in_bytes);
  }
};

// Why evaluate_node declined a node whose value it could compute: ONNX Runtime fails or traps on
// it, or its result is undefined or differs from ONNX's spec. `code` names the reason in counters
// ("refused_<Op>(<code>)"), `text` explains it (--explain).
struct Refusal {
  std::string code;
  std::string text;
};

// Op types (ai.onnx) that evaluate_node implements.
const std::vector<std::string>& native_fold_ops();

// The outputs of `n` (an ai.onnx node of a graph at `opset`) when every input is a constant, the
// op and its types have a native implementation, and the outputs are within `limits`; nullopt
// otherwise. Results are bit-exact with ONNX Runtime's CPU kernels: ops whose rounding could
// differ (float16 arithmetic, float Range) are left to the ONNX Runtime fallback: for those,
// `unsupported` (if given) is set to true, while the outputs were found to be within `limits`.
// Reshape-like ops return views of their input's bytes. Values on which ONNX Runtime fails,
// traps or disagrees with ONNX's spec are not folded: `refused` (if given) then says why.
std::optional<std::vector<std::shared_ptr<Tensor>>> evaluate_node(const Node& n, int64_t opset,
                                                                  const FoldLimits& limits,
                                                                  bool* unsupported = nullptr,
                                                                  Refusal* refused = nullptr);

// evaluate_node on the given input tensors (one per input of `n`, null for an absent one) instead
// of its constant inputs; nullopt also where evaluate_node would defer to ONNX Runtime.
std::optional<std::vector<std::shared_ptr<Tensor>>> evaluate_node_on(
    const Node& n, int64_t opset, const FoldLimits& limits,
    const std::vector<std::shared_ptr<const Tensor>>& inputs);

}  // namespace fastopt::eval
