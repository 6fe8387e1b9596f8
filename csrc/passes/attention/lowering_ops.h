// Small builders the attention lowerings share: constants, and ops on values every layer
// reads (the mask, its shape) made once per graph.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes {

// A scalar (rank 0) of a float dtype (fp32/64/16, bf16); null for other dtypes.
std::shared_ptr<Tensor> scalar_tensor(int32_t dtype, double value);
// A constant for the rewrite: an initializer, or a Constant node inside a function body.
Value* constant(pattern::Rewriter& rw, const std::string& base, std::shared_ptr<Tensor> t);
// int64 (n) or, with `scalar`, rank 0.
Value* ints(pattern::Rewriter& rw, const std::vector<int64_t>& v, bool scalar = false);
Value* int32_scalar(pattern::Rewriter& rw, int32_t x);
// Scalar 0 or the lowest finite value of a float dtype.
Value* float_scalar(pattern::Rewriter& rw, int32_t dtype, bool lowest);
// An op on values every layer shares (the mask, its shape): an equal node that an earlier
// lowering made before this one is reused, so the bias / seqlens_k exist once per graph.
Value* shared_op(pattern::Rewriter& rw, const std::string& op, const std::vector<Value*>& inputs,
                 std::vector<Attribute> attrs = {});
// A Reduce* over `axes`: axes as an input from opset 18 (ReduceSum from 13), else an attribute.
Value* reduce(pattern::Rewriter& rw, const std::string& op, Value* x,
              const std::vector<int64_t>& axes, bool keepdims, bool shared = false);

}  // namespace fastopt::passes
