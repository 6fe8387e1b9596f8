// Conv (+ bias) followed by an inference-mode BatchNormalization, folded into the Conv.
//
//    x    W   [b]                           x    W'   b'
//     \   |   /                              \   |   /
//       Conv                                   Conv
//        |   scale  B  mean  var      ==>        |
//   BatchNormalization                           y
//        |
//        y
//
//   s[m] = scale[m] / sqrt(var[m] + eps)          (m = output channel, axis 0 of W)
//   W'[m, ...] = W[m, ...] * s[m]                  b'[m] = (b[m] - mean[m]) * s[m] + B[m]
//
// CNN exports keep BN as its own node when the exporter does not fold (PyTorch with
// do_constant_folding=False or in training-mode export, Caffe2/MXNet/Keras conversions). Folding
// removes a full pass over every activation. Group convs fold the same way (W's axis 0 is still
// the output channel); ConvTranspose does not (its output channels are on axis 1, per group).
// New W'/b' tensors are written; the originals stay untouched (DCE drops them once unused).
#include <cmath>
#include <cstring>
#include <limits>

#include "ir/constant.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// Encodes doubles as `dtype` (float, double or float16).
std::string encode(int32_t dtype, const std::vector<double>& values) {
  std::string out;
  if (dtype == kFloat) {
    out.resize(values.size() * 4);
    for (size_t i = 0; i < values.size(); ++i) {
      float f = static_cast<float>(values[i]);
      std::memcpy(&out[i * 4], &f, 4);
    }
  } else if (dtype == kDouble) {
    out.resize(values.size() * 8);
    std::memcpy(out.data(), values.data(), out.size());
  } else {
    out.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t h = float_to_half(static_cast<float>(values[i]));
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

// A constant's elements when it is a 1-D tensor of `n` elements.
std::optional<std::vector<double>> channel_vector(const Value* v, int64_t n) {
  auto t = constant_tensor(v);
  if (!t || t->dims.size() != 1 || t->dims[0] != n) return std::nullopt;
  return tensor_doubles(*t, static_cast<uint64_t>(n));
}

// Function bodies have no initializers: new tensors go into Constant nodes there.
Value* add_constant(Rewriter& rw, const std::string& base, std::shared_ptr<Tensor> t) {
  const Graph* top = &rw.graph();
  while (top->parent()) top = top->parent();
  if (top == rw.graph().model()->graph.get()) return rw.initializer(base, std::move(t));
  std::vector<Attribute> attrs;
  attrs.push_back(attr_tensor("value", std::move(t)));
  return rw.op1("Constant", {}, std::move(attrs));
}

// A weight computed from constants only (ConstantOfShape of a constant shape, a Cast or
// Reshape of a constant ...): exporters that keep files small emit these. The weight is not
// materialized here; W' = W * factor[M, 1, ...] is left for the runtime's constant folding.
bool computed_from_constants(const Value* v, int depth) {
  if (constant_tensor(v)) return true;
  const Node* n = v ? v->producer() : nullptr;
  if (!n || depth == 0 || n->has_subgraphs() || n->op_type.rfind("Random", 0) == 0) return false;
  for (const Value* in : n->inputs()) {
    if (in && !computed_from_constants(in, depth - 1)) return false;
  }
  return true;
}

// Per output channel: factor = scale / sqrt(var + eps) and the folded bias
// (conv_bias - mean) * factor + B. Returns why not, when an operand is not a constant [M].
std::optional<std::string> fold_factors(const Match& m, const Node* conv_node, int64_t channels,
                                        int32_t dtype, double eps, std::vector<double>& factor,
                                        std::vector<double>& new_bias) {
  std::vector<double> bias(static_cast<size_t>(channels), 0.0);
  Value* conv_bias = conv_node->inputs().size() > 2 ? conv_node->inputs()[2] : nullptr;
  if (conv_bias) {
    auto b = channel_vector(conv_bias, channels);
    if (!b || value_dtype(conv_bias) != dtype) {
      return std::string("the Conv bias is not a constant [M] of the weight's dtype");
    }
    bias = *b;
  }
  auto scale = channel_vector(m.value("scale"), channels);
  auto shift = channel_vector(m.value("B"), channels);
  auto mean = channel_vector(m.value("mean"), channels);
  auto var = channel_vector(m.value("var"), channels);
  if (!scale || !shift || !mean || !var) {
    return std::string("scale, B, mean and var must be constants of shape [M]");
  }
  factor.assign(bias.size(), 0.0);
  new_bias.assign(bias.size(), 0.0);
  for (size_t c = 0; c < bias.size(); ++c) {
    const double denom = (*var)[c] + eps;
    if (!(denom > 0)) return std::string("var + epsilon is not positive");
    factor[c] = (*scale)[c] / std::sqrt(denom);
    new_bias[c] = (bias[c] - (*mean)[c]) * factor[c] + (*shift)[c];
  }
  return std::nullopt;
}

Replacement fold_into_computed_weight(const Match& m, Rewriter& rw, Node* conv_node, double eps) {
  Value* w = m.value("w");
  if (!computed_from_constants(w, 4)) return rw.fail("the Conv weight is not a constant");
  const int32_t dtype = value_dtype(w);
  if (dtype != kFloat && dtype != kDouble && dtype != kFloat16) {
    return rw.fail("the computed weight's dtype is unknown or not handled");
  }
  const int rank = value_rank(w);
  if (rank < 3) return rw.fail("the computed weight's rank is unknown");
  auto scale_t = constant_tensor(m.value("scale"));
  if (!scale_t || scale_t->dims.size() != 1) return rw.fail("scale is not a constant [M]");
  const int64_t channels = scale_t->dims[0];
  std::vector<double> factor, new_bias;
  if (auto why = fold_factors(m, conv_node, channels, dtype, eps, factor, new_bias)) {
    return rw.fail(*why);
  }
  std::vector<int64_t> factor_dims(static_cast<size_t>(rank), 1);
  factor_dims[0] = channels;
  Value* f = add_constant(rw, w->name() + "_bn_scale",
                          make_tensor(dtype, factor_dims, encode(dtype, factor)));
  Value* b_new = add_constant(rw, w->name() + "_bn_bias",
                              make_tensor(dtype, {channels}, encode(dtype, new_bias)));
  Value* w_new = rw.op1("Mul", {w, f});
  std::vector<Attribute> attrs;
  for (const Attribute& a : conv_node->attributes) attrs.push_back(copy_attribute(a));
  return std::vector<Value*>{rw.op1("Conv", {m.value("x"), w_new, b_new}, std::move(attrs))};
}

// An inference-mode BatchNormalization (batch statistics would replace mean/var) with
// per-channel statistics and unused statistics outputs; "" or the refusal.
std::string inference_problem(const Node* bn_node, int64_t opset) {
  if (auto* a = bn_node->attribute("training_mode"); a && a->i && *a->i != 0) {
    return "training_mode is set";
  }
  if (opset > 0 && opset < 7) {
    auto* a = bn_node->attribute("is_test");
    if (!a || !a->i || *a->i == 0) return "opset < 7 without is_test=1 (training)";
  }
  if (auto* a = bn_node->attribute("spatial"); a && a->i && *a->i != 1) {
    return "spatial=0 (per-activation statistics)";
  }
  for (size_t i = 1; i < bn_node->outputs().size(); ++i) {
    Value* o = bn_node->outputs()[i];
    if (o && (!o->uses().empty() || o->is_graph_output())) {
      return "a statistics output of the BatchNormalization is used";
    }
  }
  return "";
}

// A constant weight's dtype and [M, C/g, k...] shape; "" or the refusal.
std::string weight_problem(const Tensor& wt) {
  const int32_t dtype = wt.dtype();
  if (dtype != kFloat && dtype != kDouble && dtype != kFloat16) {
    return "weight dtype " + dtype_name(dtype) + " is not handled";
  }
  if (wt.dims.size() < 3 || wt.dims[0] <= 0) return "the weight is not [M, C/g, k...]";
  return "";
}

// Every value within what `dtype` holds (fp16 tops out at 65504): folding must not overflow
// what the original computed in range.
bool in_range(const std::vector<double>& v, int32_t dtype) {
  double limit = std::numeric_limits<double>::max();
  if (dtype == kFloat) limit = std::numeric_limits<float>::max();
  if (dtype == kFloat16) limit = 65504.0;
  for (double d : v) {
    if (!(std::fabs(d) <= limit)) return false;
  }
  return true;
}

struct ConvBn {
  P x, w, conv, bn;
};

Replacement fuse_conv_bn(const ConvBn& h, const Match& m, Rewriter& rw) {
  Node* bn_node = m.node(h.bn);
  Node* conv_node = m.node(h.conv);
  if (conv_node->graph() != &rw.graph()) return rw.fail("the producer is in an enclosing graph");
  const int64_t opset = default_opset(*rw.graph().model());
  if (std::string why = inference_problem(bn_node, opset); !why.empty()) return rw.fail(why);
  double eps = 1e-5;
  if (auto* a = bn_node->attribute("epsilon"); a && a->f) eps = *a->f;

  auto wt = constant_tensor(m.value(h.w));
  if (!wt) return fold_into_computed_weight(m, rw, conv_node, eps);
  if (std::string why = weight_problem(*wt); !why.empty()) return rw.fail(why);
  const int32_t dtype = wt->dtype();
  const int64_t channels = wt->dims[0];

  std::vector<double> factor, new_bias;
  if (auto why = fold_factors(m, conv_node, channels, dtype, eps, factor, new_bias)) {
    return rw.fail(*why);
  }
  // The weight is decoded last: every cheaper check has passed.
  auto weights = tensor_doubles(*wt, wt->numel());
  if (!weights) return rw.fail("the weight cannot be decoded");
  const size_t per_channel = weights->size() / static_cast<size_t>(channels);
  for (size_t i = 0; i < weights->size(); ++i) (*weights)[i] *= factor[i / per_channel];
  if (!in_range(*weights, dtype) || !in_range(new_bias, dtype)) {
    return rw.fail("a folded value overflows " + dtype_name(dtype));
  }

  Value* w_new = add_constant(rw, m.value(h.w)->name() + "_bn",
                              make_tensor(dtype, wt->dims, encode(dtype, *weights)));
  const Value* conv_bias = conv_node->inputs().size() > 2 ? conv_node->inputs()[2] : nullptr;
  const std::string bias_base = conv_bias ? conv_bias->name() : m.value(h.w)->name() + "_bias";
  Value* b_new =
      add_constant(rw, bias_base + "_bn", make_tensor(dtype, {channels}, encode(dtype, new_bias)));
  std::vector<Attribute> attrs;
  for (const Attribute& a : conv_node->attributes) attrs.push_back(copy_attribute(a));
  Value* y = rw.op1("Conv", {m.value(h.x), w_new, b_new}, std::move(attrs));
  return std::vector<Value*>{y};
}

std::vector<Rule> rules(const PassContext&) {
  auto p = std::make_shared<Pattern>("fuse_conv_bn");
  ConvBn h;
  h.x = p->var("x");
  h.w = p->var("w");
  h.conv = p->op("Conv", {h.x, h.w}).extra_inputs();  // optional bias
  h.bn = p->op("BatchNormalization",
               {h.conv, p->var("scale"), p->var("B"), p->var("mean"), p->var("var")});
  p->root(h.bn);
  return {
      {"fuse_conv_bn", p, [h](const Match& m, Rewriter& rw) { return fuse_conv_bn(h, m, rw); }}};
}

const PassRegistrar kRegister{rule_pass(
    "fuse_conv_bn", "fold inference BatchNormalization after Conv into the Conv's weights and bias",
    {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
