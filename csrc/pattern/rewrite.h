// Rules (a pattern plus a rewrite, or a code rule: a match function plus a rewrite) and the
// driver that applies a set of them to a fixed point.
//
// A rewrite builds replacement nodes through a Rewriter, which inserts them before the matched
// root. It returns the values that replace the root's outputs, or fails (the Rewriter then
// removes whatever it made: a failed check leaves the graph untouched).
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "pattern/pattern.h"

namespace fastopt::pattern {

Attribute attr_int(const std::string& name, int64_t v);
Attribute attr_float(const std::string& name, float v);
Attribute attr_ints(const std::string& name, std::vector<int64_t> v);
Attribute attr_floats(const std::string& name, std::vector<float> v);
Attribute attr_string(const std::string& name, const std::string& v);
Attribute attr_tensor(const std::string& name, std::shared_ptr<Tensor> t);
Attribute copy_attribute(const Attribute& a);  // scalars, lists and tensors (not graphs)

class Rewriter {
 public:
  Rewriter(Graph& g, Node* root) : graph_(g), root_(root) {}
  Graph& graph() const { return graph_; }
  Node* root() const { return root_; }

  // Adds a node before the root; returns its outputs.
  std::vector<Value*> op(const std::string& op_type, const std::vector<Value*>& inputs,
                         std::vector<Attribute> attrs = {}, int num_outputs = 1,
                         const std::string& domain = "");
  Value* op1(const std::string& op_type, const std::vector<Value*>& inputs,
             std::vector<Attribute> attrs = {}, const std::string& domain = "") {
    return op(op_type, inputs, std::move(attrs), 1, domain)[0];
  }
  // Adds an initializer (a new name derived from `base`).
  Value* initializer(const std::string& base, std::shared_ptr<Tensor> t);
  // Records why the rewrite gave up; returns nullopt for `return rw.fail("...")`.
  std::nullopt_t fail(std::string reason) {
    failure_ = std::move(reason);
    return std::nullopt;
  }
  const std::string& failure() const { return failure_; }
  const std::vector<Node*>& created() const { return created_nodes_; }
  void rollback();

 private:
  Graph& graph_;
  Node* root_;
  std::vector<Node*> created_nodes_;
  std::vector<Value*> created_initializers_;
  std::string failure_;
};

// Replacements for the root's outputs, in order; a null entry means the output must be unused.
using Replacement = std::optional<std::vector<Value*>>;
using RewriteFn = std::function<Replacement(const Match&, Rewriter&)>;

struct Rule {
  std::string name;
  std::shared_ptr<Pattern> pattern;
  RewriteFn rewrite;
};

// A code rule: for subgraphs a pattern cannot say (exporter variants found by walking the
// producers), the match is a function. It gets the same driver as pattern rules: dispatch on the
// root's op type, rollback of a declined rewrite, counters and --explain lines.
struct CodeMatch {
  Node* root = nullptr;
  std::vector<Node*> nodes;  // matched nodes besides the root (its producers): removed when dead
  std::any found;            // what the match worked out, for the rewrite
};
// True when the rule matches at `root` (filling `m`); else false with why.text the reason (left
// empty for a node that is no candidate at all: nothing is explained then).
using CodeMatchFn = std::function<bool(Node* root, CodeMatch& m, MatchFailure& why)>;
using CodeRewriteFn = std::function<Replacement(const CodeMatch&, Rewriter&)>;

struct CodeRule {
  std::string name;
  std::vector<std::string> root_op_types;
  int benefit = 1;  // ordering among rules rooted at one op type, as Pattern::benefit
  CodeMatchFn match;
  CodeRewriteFn rewrite;
};

struct ApplyOptions {
  int max_iterations = 10;
  // Explanations: for rules named here ("*" = all), one line per candidate root that failed.
  std::string explain_rule;
  std::vector<std::string>* explain_lines = nullptr;
};

struct ApplyStats {
  int64_t rewrites = 0;
  int64_t candidates = 0;
  int iterations = 0;
  std::map<std::string, int64_t> per_rule;
};

// Applies `rules` over every graph of the model (subgraphs and functions included), dispatching
// on the root's op type, larger patterns first, until nothing changes or the cap is reached.
ApplyStats apply_rules(Model& model, const std::vector<Rule>& rules, const ApplyOptions& options);
// The same with code rules among them.
ApplyStats apply_rules(Model& model, const std::vector<Rule>& rules,
                       const std::vector<CodeRule>& code_rules, const ApplyOptions& options);

// Swaps `from` for `to` everywhere; when `from` is a graph output, `to` takes over its name so
// the model's interface does not change.
void replace_value(Graph& g, Value* from, Value* to);

// True when replace_value(g, from, to) keeps the graph's interface: `from` is not a graph output,
// or `to` can take over its name (made by a node of `g`, not itself an input or output).
bool can_replace(const Graph& g, const Value* from, const Value* to);

// The nodes that `to` depends on and that read `from` (walking back
// from `to`'s producer in its graph; a node's subgraphs' outer references count as its inputs):
// replace_value(from, to) would close a cycle through each. The walk does not go past values in
// `known_upstream` (the caller knows they cannot depend on `from`: inputs of the nodes it
// replaces). Empty when the replacement is safe.
std::vector<Node*> readers_feeding(const Value* from, const Value* to,
                                   const std::vector<const Value*>& known_upstream = {});

// Removes nodes of `candidates` whose outputs have become unused.
void remove_dead(Graph& g, const std::vector<Node*>& candidates);

}  // namespace fastopt::pattern
