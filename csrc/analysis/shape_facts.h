// Symbolic shape and type facts over the IR: one analysis every pass can ask.
//
// For each value: its element type, its rank and dims as DimExprs (numbers, graph-input
// dim_params, products and sums of them), and for small integer tensors their elements too
// ("shape values", like onnx's data propagation): Shape -> Gather -> Unsqueeze -> Concat chains
// carry B, S, 14, 64, so Reshape targets built from them give their output exact dims, and a
// -1 resolves to the input's element count over the rest. A dim the analysis cannot tell gets a
// fresh symbol: unknown, but equal to itself wherever it flows (same_dim sees it).
//
// Facts are computed in one forward sweep over the main graph on first use and memoized; a
// graph edit (anything that bumps Model::edit_generation) makes the next query recompute.
// Nodes the analysis has no rule for are listed (unknown_ops); their outputs keep only what
// their declared types say. If/Loop/Scan bodies are analysed with the node (control_flow.cc:
// both If branches merged, or the one a constant condition picks; loop-carried facts kept only
// where proven invariant across iterations); function bodies are not.
//
// Assumptions, the same ones onnx and ORT's symbolic inference make: symbolic dims are sizes
// (>= 0), and a model is valid (broadcast dims agree, Reshape element counts match).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "analysis/dim_expr.h"
#include "ir/graph.h"

namespace fastopt::analysis {

struct Facts {
  int32_t dtype = 0;    // TensorProto element type; 0 unknown
  bool ranked = false;  // rank (dims.size()) known
  std::vector<DimExpr> dims;
  // Elements of an integer tensor of rank <= 1 with at most kMaxShapeValue elements, when known
  // (each maybe symbolic).
  bool has_value = false;
  std::vector<DimExpr> value;
};

constexpr size_t kMaxShapeValue = 64;

enum class SymbolKind : uint8_t { kNamed, kFreshDim, kFreshData };

class SymbolTable {
 public:
  int32_t named(const std::string& name);  // the same name -> the same symbol
  int32_t fresh(SymbolKind kind);
  // A named symbol's name; fresh ones are spelled "?<id>".
  std::string name(int32_t id) const {
    return kind(id) == SymbolKind::kNamed ? names_[static_cast<size_t>(id)]
                                          : "?" + std::to_string(id);
  }
  // Symbols made so far; ids are issued in order, so a later symbol has a larger id.
  int32_t size() const { return static_cast<int32_t>(kinds_.size()); }
  SymbolKind kind(int32_t id) const { return kinds_[static_cast<size_t>(id)]; }
  // Every symbol is named (no fresh ones): the expression can be written as a dim_param.
  bool all_named(const DimExpr& e) const;
  // Every symbol is a size (named or a fresh dim) and the coefficients are >= 0.
  bool nonneg(const DimExpr& e) const;
  std::string str(const DimExpr& e) const {
    return e.str([this](int32_t s) { return name(s); });
  }

 private:
  std::vector<std::string> names_;
  std::vector<SymbolKind> kinds_;
  std::unordered_map<std::string, int32_t> by_name_;
};

// What the per-op rules see: the facts of a node's inputs, symbols, the opset.
class RuleContext {
 public:
  RuleContext(SymbolTable& symbols, int64_t opset) : symbols_(symbols), opset_(opset) {}
  SymbolTable& symbols() { return symbols_; }
  int64_t opset() const { return opset_; }
  DimExpr fresh_dim() { return DimExpr::symbol(symbols_.fresh(SymbolKind::kFreshDim)); }
  DimExpr fresh_data() { return DimExpr::symbol(symbols_.fresh(SymbolKind::kFreshData)); }
  // Facts of input i; an empty Facts for an unknown input. Reading an input the node does not
  // have (absent or omitted) marks the node malformed: rules read optional inputs only after
  // present(i), so a missing required input leaves the node to onnx's checks.
  const Facts& in(size_t i) const {
    if (i < inputs_.size() && inputs_[i]) return *inputs_[i];
    if (!present(i)) missing_ = true;
    return empty_;
  }
  bool missing_input() const { return missing_; }
  size_t num_inputs() const { return inputs_.size(); }
  bool present(size_t i) const { return i < present_.size() && present_[i]; }
  // Known constant integer elements of input i (shape value with numbers only).
  std::optional<std::vector<int64_t>> ints(size_t i) const;
  void set_inputs(std::vector<const Facts*> in, std::vector<bool> present) {
    inputs_ = std::move(in);
    present_ = std::move(present);
    missing_ = false;
  }

