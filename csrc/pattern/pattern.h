// Declarative patterns: a small DAG over pattern variables, matched in C++ from a root node.
//
//   Pattern p("fuse_gelu_erf");
//   auto x   = p.var("x");
//   auto erf = p.op("Erf", {p.op("Div", {x, p.scalar("sqrt2", 1.4142, 1e-3)})});
//   auto y   = p.op("Mul", {p.op("Mul", {x, p.op("Add", {erf, p.scalar("one", 1.0)})}),
//                           p.scalar("half", 0.5)});
//   p.root(y);
//
// Supported: commutative binary ops (tried in both orders, never duplicated), optional nodes
// (`optional(op)` matches the op or skips to its first input), alternatives, attribute and
// constant-value constraints, dtype/rank constraints, and "intermediate values have no other
// uses" (on by default for every matched node except the root).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/graph.h"

namespace fastopt::pattern {

class Pattern;

// A handle on one pattern node; the builder methods add constraints and return *this.
class P {
 public:
  P() = default;
  P(Pattern* p, int id) : pattern_(p), id_(id) {}
  int id() const { return id_; }
  bool valid() const { return pattern_ != nullptr; }

  // Op nodes.
  P& commutative();      // the two inputs may come in either order
  P& output(int index);  // the value is this output of the node (default 0)
  P& extra_inputs();     // the node may have more inputs than the pattern names
  P& shared();           // its outputs may have uses outside the match
  P& attr_int(const std::string& name, int64_t value);
  P& attr_ints(const std::string& name, std::vector<int64_t> value);
  P& attr_float(const std::string& name, float value, float tolerance = 1e-6f);
  P& attr_string(const std::string& name, const std::string& value);
  P& attr_absent(const std::string& name);
  P& attr_check(const std::string& name, std::function<bool(const Attribute*)> check,
                std::string description);
  // Any node: a check on the value itself (dtype, rank, ...).
  P& dtype_in(std::vector<int32_t> dtypes);
  P& rank(int r);
  // Symbolic dimension: dim `axis` (negative counts from the end) of this value must be known
  // and equal to every other dim bound to `symbol` in the same match.
  P& dim(int axis, const std::string& symbol);
  P& check(std::function<bool(const Value*)> check, std::string description);

 private:
  Pattern* pattern_ = nullptr;
  int id_ = -1;
};

struct Constraint {
  std::function<bool(const Value*)> check;
  std::string description;
};

struct DimConstraint {
  int axis;
  std::string symbol;
};

struct AttrConstraint {
  std::string name;
  std::function<bool(const Attribute*)> check;  // receives null when the attribute is absent
  std::string description;
};

struct PatternNode {
  enum class Kind { kVar, kOp, kConst, kAlt, kOptional };
  Kind kind = Kind::kVar;
  std::string name;                   // for bindings and explanations
  std::vector<std::string> op_types;  // kOp: any of these
  std::string domain;                 // kOp ("" = ai.onnx)
  std::vector<int> inputs;            // kOp: inputs; kAlt: alternatives; kOptional: {op}
  bool commutative = false;
  bool extra_inputs = false;
  bool shared = false;
  int output_index = 0;
  std::vector<AttrConstraint> attrs;
  std::vector<Constraint> checks;
  std::vector<DimConstraint> dims;
  // kConst: a check on the constant's elements (decoded as doubles, at most 4096 of them).
  std::function<bool(const std::vector<double>&)> const_check;
  std::string const_description;
};

class Pattern {
 public:
  explicit Pattern(std::string name = "") : name_(std::move(name)) {}
  Pattern(const Pattern&) = delete;
  Pattern& operator=(const Pattern&) = delete;
  Pattern(Pattern&&) = default;
  Pattern& operator=(Pattern&&) = default;

