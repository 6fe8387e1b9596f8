// The native evaluator's entry points and its dispatch on the op type (see evaluator.h).
#include "eval/evaluator.h"

#include <string>
#include <unordered_map>

#include "eval/evaluator_class.h"
#include "ir/error.h"
#include "schema/attr_schema.h"

namespace fastopt::eval {

bool Evaluator::read_inputs() {
  for (size_t i = 0; i < n_.inputs().size(); ++i) {
    Value* v = n_.inputs()[i];
    if (!v) {
      inputs_.push_back(nullptr);
      continue;
    }
    auto t = given_ ? (i < given_->size() ? (*given_)[i] : nullptr) : constant_tensor(v);
    if (!t) return false;
    inputs_.push_back(std::move(t));
    in_bytes_ += inputs_.back()->nbytes();
  }
  return true;
}

Result Evaluator::dispatch() {
  using Op = Result (Evaluator::*)();
  static const std::unordered_map<std::string, Op> ops = {
      {"Shape", &Evaluator::shape},         {"Size", &Evaluator::size},
      {"Gather", &Evaluator::gather},       {"GatherND", &Evaluator::gather_nd},
      {"Unsqueeze", &Evaluator::unsqueeze}, {"Squeeze", &Evaluator::squeeze},
      {"Flatten", &Evaluator::flatten},     {"Reshape", &Evaluator::reshape},
      {"Concat", &Evaluator::concat},       {"Cast", &Evaluator::cast},
      {"CastLike", &Evaluator::cast},       {"Slice", &Evaluator::slice},
      {"Transpose", &Evaluator::transpose}, {"Where", &Evaluator::where},
      {"Range", &Evaluator::range},         {"ConstantOfShape", &Evaluator::constant_of_shape},
      {"Expand", &Evaluator::expand},       {"OneHot", &Evaluator::one_hot},
      {"Trilu", &Evaluator::trilu},         {"ScatterND", &Evaluator::scatter_nd},
      {"Neg", &Evaluator::unary},           {"Abs", &Evaluator::unary},
      {"Not", &Evaluator::unary},           {"Sqrt", &Evaluator::unary},
  };
  auto it = ops.find(n_.op_type);
  return it != ops.end() ? (this->*(it->second))() : elementwise();
}

Result Evaluator::run() {
  if (!read_inputs()) return std::nullopt;
  return dispatch();
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
