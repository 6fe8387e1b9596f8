// Dynamic int8 quantization of MatMul and Conv weights: weights become int8 once, activations
// are quantized to uint8 at run time. Weight bytes are those of onnxruntime's
// quantize_dynamic(weight_type=QInt8) for the same per_channel / symmetric / reduce_range
// settings (quant/int8.h).
//
//   target ort:   A ── MatMul(A, W [K, N] float32) (── Add(b [N]))?
//                   ==>  com.microsoft DynamicQuantizeMatMul(A, Wq int8, w_scale, w_zp?, b?)
//                 or, when several quantized MatMuls read A (Q/K/V, gate/up), A quantized once:
//                   A ── DynamicQuantizeLinear ── com.microsoft MatMulIntegerToFloat(Aq, Wq,
//                   a_scale, w_scale, a_zp, w_zp?, b?) for each
//                 (what ORT's own fusions make of quantize_dynamic's output, written directly)
//   target onnx:  A ── DynamicQuantizeLinear ── MatMulInteger(Aq, Wq, a_zp, w_zp?) ── Cast(float)
//                 ── Mul(·, Mul(a_scale, w_scale))        (what quantize_dynamic writes)
//   both:         X ── Conv(X, W [M, C/g, k...], B?)
//                   ==>  X ── DynamicQuantizeLinear ── ConvInteger(Xq, Wq, x_zp, w_zp?) ── Cast
//                        ── Mul(·, Mul(x_scale, w_scale)) (── Add(B viewed as [M, 1, ...]))?
//
// w_scale / w_zp are scalars, or [N] per output column with quant_per_channel (MatMul only:
// quantize_dynamic quantizes Conv weights per tensor whatever per_channel says). w_zp is written
// only when asymmetric (symmetric zero points are 0, the ops' default). One DynamicQuantizeLinear
// serves every MatMulInteger / ConvInteger reading the same activation.
// Kept in float, with the reason in the report: weights that are not float32 initializers (the
// activation quantizers take float32 only), not 2-D (MatMul), names matching quant_exclude,
// NaN / infinite weights, embedding tables (Gather; not quantized by this mode).
#include <map>
#include <memory>

#include "ir/constant.h"
#include "ir/error.h"
#include "passes/fusion_util.h"
#include "passes/quant/options.h"
#include "passes/registry.h"
#include "proto/onnx_writer.h"
#include "quant/int8.h"

namespace fastopt::passes {
namespace {
using quant::QuantRecord;

struct Candidate {
  Graph* graph;
  Node* node;           // MatMul or Conv
  Node* add = nullptr;  // bias Add folded into DynamicQuantizeMatMul
  Value* weight;
  std::shared_ptr<const Tensor> tensor;
  size_t job = 0;
  std::string made;  // the op it became
};

// The Add of a constant 1-D float32 bias of length n that alone reads `mm`'s output, or null.
Node* bias_add(const Node* mm, int64_t n) {
  const Value* out = mm->outputs()[0];
  if (out->is_graph_output() || out->uses().size() != 1) return nullptr;
  Node* add = out->uses()[0].node;
  if (add->op_type != "Add" || !add->domain.value.empty() || add->inputs().size() != 2) {
    return nullptr;
  }
  const Value* other = add->inputs()[1 - out->uses()[0].input_index];
  const Tensor* b = constant_tensor_view(other);
  if (!b || b->dims.size() != 1 || b->dims[0] != n || b->dtype() != kFloat) return nullptr;
  return add;
}

std::shared_ptr<Tensor> view_tensor(int32_t dtype, std::vector<int64_t> dims, ByteRef bytes) {
  auto t = std::make_shared<Tensor>();
  t->data_type = dtype;
  t->dims = std::move(dims);
  t->storage = Tensor::Storage::kRaw;
  t->has_raw_field = true;
  t->raw = std::move(bytes);
  return t;
}

class DynamicQuantizer {
 public:
  DynamicQuantizer(Model& m, PassContext& ctx)
      : model_(m), ctx_(ctx), opt_(quant::read_options(ctx)) {
    spec_.symmetric = opt_.symmetric;
    spec_.per_channel = opt_.per_channel;
    auto it = ctx.options.find("quant_reduce_range");
    spec_.reduce_range = it != ctx.options.end() && it->second != 0;
  }