 private:
  SymbolTable& symbols_;
  int64_t opset_;
  std::vector<const Facts*> inputs_;
  std::vector<bool> present_;
  mutable bool missing_ = false;
  Facts empty_;
};

// A rule fills the facts of the node's outputs (one per output, pre-sized) and returns true, or
// returns false when it cannot say anything (the node counts as unknown).
using OpRule = bool (*)(const Node&, RuleContext&, std::vector<Facts>&);
// The rule for (domain, op_type), or null. Domain "" and "ai.onnx" are the same.
OpRule find_rule(const std::string& domain, const std::string& op_type);

class ShapeFacts {
 public:
  explicit ShapeFacts(const Model& model) : model_(model) {}

  // nullptr when the value is not in the analysed graph (or is null).
  const Facts* facts(const Value* v);
  int32_t dtype(const Value* v);
  int rank(const Value* v);  // -1 unknown
  // Dim `axis` (negative from the end) of v; nullopt when the rank is unknown or out of range.
  std::optional<DimExpr> dim(const Value* v, int axis);
  std::optional<int64_t> known_dim(const Value* v, int axis);
  // Dims proven equal (the same expression, fresh symbols included, or expressions a declared
  // type equates: see equal).
  bool same_dim(const Value* a, int axis_a, const Value* b, int axis_b);
  // Equality facts: a and b are the same expression, or a value's declared type names a dim
  // that the analysis computed as a sum or product of sizes (value_info says
  // total_sequence_length where a Concat of the past and the new rows gives
  // past_sequence_length+sequence_length), which makes the two equal everywhere; closed
  // transitively. Two different names are never equated.
  bool equal(const DimExpr& a, const DimExpr& b);
  // The elements of a small integer tensor, or null.
  const std::vector<DimExpr>* shape_value(const Value* v);
  std::optional<std::vector<int64_t>> constant_shape_value(const Value* v);

  // Op types (domain::op) of nodes without a rule, with counts.
  const std::map<std::string, int64_t>& unknown_ops();
  // Nodes a rule gave facts to (subgraph nodes included), and the If/Loop/Scan bodies analysed.
  int64_t analysed_nodes();
  int64_t analysed_bodies();
  const SymbolTable& symbols() { return symbols_; }
  // How many times the facts were computed (1 after the first query; +1 per query after an
  // edit).
  int64_t computations() const { return computations_; }
  // Spells e as a dim: a number, a dim_param naming an expression of named symbols, or unknown.
  Dim to_dim(const DimExpr& e) const;

  // Writes what the facts know into the value types of the main graph's node outputs
  // (refine_type: never loses what a type already says); a changed value gets a value_info
  // entry. Returns the number of values whose type changed.
  int64_t apply_to_types(Model& model);

