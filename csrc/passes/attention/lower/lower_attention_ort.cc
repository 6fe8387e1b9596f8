// Lowering of the internal Attention op (internal_op.h) for target "ort": com.microsoft
// MultiHeadAttention or GroupQueryAttention, exact to the internal op's semantics or not at all.
// The choice is made first (ort_plan.h: every check, no edit); this file builds what it chose.
//
//   q3 (B,S,Hq*D) -Reshape-Transpose(0,2,1,3)- Q -+
//   k3 (B,T,Hkv*D) ---- ... same split ------- K -+                 q3, k3, v3 (3-D; else
//   v3 (B,T,Hkv*Dv) --- ... same split ------- V -+- Attention ==>  split back from Q/K/V)
//                                          mask? -+     |           bias (B|1,Hq|1,S,T)?
//                                                       Y           MHA | GQA -> (B,S,Hq*Dv)
//                                                       |               |
//                      Transpose(0,2,1,3)-Reshape(B,S,Hq*Dv)          (read directly)
//
// Both exporters split heads (head_split.h) as Reshape + Transpose(0,2,1,3) of the projection
// (rotary before or after) and merge them back with the inverse pair. The lowering reads the 3-D
// projection when the Reshape provably keeps (B, S) (else inserts Transpose + Reshape), and hands
// the 3-D output to the merging Reshape's readers when Y's only readers are that pair (else returns
// Y as Reshape + Transpose of it). MHA takes K/V as BNSH when they have no 3-D source, unless
// V's head size is not K's (multi-latent attention), which ORT 1.32's MHA takes only as 3-D K/V
// (with a cache, whose past_value must have K's head size, the node stays standard ops).
//
// Which op, per node (latencies in bench/results/lower_attention_ort.md):
//   fp16 / bf16                 -> GroupQueryAttention (CPU fp16; CUDA fp16/bf16), or MHA when
//                                  GQA does not fit (cross-attention: K/V of the encoder's length)
//   fp32, Hkv == Hq             -> MultiHeadAttention
//   fp32, Hkv <  Hq             -> GroupQueryAttention (CPU only: no fp32 GQA on CUDA), or MHA
//                                  over repeated kv heads when GQA does not fit (below)
//   options cuda=1              -> GQA only for fp16/bf16, causal, without mask (CUDA rejects
//                                  GQA's attention_bias); everything else MHA (repeated kv heads
//                                  when Hkv < Hq)
//   sinks (gpt-oss, sinks.h)    -> GroupQueryAttention's head_sink, as softcap below.
//   softcap (gemma2)            -> GroupQueryAttention's softcap, whatever the dtype (MHA and
//                                  packed Attention cannot cap); standard ops when GQA does not fit
// GQA fits when T == S is shown (it takes K/V of the query's length) and the head size is
// static, a multiple of 8 (kernel check) and the same for K and V.
//
// Packed QKV (encoders; option packed_attention, below; packed_qkv.h): com.microsoft Attention,
// the projections inside the op, when Q, K, V are head splits of projections of ONE 3-D input:
//
//   x -MatMul(Wq)(+bq)?- q3 -split- Q -+
//   x -MatMul(Wk)(+bk)?- k3 -split- K -+- Attention ==>  Attention(x, [Wq|Wk|Wv], [bq|bk|bv],
//   x -MatMul(Wv)(+bv)?- v3 -split- V -+                    -, -, bias; num_heads, scale,
//                                mask? -+                    unidirectional?, qkv_hidden_sizes?)
//
// Both exporters emit BERT-like self-attention this way (the bias Add on either side). Weights
// must be constant 2-D of Q's dtype, biases 1-D (a missing one packs as zeros: the one place
// bytes are copied, into two new initializers), Hq == Hkv, no cache. The projections must
// feed nothing but the head split, or only shapes besides it (which then read x: same shape when
// the weight is square), so that they go dead. ORT 1.32 CPU runs it in fp32 (fp16 through
// inserted Casts, still faster than GQA on the bert fixtures); its attention_bias must be
// (B|1, 1|N, S, T), which the mask below is. Measured against MHA/GQA (ORT CPU, 2 threads,
// batch 1; bench/attention/bench_encoder_attention.py, bench/results/lower_attention_ort.md):
// 0.89-0.91x the latency on the bert fixtures (seq 128), 0.98-1.00x on a BERT-base-sized export
// (seq 128, 512). So option packed_attention defaults to 1 = non-causal (encoders); 2 = causal too
// (unidirectional=1 is exact: S == T, one input); 0 = off. With option cuda=1 the default is 0
// (the CUDA lowering is unchanged). When packing does not apply the node falls through to
// MHA/GQA below (explained as "not packed into Attention: ...").
//
// Masks become the ops' additive attention_bias (B|1, Hq|1, S, T), expanded over (S, T) when
// the mask broadcasts there: Where(mask, 0, lowest) for bool masks; additive masks are clamped
// to the dtype's lowest unless provably finite (a row of -inf is NaN in GQA fp16, and a NaN pad
// row poisons valid rows in the next layer). GQA gets seqlens_k = S-1 and total_sequence_length
// = S for every batch row, so padding on either side is the bias's job and stays exact. Rows
// whose every key is masked (pad queries) get what the internal op gives there (masked_rows.h):
// the export's own bias value where the op then sums every key in fp32 as the export did, else
// a Where on the output. MHA's causal mask is top-left aligned, the internal op's bottom-right:
// causal MHA needs S == T too (or S == 1, where causal masks nothing).
//
// S == T is asked of the shape analysis (shapes.h): TorchScript exports lose the dims in their
// types, but the analysis carries Q's and K's length from the one hidden state X through the
// head splits (Reshape targets of 0 or Shape(X)[1], -1 resolved), Transpose, RotaryEmbedding,
// norms and projections. Cross-attention (K from another input) has another length symbol; a
// Slice of the sequence axis another expression.
//
// The cached form (internal_op.h; add_kv_cache): K = Concat(past_k input, k_new, axis 2) whose
// output is the graph output present_k, same for V. The op takes the cache itself and the
// Concats go (its present outputs take over the graph outputs' names):
//
//   past_k  k_new -> Concat -> present_k        q3 k3_new v3_new past_k past_v seqlens_k total
//      Q ---------> Attention(Q, ., ., mask) ==>    GroupQueryAttention(..., bias, ...,
//                                                     query_seqlens) -> out3, present_k/_v
//   GQA (fp16/bf16, or Hkv < Hq): seqlens_k = T-1 and total = T for every row, T = P + S
//     (from the mask's shape when its type shows (B, 1, S, T)); the bias carries padding; causal
//     = 1 (the form's mask is causal, and query_seqlens needs it); query_seqlens = S per row
//     (ORT >= 1.32), without which a chunk after a past (S > 1, P > 0) runs only for batch 1.
//   MHA (fp32, Hkv == Hq; and options cuda=1, whose GQA rejects a bias): past_key/past_value
//     (B, N, P, H) + attention_bias, unidirectional 0. Hkv < Hq without a fitting GQA fails:
//     MHA over repeated heads would make an Hq-head present.
//   kv_cache == 2 (in place): GQA on one max-length buffer per layer (past and present dims
//     become "max_sequence_length" so a runtime binds one tensor to both; the kernel detects the
//     sharing by pointer), seqlens_k = ReduceSum(attention_mask, 1) - 1 and total =
//     Shape(attention_mask)[1] (int32) and query_seqlens = min(S, the row's tokens) once for all
//     layers, so that chunks after a past run for batch > 1; no bias for a boolean mask:
//     valid tokens must be contiguous from 0 (right padding), which is what the runtimes feed; a
//     float mask (ALiBi's score bias) is attention_bias at (S, total). RotaryEmbedding
//     (com.microsoft, full, same cos/sin for Q and K; on the 3-D projections or on the BNSH
//     heads) folds in as do_rotary when the head size is a multiple of 16 (kernel check); GQA
//     then computes positions past_seqlen + s itself.
//
// Fails (the driver then writes standard ops) when: the dtype is not fp32/fp16/bf16; S == T is
// needed and not shown; GQA does not fit and MHA cannot stand in (fp16, or no static head size
// to repeat kv heads with); softmax_precision is neither the dtype nor fp32 (the kernels
// accumulate the softmax in fp32); inputs after the mask or extra outputs are present.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention/head_split.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/lower/ort_plan.h"
#include "passes/attention/lower/packed_qkv.h"
#include "passes/attention/lowering_ops.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/cache_form.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// True when every element of `v` is finite for sure (so that no bias row is all -inf).
bool known_finite(const Value* v, int depth = 0) {
  if (depth > 16) return false;
  if (auto t = constant_tensor(v)) {
    auto d = tensor_doubles(*t, uint64_t{1} << 22);
    if (!d) return false;
    for (double x : *d) {
      if (!std::isfinite(x)) return false;
    }
    return true;
  }
  const Node* n = v->producer();
  if (!n || !n->domain.value.empty() || n->inputs().empty()) return false;
  const std::string& op = n->op_type;
  if (op == "Where")
    return known_finite(n->inputs()[1], depth + 1) && known_finite(n->inputs()[2], depth + 1);
  if (op == "Expand" || op == "Unsqueeze" || op == "Squeeze" || op == "Reshape" ||
      op == "Transpose" || op == "Identity" || op == "Slice" || op == "Tile") {
    return n->inputs()[0] && known_finite(n->inputs()[0], depth + 1);
  }
  return false;
}

