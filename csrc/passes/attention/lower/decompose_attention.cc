// The internal Attention op (see internal_op.h) written back as standard ops: the fallback of
// lower_attention when the target's lowering does not apply. Exactly the op's semantics:
//
//   k, v (B,Hkv,T,D) -> [Unsqueeze(2) -> Expand(1,1,G,1,1) -> Reshape(Shape(k) * (1,G,1,1))]?
//   Q (B,Hq,S,D)  Kt = Transpose(k, 0,1,3,2)
//        \        /
//        MatMul -> Mul(scale) -> [Div(c) -> Tanh -> Mul(c)]? -> [Cast(softmax_precision)]?
//        -> [Add(mask | Where(bool, 0, -inf))]?
//        -> [Add(causal)]? -> Softmax(-1) -> Where(IsNaN(p), 0, p) -> [Cast back]? -> MatMul(v)
//
// The cached form (internal_op.h) needs nothing special: K/V are the Concat'd (B,Hkv,P+S,D), the
// causal Range starts at T - S = P, and repeat_kv's Reshape takes Shape(k) (T, not S).
//
// Any opset from kDecomposeOpset (11: Range): Softmax(-1) is over the last axis alone at every
// opset (before 13 it flattens from the axis given, here the last); Unsqueeze takes its axes as
// an attribute before 13, and LessOrEqual (12) is Not(Greater) before 12.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "ir/constant.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/lowering_ops.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/attention/sinks.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// Unsqueeze(x, [axis]) in the form of the model's opset (axes an input from 13).
Value* unsqueeze(Value* x, int64_t axis, int64_t opset, Rewriter& rw) {
  if (opset < 13) return rw.op1("Unsqueeze", {x}, one_attr(attr_ints("axes", {axis})));
  const std::string name = "attention_unsqueeze_axis" + std::to_string(axis);
  return rw.op1("Unsqueeze", {x, rw.initializer(name, make_int64_tensor({axis}, {1}))});
}

// (B,Hkv,T,D) -> (B,Hkv*G,T,D) with head h reading kv head h / G (HF repeat_kv).
Value* repeat_kv(Value* x, int64_t groups, int64_t opset, Rewriter& rw) {
  Value* expand =
      rw.initializer("attention_kv_expand", make_int64_tensor({1, 1, groups, 1, 1}, {5}));
  Value* factor = rw.initializer("attention_kv_heads", make_int64_tensor({1, groups, 1, 1}, {4}));
  Value* x5 = rw.op1("Expand", {unsqueeze(x, 2, opset, rw), expand});
  Value* shape = rw.op1("Mul", {rw.op1("Shape", {x}), factor});
  return rw.op1("Reshape", {x5, shape});
}

// Bool (S,T): key j visible to query i iff j <= i + T - S (bottom-right aligned, Attention-23).
Value* causal_mask(Value* q, Value* k, int64_t opset, Rewriter& rw) {
  Value* two = rw.initializer("attention_dim2", make_int64_tensor({2}, {}));
  Value* zero = rw.initializer("attention_zero", make_int64_tensor({0}, {}));
  Value* step = rw.initializer("attention_one", make_int64_tensor({1}, {}));
  Value* s = rw.op1("Gather", {rw.op1("Shape", {q}), two}, one_attr(attr_int("axis", 0)));
  Value* t = rw.op1("Gather", {rw.op1("Shape", {k}), two}, one_attr(attr_int("axis", 0)));
  Value* rows = rw.op1("Range", {rw.op1("Sub", {t, s}), t, step});  // i + T - S
  Value* cols = rw.op1("Range", {zero, t, step});
  rows = unsqueeze(rows, 1, opset, rw);
  if (opset < 12) return rw.op1("Not", {rw.op1("Greater", {cols, rows})});
  return rw.op1("LessOrEqual", {cols, rows});
}

// 0 and -inf in the softmax dtype, made once, when first needed.
struct MaskConstants {
  Value* zero = nullptr;
  Value* neg = nullptr;
  void make(pattern::Rewriter& rw, int32_t ct) {
    if (zero) return;
    zero = rw.initializer("attention_zero", scalar_tensor(ct, 0.0));
    // -inf, not the lowest finite value: a row whose keys are all masked then becomes NaN,
    // which the Where(IsNaN) below turns into the 0 the op specifies (a finite bias would
    // give the mean of V instead).
    neg = rw.initializer("attention_masked",
                         scalar_tensor(ct, -std::numeric_limits<double>::infinity()));
  }
};