 private:
  friend class KeepAcrossEdits;
  void ensure();
  void compute();
  void sweep_node(const Node& n, int64_t opset, RuleContext& ctx);
  const Facts* extend(const Value* v);
  // Records what an output's declared facts (its type) say its inferred ones equal.
  void note_declared(const Facts& inferred, const Facts& declared);
  const std::string& representative(const std::string& e);
  // One forward pass over g's nodes (bodies included, through control_flow).
  void sweep(const Graph& g, int64_t opset);
  // Facts of an If/Loop/Scan node's outputs, sweeping its bodies; false when it cannot say.
  bool control_flow(const Node& n, int64_t opset, std::vector<Facts>& outs);
  bool if_facts(const Node& n, int64_t opset, std::vector<Facts>& outs);
  bool loop_facts(const Node& n, int64_t opset, std::vector<Facts>& outs);
  bool scan_facts(const Node& n, int64_t opset, std::vector<Facts>& outs);
  // Sweeps `body` with `carried` as the facts of its first carried.size() inputs after
  // `leading` (facts of the inputs before them), widening carried facts until one sweep
  // proves them invariant (the body maps them onto themselves). Leaves `carried` at the
  // proven facts; false when the body does not fit.
  bool fixpoint(const Graph& body, int64_t opset, const std::vector<Facts>& leading,
                std::vector<Facts>& carried, size_t first_carried_out);
  Facts& facts_slot(const Value* v);  // facts_[v], from what v declares when first seen
  const Model& model_;
  uint64_t generation_ = UINT64_MAX;
  int64_t opset_ = 0;
  bool keep_ = false;
  uint64_t keep_since_ = 0;
  int64_t computations_ = 0;
  SymbolTable symbols_;
  std::unordered_map<const Value*, Facts> facts_;
  std::map<std::string, int64_t> unknown_;
  int64_t analysed_ = 0, bodies_ = 0;
  // Loop/Scan bodies being swept: a value there is a different tensor every iteration, so a
  // dim_param its declared type gives is no symbol shared with values outside (exporters
  // name a growing dim after the body's value and reuse the name for the loop's result).
  int loop_depth_ = 0;
  // Union-find over spelled expressions (only those of equality facts are in it).
  std::unordered_map<std::string, std::string> equal_to_;
};

// While held, the facts survive the graph's edits instead of being recomputed by the next query:
// for a pass whose every edit leaves each surviving value computing what it computed (a fusion
// or lowering replacing a subgraph by an equal one, rewiring readers to an equal value). Values
// it makes in the main graph get their facts on first query from their producers, also after
// the scope. A pass that changes what a value holds (a precision conversion, a new model input)
// must not hold one.
class KeepAcrossEdits {
 public:
  explicit KeepAcrossEdits(ShapeFacts& facts)
      : facts_(facts), was_(facts.keep_), since_was_(facts.keep_since_) {
    facts_.keep_ = true;
    facts_.keep_since_ = facts_.model_.edit_generation;  // facts older than this are recomputed
  }
  // The facts stay current for the graph the scope leaves (its edits kept every value): the next
  // pass asking reuses them unless something edits the graph first.
  ~KeepAcrossEdits() {
    if (facts_.computations_ > 0 && facts_.generation_ != UINT64_MAX &&
        facts_.generation_ >= facts_.keep_since_) {
      facts_.generation_ = facts_.model_.edit_generation;
    }
    facts_.keep_ = was_;
    facts_.keep_since_ = since_was_;
  }
  KeepAcrossEdits(const KeepAcrossEdits&) = delete;
  KeepAcrossEdits& operator=(const KeepAcrossEdits&) = delete;

 private:
  ShapeFacts& facts_;
  bool was_;
  uint64_t since_was_;
};

// The model's shared analysis (Model::shape_facts), made on first use: infer_shapes and the
// passes after it reuse one sweep as long as nothing edits the graph.
ShapeFacts& facts_of(Model& model);

// Types for the outputs of one node from its inputs' types alone (no memo, no graph walk):
// for nodes made by rewrites (Rewriter::op). Sets a type only where the output has none.
void type_new_node(const Model& model, Node& node);

// Facts a declared type says (dim_params named symbols, unknown dims fresh ones; with
// `named` false, dim_params are fresh too).
Facts facts_from_type(SymbolTable& symbols, const TypeInfo& t, bool named = true);
// Facts of a value nothing computed: its fixed initializer, else its declared type.
Facts leaf_facts(SymbolTable& symbols, const Value* v);

// Merges the facts a rule found with what an existing type says (where the rule knows less).
void merge_facts(SymbolTable& symbols, Facts& inferred, const Facts& declared);

}  // namespace fastopt::analysis