// bsd_source, else Transpose + Reshape(0, 0, -1) of x4.
Value* to_bsd(Rewriter& rw, Value* x4, int32_t dtype) {
  if (Value* x3 = bsd_source(rw.graph(), x4, dtype)) return x3;
  std::vector<Attribute> perm;
  perm.push_back(attr_ints("perm", {0, 2, 1, 3}));
  Value* bshd = rw.op1("Transpose", {x4}, std::move(perm));
  return rw.op1("Reshape", {bshd, ints(rw, {0, 0, -1})});
}

// Dim 2 of a cache value becomes "max_sequence_length" (in place: past and present are one
// buffer, so one name lets a runtime bind the same tensor to both).
void set_max_length(Value* x) {
  if (!x->type.known || !x->type.is_tensor || !x->type.has_shape || x->type.dims.size() != 4) {
    return;
  }
  x->type.encoded = ByteRef{};
  x->type.dims[2] = Dim{std::nullopt, std::string(kv_cache::kMaxSequenceLength)};
}

// The ops' additive bias (B|1, Hq|1, S, T) from the mask, or null without one. In place, GQA's
// causal flag and seqlens_k stand for a boolean mask (right padding: the cache holds each row's
// tokens from position 0); a float one is a score bias (ALiBi: add_kv_cache's Where(allowed,
// bias, lowest)), read at [b, h, s, t] for the keys t <= seqlens_k[b], whose (S, T) ORT 1.32
// requires exactly: T = total_sequence_length, the attention_mask's width, not the buffer's.
Value* build_bias(Rewriter& rw, const OrtLoweringPlan& p, Value* q3, Value* k3) {
  if (!p.mask || (p.inplace && p.mask_dtype == kBool)) return nullptr;
  if (p.inplace) {
    Value* s = rw.op1("Gather", {rw.op1("Shape", {q3}), ints(rw, {1})});
    Value* t = p.mask_input
                   ? rw.op1("Gather", {shared_op(rw, "Shape", {p.mask_input}), ints(rw, {1})})
                   : rw.op1("Add", {shared_op(rw, "Cast", {p.past_length_input},
                                              one_attr(attr_int("to", kInt64))),
                                    s});
    Value* shape = rw.op1("Concat", {ints(rw, {1, 1}), s, t}, one_attr(attr_int("axis", 0)));
    return rw.op1("Expand",
                  {shared_op(rw, "Max", {p.mask, float_scalar(rw, p.dtype, true)}), shape});
  }
  const bool full = p.mask_full;
  Value* m = p.mask;
  if (p.mask_dtype != kBool && !known_finite(p.mask)) {
    m = shared_op(rw, "Max", {m, float_scalar(rw, p.dtype, true)});
  }
  if (!full) {
    Value* s = nullptr;
    Value* t = nullptr;
    if (!p.qkv.empty()) {  // S == T: one input; its shape keeps the projections dead
      s = rw.op1("Gather", {rw.op1("Shape", {p.qkv.front().x}), ints(rw, {1})});
      t = s;
    } else if (p.cache) {  // T = P + the new rows (K itself is the Concat that goes away)
      s = rw.op1("Gather", {rw.op1("Shape", {q3}), ints(rw, {1})});
      // A cross-attention's new rows are the encoder's, not the query's (kv_cache_cross.cc).
      Value* fresh = p.kv_query_length ? s
                     : k3 ? rw.op1("Gather", {rw.op1("Shape", {k3}), ints(rw, {1})})
                          : rw.op1("Gather", {rw.op1("Shape", {p.k_new}), ints(rw, {2})});
      t = rw.op1("Add",
                 {rw.op1("Gather", {rw.op1("Shape", {p.cache->past_k}), ints(rw, {2})}), fresh});
    } else {
      s = rw.op1("Gather", {rw.op1("Shape", {q3}), ints(rw, {1})});
      t = k3 ? rw.op1("Gather", {rw.op1("Shape", {k3}), ints(rw, {1})})
             : rw.op1("Gather", {rw.op1("Shape", {p.k}), ints(rw, {2})});
    }
    Value* shape = rw.op1("Concat", {ints(rw, {1, 1}), s, t}, one_attr(attr_int("axis", 0)));
    m = rw.op1("Expand", {m, shape});
  }
  if (p.mask_dtype == kBool) {
    Value* masked = p.bias_masked_value != 0 ? constant(rw, "attention_masked",
                                                        scalar_tensor(p.dtype, p.bias_masked_value))
                                             : float_scalar(rw, p.dtype, true);
    m = shared_op(rw, "Where", {m, float_scalar(rw, p.dtype, false), masked});
  }
  return m;
}

