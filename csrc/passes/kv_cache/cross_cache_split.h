// An encoder that computes the cross cache: the decoder's cross-attention key and value
// projections moved into the encoder graph (onnxruntime-genai's whisper form, where the encoder
// gives present_key_cross_* and the decoder reads them as inputs, without encoder_hidden_states).
#pragma once

#include <cstdint>
#include <string>

#include "ir/graph.h"

namespace fastopt::passes::kv_cache {

// `decoder` is what add_kv_cache writes with cross_attention_cache 2: graph outputs
// present.<i>.encoder.key|value computed from its input encoder_hidden_states, and the
// cross-attentions reading past_key_values.<i>.encoder.key|value. The nodes and constants that
// compute those outputs are copied into `encoder`, reading its output `hidden` where they read
// encoder_hidden_states, and become the encoder's outputs under the same names; the decoder loses
// those outputs, the nodes only they needed, and its input encoder_hidden_states. Weights are
// shared, not copied: the encoder's tensors are views of the decoder's files.
//
// Refused (ModelError naming the reason, neither model changed) when the decoder has no such
// outputs, when they read a graph input other than encoder_hidden_states or a node with a
// subgraph, when encoder_hidden_states feeds anything else in the decoder (it would still need
// it), when `hidden` is not an output of the encoder of the same element type, when a name is
// taken in the encoder, or when the models import different versions of an opset the moved
// nodes use. Returns the number of outputs moved.
int64_t move_cross_projections(Model& encoder, const std::string& hidden, Model& decoder);

}  // namespace fastopt::passes::kv_cache