  // Anything; binds by name (the same var used twice must be the same value).
  P var(const std::string& name);
  // An op producing the value; `op_types` may list alternatives ("Div|Mul" is not parsed).
  P op(const std::string& op_type, std::vector<P> inputs, const std::string& domain = "");
  P op_any(std::vector<std::string> op_types, std::vector<P> inputs,
           const std::string& domain = "");
  // A constant (initializer or Constant output) whose elements satisfy `check`.
  P constant(const std::string& name, std::function<bool(const std::vector<double>&)> check,
             std::string description);
  // A constant with every element within `tolerance` of `value` (scalars or splats).
  P scalar(const std::string& name, double value, double tolerance = 1e-6);
  // Any constant.
  P any_constant(const std::string& name);
  // The first alternative that leads to a complete match wins.
  P alt(const std::string& name, std::vector<P> alternatives);
  // Matches `op`, or skips it and matches its first input in its place.
  P optional(P op);

  void root(P r) { root_ = r.id(); }
  int root_id() const { return root_; }
  const std::string& name() const { return name_; }
  const std::vector<PatternNode>& nodes() const { return nodes_; }
  PatternNode& node(int id) { return nodes_[id]; }
  const PatternNode& node(int id) const { return nodes_[id]; }
  // Op types the root can have: the driver dispatches on these.
  std::vector<std::string> root_op_types() const;
  // Number of op nodes: larger patterns are tried first.
  int benefit() const;
  int find(const std::string& name) const;  // node id by name, or -1

 private:
  friend class P;
  int add(PatternNode n);
  std::string name_;
  std::vector<PatternNode> nodes_;
  int root_ = -1;
};

// The result of a successful match.
class Match {
 public:
  explicit Match(const Pattern& p)
      : pattern_(&p), values_(p.nodes().size(), nullptr), nodes_(p.nodes().size(), nullptr) {}
  Value* value(P p) const { return values_[p.id()]; }
  Value* value(const std::string& name) const;
  Node* node(P p) const { return nodes_[p.id()]; }  // null for skipped optional nodes
  Node* node(const std::string& name) const;
  Node* root() const { return nodes_[pattern_->root_id()]; }
  const Pattern& pattern() const { return *pattern_; }
  std::vector<Node*> matched_nodes() const;  // each op node once, root first

 private:
  friend class Matcher;
  const Pattern* pattern_;
  std::vector<Value*> values_;
  std::vector<Node*> nodes_;
};

// Why a candidate did not match: the furthest point the matcher reached. Text is formatted only
// when asked for (explanations are off the hot path).
struct MatchFailure {
  int pattern_node = -1;
  const Value* value = nullptr;
  const char* reason = "";
  const std::string* detail = nullptr;  // a constraint's description, when one failed
  int depth = 0;
  std::string text;  // a code rule's reason (rewrite.h: CodeRule), used as is
  std::string format(const Pattern& p) const;
};

class Matcher {
 public:
  explicit Matcher(const Pattern& p) : pattern_(p) {}
  // Tries to match the pattern with its root at `node`.
  bool match(Node* node, Match* out, MatchFailure* why = nullptr);

 private:
  struct Goal {
    int pn;
    Value* value;
  };
  bool solve(std::vector<Goal>& goals);
  std::vector<Goal> goals_;       // reused across candidates
  std::vector<double> constant_;  // decoded constant, reused
  // Symbolic dims bound so far, in binding order (undone with the pattern node that bound them).
  struct DimBinding {
    const std::string* symbol;
    Dim dim;
    int pn;
  };
  std::vector<DimBinding> dim_bindings_;
  bool bind_dims(int pn, const Value* v);
  bool match_one(const Goal& g, std::vector<Goal>& goals);
  bool bind(int pn, Value* v, Node* n);
  void unbind(int pn);
  bool no_outside_uses();
  void fail(int pn, const Value* v, const char* reason, const std::string* detail = nullptr);

  const Pattern& pattern_;
  Match* m_ = nullptr;
  MatchFailure* why_ = nullptr;
  int depth_ = 0;
  // Failure details formatted during matching (MatchFailure points at them); kept only when
  // explaining.
  std::deque<std::string> details_;
  // Nodes bound so far; patterns are small, so a vector beats a hash set.
  std::vector<const Node*> used_nodes_;
  bool used(const Node* n) const;
};

}  // namespace fastopt::pattern