// What a built op gives: its (B, S, Hq*Dv) output and, with a cache, its present outputs.
struct BuiltOp {
  Value* out3 = nullptr;
  Value* present_k = nullptr;
  Value* present_v = nullptr;
};

// GQA's seqlens_k, total_sequence_length and query_seqlens (null when not needed).
struct GqaLengths {
  Value *seqlens = nullptr, *total = nullptr, *query_lens = nullptr;
};

GqaLengths gqa_lengths(Rewriter& rw, const OrtLoweringPlan& p, Value* q3) {
  GqaLengths l;
  if (p.inplace && p.past_length_input) {
    // Every row holds past_sequence_length tokens before the S new ones (a seq2seq decoder:
    // rows advance together): total = past + S, seqlens_k = total - 1 for each row.
    Value* shape = shared_op(rw, "Shape", {q3});
    Value* s = shared_op(rw, "Gather", {shape, ints(rw, {1}, true)}, one_attr(attr_int("axis", 0)));
    Value* past = shared_op(rw, "Squeeze", {p.past_length_input, ints(rw, {0})});
    l.total =
        shared_op(rw, "Add", {past, shared_op(rw, "Cast", {s}, one_attr(attr_int("to", kInt32)))});
    Value* batch = shared_op(rw, "Gather", {shape, ints(rw, {0})}, one_attr(attr_int("axis", 0)));
    l.seqlens =
        shared_op(rw, "Expand", {shared_op(rw, "Sub", {l.total, int32_scalar(rw, 1)}), batch});
    // query_seqlens = S per row: a chunk after a past (S > 1, P > 0) runs for batch > 1 too.
    l.query_lens = shared_op(rw, "Expand",
                             {shared_op(rw, "Cast", {s}, one_attr(attr_int("to", kInt32))), batch});
    return l;
  }
  if (p.inplace) {
    // seqlens_k = valid tokens - 1 per row, total = the mask's width: once for all layers.
    Value* shape = shared_op(rw, "Shape", {p.mask_input});
    Value* width =
        shared_op(rw, "Gather", {shape, ints(rw, {1}, true)}, one_attr(attr_int("axis", 0)));
    l.total = shared_op(rw, "Cast", {width}, one_attr(attr_int("to", kInt32)));
    Value* valid = shared_op(rw, "ReduceSum", {p.mask_input, ints(rw, {1})},
                             one_attr(attr_int("keepdims", 0)));
    Value* valid32 = shared_op(rw, "Cast", {valid}, one_attr(attr_int("to", kInt32)));
    l.seqlens = shared_op(rw, "Sub", {valid32, int32_scalar(rw, 1)});
    // query_seqlens = S, or a row's tokens where it has fewer (right padding): a chunk after a
    // past (S > 1, P > 0) then runs for batch > 1 too ("batch_size must be 1 when
    // sequence_length > 1 and past context is given" without it).
    Value* ids_shape = shared_op(rw, "Shape", {p.ids_input ? p.ids_input : q3});
    Value* s =
        shared_op(rw, "Gather", {ids_shape, ints(rw, {1}, true)}, one_attr(attr_int("axis", 0)));
    l.query_lens = shared_op(
        rw, "Min", {valid32, shared_op(rw, "Cast", {s}, one_attr(attr_int("to", kInt32)))});
    return l;
  }
  // seqlens_k = T-1 and total = T for every row: every key is "valid" to GQA and the bias does
  // the padding, whichever side it is on. T from the mask's shape when it has (B, S) or
  // (B, S, T) (one chain for every layer), else from Q's / the past's.
  const bool mask_bs = p.mask_bs, mask_t = p.mask_t;
  Value* shape = shared_op(rw, "Shape", {mask_bs ? p.mask : q3});
  Value* s = shared_op(rw, "Gather", {shape, ints(rw, {mask_bs ? 2 : 1}, true)},
                       one_attr(attr_int("axis", 0)));
  Value* t = s;
  if (p.cache && mask_t) {
    t = shared_op(rw, "Gather", {shape, ints(rw, {3}, true)}, one_attr(attr_int("axis", 0)));
  } else if (p.cache) {
    Value* past = rw.op1("Gather", {rw.op1("Shape", {p.cache->past_k}), ints(rw, {2}, true)},
                         one_attr(attr_int("axis", 0)));
    t = rw.op1("Add", {past, s});
  }
  l.total = shared_op(rw, "Cast", {t}, one_attr(attr_int("to", kInt32)));
  Value* last = shared_op(rw, "Sub", {l.total, int32_scalar(rw, 1)});
  Value* batch = shared_op(rw, "Gather", {shape, ints(rw, {0})}, one_attr(attr_int("axis", 0)));
  l.seqlens = shared_op(rw, "Expand", {last, batch});
  if (p.cache) {
    // query_seqlens (ORT >= 1.32): S for every row, so that a chunk after a past (S > 1,
    // P > 0) runs for batch > 1 too ("subsequent prompt" needs batch 1 without it).
    Value* s32 = shared_op(rw, "Cast", {s}, one_attr(attr_int("to", kInt32)));
    l.query_lens = shared_op(rw, "Expand", {s32, batch});
  }
  return l;
}

