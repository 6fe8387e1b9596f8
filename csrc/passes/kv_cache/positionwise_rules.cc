// One rule per op family for the sequence-axis dataflow (positionwise.h): where each output
// carries the positions, or why the op mixes them (layout ops: positionwise_layout.cc). A rule runs
// only when an input carries the tokens (seq); an op without a rule is refused by the caller.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/internal_op.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/positionwise.h"

namespace fastopt::passes::kv_cache {

using analysis::DimExpr;

int normalize_axis(int64_t axis, int rank) {
  const int64_t a = axis < 0 ? axis + rank : axis;
  return a < 0 || a >= rank ? -1 : static_cast<int>(a);
}

const char* const kLastWithSeq =
    "it combines one position's value (selected from the end of the sequence) with every "
    "position";

int seq_rank(SeqContext& c, const Value* v) {
  return v ? c.facts.rank(v) : -1;
}

bool same_place(const SeqState& a, const SeqState& b) {
  return a.axis == b.axis && a.outer == b.outer && a.inner == b.inner;
}

// Every input from `carriers` on (the first inputs carry the data) must not depend on the
// tokens.
bool others_free(SeqContext& c, size_t carriers, const char* what) {
  for (size_t i = carriers; i < c.in.size(); ++i) {
    if (c.in[i].kind == SeqState::kFree) continue;
    return c.refuse(std::string("its ") + what + " (input " + std::to_string(i) +
                    ") depends on the tokens");
  }
  return true;
}

// The seq input among the first `carriers` (all that carry the tokens agree on the place), or
// nullopt with the reason set.
std::optional<SeqState> carried(SeqContext& c, size_t carriers) {
  std::optional<SeqState> found;
  for (size_t i = 0; i < carriers && i < c.in.size(); ++i) {
    const SeqState& s = c.in[i];
    if (s.kind == SeqState::kLast) {
      c.refuse(kLastWithSeq);
      return std::nullopt;
    }
    if (s.kind != SeqState::kSeq) continue;
    if (found && !same_place(*found, s)) {
      c.refuse("its inputs carry the sequence on different axes");
      return std::nullopt;
    }
    found = s;
  }
  if (!found) c.refuse("the input that carries the tokens is not one it keeps per position");
  return found;
}

std::optional<std::vector<int64_t>> ints_of(const Node& n, size_t input, const char* attr,
                                            int64_t opset, int64_t first_input_opset) {
  if (opset >= first_input_opset) {
    if (input < n.inputs().size() && n.inputs()[input]) return constant_ints(n.inputs()[input]);
    return std::vector<int64_t>{};
  }
  if (const Attribute* a = n.attribute(attr)) return a->ints;
  return std::vector<int64_t>{};
}

// The op's reduced / normalized axis from attribute `attr` (default `fallback`), refused when it
// is the sequence axis.
bool off_sequence_axis(const Node& n, SeqContext& c, const SeqState& s, const char* attr,
                       int64_t fallback, const char* what) {
  const int r = seq_rank(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  const int axis = normalize_axis(int_attr_or(&n, attr, fallback), r);
  if (axis < 0) return c.refuse("its axis is out of range");
  if (axis == s.axis) return c.refuse(std::string("it ") + what + " over the sequence axis");
  return true;
}

namespace {

// Broadcasting elementwise ops (unary ones too): a position of the output reads that position
// of every operand; operands without the tokens (weights, constants) broadcast.
bool elementwise(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const int r = seq_rank(c, n.outputs()[0]);
  if (r < 0) return c.refuse("its output rank is unknown");
  std::optional<SeqState> res;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const SeqState& s = c.in[i];
    if (s.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
    if (s.kind != SeqState::kSeq) continue;
    const int ri = seq_rank(c, n.inputs()[i]);
    if (ri < 0) return c.refuse("an operand's rank is unknown");
    SeqState m = s;
    m.axis = s.axis + (r - ri);
    if (res && !same_place(*res, m)) {
      return c.refuse(
          "its operands carry the sequence on different axes (it pairs different "
          "positions)");
    }
    res = m;
  }
  out.assign(n.outputs().size(), *res);
  return true;
}

// MatMul: each position's rows times a weight, or a batched product per token (MoE experts
// gathered per token: the tokens on a batch axis of both). The tokens on the rows of one and the
// columns of the other (Q K^T, P V of an attention that did not fuse) or on the contracted axis
// mix positions.
bool matmul(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const SeqState& a = c.in[0];
  const SeqState& b = c.in[1];
  if (a.kind == SeqState::kLast || b.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  const int ra = seq_rank(c, n.inputs()[0]), rb = seq_rank(c, n.inputs()[1]);
  const int r = seq_rank(c, n.outputs()[0]);
  if (ra < 0 || rb < 0 || r < 0) return c.refuse("an operand's rank is unknown");
  std::optional<SeqState> res;
  bool rows = false, cols = false;
  if (a.kind == SeqState::kSeq) {
    if (ra < 2 || a.axis == ra - 1) return c.refuse("it contracts over the sequence axis");
    rows = a.axis == ra - 2;
    res = a;
    res->axis = a.axis + (r - ra);
  }
  if (b.kind == SeqState::kSeq) {
    if (rb < 2 || b.axis == rb - 2) return c.refuse("it contracts over the sequence axis");
    cols = b.axis == rb - 1;
    SeqState m = b;
    m.axis = cols ? r - 1 : b.axis + (r - rb);
    if (res && (rows || cols || !same_place(*res, m))) {
      c.priority = 1;  // the likeliest cause: named before the mask ops such a layer has
      return c.refuse(
          "it multiplies two values that both carry the tokens (the scores Q K^T or the "
          "probabilities times V of an attention that did not fuse, or another product across "
          "positions)");
    }
    res = m;
  }
  out.assign(1, *res);
  return true;
}

// Quantized / fused MatMuls whose first input is the activation (..., K) and whose other inputs
// are weights: position-wise when the tokens are not on K.
bool activation_matmul(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (int_attr_or(&n, "transA", 0) || int_attr_or(&n, "transBatchA", 0)) {
    return c.refuse("its activation input is transposed");
  }
  if (!others_free(c, 1, "weight")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int ra = seq_rank(c, n.inputs()[0]), r = seq_rank(c, n.outputs()[0]);
  if (ra < 0 || r < 0) return c.refuse("an operand's rank is unknown");
  if (s->axis == ra - 1) return c.refuse("it contracts over the sequence axis");
  s->axis += r - ra;
  out.assign(1, *s);
  return true;
}

bool gemm(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const bool ta = int_attr_or(&n, "transA", 0) != 0, tb = int_attr_or(&n, "transB", 0) != 0;
  const SeqState& a = c.in[0];
  const SeqState& b = c.in[1];
  if (a.kind != SeqState::kFree && b.kind != SeqState::kFree) {
    return c.refuse("it multiplies two values that both carry the tokens");
  }
  std::optional<SeqState> res;
  if (a.kind == SeqState::kSeq) {
    if (a.axis != (ta ? 1 : 0)) return c.refuse("it contracts over the sequence axis");
    res = a;
    res->axis = 0;
  } else if (b.kind == SeqState::kSeq) {
    if (b.axis != (tb ? 0 : 1)) return c.refuse("it contracts over the sequence axis");
    res = b;
    res->axis = 1;
  } else if (a.kind == SeqState::kLast || b.kind == SeqState::kLast) {
    return c.refuse(kLastWithSeq);
  }
  if (c.in.size() > 2 && c.in[2].kind != SeqState::kFree) {  // C broadcasts to (M, N)
    const SeqState& s = c.in[2];
    const int rc = seq_rank(c, n.inputs()[2]);
    if (s.kind == SeqState::kLast || rc < 0) return c.refuse(kLastWithSeq);
    SeqState m = s;
    m.axis = s.axis + (2 - rc);
    if (res && !same_place(*res, m)) return c.refuse("its inputs pair different positions");
    res = m;
  }
  out.assign(1, *res);
  return true;
}

bool softmax(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  auto s = carried(c, 1);
  if (!s) return false;
  if (c.opset < 13) {  // flattens from axis (default 1): the sequence must stay before it
    const int r = seq_rank(c, n.inputs()[0]);
    const int axis = normalize_axis(int_attr_or(&n, "axis", 1), r);
    if (r < 0 || axis < 0 || s->axis >= axis) {
      return c.refuse("it normalizes over axes that include the sequence axis");
    }
  } else if (!off_sequence_axis(n, c, *s, "axis", -1, "normalizes")) {
    return false;
  }
  out.assign(n.outputs().size(), *s);
  return true;
}

// ReduceX, ArgMax/ArgMin: reducing the sequence (a mean over the tokens) mixes positions.
bool reduce(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "axes")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = seq_rank(c, n.inputs()[0]);
  if (r < 0) return c.refuse("its input rank is unknown");
  const bool arg = n.op_type == "ArgMax" || n.op_type == "ArgMin";
  const int64_t axes_input_opset = n.op_type == "ReduceSum" ? 13 : 18;
  std::vector<int64_t> axes;
  if (arg) {
    axes = {int_attr_or(&n, "axis", 0)};
  } else {
    auto a = ints_of(n, 1, "axes", c.opset, axes_input_opset);
    if (!a) return c.refuse("its axes are not constant");
    axes = *a;
    if (axes.empty()) {
      if (int_attr_or(&n, "noop_with_empty_axes", 0)) {
        out.assign(1, *s);
        return true;
      }
      return c.refuse("it reduces over every axis, the sequence included");
    }
  }
  const bool keep = int_attr_or(&n, "keepdims", 1) != 0;
  int removed_before = 0;
  for (int64_t a : axes) {
    const int ax = normalize_axis(a, r);
    if (ax < 0) return c.refuse("its axes are out of range");
    if (ax == s->axis) return c.refuse("it reduces over the sequence axis (across the tokens)");
    removed_before += ax < s->axis ? 1 : 0;
  }
  if (!keep) s->axis -= removed_before;
  out.assign(1, *s);
  return true;
}

bool topk(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "k")) return false;
  auto s = carried(c, 1);
  if (!s || !off_sequence_axis(n, c, *s, "axis", -1, "selects")) return false;
  out.assign(n.outputs().size(), *s);
  return true;
}

bool cumsum(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "axis")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  const int r = seq_rank(c, n.inputs()[0]);
  auto axis = n.inputs().size() > 1 ? constant_ints(n.inputs()[1]) : std::nullopt;
  if (r < 0 || !axis || axis->size() != 1) return c.refuse("its axis is not constant");
  const int a = normalize_axis((*axis)[0], r);
  if (a < 0 || a == s->axis) {
    return c.refuse("it accumulates over the sequence axis (a running sum across the tokens)");
  }
  out.assign(1, *s);
  return true;
}

// Norms over the trailing axes [axis, rank): the sequence must stay before them.
bool norm(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const bool skip = n.op_type.rfind("Skip", 0) == 0;
  const size_t carriers = skip ? 2 : 1;
  if (!others_free(c, carriers, "scale or bias")) return false;
  auto s = carried(c, carriers);
  if (!s) return false;
  const int r = seq_rank(c, n.inputs()[0]);
  const int axis = normalize_axis(skip ? -1 : int_attr_or(&n, "axis", -1), r);
  if (r < 0 || axis < 0) return c.refuse("its axis is unknown");
  if (s->axis >= axis) return c.refuse("it normalizes over the sequence axis");
  out.assign(n.outputs().size(), *s);
  return true;
}

// RotaryEmbedding rotates each position by its own position id (any layout of X).
bool rotary(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  for (const SeqState& s : c.in) {
    if (s.kind == SeqState::kLast) return c.refuse(kLastWithSeq);
  }
  if (c.in[0].kind != SeqState::kSeq) {
    return c.refuse("it rotates a value without the tokens by per-token positions");
  }
  (void)n;
  out.assign(n.outputs().size(), c.in[0]);
  return true;
}

constexpr const char* kConvolution =
    "it convolves along the sequence axis: a convolution over the tokens (a conv/SSM hybrid "
    "layer, such as LFM2's short convolutions or Mamba's) needs a cached state of its own (the "
    "last inputs carried from step to step), which add_kv_cache does not build";

// Convolutions and pools slide over axes 2..: position-wise only when the tokens are the batch.
bool convolution(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  if (!others_free(c, 1, "weight")) return false;
  auto s = carried(c, 1);
  if (!s) return false;
  if (s->axis >= 2) return c.refuse(kConvolution);
  if (s->axis == 1) return c.refuse("it mixes its channels, which carry the sequence");
  out.assign(n.outputs().size(), *s);
  return true;
}

// The attention the rewrite caches: Q per position, K/V over the positions (self, cached) or
// the encoder's (cross); the mask is proven and replaced (mask_proof.h), never read here.
bool internal_attention(const Node& n, SeqContext& c, std::vector<SeqState>& out) {
  const SeqState& q = c.in[0];
  if (q.kind != SeqState::kSeq || q.axis != 2 || q.flattened()) {
    return c.refuse("its query is not (B, H, S, D) with one position per row");
  }
  for (size_t i : {1, 2}) {
    const SeqState& kv = c.in[i];
    if (kv.kind == SeqState::kFree) continue;  // cross-attention: the encoder's keys
    if (kv.kind != SeqState::kSeq || !same_place(kv, q)) {
      return c.refuse("its keys or values are not (B, Hkv, S, D) over the query's positions");
    }
  }
  if (c.in.size() > 4 && c.in[4].kind != SeqState::kFree) {
    return c.refuse("its sinks depend on the tokens");
  }
  (void)n;
  out.assign(1, q);
  return true;
}

}  // namespace

