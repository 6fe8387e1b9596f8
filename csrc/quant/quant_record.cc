#include "quant/quant_record.h"

#include <utility>

#include "ir/dtype.h"

namespace fastopt::quant {

QuantRecord kept_record(const Value* weight, const Node* node, std::string reason,
                        const Tensor* tensor) {
  QuantRecord r;
  r.weight = weight ? weight->name() : "";
  r.node = node ? node->name.value : "";
  r.op = node ? node->op_type : "";
  r.reason = std::move(reason);
  if (tensor) {
    r.dtype_before = dtype_name(tensor->dtype());
    r.bytes_before = r.bytes_after = tensor->nbytes();
  }
  return r;
}

QuantRecord quantized_record(const std::string& weight, const Node* node, uint64_t bytes_before,
                             const ErrorSums& e) {
  QuantRecord r;
  r.weight = weight;
  r.node = node ? node->name.value : "";
  r.op = node ? node->op_type : "";
  r.quantized = true;
  r.bytes_before = bytes_before;
  r.max_rel_error = e.max_abs > 0 ? static_cast<double>(e.max_err) / e.max_abs : 0.0;
  r.mean_rel_error = e.abs > 0 ? e.abs_err / e.abs : 0.0;
  r.rel_mse = e.rel_mse();
  return r;
}

}  // namespace fastopt::quant
