// Proves the masks of an encoder-decoder's decoder (see kv_cache_cross.h) by evaluating them on
// probes with the walker mask_proof.cc uses for decoder-only models (mask_walker.h), over the
// seq2seq decoder's inputs:
//   input_ids (B, S) and encoder_hidden_states (B, E, D): shapes only;
//   encoder_attention_mask (B, E): values and shape.
// Admitted subgraphs read nothing else (constants aside), through ops the native evaluator
// computes exactly; a Shape of an activation is answered from its type when every dim is fixed or
// a symbol of those inputs' dims, or, above an op the evaluator cannot compute (a norm), when a
// dim of unknown size only sizes a broadcast (t5's zero cross-attention bias, mask_walker.h).
//
// Probes: every S in 1..8 with every E in 1..8 and, for each integer constant c of the subgraph
// with 8 < c <= 2048, S and E of c-1 .. c+2; each with a batch of encoder_attention_mask rows
// (unpadded, every right and left padding, a hole). The self-attention mask must be causal
// (key t visible to query s iff t <= s, whatever the encoder padding: the decoder has no padding
// of its own); the cross-attention mask must let every query see exactly the keys the row keeps.
// Why probes of this kind suffice for the admitted op set is argued in mask_proof.cc.
#include <string>
#include <utility>
#include <vector>

#include "passes/fusion_util.h"
#include "passes/kv_cache/kv_cache_cross.h"
#include "passes/kv_cache/mask_walker.h"

namespace fastopt::passes::kv_cache {
namespace {
using mask_walk::MaskInput;
using mask_walk::MaskWalker;
using mask_walk::Probe;
using mask_walk::TensorPtr;

constexpr int64_t kShort = 8;

// Probe length slots: 0 batch, then the decoder's and the encoder's lengths.
enum Slot : size_t { kBatch = 0, kDecoderLen = 1, kEncoderLen = 2 };

class Seq2SeqMaskProof {
 public:
  Seq2SeqMaskProof(const Model& m, const Graph& g, const Node* att, bool cross, const Value* mask)
      : g_(g), att_(att), cross_(cross), given_(mask), walker_(m, g, inputs()) {}

  bool run(std::string* why) {
    Value* mask = given_                      ? const_cast<Value*>(given_)
                  : att_->inputs().size() > 3 ? att_->inputs()[3]
                                              : nullptr;
    causal_ = int_attr_or(att_, "is_causal", 0) != 0;
    hq_ = int_attr_or(att_, "q_num_heads", 0);
    if (hq_ <= 0) return fail(why, "no q_num_heads");
    if (cross_ && causal_) return fail(why, "a causal cross-attention");
    if (!mask) {
      if (cross_ || causal_) return true;  // every key, or the causal flag the cache keeps
      return fail(why, "a decoder self-attention that is neither causal nor masked");
    }
    encoder_mask_ = graph_input(g_, kEncoderAttentionMask) != nullptr;
    if (const Node* table = float_table_gather(mask, g_)) {
      return fail(why, "it adds a learned position bias (Gather '" + table->name.value +
                           "' from the float table '" + table->inputs()[0]->name() +
                           "', as t5's relative position bias), which depends on the query's "
                           "position, and is not the relative position bias the rewrite "
                           "re-reads over the cached positions");
    }
    std::string err;
    if (!walker_.admit(mask, &err)) return fail(why, err);
    std::vector<int64_t> constants = walker_.constants();
    if (!walker_.evaluate(probe(1, 1), &err, &constants)) return fail(why, err);
    auto lengths = mask_walk::probe_lengths(constants, kShort, &err);
    if (!lengths) return fail(why, err);
    for (int64_t s : *lengths) {
      for (int64_t e : *lengths) {
        if (s > kShort && e > kShort && s != e) continue;  // long lengths: one axis at a time
        Probe p = probe(s, e);
        auto got = walker_.evaluate(p, &err);
        if (!got) return fail(why, err);
        if (!matches(*got, p, &err)) return fail(why, err);
      }
    }
    return true;
  }