  int64_t run() {
    model_.for_each_graph([&](Graph& g) { collect(g); });
    if (jobs_.empty()) return 0;
    if (default_opset(model_) < 11) {
      throw ModelError("int8-dynamic needs opset >= 11 (DynamicQuantizeLinear), the model has " +
                       std::to_string(default_opset(model_)) + " (convert_version first)");
    }
    file_ = quant::TempFile::create(opt_.tmpdir);
    quant::run_int8_jobs(jobs_, *file_, opt_.threads, ctx_.progress);
    for (const Candidate& c : cands_) {
      if (jobs_[c.job].finite && c.node->op_type != "Conv") {
        ++readers_[{c.graph, c.node->inputs()[0]}];
      }
    }
    int64_t rewrites = 0;
    for (Candidate& c : cands_) rewrites += rewrite(c);
    for (size_t j = 0; j < jobs_.size(); ++j) finish_record(j);
    return rewrites;
  }

 private:
  void keep(const Value* w, const Node* n, std::string reason, const Tensor* t) {
    ctx_.quant_records.push_back(quant::kept_record(w, n, std::move(reason), t));
    ++ctx_.counters["weights_kept"];
  }

  void collect(Graph& g) {
    for (Node* n = g.first(); n; n = n->next()) {
      if (!n->domain.value.empty() && n->domain.value != "ai.onnx") continue;
      if (n->op_type == "Gather" && !n->inputs().empty() && n->inputs()[0]) {
        const Tensor* t = constant_tensor_view(n->inputs()[0]);
        if (t && t->dims.size() == 2 && t->dtype() == kFloat) {
          keep(n->inputs()[0], n,
               "embedding table (Gather): int8-dynamic quantizes MatMul and "
               "Conv weights",
               t);
        }
        continue;
      }
      const bool conv = n->op_type == "Conv";
      if ((n->op_type != "MatMul" && n->op_type != "Gemm" && !conv) || n->inputs().size() < 2 ||
          !n->inputs()[1]) {
        continue;
      }
      consider(g, n, conv);
    }
  }

