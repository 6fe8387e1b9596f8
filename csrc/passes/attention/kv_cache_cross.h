// add_kv_cache for the decoder of an encoder-decoder (bart, marian, whisper, ...; optimum's
// decoder_model.onnx: input_ids, encoder_hidden_states[, encoder_attention_mask] -> logits),
// kv_cache_cross.cc; the masks' proofs in kv_cache_cross_mask.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "passes/attention/kv_cache.h"

namespace fastopt::passes::kv_cache {

// The graph input that marks a seq2seq decoder.
inline constexpr const char* kEncoderHiddenStates = "encoder_hidden_states";

// Rewrites the decoder's self- and cross-attentions into the cached form (kv_cache_cross.cc's
// header); refuses (ModelError, nothing changed) what it cannot prove equal.
int64_t add_cross_cache(Model& m, const std::vector<Node*>& attentions, int64_t mode,
                        PassContext& ctx);

// Whether the mask of the internal Attention `att` is what the cached form installs: causal
// (self-attention, `cross` false) or the encoder padding, every query seeing the keys
// encoder_attention_mask keeps (cross-attention; every key without that input). `why` says what
// differs when it is not.
bool prove_seq2seq_mask(const Model& m, const Graph& g, const Node* att, bool cross,
                        std::string* why);

}  // namespace fastopt::passes::kv_cache
