// The pass registry. A pass registers itself from its own file with a static PassRegistrar:
// adding a pass touches no central list.
#pragma once

#include <climits>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/graph.h"
#include "pattern/rewrite.h"
#include "quant/quant_record.h"

namespace fastopt::passes {

// What the optimized model is for: ONNX Runtime (its contrib ops allowed), or standard ONNX ops.
enum class Target { kOrt, kOnnx };
// "ort" or "onnx"; ModelError on another name.
Target parse_target(const std::string& name);

struct PassContext {
  Target target = Target::kOrt;
  int max_iterations = 10;
  std::string explain_rule;  // rule name, "*" for all, "" for none
  std::vector<std::string> explain_lines;
  std::map<std::string, int64_t> counters;          // per rule or per kind of rewrite
  std::map<std::string, int64_t> options;           // numeric options from the caller, by name
  std::map<std::string, std::string> text_options;  // string options (e.g. quant_exclude)
  // One record per weight a quantization pass looked at (quant/quant_record.h).
  std::vector<quant::QuantRecord> quant_records;
  // Progress of long passes: (done, total, what); may be empty. Called from the pass's thread.
  std::function<void(int64_t, int64_t, const std::string&)> progress;

  // Whether the caller asked to explain `rule` (--explain RULE or *).
  bool explains(const std::string& rule) const {
    return explain_rule == "*" || (!explain_rule.empty() && explain_rule == rule);
  }
  // Adds the line "rule: what" when the caller asked to explain `rule`.
  void explain(const std::string& rule, const std::string& what) {
    if (explains(rule)) explain_lines.push_back(rule + ": " + what);
  }
};

// The integer option `name` the caller set, or `fallback`. Declare it with the pass (OptionDecl).
inline int64_t option(const PassContext& ctx, const std::string& name, int64_t fallback) {
  auto it = ctx.options.find(name);
  return it == ctx.options.end() ? fallback : it->second;
}

// An option a pass reads from PassContext::options, declared with the pass (python/fastopt/
// options.py exposes the declarations; optimize() checks keys and values against them before any
// pass runs). A declaration without help only says the pass reads an option another pass
// declares.
struct OptionInfo {
  std::string name;
  std::string kind = "int";  // "int" or "bool"
  std::string help = {};
  std::optional<int64_t> default_value = {};                  // unset: the pass's own behaviour
  std::vector<std::pair<int64_t, std::string>> choices = {};  // allowed values, with meanings
  std::optional<int64_t> minimum = {}, maximum = {};
  bool internal = false;  // set by optimize() itself (e.g. kv_cache), not by callers
};

struct PassInfo {
  std::string name;
  std::string description;  // one line
  std::vector<std::string> tags;
  int64_t min_opset = 1;
  int64_t max_opset = INT64_MAX;
  // Running it again on its own output rewrites nothing. The pass manager skips a listed pass
  // declared so when no pass changed the model since it last ran (python/fastopt/optimize.py);
  // tests/pipeline/test_idempotent.py runs each twice on the fixtures.
  bool idempotent = true;
  // Returns the number of rewrites made.
  std::function<int64_t(Model&, PassContext&)> run;
  // Contracts, read by the pass manager (python/fastopt/optimize.py) when it places a pass the
  // caller asked for by an option rather than in the list (add_kv_cache for kv_cache, the
  // lowering of internal ops a list leaves): facts the pass needs an earlier pass of the list to
  // have established, facts it establishes, and passes it must run before when both are listed.
  std::vector<std::string> requires_facts = {};
  std::vector<std::string> ensures_facts = {};
  std::vector<std::string> runs_before = {};
  std::vector<OptionInfo> options = {};
  // The rule names --explain takes for this pass (beside its own name); empty for passes that
  // explain under their own name only.
  std::function<std::vector<std::string>()> rule_names = {};
};

// Facts of the pass contracts.
inline constexpr const char* kAttentionFused = "attention fused";  // internal Attention ops
inline constexpr const char* kNoInternalOps = "no internal ops";   // none left in the model
// The model's value types are those of a shape inference run on its current graph. The pass
// manager establishes it itself (its shape inference step) before a pass that requires it, and
// it holds after a pass that ensures it (infer_shapes); any other rewrite ends it.
inline constexpr const char* kValueTypes = "value types";

// A declaration with named fields (C++17 has no designated initialisers). An option:
//   OptionDecl("kv_cache", "the form add_kv_cache writes").choices({{1, "standard"}}).internal()
// OptionDecl("kv_cache") alone says the pass reads an option another pass declares.
class OptionDecl {
 public:
  explicit OptionDecl(std::string name, std::string help = {}) {
    info_.name = std::move(name);
    info_.help = std::move(help);
  }
  OptionDecl& default_value(int64_t v) {
    info_.default_value = v;
    return *this;
  }
  OptionDecl& choices(std::vector<std::pair<int64_t, std::string>> c) {
    info_.choices = std::move(c);
    return *this;
  }
  OptionDecl& internal() {
    info_.internal = true;
    return *this;
  }
  operator OptionInfo() const { return info_; }  // NOLINT: the point of the builder

 private:
  OptionInfo info_;
};

// A pass:
//   const PassRegistrar kRegister{PassDecl("eliminate_dead_nodes", "remove ...")
//                                     .tags({"cleanup"})
//                                     .run(eliminate_dead_nodes)};
class PassDecl {
 public:
  PassDecl(std::string name, std::string description) {
    info_.name = std::move(name);
    info_.description = std::move(description);
  }
  PassDecl& tags(std::vector<std::string> t) {
    info_.tags = std::move(t);
    return *this;
  }
  PassDecl& opsets(int64_t min, int64_t max = INT64_MAX) {
    info_.min_opset = min;
    info_.max_opset = max;
    return *this;
  }
  PassDecl& not_idempotent() {
    info_.idempotent = false;
    return *this;
  }
  PassDecl& run(std::function<int64_t(Model&, PassContext&)> f) {
    info_.run = std::move(f);
    return *this;
  }
  PassDecl& requires_facts(std::vector<std::string> f) {
    info_.requires_facts = std::move(f);
    return *this;
  }
  PassDecl& ensures_facts(std::vector<std::string> f) {
    info_.ensures_facts = std::move(f);
    return *this;
  }
  PassDecl& runs_before(std::vector<std::string> p) {
    info_.runs_before = std::move(p);
    return *this;
  }
  PassDecl& options(std::vector<OptionInfo> o) {
    info_.options = std::move(o);
    return *this;
  }
  operator PassInfo() const { return info_; }  // NOLINT: the point of the builder

 private:
  PassInfo info_;
};

const std::vector<PassInfo>& all_passes();
const PassInfo* find_pass(const std::string& name);

struct PassRegistrar {
  explicit PassRegistrar(PassInfo info);
};

// A pass made of pattern rules applied to a fixed point. `make_rules` runs at each run of the
// pass; the rules it makes may keep a reference to `ctx` (target, options, counters) for that run.
PassInfo rule_pass(std::string name, std::string description, std::vector<std::string> tags,
                   std::function<std::vector<pattern::Rule>(PassContext&)> make_rules);

// Opset of the default domain, or 0.
int64_t default_opset(const Model& m);

}  // namespace fastopt::passes