  void consider(Graph& g, Node* n, bool conv) {
    Value* w = n->inputs()[1];
    auto t = constant_tensor(w);
    if (!t) return keep(w, n, "weight is not a constant initializer", nullptr);
    if (std::string bad = mistyped_reason(n); !bad.empty()) return keep(w, n, bad, t.get());
    if (!w->initializer()) {
      return keep(w, n, "weight is a Constant node, not an initializer", t.get());
    }
    if (t->dtype() != kFloat) {
      return keep(w, n,
                  "weight type " + dtype_name(t->dtype()) +
                      " (DynamicQuantizeLinear and DynamicQuantizeMatMul take float32 only)",
                  t.get());
    }
    const int32_t a_type = value_dtype(n->inputs()[0]);
    if (a_type != 0 && a_type != kFloat) {
      return keep(w, n, "input is " + dtype_name(a_type) + ", not float32", t.get());
    }
    if (!conv && t->dims.size() != 2) {
      return keep(w, n, "weight is not 2-D (rank " + std::to_string(t->dims.size()) + ")", t.get());
    }
    if (conv && t->dims.size() < 3) {
      return keep(w, n, "Conv weight of rank " + std::to_string(t->dims.size()), t.get());
    }
    if (t->numel() == 0) return keep(w, n, "weight is empty", t.get());
    const bool gemm = n->op_type == "Gemm";
    const bool trans_b = gemm && int_attr_or(n, "transB", 0) != 0;
    if (gemm) {
      // quantize_dynamic turns such a Gemm into MatMul(A, B or B^T) + Add(C) first.
      if (int_attr_or(n, "transA", 0) != 0 || float_attr(n, "alpha", 1.0f) != 1.0f ||
          float_attr(n, "beta", 1.0f) != 1.0f) {
        return keep(w, n, "Gemm with transA, alpha or beta other than 0, 1, 1", t.get());
      }
      if (n->inputs().size() > 2 && n->inputs()[2]) {
        const Tensor* b = constant_tensor_view(n->inputs()[2]);
        const int64_t cols = trans_b ? t->dims[0] : t->dims[1];
        if (!b || b->dtype() != kFloat || b->dims.size() != 1 || b->dims[0] != cols) {
          return keep(w, n, "Gemm bias C is not a constant float32 [N] tensor", t.get());
        }
      }
    }
    if (conv && n->inputs().size() > 2 && n->inputs()[2]) {
      const Tensor* b = constant_tensor_view(n->inputs()[2]);
      if (!b || b->dtype() != kFloat || b->dims.size() != 1 || b->dims[0] != t->dims[0]) {
        return keep(w, n, "Conv bias is not a constant float32 [M] tensor", t.get());
      }
    }
    for (const std::string& name : {n->name.value, w->name()}) {
      std::string glob = opt_.excluded(name);
      if (!glob.empty()) return keep(w, n, "excluded by '" + glob + "'", t.get());
    }
    Candidate c{&g, n, nullptr, w, t, 0, ""};
    if (!conv && !gemm && ctx_.target != Target::kOnnx) c.add = bias_add(n, t->dims[1]);
    auto it = job_of_.find({t.get(), trans_b});
    if (it == job_of_.end()) {
      quant::Int8Job job;
      job.name = trans_b ? w->name() + "_Transposed" : w->name();
      job.transposed = trans_b;
      const int64_t rows = conv ? 1 : t->dims[0];
      const int64_t cols = conv ? static_cast<int64_t>(t->numel()) : t->dims[1];
      job.src = quant::WeightSource{t->bytes(), kFloat, rows, cols};
      job.spec = spec_;
      job.spec.per_channel = spec_.per_channel && !conv;
      // Room for the framing of the codes' initializer as initializers() names it.
      job.framing = initializer_framing_bytes(
          job.name + "_quantized", trans_b ? std::vector<int64_t>{job.rows(), job.cols()} : t->dims,
          kInt8, job.data_bytes());
      it = job_of_.emplace(std::make_pair(t.get(), trans_b), jobs_.size()).first;
      jobs_.push_back(std::move(job));
      first_user_.push_back(cands_.size());
    }
    c.job = it->second;
    cands_.push_back(std::move(c));
  }

  struct Made {
    Value *data, *scale, *zp;
  };
  // The quantized initializers of job j in graph g (made once per graph), named as
  // quantize_dynamic names them.
  Made initializers(Graph& g, size_t j, const Tensor& w) {
    auto key = std::make_pair(&g, j);
    auto it = made_.find(key);
    if (it != made_.end()) return it->second;
    const quant::Int8Job& job = jobs_[j];
    const std::string& base = job.name;
    Made m{nullptr, nullptr, nullptr};
    const std::vector<int64_t> dims_q =
        job.transposed ? std::vector<int64_t>{job.rows(), job.cols()} : w.dims;
    m.data = g.add_initializer(
        g.unique_name(base + "_quantized"),
        view_tensor(kInt8, dims_q, ByteRef{file_, job.data_offset, job.data_bytes()}));
    std::string scales, zps;
    for (const quant::Int8Params& p : job.params) {
      scales.append(reinterpret_cast<const char*>(&p.scale), 4);
      zps.push_back(static_cast<char>(p.zero_point));
    }
    std::vector<int64_t> dims;
    if (job.spec.per_channel) dims.push_back(job.channels());
    m.scale = g.add_initializer(g.unique_name(base + "_scale"),
                                make_tensor(kFloat, dims, std::move(scales)));
    if (!opt_.symmetric || has_nonzero(job)) {
      m.zp = g.add_initializer(g.unique_name(base + "_zero_point"),
                               make_tensor(kInt8, dims, std::move(zps)));
    }
    made_.emplace(key, m);
    return m;
  }

