// The attention fusion's walk (fuse_attention.cc): from the second MatMul back through the
// exporter variants of scaled dot-product attention, each step a named check that fails with
// the reason the subgraph is not fused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "analysis/shape_facts.h"
#include "ir/graph.h"
#include "passes/attention/fuse/alibi.h"
#include "passes/attention/fuse/softcap.h"

namespace fastopt::passes::attention_walk {

// The producer of `v` when it is a standard `op` node, else null.
Node* producer_of(const Value* v, const char* op);

struct Found {
  Value* q = nullptr;
  Value* k = nullptr;  // BNSH, or BSNH when k_bshd
  Value* v = nullptr;
  bool k_bshd = false;
  Value* mask = nullptr;
  bool mask_bool = false;
  Value* mask_additive = nullptr;  // the Where(c, 0, lowest) a boolean mask was read from
  double mask_value = 0;           // ... its `lowest` (or masked_fill's value), when finite
  int32_t mask_value_dtype = 0;    // the dtype it is added in
  // alibi.h: a second additive term (ALiBi's bias), masked_fill's Where(c, value, scores), and
  // flat (B*H, S, T) scores between the Reshapes `scores3` -> `scores4` and `probs4` -> 3-D.
  Value* bias = nullptr;
  alibi::FlatBias bias_flat = alibi::FlatBias::kNone;
  Value* masked_value = nullptr;  // mask is then masked_fill's condition (true = masked)
  bool flat = false;
  bool flat_out_4d = false;  // the flat rule's root gives (B, H, S, Dv) (y replaces it as is)
  int position_terms = 0;    // disentangled.h: reads of flat Q / K for the bias's terms
  Value* q3 = nullptr;       // flat Q (B*H, S, D): what Shape reads of the flat output are given
  Value *scores3 = nullptr, *scores4 = nullptr, *probs4 = nullptr, *probs3 = nullptr;
  double scale = 1.0;
  double softcap = 0;             // c of c * tanh(scale * QK^T / c), 0 for none
  Value* sink_logits = nullptr;   // sinks.h: the constant (1, H, 1, 1) per-head sink logits
  std::shared_ptr<Tensor> sinks;  // ... as the internal op's (Hq) input, once they fit
  int32_t softmax_precision = 0;
  int64_t hq = 0, hkv = 0;
  std::vector<Node*> nodes;           // matched nodes (removed when dead after the rewrite)
  std::vector<Value*> intermediates;  // values that must not be used outside the match
};

// Walks back from the second MatMul through the exporter variants above (a code rule's match:
// the variants are optional ops in any order, which a pattern cannot say).
class AttentionWalk {
 public:
  explicit AttentionWalk(Found& f) : f_(f) {}
  std::string error;

  bool fail(std::string why);

  void take(Node* n);

  // Mul/Div by a constant scalar: folds it into the scale; true when one was peeled.
  // Sets error when the factor is a scalar that is not constant.
  bool peel_scale(Value*& x);

  // HF repeat_kv: Reshape(Expand(Unsqueeze(kv, [2]), (B,Hkv,G,T,D)), (B,Hkv*G,T,D)).
  Value* through_repeat_kv(Value* x);

  // K^T = Transpose(K, (0,1,3,2)) of BNSH K, or Transpose(k_BSHD, (0,2,3,1)).
  bool take_kt_transpose(Node* t);

  // torchlib: Reshape(k, (-1, T, D)) -> Transpose(0,2,1) -> Reshape(lead..., D, T).
  bool take_kt_reshapes(Node* outer);

  // Flat heads: Transpose(Reshape(k, (B*H, T, D)), (0, 2, 1)).
  bool take_flat_kt(Value* kt);

  // K^T forms; sets f_.k (BNSH before transposing, or BSNH with k_bshd).
  bool match_kt(Value* kt);

  analysis::ShapeFacts& facts() { return analysis::facts_of(*model_); }

  // Flat heads (alibi.h): x3 (B*H, L, D) as the 4-D x it was reshaped from.
  Value* unflatten(Value* x3, const char* what);

  bool check_flat();

  // A second additive term on the scores (ALiBi's bias, alibi.h).
  bool take_bias(Node* add, Value*& s);

  // masked_fill: Where(masked (bool), value <= kMaskedBelow, scores) (mpt).
  bool take_masked_fill(Node* w, Value*& s);

  // Does `x` lead to the scores MatMul through scale/Cast ops?
  static bool reaches_matmul(const Value* x, int depth = 0);

  bool match_mask(Value* m, int32_t score_dtype);

  // Attention sinks (sinks.h) in the forms the internal op states: one logit per query head in
  // Q's dtype, the softmax in it too, no score bias, and rows whose every key is masked giving
  // 0 (the sink takes them: -inf, or a masking value that absorbs the scores).
  bool sinks_fit(int32_t t);

  // The walk from the Softmax down to the scores MatMul.
  struct Scores {
    Node* softmax = nullptr;
    Value* s = nullptr;  // the scores where the walk stands
    int32_t dtype = 0;   // the softmax's dtype
    Node* mm = nullptr;  // the scores MatMul, once reached
    bool casted = false;
    bool scaled = false;  // a scale factor was peeled (the walk meets a later one first)
  };

  // Flat heads (alibi.h): the output is Reshape(probs4 (B, H, S, T)) to 3-D.
  void take_flat_probs(Value*& p);

  // Where(IsNaN(p), 0, p) of the Softmax (rows whose keys are all masked give 0).
  bool take_nan_guard(Node* w, Scores& sc);

  // The Softmax over the scores joined to a sink column (sinks.h).
  bool take_sinks(Value* p, Scores& sc);

  // Probabilities side: [Cast] <- [Where(IsNaN(s), 0, s)] <- Softmax, or the sinks' form.
  bool match_probs(Value* p, Scores& sc);

  // 4-D scores normalized over the keys.
  bool check_softmax(Scores& sc);

  // fuzz_pipeline: a one-input MatMul on the scores (read as two) overflowed.
  bool check_score_arity(const Node* n);

  bool take_score_cast(Node* n, Scores& sc);

  // Add(scores, mask): the attention mask.
  bool take_mask_add(Node* n, Value*& s);

  bool take_softcap(const attention_softcap::Softcap& cap, Scores& sc);

  // Flat heads: the scores Reshape (B*H, S, T) -> (B, H, S, T).
  bool take_flat_scores(Node* n, Scores& sc);

  // One op of the scores side: [Add(mask)] / [Cast] / [Mul|Div c] in any order, down to
  // MatMul(q', Kt').
  bool step_scores(Scores& sc);

  // Q side: [Mul|Div c] (flat heads: Reshape back to 4-D).
  bool match_q(Value* q);

  // V side: [Cast] <- [repeat_kv].
  bool match_v(Value* v);

  // Float Q, K, V of one dtype, 4-D; the softmax in it or in fp32; the mask's and output's.
  bool check_types(const Scores& sc, int32_t out_dtype);

  // Heads: from Q (or from the repeated K it is multiplied with), kv heads from K and V.
  bool read_heads(const Scores& sc);

  // Nothing computed inside may be used outside (Shape reads of the repeated K excepted:
  // torchlib's K^T reshapes read them, and they only need the shape).
  bool check_inside(const Node* root);

  bool match(Node* root);

 private:
  Found& f_;
  Model* model_ = nullptr;
};

}  // namespace fastopt::passes::attention_walk
