// A norm the exporter runs in fp32 between Casts -> the same norm on the fp16 value (target ort).
//
//   x:f16 ── Cast(to=f32) ── LayerNormalization(gamma:f32 [, beta:f32]) ── Cast(to=f16) ── y
//     =>  x:f16 ── LayerNormalization(gamma:f16 [, beta:f16], stash_type=1) ── y
//
// Models that upcast their norms (cohere's, olmo's `hidden.to(float32)` around LayerNorm) export
// this island in fp16; it keeps the residual Add out of SkipLayerNormalization and costs two
// Casts per norm. ONNX Runtime computes fp16 LayerNormalization and SimplifiedLayerNormalization
// entirely in fp32 (mean, variance, scale and bias) and rounds once at the end, which is what the
// Cast pair does: the outputs are bit-identical (tests/fusion/test_fuse_norm_casts.py checks it on
// the kernels). The ONNX spec instead applies scale and bias in the input type after the stash, so
// target onnx keeps the Casts. gamma and beta must be fp16-exact (converted weights are).
#include <cmath>

#include "ir/constant.h"
#include "passes/fusion/norm_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

bool is_cast_to(const Node* n, int32_t dtype) {
  const Attribute* to = n->attribute("to");
  if (!to || !to->i || *to->i != dtype) return false;
  for (const auto& a : n->attributes) {
    if (a.name != "to" && a.name != "saturate") return false;
  }
  return true;
}

// `v` (a 1-D fp32 constant) as an fp16 initializer, when every element survives the round trip.
Value* exact_half(Rewriter& rw, Value* v, std::string* why, const std::string& what) {
  const Tensor* t = constant_tensor_view(v);
  if (!t || t->dtype() != kFloat || t->dims.size() != 1) {
    *why = what + " is not a 1-D fp32 constant";
    return nullptr;
  }
  auto values = tensor_doubles(*t, uint64_t{1} << 20);
  if (!values) {
    *why = what + " cannot be read";
    return nullptr;
  }
  for (double d : *values) {
    const float f = static_cast<float>(d);
    if (!(half_to_float(float_to_half(f)) == f)) {
      *why = what + " has values fp16 cannot hold exactly";
      return nullptr;
    }
  }
  return rw.initializer(v->name(), norm::convert_tensor(*t, kFloat16));
}

Replacement absorb(const Match& m, P up_p, P norm_p, Rewriter& rw, PassContext& ctx) {
  if (ctx.target != Target::kOrt) {
    return rw.fail("target onnx: the spec applies scale and bias in fp16, the Casts keep fp32");
  }
  Node* up = m.node(up_p);
  Node* norm = m.node(norm_p);
  Node* down = m.root();
  Value* x = m.value("x");
  if (value_dtype(x) != kFloat16) return rw.fail("the norm's input before the Cast is not fp16");
  if (!is_cast_to(up, kFloat) || !is_cast_to(down, kFloat16)) {
    return rw.fail("the Casts are not fp16 -> fp32 -> fp16");
  }
  for (size_t i = 1; i < norm->outputs().size(); ++i) {
    const Value* o = norm->outputs()[i];
    if (o && (!o->uses().empty() || o->is_graph_output())) {
      return rw.fail("the norm's mean / inverse std-dev outputs are used");
    }
  }
  if (const Attribute* s = norm->attribute("stash_type"); s && s->i && *s->i != 1) {
    return rw.fail("the norm's stash_type is not fp32");
  }
  std::string why;
  std::vector<Value*> inputs = {x};
  for (size_t i = 1; i < norm->inputs().size(); ++i) {
    Value* in = norm->inputs()[i];
    if (!in) {
      inputs.push_back(nullptr);
      continue;
    }
    Value* half = exact_half(rw, in, &why, i == 1 ? "the scale" : "the bias");
    if (!half) return rw.fail(why);
    inputs.push_back(half);
  }
  std::vector<Attribute> attrs;
  for (const auto& a : norm->attributes) {
    if (a.name != "stash_type") attrs.push_back(copy_attribute(a));
  }
  attrs.push_back(attr_int("stash_type", 1));
  Value* y = rw.op1(norm->op_type, inputs, std::move(attrs), norm->domain.value);
  ++ctx.counters[norm->op_type == "LayerNormalization" ? "layer_norm" : "simplified_layer_norm"];
  return std::vector<Value*>{y};
}

std::vector<Rule> rules(PassContext& ctx) {
  std::vector<Rule> out;
  for (const char* op : {"LayerNormalization", "SimplifiedLayerNormalization"}) {
    auto p = std::make_shared<Pattern>("fuse_norm_casts");
    P up = p->op("Cast", {p->var("x")});
    P norm = p->op(op, {up}).extra_inputs();
    p->root(p->op("Cast", {norm}));
    out.push_back({"fuse_norm_casts", p, [up, norm, &ctx](const Match& m, Rewriter& rw) {
                     return absorb(m, up, norm, rw, ctx);
                   }});
  }
  return out;
}

const PassRegistrar kRegister{
    rule_pass("fuse_norm_casts",
              "a LayerNormalization / SimplifiedLayerNormalization run in fp32 between Casts "
              "from and back to fp16 -> the norm on the fp16 value (target ort; ORT computes it "
              "in fp32 internally, bit-identical)",
              {"fusion"}, rules)};

}  // namespace
}  // namespace fastopt::passes
