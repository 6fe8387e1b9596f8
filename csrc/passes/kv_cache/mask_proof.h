// What mask an attention computes, proven by evaluating it: the check that lets add_kv_cache
// replace an export's mask subgraph by its own (internal_op.h, the cached form) only when the two
// agree. See mask_proof.cc for the probes and why they suffice.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace fastopt::passes {

// The masks the cached form can reproduce: every earlier key of the row that attention_mask
// keeps (window 0), or only those among the last `window` positions (a sliding window as
// transformers': key j visible to query i iff i - window < j <= i, the query's own included).
struct MaskKind {
  int64_t window = 0;
};

// A cache whose sliding-window layers keep their last `rows` rows (transformers' sliding layers:
// present = Slice(Concat(past, new), -rows)): those layers' past inputs (`pasts`) hold
// min(P, rows) rows, and their attentions read those rows and the new ones.
struct SlidingRows {
  std::vector<std::string> pasts;
  int64_t rows = 0;
  // Only unpadded and right-padded rows are probed: an in-place cache's rows are contiguous
  // from 0 (GroupQueryAttention's seqlens_k), so no other padding reaches the rewritten model.
  bool right_padded_only = false;
};

// Classifies the mask (input 3, with the node's is_causal) of the internal Attention `att` in
// `g` (the main graph of `m`). The mask may read only attention_mask's values, the shapes of
// input_ids, attention_mask and (with_past) the past_* inputs, and constants, through ops the
// native evaluator computes exactly. nullopt, with `why` set, when it reads anything else,
// cannot be evaluated, or differs from both patterns on some probe.
// With `sliding` (a model exported with such a cache), the probes give its pasts min(P, rows)
// rows, and an attention that `reads_rows` has min(P, rows) + S keys, key j at position
// P - min(P, rows) + j; every key the pattern lets a kept query see must be among them.
std::optional<MaskKind> classify_attention_mask(const Model& m, const Graph& g, const Node* att,
                                                bool with_past, std::string* why,
                                                const SlidingRows* sliding = nullptr,
                                                bool reads_rows = false);

}  // namespace fastopt::passes