SeqRule find_seq_rule(const std::string& domain, const std::string& op_type) {
  static const std::unordered_map<std::string, SeqRule> kRules = [] {
    std::unordered_map<std::string, SeqRule> m;
    for (const char* op : {"Abs",
                           "Acos",
                           "Acosh",
                           "Add",
                           "And",
                           "Asin",
                           "Asinh",
                           "Atan",
                           "Atanh",
                           "BitShift",
                           "BitwiseAnd",
                           "BitwiseNot",
                           "BitwiseOr",
                           "BitwiseXor",
                           "Cast",
                           "CastLike",
                           "Ceil",
                           "Celu",
                           "Clip",
                           "Cos",
                           "Cosh",
                           "Div",
                           "Dropout",
                           "Elu",
                           "Equal",
                           "Erf",
                           "Exp",
                           "Expand",
                           "Floor",
                           "Gelu",
                           "Greater",
                           "GreaterOrEqual",
                           "HardSigmoid",
                           "HardSwish",
                           "Identity",
                           "IsInf",
                           "IsNaN",
                           "LeakyRelu",
                           "Less",
                           "LessOrEqual",
                           "Log",
                           "Max",
                           "Mean",
                           "Min",
                           "Mish",
                           "Mod",
                           "Mul",
                           "Neg",
                           "Not",
                           "Or",
                           "Pow",
                           "PRelu",
                           "Reciprocal",
                           "Relu",
                           "Round",
                           "Selu",
                           "Shrink",
                           "Sigmoid",
                           "Sign",
                           "Sin",
                           "Sinh",
                           "Softplus",
                           "Softsign",
                           "Sqrt",
                           "Sub",
                           "Sum",
                           "Tan",
                           "Tanh",
                           "ThresholdedRelu",
                           "Where",
                           "Xor"}) {
      m[std::string("|") + op] = elementwise;
    }
    for (const char* op : {"FastGelu", "Gelu", "BiasGelu", "QuickGelu", "BiasAdd"}) {
      m[std::string(kMsDomain) + "|" + op] = elementwise;
    }
    m["|MatMul"] = matmul;
    m["|Gemm"] = gemm;
    for (const char* op :
         {"MatMulNBits", "FusedMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}) {
      m[std::string(kMsDomain) + "|" + op] = activation_matmul;
    }
    add_layout_rules(m);
    for (const char* op : {"Softmax", "LogSoftmax", "Hardmax"}) m[std::string("|") + op] = softmax;
    for (const char* op :
         {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"}) {
      m[std::string("|") + op] = reduce;
    }
    m["|TopK"] = topk;
    m["|CumSum"] = cumsum;
    m["|LayerNormalization"] = norm;
    m["|RMSNormalization"] = norm;
    m["|SimplifiedLayerNormalization"] = norm;  // ORT registers it in the ONNX domain
    for (const char* op : {"LayerNormalization", "SimplifiedLayerNormalization",
                           "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}) {
      m[std::string(kMsDomain) + "|" + op] = norm;
    }
    m["|RotaryEmbedding"] = rotary;
    m[std::string(kMsDomain) + "|RotaryEmbedding"] = rotary;
    for (const char* op :
         {"Conv", "ConvInteger", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"}) {
      m[std::string("|") + op] = convolution;
    }
    m[std::string(kInternalDomain) + "|" + kInternalAttention] = internal_attention;
    return m;
  }();
  const std::string d = domain == "ai.onnx" ? "" : domain;
  auto it = kRules.find(d + "|" + op_type);
  return it == kRules.end() ? nullptr : it->second;
}

}  // namespace fastopt::passes::kv_cache