// The mask as a bias in the softmax dtype ct.
Value* mask_bias(const Node* node, Value* mask, int32_t ct, MaskConstants& c,
                 pattern::Rewriter& rw) {
  if (dtype_of(mask) != kBool) {
    return dtype_of(mask) != ct ? rw.op1("Cast", {mask}, one_attr(attr_int("to", ct))) : mask;
  }
  c.make(rw, ct);
  // The export's finite masking value where it had one: its all-masked rows average the
  // keys rather than give 0 (internal_op.h).
  Value* masked = c.neg;
  if (masked_rows(node) == MaskedRows::kScores) {
    masked = rw.initializer("attention_masked", scalar_tensor(ct, masked_value(node)));
  } else if (masked_rows(node) == MaskedRows::kMean) {
    masked = rw.initializer("attention_masked", scalar_tensor(ct, absorbing_mask_value(ct)));
  }
  return rw.op1("Where", {mask, c.zero, masked});
}

// scale * Q K^T [soft-capped], in the softmax dtype ct.
Value* scores(const Node* node, Value* q, Value* k, int32_t t, int32_t ct,
              const std::shared_ptr<Tensor>& scale, pattern::Rewriter& rw) {
  Value* kt = rw.op1("Transpose", {k}, one_attr(attr_ints("perm", {0, 1, 3, 2})));
  Value* s = rw.op1("MatMul", {q, kt});
  s = rw.op1("Mul", {s, rw.initializer("attention_scale", scale)});
  if (const float cap = float_attr(node, "softcap", 0.0f); cap > 0) {  // c * tanh(s / c)
    Value* c = rw.initializer("attention_softcap", scalar_tensor(t, cap));
    s = rw.op1("Mul", {rw.op1("Tanh", {rw.op1("Div", {s, c})}), c});
  }
  if (ct != t) s = rw.op1("Cast", {s}, one_attr(attr_int("to", ct)));
  return s;
}

// The op's inputs and attributes the decomposition reads; "" or the refusal.
std::string inputs_problem(const Node* node, int64_t opset) {
  const auto& in = node->inputs();
  if (in.size() < 3) return "Attention has fewer than 3 inputs";
  if (in.size() > 5) return "Attention has inputs after the sinks";
  if (opset < kDecomposeOpset) return "opset " + std::to_string(opset) + " < 11";
  const int64_t hq = int_attr_or(node, "q_num_heads", 0),
                hkv = int_attr_or(node, "kv_num_heads", 0);
  if (hq <= 0 || hkv <= 0 || hq % hkv != 0) return "bad q_num_heads / kv_num_heads";
  const Attribute* scale_attr = node->attribute("scale");
  if (!scale_attr || !scale_attr->f) return "no scale attribute";
  return "";
}

}  // namespace

pattern::Replacement decompose_attention(Node* node, pattern::Rewriter& rw, PassContext&) {
  const int64_t opset = default_opset(*rw.graph().model());
  if (std::string why = inputs_problem(node, opset); !why.empty()) return rw.fail(why);
  const auto& in = node->inputs();
  Value *q = in[0], *k = in[1], *v = in[2];
  Value* mask = in.size() > 3 ? in[3] : nullptr;
  Value* sinks = in.size() > 4 ? in[4] : nullptr;
  const int32_t t = dtype_of(q);
  const int64_t hq = int_attr_or(node, "q_num_heads", 0),
                hkv = int_attr_or(node, "kv_num_heads", 0);
  const int32_t precision = static_cast<int32_t>(int_attr_or(node, "softmax_precision", 0));
  const int32_t ct = precision && precision != t ? precision : t;  // softmax dtype
  auto scale_t = scalar_tensor(t, *node->attribute("scale")->f);
  if (!scale_t || !scalar_tensor(ct, 0.0)) return rw.fail("unsupported dtype " + dtype_name(t));
  if (hkv != hq) {
    k = repeat_kv(k, hq / hkv, opset, rw);
    v = repeat_kv(v, hq / hkv, opset, rw);
  }
  Value* s = scores(node, q, k, t, ct, scale_t, rw);
  MaskConstants c;
  if (mask) s = rw.op1("Add", {s, mask_bias(node, mask, ct, c, rw)});
  if (int_attr_or(node, "is_causal", 0) != 0) {
    c.make(rw, ct);
    s = rw.op1("Add", {s, rw.op1("Where", {causal_mask(q, k, opset, rw), c.zero, c.neg})});
  }
  Value* p = sinks ? attention_sinks::softmax_with_sinks(rw, s, sinks)
                   : rw.op1("Softmax", {s}, one_attr(attr_int("axis", -1)));
  // Rows whose every key is masked: -inf masks make them NaN, the op's semantics make them 0.
  c.make(rw, ct);
  p = rw.op1("Where", {rw.op1("IsNaN", {p}), c.zero, p});
  if (ct != t) p = rw.op1("Cast", {p}, one_attr(attr_int("to", t)));
  return std::vector<Value*>{rw.op1("MatMul", {p, v})};
}

}  // namespace fastopt::passes