BuiltOp build_gqa(Rewriter& rw, const OrtLoweringPlan& p, const Node* node, Value* q3, Value* k3,
                  Value* v3, Value* bias, PassContext& ctx) {
  const GqaLengths l = gqa_lengths(rw, p, q3);
  std::vector<Attribute> a;
  a.push_back(attr_int("num_heads", p.hq));
  a.push_back(attr_int("kv_num_heads", p.hkv));
  a.push_back(attr_float("scale", p.scale));
  if (p.softcap > 0) a.push_back(attr_float("softcap", p.softcap));
  // With a cache the mask is causal by contract (internal_op.h), so GQA's causal flag (which
  // query_seqlens requires) masks nothing more.
  if (!p.causal && !p.cache) a.push_back(attr_int("causal", 0));
  // In place, GQA reads no mask: a sliding window (add_kv_cache's sliding_window, the keys a
  // query sees, itself included) must be its local_window_size, which counts the same way in
  // ORT >= 1.32 (tests/kv_cache/test_sliding_window.py checks). The rows are contiguous from 0
  // there, so positions and kept keys agree. Elsewhere the bias carries the window: GQA's own would
  // count positions, holes included.
  if (p.window > 0 && p.inplace) a.push_back(attr_int("local_window_size", p.window));
  Value* none = nullptr;
  Value *cos = none, *sin = none;
  Value *gq = q3, *gk = k3;
  if (p.rotary_q) {
    const Node *rot_q = p.rotary_q, *rot_k = p.rotary_k;
    a.push_back(attr_int("do_rotary", 1));
    a.push_back(attr_int("rotary_interleaved", int_attr_or(rot_q, "interleaved", 0)));
    // A 4-D rotary's BNSH input goes in as (B, S, H*D): its Transpose then meets the head
    // split's and both fold away.
    auto operand = [&](const Node* rot) {
      Value* x = rot->inputs()[0];
      return rank_of(x) == 4 ? to_bsd(rw, x, p.dtype) : x;
    };
    gq = operand(rot_q);
    gk = operand(rot_k);
    cos = rot_q->inputs()[2];
    sin = rot_q->inputs()[3];
    ctx.counters["rotary folded into GroupQueryAttention"] += 1;
    // A rotary has its input's shape: readers of its shape alone need not keep it alive.
    for (const Node* rot : {rot_q, rot_k}) {
      Value* out = rot->outputs()[0];
      if (!read_only_for_shape(out, node)) continue;
      const std::vector<Use> readers = out->uses();
      for (const Use& u : readers) u.node->set_input(u.input_index, rot->inputs()[0]);
    }
  }
  Value* past_k = p.cache ? p.cache->past_k : none;
  Value* past_v = p.cache ? p.cache->past_v : none;
  std::vector<Value*> inputs = {gq,      gk,   v3,   past_k, past_v,      l.seqlens,
                                l.total, cos,  sin,  none,   bias,        p.sinks,
                                none,    none, none, none,   l.query_lens};
  while (!inputs.back()) inputs.pop_back();
  std::vector<Value*> outs = rw.op("GroupQueryAttention", inputs, std::move(a), 3, kMsDomain);
  ctx.counters[p.inplace ? "GroupQueryAttention (in-place cache)"
               : p.cache ? "GroupQueryAttention (past/present)"
                         : "GroupQueryAttention"] += 1;
  return {outs[0], outs[1], outs[2]};
}

