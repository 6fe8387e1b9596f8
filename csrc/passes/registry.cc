#include "passes/registry.h"

#include <algorithm>

#include "ir/error.h"

namespace fastopt::passes {

namespace {
std::vector<PassInfo>& registry() {
  static std::vector<PassInfo> passes;
  return passes;
}
}  // namespace

const std::vector<PassInfo>& all_passes() {
  return registry();
}

const PassInfo* find_pass(const std::string& name) {
  for (const auto& p : registry()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

PassRegistrar::PassRegistrar(PassInfo info) {
  if (find_pass(info.name)) throw ModelError("pass '" + info.name + "' registered twice");
  registry().push_back(std::move(info));
}

PassInfo rule_pass(std::string name, std::string description, std::vector<std::string> tags,
                   std::function<std::vector<pattern::Rule>(PassContext&)> make_rules) {
  PassInfo info;
  info.name = name;
  info.description = std::move(description);
  info.tags = std::move(tags);
  info.run = [make_rules](Model& m, PassContext& ctx) -> int64_t {
    std::vector<pattern::Rule> rules = make_rules(ctx);
    pattern::ApplyOptions o;
    o.max_iterations = ctx.max_iterations;
    o.explain_rule = ctx.explain_rule;
    o.explain_lines = ctx.explain_rule.empty() ? nullptr : &ctx.explain_lines;
    pattern::ApplyStats stats = pattern::apply_rules(m, rules, o);
    for (const auto& kv : stats.per_rule) ctx.counters[kv.first] += kv.second;
    return stats.rewrites;
  };
  info.rule_names = [make_rules] {
    std::vector<std::string> names;
    for (Target target : {Target::kOrt, Target::kOnnx}) {  // a target may add or drop rules
      PassContext ctx;
      ctx.target = target;
      for (const auto& r : make_rules(ctx)) {
        if (std::find(names.begin(), names.end(), r.name) == names.end()) names.push_back(r.name);
      }
    }
    return names;
  };
  return info;
}

Target parse_target(const std::string& name) {
  if (name == "ort") return Target::kOrt;
  if (name == "onnx") return Target::kOnnx;
  throw ModelError("unknown target '" + name + "': choose ort or onnx");
}

int64_t default_opset(const Model& m) {
  for (const auto& o : m.opset_import) {
    if (o.domain.value.empty() || o.domain.value == "ai.onnx") return o.version.value_or(0);
  }
  return 0;
}

}  // namespace fastopt::passes