 private:
  // encoder_attention_mask's values; the shapes of input_ids and encoder_hidden_states.
  static std::vector<MaskInput> inputs() {
    return {{kEncoderAttentionMask, false, true, {{0, kBatch}, {1, kEncoderLen}}},
            {kInputIds, false, false, {{0, kBatch}, {1, kDecoderLen}}},
            {kEncoderHiddenStates, false, false, {{0, kBatch}, {1, kEncoderLen}}}};
  }

  bool fail(std::string* why, const std::string& what) {
    if (why) *why = what;
    return false;
  }

  // Decoder length s, encoder length e; encoder_attention_mask rows: unpadded, every right and
  // left padding (1 and e / 2 past kShort) and a hole.
  static Probe probe(int64_t s, int64_t e) {
    Probe p;
    p.what = "decoder length " + std::to_string(s) + ", encoder length " + std::to_string(e);
    p.rows.emplace_back(e, 1);
    auto padded = [&](int64_t k, bool right) {
      std::vector<uint8_t> r(e, 1);
      for (int64_t i = 0; i < k; ++i) r[right ? e - 1 - i : i] = 0;
      p.rows.push_back(std::move(r));
    };
    if (e <= kShort) {
      for (int64_t k = 1; k < e; ++k) {
        padded(k, true);
        padded(k, false);
      }
    } else {
      for (int64_t k : {int64_t{1}, e / 2}) {
        padded(k, true);
        padded(k, false);
      }
    }
    if (e > 2) {
      std::vector<uint8_t> r(e, 1);
      r[e / 2] = 0;
      p.rows.push_back(std::move(r));
    }
    p.lengths = {static_cast<int64_t>(p.rows.size()), s, e};
    return p;
  }

  bool matches(const TensorPtr& mask, const Probe& p, std::string* err) const {
    if (!mask_walk::readable(*mask)) {
      *err = "the mask is not a tensor of rank <= 4 the check can read";
      return false;
    }
    const ByteRef bytes = mask->bytes();
    const int64_t seq = p.lengths[kDecoderLen];
    const int64_t keys = cross_ ? p.lengths[kEncoderLen] : seq;
    const int64_t full[4] = {static_cast<int64_t>(p.rows.size()), hq_, seq, keys};
    for (size_t b = 0; b < p.rows.size(); ++b) {
      for (int64_t s = 0; s < seq; ++s) {
        for (int64_t h = 0; h < hq_; ++h) {
          for (int64_t t = 0; t < keys; ++t) {
            const int want = cross_ ? !encoder_mask_ || p.rows[b][t] != 0 : t <= s;
            const int64_t at[4] = {static_cast<int64_t>(b), h, s, t};
            int got = mask_walk::read_mask(*mask, bytes.data(), full, at);
            if (got == 1 && causal_ && t > s) got = 0;
            if (got == -2) {
              *err = "the mask's shape does not broadcast to (B, Hq, S, keys)";
              return false;
            }
            if (got == -1) {
              *err =
                  "the mask holds values other than 0 and a masking value (a bias, such as a "
                  "relative position bias, not a mask)";
              return false;
            }
            if (got != want) {
              *err = "on a probe (" + p.what + ", row " + std::to_string(b) + ") query " +
                     std::to_string(s) + (got ? " sees" : " does not see") + " key " +
                     std::to_string(t) +
                     (cross_ ? ", unlike the encoder padding" : ", unlike a causal mask");
              return false;
            }
          }
        }
      }
    }
    return true;
  }

  const Graph& g_;
  const Node* att_;
  bool cross_;
  const Value* given_;
  MaskWalker walker_;
  bool causal_ = false;
  bool encoder_mask_ = false;  // the graph has an encoder_attention_mask input
  int64_t hq_ = 0;
};

}  // namespace

bool prove_seq2seq_mask(const Model& m, const Graph& g, const Node* att, bool cross,
                        std::string* why, const Value* mask) {
  return Seq2SeqMaskProof(m, g, att, cross, mask).run(why);
}

}  // namespace fastopt::passes::kv_cache
