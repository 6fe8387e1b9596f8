// A KV-cache form: what a cached decoder looks like to whoever runs it. Its per-layer graph
// inputs (the past) and outputs (the present) and how they are named, the names of their
// length axis, how the graph learns P (the tokens the past holds), whether the present is the
// past's own buffer, and the keys genai_config.json names them under. The rewrites
// (add_kv_cache.cc, kv_cache_cross.cc, kv_cache_adopt.cc, the ORT lowering) read the entry of
// the form they write or recognise; Python reads the same table through _C.kv_cache_forms()
// (genai/config.py, genai/whisper.py), so no name is written twice.
//
// Every cache is (B, H, L, D) per layer, K and V apart; the names are
//   <kPastPrefix><layer><section>.key|value  and  <kPresentPrefix><layer><section>.key|value
// e.g. past_key_values.3.key, present.3.decoder.value.
//
// Adding a form: write one more entry below (a constexpr CacheForm, added to kForms), then
// the rewrite that builds it, reading the entry's fields rather than literals. The bindings list
// kForms (_C.kv_cache_forms()); Python reads an entry by name where it writes a genai config;
// tests/kv_cache/test_cache_forms.py holds each entry to the graph its rewrite writes (add the
// new one there). A form whose P comes from somewhere new needs a
// PastLength value and its case where P is built (SharedMask in kv_cache_mask.cc for
// kMaskWidth; kv_cache_cross.cc's past_length for kPastRows and kLengthInput) and, in place,
// where the ORT lowering gives GroupQueryAttention its seqlens_k (lower_attention_ort.cc).
#pragma once

#include <array>
#include <cstddef>
#include <string>

