// What a quantization pass did to one weight: the per-weight line of the quantization report.
// Every quant pass (quantize_weights, quantize_dynamic, convert_precision) appends one record per
// weight it looked at to PassContext::quant_records, kept or quantized; Python surfaces them as
// OptimizeReport.quantization and QuantizeReport.weights.
#pragma once

#include <cstdint>
#include <string>

#include "ir/graph.h"
#include "quant/blockwise.h"

namespace fastopt::quant {

struct QuantRecord {
  std::string weight;  // initializer name
  std::string node;    // the node reading it (the first one when shared)
  std::string op;      // what the node became, e.g. "MatMulNBits"; the node's op when kept
  bool quantized = false;
  std::string reason;        // why it was kept ("" when quantized)
  std::string dtype_before;  // "float32", "float16", ...
  std::string dtype_after;   // "int4", "uint4", "int8", "float16", ... ("" when kept)
  uint64_t bytes_before = 0;
  uint64_t bytes_after = 0;  // quantized data + scales + zero points (bytes_before when kept)
  // Reconstruction error of the dequantized weight w' against w, relative to the weight's scale:
  // max |w - w'| / max |w| and mean |w - w'| / mean |w| (0 when kept).
  double max_rel_error = 0;
  double mean_rel_error = 0;
  // sum k,n imp[k] (w - w')^2 / sum k,n imp[k] w^2 (imp = 1 without quant_importance): the
  // relative weighted mean squared error the search minimises (0 when kept).
  double rel_mse = 0;
};

// A weight left as it is: bytes unchanged; `node` (may be null) is its reader, `tensor` (may be
// null) gives its dtype and size.
QuantRecord kept_record(const Value* weight, const Node* node, std::string reason,
                        const Tensor* tensor);
// A weight the pass rewrote, read by `node`: name, node, bytes before and the relative errors
// from the kernel's sums; the caller sets op, dtypes and bytes_after.
QuantRecord quantized_record(const std::string& weight, const Node* node, uint64_t bytes_before,
                             const ErrorSums& error);

}  // namespace fastopt::quant