BuiltOp build_mha(Rewriter& rw, const OrtLoweringPlan& p, Value* q3, Value* k3, Value* v3,
                  Value* bias, PassContext& ctx) {
  Value *kx = k3 ? k3 : p.k, *vx = v3 ? v3 : p.v;
  if (p.repeat_kv) {
    // (B, Hkv, T, D) -> (B, Hkv, G, T, D) -> (B, Hq, T, D): query head h reads kv head h/G.
    Value* expand = ints(rw, {1, 1, p.hq / p.hkv, 1, 1});
    auto repeat = [&](Value* x, int64_t head_dim) {
      Value* x5 = rw.op1("Unsqueeze", {x, ints(rw, {2})});
      return rw.op1("Reshape", {rw.op1("Expand", {x5, expand}), ints(rw, {0, p.hq, -1, head_dim})});
    };
    kx = repeat(p.k, p.head_dim);
    vx = repeat(p.v, p.v_head_dim ? p.v_head_dim : p.head_dim);
    if (p.kv_bsd) {
      kx = to_bsd(rw, kx, p.dtype);
      vx = to_bsd(rw, vx, p.dtype);
    }
  }
  std::vector<Attribute> a;
  a.push_back(attr_int("num_heads", p.hq));
  a.push_back(attr_float("scale", p.scale));
  if (p.mha_causal) a.push_back(attr_int("unidirectional", 1));
  Value* none = nullptr;
  std::vector<Value*> inputs = {q3, kx, vx};
  if (bias || p.cache) inputs.insert(inputs.end(), {none, none, bias});
  if (p.cache) inputs.insert(inputs.end(), {p.cache->past_k, p.cache->past_v});
  std::vector<Value*> outs =
      rw.op("MultiHeadAttention", inputs, std::move(a), p.cache ? 3 : 1, kMsDomain);
  ctx.counters[p.repeat_kv ? "MultiHeadAttention (repeated kv heads)"
               : p.cache   ? "MultiHeadAttention (past/present)"
                           : "MultiHeadAttention"] += 1;
  if (!p.cache) return {outs[0]};
  return {outs[0], outs[1], outs[2]};
}

