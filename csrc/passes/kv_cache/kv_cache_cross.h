// add_kv_cache for the decoder of an encoder-decoder (bart, marian, whisper, ...; optimum's
// decoder_model.onnx: input_ids, encoder_hidden_states[, encoder_attention_mask] -> logits),
// kv_cache_cross.cc; the masks' proofs in kv_cache_cross_mask.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "passes/kv_cache/kv_cache.h"

namespace fastopt::passes::kv_cache {

// Rewrites the decoder's self- and cross-attentions into the cached form (kv_cache_cross.cc's
// header); refuses (ModelError, nothing changed) what it cannot prove equal.
int64_t add_cross_cache(Model& m, const std::vector<Node*>& attentions, int64_t mode,
                        PassContext& ctx);

// Whether the mask of the internal Attention `att` (`mask`, or its input 3 when null) is what the
// cached form installs: causal (self-attention, `cross` false) or the encoder padding, every
// query seeing the keys encoder_attention_mask keeps (cross-attention; every key without that
// input). `why` says what differs when it is not.
bool prove_seq2seq_mask(const Model& m, const Graph& g, const Node* att, bool cross,
                        std::string* why, const Value* mask = nullptr);

// A Gather from a constant float table in v's ancestry (not through Shape or Size): a learned
// position bias; null when there is none (kv_cache_cross_bias.cc).
const Node* float_table_gather(const Value* v, const Graph& g);

// t5's relative position bias in a self-attention's mask (kv_cache_cross_bias.cc).
struct RelativeBias {
  Value* bias = nullptr;       // (1, H, S, S): table[f(key - query), h]
  Value* mask_part = nullptr;  // c of Where(c, bias, lowest) or m of Add(bias, m): proven, replaced
  Node* relative = nullptr;    // Sub of the key row and the query column
  int query_operand = 1;       // the Sub's input that is the query column
  std::vector<Node*> chain;    // rel .. bias: their (S, S) types are dropped by the rewrite
};
struct BiasedLayer {
  Node* att;
  RelativeBias bias;
};

// The bias of `att`'s mask, proven to be a function of key - query positions over the decoder's
// length; nullopt when the mask reads no float table (no bias), or, with `why` set, when it does
// but the structure is not proven. No edits.
std::optional<RelativeBias> match_relative_bias(const Model& m, const Graph& g, const Node* att,
                                                const Value* input_ids, std::string* why);

// The biases read absolute positions (query P + s: `query_column` (S, 1), keys 0 .. T - 1:
// `key_positions` (T)); each layer's mask becomes Where(causal, bias, lowest).
void use_relative_biases(Graph& g, KvCacheBuilder& b, const std::vector<BiasedLayer>& layers,
                         Value* query_column, Value* key_positions, Value* causal,
                         PassContext& ctx);

}  // namespace fastopt::passes::kv_cache
