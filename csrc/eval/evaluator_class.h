// The evaluator of one node, shared by the files that implement its ops (evaluator.cc,
// shape_ops.cc, arith_ops.cc). Internal to csrc/eval; callers use evaluator.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "eval/evaluator.h"
#include "eval/ort_semantics.h"
#include "eval/tensor_data.h"

namespace fastopt::eval {

class Evaluator {
 public:
  Evaluator(const Node& n, int64_t opset, const FoldLimits& limits,
            const std::vector<std::shared_ptr<const Tensor>>* given = nullptr)
      : n_(n), opset_(opset), limits_(limits), given_(given) {}

  bool declined_for_types() const { return unsupported_; }
  const std::optional<Refusal>& refusal() const { return refusal_; }

  Result run();

 private:
  // Reads every present input as a constant (or from `given_`); false when one is not.
  bool read_inputs();
  // The evaluation of n_'s op type.
  Result dispatch();

  // ---- helpers ----
  std::optional<Arr> in(size_t i, bool need_bytes = true) const {
    if (i >= inputs_.size() || !inputs_[i]) return std::nullopt;
    return to_arr(inputs_[i], need_bytes);
  }
  bool has_input(size_t i) const { return i < inputs_.size() && inputs_[i]; }
  std::optional<std::vector<int64_t>> ints_in(size_t i) const {
    if (!has_input(i)) return std::nullopt;
    return tensor_ints(*inputs_[i], 1 << 16);
  }
  std::optional<int64_t> attr_i(const char* name) const {
    const Attribute* a = n_.attribute(name);
    if (!a || !a->i) return std::nullopt;
    return *a->i;
  }
  std::optional<std::vector<int64_t>> attr_ints(const char* name) const {
    const Attribute* a = n_.attribute(name);
    if (!a || a->kind() != AttrType::kInts) return std::nullopt;
    return a->ints;
  }
  bool fits(int32_t dtype, const Dims& dims) const {
    auto n = checked_numel(dims);
    return n && limits_.allows(dtype_storage_bytes(dtype, *n), in_bytes_);
  }
  // A view (shared bytes) is free unless its source is used elsewhere too, when the file
  // would then hold both.
  bool view_fits(const Arr& a) const {
    Value* src = n_.inputs()[0];
    return src->uses().size() == 1 || a.tensor->nbytes() <= limits_.max_bytes;
  }
  static Result one(std::shared_ptr<Tensor> t) { return Tensors{std::move(t)}; }
  // Declines for lack of an implementation for these types (not for limits or bad values): the
  // ONNX Runtime fallback may evaluate the node.
  std::nullopt_t unsupported() {
    unsupported_ = true;
    return std::nullopt;
  }
  // Declines values whose result ONNX Runtime does not define, or defines otherwise than ONNX.
  std::nullopt_t refuse(std::string code, std::string text) {
    refusal_ = Refusal{std::move(code), std::move(text)};
    return std::nullopt;
  }
  // Normalizes an axis of a rank-`rank` tensor; nullopt when out of range.
  static std::optional<int64_t> axis(int64_t a, int64_t rank) {
    if (a < -rank || a >= rank) return std::nullopt;
    return a < 0 ? a + rank : a;
  }

  // ---- shapes and data movement (shape_ops.cc) ----
  Result shape();
  Result size();
  Result gather();
  Result gather_nd();
  std::optional<std::vector<int64_t>> axes_operand() const;
  Result unsqueeze();
  Result squeeze();
  Result flatten();
  Result reshape();
  Result concat();
  Result transpose();
  Result slice();
  Result where();
  Result expand();
  Result one_hot();
  Result constant_of_shape();
  Result range();

  // ---- triangles and scatters (triangle_scatter_ops.cc) ----
  Result trilu();
  Result scatter_nd();

  // ---- arithmetic (arith_ops.cc) ----
  enum class Kind { kArith, kCompare, kLogic, kMinMax };
  Result cast();
  static bool in_range(double t, int32_t to);
  Result unary();
  Result elementwise();

  const Node& n_;
  int64_t opset_;
  const FoldLimits& limits_;
  const std::vector<std::shared_ptr<const Tensor>>* given_;  // inputs in place of constants
  std::vector<std::shared_ptr<const Tensor>> inputs_;
  uint64_t in_bytes_ = 0;
  bool unsupported_ = false;
  std::optional<Refusal> refusal_;
};

}  // namespace fastopt::eval
