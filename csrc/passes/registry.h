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

struct PassContext {
  std::string target = "ort";  // "ort": ONNX Runtime (contrib ops allowed); "onnx": standard ops
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
};

// Facts of the pass contracts.
inline constexpr const char* kAttentionFused = "attention fused";  // internal Attention ops
inline constexpr const char* kNoInternalOps = "no internal ops";   // none left in the model

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
