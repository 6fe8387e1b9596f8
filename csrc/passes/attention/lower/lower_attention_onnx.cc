// Lowering of the internal Attention op for target "onnx": ONNX Attention-23, whose semantics the
// internal op copies (internal_op.h), so the node is renamed rather than rebuilt:
//
//   ai.fastopt.internal::Attention(Q, K, V, mask?)  ==>  Attention-23(Q, K, V, attn_mask?)
//
// The cached form (internal_op.h: K = Concat(past_k, k_new) -> graph output present, same for V)
// takes Attention-23's own cache instead, the Concats going away:
//
//   past_k  k_new                   Q  k_new  v_new  mask  past_k  past_v
//       \   /                        \    \    |     /      /      /
//      Concat(2) -> present_k  ==>      Attention-23 (is_causal as set)
//          \                             |       |            |
//   Q ---- Attention(Q, ., ., mask)      Y   present_k    present_v   (the graph outputs)
//
// Attention-23's present is Concat(past, K) on axis 2 and its mask covers the P+S columns; its
// causal mask is bottom-right aligned (key j seen by query i iff j <= i + P), as the internal
// op's (ORT 1.32 CPU, ops.md 1.3), so prefill (P = 0), decode and chunked steps stay exact.
//
// 4-D BNSH inputs; q_num_heads/kv_num_heads are carried (Attention-23 needs them only for 3-D
// inputs, but they cost nothing and document GQA), scale, is_causal, softmax_precision and softcap
// as set (ORT 1.32 CPU runs softcap, after the scale and before the mask:
// tests/ort_behaviour/test_softcap_order.py). ORT runs it on CPU since 1.23 (float, fp16; bool or
// float masks).
#include "passes/attention/internal_op.h"
#include "passes/attention/lowering_ops.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {

// ORT 1.32's Attention-23 (CPU) wants the mask's query axis to be S itself, not 1 broadcast to
// it ("attn_mask->Shape()[-2] == Q->Shape()[2]"): a cross-attention's (B, 1, 1, T) encoder mask
// with a decoder step of several tokens. Such a mask is expanded over the queries.
Value* mask_over_queries(pattern::Rewriter& rw, Value* mask, Value* q) {
  const int r = value_rank(mask);
  if (r < 2 || same_length(mask, r - 2, q, 2)) return mask;
  Value* s = rw.op1("Slice", {rw.op1("Shape", {q}), ints(rw, {2}), ints(rw, {3})});
  std::vector<Value*> parts;
  if (r > 2) parts.push_back(ints(rw, std::vector<int64_t>(static_cast<size_t>(r - 2), 1)));
  parts.push_back(s);
  parts.push_back(ints(rw, {1}));
  Value* target = rw.op1("Concat", parts, one_attr(pattern::attr_int("axis", 0)));
  return rw.op1("Expand", {mask, target});
}

}  // namespace

pattern::Replacement lower_attention_onnx(Node* node, pattern::Rewriter& rw, PassContext& ctx) {
  const int64_t opset = default_opset(*rw.graph().model());
  if (opset < kFusedOpsOpset) {
    return rw.fail("the model's opset is " + std::to_string(opset) +
                   " (Attention needs 23: run convert_version with opset=23 first)");
  }
  if (node->inputs().size() > 4) return rw.fail("attention sinks: Attention-23 has no sink input");
  std::vector<Attribute> attrs;
  for (const char* name :
       {"scale", "is_causal", "q_num_heads", "kv_num_heads", "softmax_precision", "softcap"}) {
    if (const Attribute* a = node->attribute(name)) attrs.push_back(pattern::copy_attribute(*a));
  }
  const std::optional<CachedKV> cache = cached_kv(node);
  std::vector<Value*> in = node->inputs();
  // Attention-23 gives the internal op's 0 for rows whose every key a bool mask hides. An export
  // that masked with a finite value has softmax(scores + v) there (masked_rows.h): its value as
  // an additive mask sums the same (fp32); where v absorbs the scores any absorbing value does
  // but the dtype's lowest, which ORT 1.32 reads as -inf (a 0 row;
  // tests/attention/test_masked_rows.py probes both): absorbing_mask_value.
  if (in.size() > 3 && in[3] && dtype_of(in[3]) == kBool &&
      masked_rows(node) != MaskedRows::kZero && masked_rows(node) != MaskedRows::kUnread) {
    const int32_t dtype = dtype_of(in[0]);
    const bool mean = masked_rows(node) == MaskedRows::kMean;
    if (!mean && dtype != kFloat) {
      return rw.fail("rows whose every key is masked are softmax(scores + " +
                     std::to_string(masked_value(node)) +
                     ") in the export, which only an fp32 mask reproduces");
    }
    const double v = mean ? absorbing_mask_value(dtype) : masked_value(node);
    in[3] = shared_op(rw, "Where",
                      {in[3], float_scalar(rw, dtype, false),
                       rw.initializer("attention_masked", scalar_tensor(dtype, v))});
    ctx.counters["rows with every key masked: an additive mask"] += 1;
  }
  if (in.size() > 3 && in[3]) in[3] = mask_over_queries(rw, in[3], in[0]);
  if (!cache) return std::vector<Value*>{rw.op1("Attention", in, std::move(attrs))};

  if (in.size() > 4) return rw.fail("inputs after the mask");
  // New rows not shown to have the query's length (a cross-attention's cache, kv_cache_cross.cc:
  // the encoder's rows on the first step, none after): ORT 1.32's Attention-23 refuses an empty
  // K, so the op reads the Concats, which stay.
  if (!same_length(in[0], 2, cache->k_new, 2, 4)) {
    ctx.counters["Attention-23 reading a cross cache's Concat"] += 1;
    return std::vector<Value*>{rw.op1("Attention", in, std::move(attrs))};
  }
  Value* mask = in.size() > 3 ? in[3] : nullptr;
  std::vector<Value*> outs =
      rw.op("Attention", {in[0], cache->k_new, cache->v_new, mask, cache->past_k, cache->past_v},
            std::move(attrs), 3);
  if (std::string why = adopt_presents(rw.graph(), *cache, outs[1], outs[2], node); !why.empty()) {
    return rw.fail(why);
  }
  ctx.counters["Attention-23 with past/present"] += 1;
  return std::vector<Value*>{outs[0]};
}

}  // namespace fastopt::passes