// Y's readers get the 3-D output: the usual reader merges the heads back, which then goes; else
// Y is (B, Hq, S, Dv) again by Reshape + Transpose.
Replacement hand_out(Rewriter& rw, const Node* node, const OrtLoweringPlan& p, Value* out3,
                     PassContext& ctx) {
  Graph& g = rw.graph();
  Value* y = node->outputs()[0];
  std::vector<Node*> merges = head_merges(y, p.q);
  if (!merges.empty() && !y->is_graph_output()) {
    for (Node* r : merges) {
      if (!can_replace(g, r->outputs()[0], out3)) {
        merges.clear();
        break;
      }
    }
  }
  if (!merges.empty() && !y->is_graph_output()) {
    std::vector<Node*> transposes;
    for (const Use& u : y->uses()) transposes.push_back(u.node);
    for (Node* r : merges) {
      replace_value(g, r->outputs()[0], out3);
      g.remove_node(r);
    }
    for (Node* t : transposes) {
      if (t->alive()) g.remove_node(t);
    }
    ctx.counters["head merges folded"] += static_cast<int64_t>(merges.size());
    return std::vector<Value*>{nullptr};
  }
  Value* bshd = rw.op1("Reshape", {out3, ints(rw, {0, 0, p.hq, -1})});
  return std::vector<Value*>{
      rw.op1("Transpose", {bshd}, one_attr(attr_ints("perm", {0, 2, 1, 3})))};
}

}  // namespace

