// The sequence-axis dataflow behind add_kv_cache's whole-decoder proof (kv_cache_positionwise.cc
// walks the graph, positionwise_rules.cc has one rule per op family).
//
// The cached model runs only the new tokens: a value at a new position must be what the full
// recompute gives there, and the keys and values it caches must stay right for later steps. That
// holds when every op between the per-token inputs and the outputs is position-wise (position s
// of its output reads position s of its inputs only) except the attentions the rewrite caches.
// Each value gets a state:
//
//   free   it does not depend on the tokens (weights, constants, shapes: Shape/Size read no data)
//   seq    it holds one slice per position, along `axis`; that axis is outer x S x inner
//          elements (outer = inner = 1 unless tokens were flattened with other dims: (B*S, H))
//   last   one position's value selected from the end (the last-token logits slice): the same
//          in the cached and the full run, so anything computed from it alone is too
//   refused  downstream of an op already refused (not examined again: one cause, one message)
//
// A rule maps the inputs' states to the outputs' or refuses with the reason (the op mixes
// positions: a reduction, cumulative sum, slice, pad or convolution along the sequence, a
// product of two token-carrying values, ...).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "analysis/dim_expr.h"
#include "analysis/shape_facts.h"
#include "ir/graph.h"

namespace fastopt::passes::kv_cache {

struct SeqState {
  enum Kind : uint8_t { kFree, kSeq, kLast, kRefused };  // kRefused: after a refused op
  Kind kind = kFree;
  int axis = -1;  // kSeq
  analysis::DimExpr outer = analysis::DimExpr::constant(1);
  analysis::DimExpr inner = analysis::DimExpr::constant(1);

  static SeqState seq(int axis) {
    SeqState s;
    s.kind = kSeq;
    s.axis = axis;
    return s;
  }
  static SeqState last() {
    SeqState s;
    s.kind = kLast;
    return s;
  }
  bool flattened() const { return outer != one() || inner != one(); }
  static analysis::DimExpr one() { return analysis::DimExpr::constant(1); }
};

// What a rule sees: the node's input states (free for omitted inputs), the shape facts, S.
struct SeqContext {
  analysis::ShapeFacts& facts;
  analysis::DimExpr seq;  // the sequence length symbol (input_ids' axis 1)
  int64_t opset;
  std::vector<SeqState> in;
  std::string why;  // a refusal's reason (what the op does to the positions)
  // Range(0, S) nodes a rule proved to index the sequence axis relative to the tokens at hand
  // (the same in the cached run): not the positions an unoffset Range would misnumber.
  std::vector<const Node*> relative_ranges;
  int priority = 0;  // a refusal that explains others (an attention that did not fuse): 1

  const SeqState& state(size_t i) const { return in[i]; }
  bool refuse(std::string reason) {
    why = std::move(reason);
    return false;
  }
};

// Fills one state per output, or returns false with ctx.why. Called only for nodes with at least
// one seq input (free and last inputs alone need no rule).
using SeqRule = bool (*)(const Node&, SeqContext&, std::vector<SeqState>&);
// The rule for (domain, op_type), or null (an op not known to be position-wise: refused).
SeqRule find_seq_rule(const std::string& domain, const std::string& op_type);

// Helpers the rule files share (positionwise_rules.cc).
int normalize_axis(int64_t axis, int rank);   // in [0, rank), or -1
extern const char* const kLastWithSeq;        // the reason for mixing last with seq
int seq_rank(SeqContext& c, const Value* v);  // -1 unknown
bool same_place(const SeqState& a, const SeqState& b);
// Every input from `carriers` on must not depend on the tokens (else refused: its `what`).
bool others_free(SeqContext& c, size_t carriers, const char* what);
// The seq state the first `carriers` inputs share, or nullopt with the reason set.
std::optional<SeqState> carried(SeqContext& c, size_t carriers);
// An int list from input `input` (opset >= first_input_opset) or attribute `attr`; nullopt when
// the input is not constant.
std::optional<std::vector<int64_t>> ints_of(const Node& n, size_t input, const char* attr,
                                            int64_t opset, int64_t first_input_opset);
// False (with the reason) when the op's axis attribute is the sequence axis.
bool off_sequence_axis(const Node& n, SeqContext& c, const SeqState& s, const char* attr,
                       int64_t fallback, const char* what);

// Adds the layout ops' rules (positionwise_layout.cc) under "domain|op".
void add_layout_rules(std::unordered_map<std::string, SeqRule>& rules);

}  // namespace fastopt::passes::kv_cache