  static bool has_nonzero(const quant::Int8Job& job) {
    for (const auto& p : job.params) {
      if (p.zero_point != 0) return true;
    }
    return false;
  }

  // DynamicQuantizeLinear of `x`, one per activation and graph: (quantized, scale, zero point).
  Node* activation_quantizer(Graph& g, Value* x, Node* before) {
    auto it = dql_.find({&g, x});
    if (it != dql_.end()) return it->second;
    const std::string& b = x->name();
    Node* q = g.create_node("DynamicQuantizeLinear", "", {x},
                            {g.unique_name(b + "_quantized"), g.unique_name(b + "_scale"),
                             g.unique_name(b + "_zero_point")},
                            before);
    q->name.set(g.unique_name(b + "_QuantizeLinear"));
    dql_.emplace(std::make_pair(&g, x), q);
    return q;
  }

  std::string base_name(const Node* n) const {
    return n->name.value.empty() ? n->outputs()[0]->name() : n->name.value;
  }

  int64_t rewrite(Candidate& c) {
    const quant::Int8Job& job = jobs_[c.job];
    if (!job.finite) return 0;  // kept; finish_record says why
    Graph& g = *c.graph;
    Made m = initializers(g, c.job, *c.tensor);
    Node* n = c.node;
    const bool conv = n->op_type == "Conv";
    const std::string base = base_name(n);
    Value* old_out = c.add ? c.add->outputs()[0] : n->outputs()[0];
    Value* result = nullptr;
    const bool gemm = n->op_type == "Gemm";
    Value* bias = c.add ? c.add->inputs()[1 - n->outputs()[0]->uses()[0].input_index] : nullptr;
    if (gemm && n->inputs().size() > 2) bias = n->inputs()[2];
    if (!conv && ctx_.target != Target::kOnnx) {
      std::vector<Value*> in;
      const bool shared = readers_[{&g, n->inputs()[0]}] > 1;
      if (shared) {
        // Several MatMuls read A (Q/K/V, gate/up): quantize A once for all of them.
        Node* dql = activation_quantizer(g, n->inputs()[0], n);
        in = {dql->outputs()[0], m.data, dql->outputs()[1], m.scale, dql->outputs()[2], m.zp, bias};
      } else {
        in = {n->inputs()[0], m.data, m.scale, m.zp, bias};
      }
      while (!in.back()) in.pop_back();
      Node* q = g.create_node(shared ? "MatMulIntegerToFloat" : "DynamicQuantizeMatMul", kMsDomain,
                              in, {g.unique_name(old_out->name() + "_quantized")}, n);
      c.made = q->op_type;
      q->name.set(g.unique_name(base + "_quant"));
      import_domain(g, kMsDomain);
      result = q->outputs()[0];
      if (c.add) ++ctx_.counters["bias_folded"];
      ++ctx_.counters["matmuls_quantized"];
      if (shared) ++ctx_.counters["activations_shared"];
    } else {
      Node* dql = activation_quantizer(g, n->inputs()[0], n);
      std::vector<Value*> in{dql->outputs()[0], m.data, dql->outputs()[2]};
      if (m.zp) in.push_back(m.zp);
      Node* qi = g.create_node(conv ? "ConvInteger" : "MatMulInteger", "", in,
                               {g.unique_name(n->outputs()[0]->name() + "_output_quantized")}, n);
      qi->name.set(g.unique_name(base + "_quant"));
      if (conv) {
        for (const Attribute& a : n->attributes)
          qi->attributes.push_back(pattern::copy_attribute(a));
      }
      Node* cast = g.create_node("Cast", "", {qi->outputs()[0]},
                                 {g.unique_name(qi->outputs()[0]->name() + "_cast_output")}, n);
      cast->attributes.push_back(pattern::attr_int("to", kFloat));
      Node* scales = g.create_node("Mul", "", {dql->outputs()[1], m.scale},
                                   {g.unique_name(base + "_quant_scales_mul:0")}, n);
      Node* mul = g.create_node("Mul", "", {cast->outputs()[0], scales->outputs()[0]},
                                {g.unique_name(n->outputs()[0]->name() + "_scaled")}, n);
      result = mul->outputs()[0];
      if (conv && n->inputs().size() > 2 && n->inputs()[2]) {
        // The bias, viewed (no copy) as [M, 1, ...] to broadcast over the spatial dims.
        const auto b = constant_tensor(n->inputs()[2]);
        std::vector<int64_t> dims(c.tensor->dims.size() - 1, 1);
        dims[0] = b->dims[0];
        bias = g.add_initializer(g.unique_name(n->inputs()[2]->name() + "_reshaped"),
                                 view_tensor(kFloat, dims, b->bytes()));
      }
      if (bias) {
        Node* add = g.create_node("Add", "", {result, bias},
                                  {g.unique_name(n->outputs()[0]->name() + "_bias_add")}, n);
        result = add->outputs()[0];
      }
      ++ctx_.counters[conv ? "convs_quantized" : "matmuls_quantized"];
    }
    pattern::replace_value(g, old_out, result);
    std::vector<Value*> dropped;
    for (Value* v : n->inputs()) {
      if (v) dropped.push_back(v);
    }
    std::vector<Node*> dead{n};
    if (c.add) dead.push_back(c.add);
    pattern::remove_dead(g, dead);
    for (Value* v : dropped) {
      if (v->initializer() && v->uses().empty() && !v->is_graph_input() && !v->is_graph_output()) {
        v->graph()->remove_initializer(v);
      }
    }
    return 1;
  }

