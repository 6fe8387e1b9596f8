// The native evaluator's entry points and its dispatch on the op type (see evaluator.h).
#include "eval/evaluator.h"

#include "eval/evaluator_class.h"
#include "ir/error.h"
#include "schema/attr_schema.h"

namespace fastopt::eval {

Result Evaluator::run() {
  for (size_t i = 0; i < n_.inputs().size(); ++i) {
    Value* v = n_.inputs()[i];
    if (!v) {
      inputs_.push_back(nullptr);
      continue;
    }
    auto t = given_ ? (i < given_->size() ? (*given_)[i] : nullptr) : constant_tensor(v);
    if (!t) return std::nullopt;
    inputs_.push_back(std::move(t));
    in_bytes_ += inputs_.back()->nbytes();
  }
  const std::string& op = n_.op_type;
  if (op == "Shape") return shape();
  if (op == "Size") return size();
  if (op == "Gather") return gather();
  if (op == "GatherND") return gather_nd();
  if (op == "Unsqueeze") return unsqueeze();
  if (op == "Squeeze") return squeeze();
  if (op == "Flatten") return flatten();
  if (op == "Reshape") return reshape();
  if (op == "Concat") return concat();
  if (op == "Cast" || op == "CastLike") return cast();
  if (op == "Slice") return slice();
  if (op == "Transpose") return transpose();
  if (op == "Where") return where();
  if (op == "Range") return range();
  if (op == "ConstantOfShape") return constant_of_shape();
  if (op == "Expand") return expand();
  if (op == "OneHot") return one_hot();
  if (op == "Trilu") return trilu();
  if (op == "ScatterND") return scatter_nd();
  if (op == "Neg" || op == "Abs" || op == "Not" || op == "Sqrt") return unary();
  return elementwise();
}

const std::vector<std::string>& native_fold_ops() {
  static const std::vector<std::string> ops = {
      "Abs",       "Add",       "And",         "Cast",
      "CastLike",  "Concat",    "Constant",    "ConstantOfShape",
      "Div",       "Equal",     "Expand",      "Flatten",
      "Gather",    "GatherND",  "Greater",     "GreaterOrEqual",
      "Identity",  "Less",      "LessOrEqual", "Max",
      "Min",       "Mul",       "Neg",         "Not",
      "OneHot",    "Or",        "Range",       "Reshape",
      "ScatterND", "Trilu",     "Shape",       "Size",
      "Slice",     "Sqrt",      "Squeeze",     "Sub",
      "Transpose", "Unsqueeze", "Where",       "Xor"};
  return ops;
}

std::optional<std::vector<std::shared_ptr<Tensor>>> evaluate_node(const Node& n, int64_t opset,
                                                                  const FoldLimits& limits,
                                                                  bool* unsupported,
                                                                  Refusal* refused) {
  if (unsupported) *unsupported = false;
  if (!standard_domain(n) || !n.subgraphs().empty() || n.outputs().size() != 1) {
    return std::nullopt;
  }
  // ORT refuses a node with a mistyped attribute: folding it would make the model valid.
  if (pattern::mistyped_attribute(n)) return std::nullopt;
  Evaluator e(n, opset, limits);
  try {
    auto r = e.run();
    if (unsupported) *unsupported = e.declined_for_types();
    if (refused && !r && e.refusal()) *refused = *e.refusal();
    return r;
  } catch (const ModelError&) {
    return std::nullopt;  // undecodable input bytes: leave the node alone
  }
}

std::optional<std::vector<std::shared_ptr<Tensor>>> evaluate_node_on(
    const Node& n, int64_t opset, const FoldLimits& limits,
    const std::vector<std::shared_ptr<const Tensor>>& inputs) {
  if (!standard_domain(n) || !n.subgraphs().empty() || n.outputs().size() != 1) {
    return std::nullopt;
  }
  Evaluator e(n, opset, limits, &inputs);
  try {
    auto r = e.run();
    if (e.declined_for_types()) return std::nullopt;
    return r;
  } catch (const ModelError&) {
    return std::nullopt;
  }
}

}  // namespace fastopt::eval