namespace fastopt::passes::kv_cache {

// The cache's graph inputs and outputs start with these (onnxruntime-genai's default names).
inline constexpr const char* kPastPrefix = "past_key_values.";
inline constexpr const char* kPresentPrefix = "present.";
// A model exported with a cache names its pasts as its exporter did (past_key_values.N.key,
// past_key.N, ...): an input starting with this is taken for a past (kv_cache_adopt.cc).
inline constexpr const char* kExportedPastPrefix = "past_";

// The other graph inputs the forms read.
inline constexpr const char* kInputIds = "input_ids";            // (B, S)
inline constexpr const char* kAttentionMask = "attention_mask";  // (B, T): past + new
inline constexpr const char* kPositionIds = "position_ids";      // (B, S), absolute
// A seq2seq decoder's: the encoder's output and its padding.
inline constexpr const char* kEncoderHiddenStates = "encoder_hidden_states";    // (B, E, D)
inline constexpr const char* kEncoderAttentionMask = "encoder_attention_mask";  // (B, E)
// An in-place seq2seq decoder's input (int32 (1)): the tokens its self-attention buffers hold
// (onnxruntime-genai whisper's name; the lowering's P where there is no attention_mask).
inline constexpr const char* kPastSequenceLength = "past_sequence_length";
// The length axis of a buffer bound as both past and present (in place, after lowering).
inline constexpr const char* kMaxSequenceLength = "max_sequence_length";

// How the cached graph learns P, the tokens the past holds.
enum class PastLength {
  kMaskWidth,    // P = Shape(attention_mask)[1] - S: the mask covers past + new (B, T)
  kPastRows,     // P = Shape(layer 0's past key)[2]: the past holds exactly its tokens
  kLengthInput,  // P = the input kPastSequenceLength: a max-length buffer's rows say nothing
  kEncoder,      // no P: a cross cache, the encoder's rows (filled once, passed through)
};

struct CacheForm {
  const char* name;         // the table's key: _C.kv_cache_forms()[name]
  const char* section;      // between the layer and .key|.value ("" or ".decoder", ...)
  const char* past_dim;     // the past input's axis 2 (dim_param), as add_kv_cache writes it
  const char* present_dim;  // the present output's axis 2
  PastLength past_length;
  // The present is the past's buffer, updated in place (GroupQueryAttention; genai's
  // search.past_present_share_buffer): both get axis 2 kMaxSequenceLength when lowered.
  bool shares_buffer;
  // genai_config.json's keys for these names: <genai>_key_names / <genai>_value_names
  // ("" where genai 0.18 has no such form).
  const char* genai_past;
  const char* genai_present;
};

// A decoder-only model (add_kv_cache on a no-cache export; an export with a cache is adopted
// into the same form, keeping its own past names): attention_mask (B, T) covers past + new.
inline constexpr CacheForm kStandard{"standard",
                                     "",
                                     "past_sequence_length",
                                     "total_sequence_length",
                                     PastLength::kMaskWidth,
                                     false,
                                     "past",
                                     "present"};
// The same, one max-length buffer per layer bound as past and present (kv_cache 2): the
// lowering's GroupQueryAttention reads seqlens_k / total_sequence_length from attention_mask.
inline constexpr CacheForm kInPlace{"inplace",
                                    "",
                                    "past_sequence_length",
                                    "total_sequence_length",
                                    PastLength::kMaskWidth,
                                    true,
                                    "past",
                                    "present"};
// An encoder-decoder's self-attention cache (optimum's names). The decoder has no
// attention_mask of its own (all rows advance together).
inline constexpr CacheForm kSeq2SeqSelf{"seq2seq",
                                        ".decoder",
                                        "past_decoder_sequence_length",
                                        "total_decoder_sequence_length",
                                        PastLength::kPastRows,
                                        false,
                                        "past",
                                        "present"};
inline constexpr CacheForm kSeq2SeqSelfInPlace{"seq2seq_inplace",
                                               ".decoder",
                                               "past_decoder_sequence_length",
                                               "total_decoder_sequence_length",
                                               PastLength::kLengthInput,
                                               true,
                                               "past",
                                               "present"};
// The cross-attention cache the decoder fills at its first step (Concat(past, projection of
// encoder_hidden_states), fed 0 rows after): cross_attention_cache 1.
inline constexpr CacheForm kSeq2SeqCross{"seq2seq_cross",
                                         ".encoder",
                                         "past_encoder_sequence_length",
                                         "encoder_sequence_length_out",
                                         PastLength::kEncoder,
                                         false,
                                         "",
                                         ""};
// The cross cache the encoder computes (cross_attention_cache 2, then move_cross_projections):
// the decoder reads the pasts, the encoder writes the presents (genai's whisper).
inline constexpr CacheForm kSeq2SeqCrossFromEncoder{"seq2seq_cross_from_encoder",
                                                    ".encoder",
                                                    "encoder_sequence_length_out",
                                                    "encoder_sequence_length_out",
                                                    PastLength::kEncoder,
                                                    false,
                                                    "cross_past",
                                                    "cross_present"};

inline constexpr std::array<const CacheForm*, 6> kForms = {
    &kStandard,           &kInPlace,      &kSeq2SeqSelf,
    &kSeq2SeqSelfInPlace, &kSeq2SeqCross, &kSeq2SeqCrossFromEncoder};

// The past (input) or present (output) name of a layer's keys or values.
inline std::string past_name(const CacheForm& f, size_t layer, bool value) {
  return kPastPrefix + std::to_string(layer) + f.section + (value ? ".value" : ".key");
}
inline std::string present_name(const CacheForm& f, size_t layer, bool value) {
  return kPresentPrefix + std::to_string(layer) + f.section + (value ? ".value" : ".key");
}
// The same with %d for the layer: the name patterns genai_config.json holds.
inline std::string name_pattern(const CacheForm& f, bool past, bool value) {
  return std::string(past ? kPastPrefix : kPresentPrefix) + "%d" + f.section +
         (value ? ".value" : ".key");
}

}  // namespace fastopt::passes::kv_cache