  void finish_record(size_t j) {
    const quant::Int8Job& job = jobs_[j];
    const Candidate& c = cands_[first_user_[j]];
    if (!job.finite) {
      keep(c.weight, c.node, "weight holds NaN or infinite values", c.tensor.get());
      return;
    }
    const bool conv = c.node->op_type == "Conv";
    QuantRecord r = quant::quantized_record(job.name, c.node, c.tensor->nbytes(), job.error);
    r.op = !c.made.empty() ? c.made : conv ? "ConvInteger" : "MatMulInteger";
    r.dtype_before = dtype_name(kFloat);
    r.dtype_after = "int8";
    const uint64_t ch = static_cast<uint64_t>(job.channels());
    r.bytes_after = job.data_bytes() + 4 * ch + (!opt_.symmetric || has_nonzero(job) ? ch : 0);
    ctx_.quant_records.push_back(std::move(r));
    ++ctx_.counters["weights_quantized"];
  }

  Model& model_;
  PassContext& ctx_;
  quant::QuantOptions opt_;
  quant::Int8Spec spec_;
  std::shared_ptr<quant::TempFile> file_;
  std::vector<Candidate> cands_;
  std::vector<quant::Int8Job> jobs_;
  std::vector<size_t> first_user_;
  std::map<std::pair<const Tensor*, bool>, size_t> job_of_;  // (weight, transposed)
  std::map<std::pair<Graph*, size_t>, Made> made_;
  std::map<std::pair<Graph*, Value*>, Node*> dql_;
  // Quantized MatMuls reading each activation (target ort: MatMulIntegerToFloat when > 1).
  std::map<std::pair<Graph*, Value*>, int> readers_;
};

int64_t quantize_dynamic(Model& model, PassContext& ctx) {
  return DynamicQuantizer(model, ctx).run();
}

const PassRegistrar kRegister{
    PassDecl(
        "quantize_dynamic",
        "dynamic int8 (options quant_per_channel, quant_symmetric, quant_exclude, ...): MatMul "
        "with "
        "a constant 2-D float32 weight -> com.microsoft DynamicQuantizeMatMul (target ort) or "
        "DynamicQuantizeLinear + MatMulInteger (target onnx); Conv -> ConvInteger; weight bytes as "
        "onnxruntime's quantize_dynamic (QInt8)")
        .tags({"quantization"})
        .not_idempotent()
        .run(quantize_dynamic)};

}  // namespace
}  // namespace fastopt::passes
