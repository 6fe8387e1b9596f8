// The mask every cached attention shares (see kv_cache.h and add_kv_cache.cc's header), and
// where a model exported with a cache need not reproduce its all-masked rows.
#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ir/error.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/kv_cache/kv_cache.h"
#include "passes/kv_cache/kv_cache_cross.h"
#include "passes/kv_cache/mask_proof.h"

namespace fastopt::passes::kv_cache {
namespace {
using pattern::attr_int;

// The mask of a sliding-window layer: `allowed` and key t > P + s - w for query P + s, as
// transformers' window (key j visible to query i iff i - w < j <= i, positions as indices, so
// padding inside the window counts, exactly what the no-cache model computes on the same
// attention_mask). One per window, shared by its layers.
Value* windowed_mask(KvCacheBuilder& b, SharedMask& m, int64_t window, const Dim& batch_dim) {
  for (auto [w, v] : m.windowed) {
    if (w == window) return v;
  }
  Node* head = m.head;
  Value* oldest = b.op("Sub", {m.query_column, b.constant("kv_window", {window}, {})},
                       "kv_window_start", head);  // (S, 1): P + s - w
  Value* inside = b.op("Greater", {m.key_positions, oldest}, "kv_in_window", head);  // (S, T)
  Value* allowed = b.op("And", {m.allowed, inside}, "kv_sliding_window_mask", head);
  allowed->type = tensor_type(kBool, {batch_dim, value_dim(1), param_dim("sequence_length"),
                                      param_dim("total_sequence_length")});
  m.windowed.emplace_back(window, allowed);
  return allowed;
}

}  // namespace

void set_attention_mask(Node* att, Value* mask) {
  // The mask is the rewrite's own: its all-masked rows are pad queries nothing reads.
  std::vector<Attribute>& attrs = att->attributes;
  attrs.erase(std::remove_if(attrs.begin(), attrs.end(),
                             [](const Attribute& a) {
                               return a.name == "masked_value" || a.name == "masked_rows_mean" ||
                                      a.name == "masked_rows_unread";
                             }),
              attrs.end());
  attrs.push_back(attr_int("masked_rows_unread", 1));
  if (att->inputs().size() > 3) {
    att->set_input(3, mask);
  } else if (mask) {
    att->append_input(mask);
  }
  for (Attribute& a : att->attributes) {
    if (a.name == "is_causal") {
      a = attr_int("is_causal", 0);
      return;
    }
  }
  att->attributes.push_back(attr_int("is_causal", 0));
}

SharedMask build_shared_mask(Graph& g, KvCacheBuilder& b, Value* input_ids, Value* attention_mask,
                             const Dim& batch_dim) {
  Node* head = g.first();
  Value* zero = b.constant("kv_zero", {0}, {});
  Value* one = b.constant("kv_one", {1}, {});
  Value* seq_len = b.op("Gather", {b.op("Shape", {input_ids}, "kv_ids_shape", head), one},
                        "kv_seq_len", head, one_attr(attr_int("axis", 0)));
  Value* mask_shape_value = b.op("Shape", {attention_mask}, "kv_mask_shape", head);
  Value* total_len =
      b.op("Gather", {mask_shape_value, one}, "kv_total_len", head, one_attr(attr_int("axis", 0)));
  Value* past_len = b.op("Sub", {total_len, seq_len}, "kv_past_len", head);
  Value* q_pos = b.op("Range", {past_len, total_len, one}, "kv_query_positions", head);
  Value* q_col =
      b.op("Unsqueeze", {q_pos, b.constant("kv_axes_1", {1}, {1})}, "kv_query_column", head);
  Value* k_pos = b.op("Range", {zero, total_len, one}, "kv_key_positions", head);
  Value* causal = b.op("LessOrEqual", {k_pos, q_col}, "kv_causal", head);
  Value* mask_bool =
      b.op("Cast", {attention_mask}, "kv_mask_bool", head, one_attr(attr_int("to", kBool)));
  Value* pad =
      b.op("Unsqueeze", {mask_bool, b.constant("kv_axes_1_2", {1, 2}, {2})}, "kv_padding", head);
  Value* allowed = b.op("And", {causal, pad}, "kv_attention_mask", head);
  allowed->type = tensor_type(kBool, {batch_dim, value_dim(1), param_dim("sequence_length"),
                                      param_dim("total_sequence_length")});
  return {past_len, allowed, mask_bool->producer(), mask_shape_value->producer(), q_col,
          k_pos,    head};
}

std::vector<int64_t> proven_windows(const Graph& g, const std::vector<Node*>& attentions,
                                    bool with_past, const SlidingRows* sliding,
                                    const std::unordered_set<const Node*>& reading_rows) {
  std::vector<int64_t> windows;
  // Layers sharing one mask value (and causal flag, head count) share the answer.
  std::vector<std::pair<const Node*, int64_t>> proven;
  auto same_mask = [&reading_rows](const Node* a, const Node* b) {
    return a->inputs().size() > 3 && b->inputs().size() > 3 && a->inputs()[3] == b->inputs()[3] &&
           int_attr_or(a, "is_causal", 0) == int_attr_or(b, "is_causal", 0) &&
           int_attr_or(a, "q_num_heads", 0) == int_attr_or(b, "q_num_heads", 0) &&
           reading_rows.count(a) == reading_rows.count(b);
  };
  for (size_t i = 0; i < attentions.size(); ++i) {
    auto known = std::find_if(proven.begin(), proven.end(),
                              [&](const auto& p) { return same_mask(p.first, attentions[i]); });
    if (known != proven.end()) {
      windows.push_back(known->second);
      continue;
    }
    std::string why;
    auto kind = classify_attention_mask(*g.model(), g, attentions[i], with_past, &why, sliding,
                                        reading_rows.count(attentions[i]) > 0);
    if (!kind) {
      refuse("the mask of layer " + std::to_string(i) + " (attention '" +
             attentions[i]->name.value +
             "') is not proven to be causal with padding, with or without a sliding window, "
             "which is all the cached form reproduces: " +
             why);
    }
    windows.push_back(kind->window);
    proven.emplace_back(attentions[i], kind->window);
  }
  return windows;
}

void use_masks(KvCacheBuilder& b, SharedMask& m, const std::vector<Node*>& attentions,
               const std::vector<int64_t>& windows, const Dim& batch_dim, PassContext& ctx) {
  for (size_t i = 0; i < attentions.size(); ++i) {
    Node* att = attentions[i];
    if (!windows[i]) {
      set_attention_mask(att, m.allowed);
      continue;
    }
    set_attention_mask(att, windowed_mask(b, m, windows[i], batch_dim));
    att->attributes.push_back(attr_int("sliding_window", windows[i]));
    ctx.counters["sliding-window layers"] += 1;
  }
}

// Why the emulation of all-masked rows (masked_rows.h) may go in a model exported with a cache:
//   1. every attention's mask is proven causal with padding (with or without a window) over
//      past + new (mask_proof.h): a query that attention_mask keeps sees at least its own key,
//      so the rows whose every key is masked are pad queries (attention_mask 0 at their
//      position), and no kept query sees a pad key;
//   2. every op outside the attentions is position-wise (prove_positionwise, cached_export):
//      a pad query's row reaches only its own position, the logits there and the keys and
//      values of later layers there (presents included), which kept queries mask by 1.
// Each lowering's row there is finite over a boolean mask (0, or an average of V over a finite
// bias), which the argument needs: a masked key still enters the products with weight 0.
// So what those rows hold reaches the outputs only at padded positions: the logits there and
// the presents' rows there, which a caller keeps masked at every later step (transformers'
// generate and onnxruntime-genai do; both leave those positions' values unspecified). Batch
// rows are taken to be independent, as in every decoder.
int64_t mark_unread_masked_rows(Model& m, std::string* why) {
  Graph& g = *m.graph;
  const Value* ids = graph_input(g, kInputIds);
  if (!has_exported_past(g) || !ids || !graph_input(g, kAttentionMask) ||
      graph_input(g, kEncoderHiddenStates)) {
    return 0;  // not a decoder exported with a cache: the rows are outputs as exported
  }
  g.topological_sort();
  std::vector<Node*> attentions;
  bool emulated = false;
  for (Node* n = g.first(); n; n = n->next()) {
    if (!is_internal_attention(n)) continue;
    attentions.push_back(n);
    emulated = emulated || masked_rows(n) != MaskedRows::kUnread;
  }
  if (attentions.empty() || !emulated) return 0;
  for (const Node* att : attentions) {
    const Value* mask = att->inputs().size() > 3 ? att->inputs()[3] : nullptr;
    if (!mask || dtype_of(mask) != kBool) {
      *why = "attention '" + att->name.value +
             "' has no boolean mask: over an additive one a lowering's pad row may be NaN, and a "
             "masked key's NaN still enters the kept rows' products (0 x NaN)";
      return 0;
    }
    if (!cached_kv(att)) {
      *why = "attention '" + att->name.value +
             "' does not read Concat(past input, new rows) feeding a present (a sliding-window "
             "cache keeps its last rows), so its rows are not proven to be the positions'";
      return 0;
    }
  }
  try {
    proven_windows(g, attentions, true);
    prove_positionwise(m, attentions, {}, ids, true);
  } catch (const ModelError& e) {
    const std::string prefix = "add_kv_cache: cannot add a KV cache: ";
    *why = e.what();
    if (why->rfind(prefix, 0) == 0) why->erase(0, prefix.size());
    return 0;
  }
  for (Node* att : attentions) {
    att->attributes.push_back(attr_int("masked_rows_unread", 1));
  }
  return static_cast<int64_t>(attentions.size());
}

}  // namespace fastopt::passes::kv_cache