Replacement lower_attention_ort(Node* node, Rewriter& rw, PassContext& ctx) {
  const OrtLoweringPlan p = plan_ort_lowering(node, rw.graph(), ctx);
  if (!p.not_packed.empty() && ctx.explains("lower_attention")) {
    ctx.explain("lower_attention",
                node->name.value + ": not packed into Attention: " + p.not_packed);
  }
  if (!p.ok()) return rw.fail(p.refusal);

  // 3-D operands: Q always; K/V for GQA, and for MHA when they exist already (else BNSH). MHA
  // with a cache takes 3-D new rows too (4-D K means cross-attention to it).
  const bool gqa = p.op == OrtAttentionOp::kGroupQueryAttention;
  Value* q3 = to_bsd(rw, p.q, p.dtype);
  Value *k3 = nullptr, *v3 = nullptr;
  if (gqa || p.cache) {
    k3 = to_bsd(rw, p.k_new, p.dtype);
    v3 = to_bsd(rw, p.v_new, p.dtype);
  } else if (!p.repeat_kv) {
    k3 = bsd_source(rw.graph(), p.k, p.dtype);
    v3 = bsd_source(rw.graph(), p.v, p.dtype);
    if (!k3 || !v3) k3 = v3 = nullptr;
    if (!k3 && p.kv_bsd) {  // V's head size is not K's: 3-D K/V (ort_plan.h)
      k3 = to_bsd(rw, p.k, p.dtype);
      v3 = to_bsd(rw, p.v, p.dtype);
    }
  }
  Value* bias = build_bias(rw, p, q3, k3);
  if (p.zero_masked_queries) {  // ort_plan.h: rows with no visible key average V in the op
    Value* zero = float_scalar(rw, p.dtype, false);
    q3 = rw.op1("Where", {rows_with_keys(rw, p.mask, false), q3, zero});
    bias = shared_op(rw, "Where", {rows_with_keys(rw, p.mask, true), bias, zero});
    ctx.counters["rows with every key masked: averaged over zeroed queries"] += 1;
  }

  BuiltOp built;
  if (p.op == OrtAttentionOp::kPackedAttention) {
    built.out3 = build_packed_attention(rw, node, p.qkv, p.hq, p.scale, p.causal, bias);
    ctx.counters["Attention (packed QKV)"] += 1;
  } else if (gqa) {
    built = build_gqa(rw, p, node, q3, k3, v3, bias, ctx);
  } else {
    built = build_mha(rw, p, q3, k3, v3, bias, ctx);
  }
  if (p.fix_masked_rows != MaskedRows::kUnread) {
    // Rows with no visible key: what the internal op gives there (masked_rows.h).
    Value* v4 = p.cache ? built.present_v : v3 ? nullptr : p.v;
    built.out3 =
        fix_masked_rows(rw, built.out3, p.mask, p.fix_masked_rows, v4, v3, p.hq, p.hkv, p.dtype);
    ctx.counters[p.fix_masked_rows == MaskedRows::kMean
                     ? "rows with every key masked: the mean of V put back"
                     : "rows with every key masked: set to 0"] += 1;
  }
  if (p.cache) {
    if (std::string why = adopt_presents(rw.graph(), *p.cache, built.present_k, built.present_v,
                                         node, k3, v3, p.inplace);
        !why.empty()) {
      return rw.fail(why);
    }
    if (p.inplace) {
      for (Value* x : {p.cache->past_k, p.cache->past_v, built.present_k, built.present_v}) {
        set_max_length(x);
      }
    }
  }
  import_domain(rw.graph(), kMsDomain);
  return hand_out(rw, node, p, built.out3, ctx);
}

}  // namespace fastopt::passes
