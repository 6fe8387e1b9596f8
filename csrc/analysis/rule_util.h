// Helpers shared by the per-op shape rules (csrc/analysis/*_rules.cc).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "analysis/shape_facts.h"

namespace fastopt::analysis::rules {

std::optional<int64_t> attr_i(const Node& n, const char* name);
std::optional<std::vector<int64_t>> attr_is(const Node& n, const char* name);
// Axis normalized into [0, rank), or nullopt.
std::optional<int64_t> norm_axis(int64_t axis, int64_t rank);

// Multidirectional broadcast of the ranked inputs; nullopt when a rank is unknown.
std::optional<std::vector<DimExpr>> broadcast(RuleContext& ctx,
                                              const std::vector<const Facts*>& inputs);
// Elementwise on shape values (Add/Sub/Mul/Div/...): applies fn per element with broadcasting of
// one-element operands; nullopt when a side has no value or fn fails.
using ValueFn = std::optional<DimExpr> (*)(const DimExpr&, const DimExpr&);
std::optional<std::vector<DimExpr>> elementwise_value(const Facts& a, const Facts& b, ValueFn fn);

// Output = input 0's facts with another dtype (or the same when 0).
Facts same_as(const Facts& f, int32_t dtype = 0);
// The product of dims (nullopt on overflow / limits).
std::optional<DimExpr> product(const std::vector<DimExpr>& dims, size_t begin, size_t end);
// Sets a rank-r output of fresh dims.
Facts fresh_ranked(RuleContext& ctx, int32_t dtype, size_t rank);

using RuleTable = std::vector<std::pair<const char*, OpRule>>;
// Each rules file adds its ops (default domain / com.microsoft / fastopt's internal domain).
void add_shape_rules(RuleTable& onnx);
void add_math_rules(RuleTable& onnx);
void add_routing_rules(RuleTable& onnx);
void add_contrib_rules(RuleTable& microsoft);
void add_attention_rules(RuleTable& onnx, RuleTable& internal);

}  // namespace fastopt::analysis::rules
