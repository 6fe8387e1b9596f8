// What mask an attention computes, proven by evaluating it: the check that lets add_kv_cache
// replace an export's mask subgraph by its own (internal_op.h, the cached form) only when the two
// agree. See mask_proof.cc for the probes and why they suffice.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ir/graph.h"

namespace fastopt::passes {

// The masks the cached form can reproduce: every earlier key of the row that attention_mask
// keeps (window 0), or only those among the last `window` positions (a sliding window as
// transformers': key j visible to query i iff i - window < j <= i, the query's own included).
struct MaskKind {
  int64_t window = 0;
};

// Classifies the mask (input 3, with the node's is_causal) of the internal Attention `att` in
// `g` (the main graph of `m`). The mask may read only attention_mask's values, the shapes of
// input_ids, attention_mask and (with_past) the past_* inputs, and constants, through ops the
// native evaluator computes exactly. nullopt, with `why` set, when it reads anything else,
// cannot be evaluated, or differs from both patterns on some probe.
std::optional<MaskKind> classify_attention_mask(const Model& m, const Graph& g, const Node* att,
                                                bool with_past, std::string* why);

}  // namespace fastopt::passes
