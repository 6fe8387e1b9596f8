// Weight-only int4 / int8 quantization of MatMuls with constant 2-D weights (round to nearest,
// blockwise along K, byte for byte what onnxruntime's MatMulNBitsQuantizer writes).
//
//   target ort:   A ── MatMul(A, W [K, N]) (── Add(b [N]))?   ==>   MatMulNBits(A, Wq, scales, zp?,
//                                                                     "", b?)  com.microsoft
//                 Wq uint8 [N, k_blocks, block_size * bits / 8], scales [N, k_blocks] (W's type),
//                 zp uint8 [N, ceil(k_blocks * bits / 8)] (asymmetric only); K padded to blocks.
//   target onnx:  A ── MatMul(A, DequantizeLinear(Wq [K, N] int4|uint4|int8|uint8, scales
//                 [k_blocks, N], zp?, axis 0, block_size))     (opset >= 21)
//
// Both exporters write every linear layer as MatMul(x, W^T-constant) (TorchScript and dynamo;
// packed QKV / gate-up after pack_matmuls too). Kept in float, with the reason in the report:
// weights that are not constant 2-D float/float16/bfloat16 initializers, names matching
// quant_exclude, the lm_head (the MatMul whose output is a graph output) per quant_lm_head, and
// embeddings (Gather tables) unless quant_embeddings says otherwise (not yet supported).
// Quantized bytes go to an unlinked temporary file (quant/temp_file.h), not to memory.
#include <map>
#include <memory>

#include "ir/constant.h"
#include "ir/error.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"
#include "quant/options.h"
#include "quant/quantize_job.h"

namespace fastopt::passes {
namespace {
using quant::QuantRecord;

struct Candidate {
  Graph* graph;
  Node* matmul;
  Node* add = nullptr;  // bias Add folded into MatMulNBits (target ort)
  Value* weight;
  std::shared_ptr<const Tensor> tensor;
  int bits;
  size_t job = 0;
};

bool is_float(int32_t t) {
  return t == kFloat || t == kFloat16 || t == kBFloat16;
}

// The Add of a constant 1-D bias of length n that alone reads `mm`'s output, or null.
Node* bias_add(const Node* mm, int64_t n, int32_t dtype) {
  const Value* out = mm->outputs()[0];
  if (out->is_graph_output() || out->uses().size() != 1) return nullptr;
  Node* add = out->uses()[0].node;
  if (add->op_type != "Add" || !add->domain.value.empty() || add->inputs().size() != 2) {
    return nullptr;
  }
  const Value* other = add->inputs()[1 - out->uses()[0].input_index];
  const Tensor* b = constant_tensor_view(other);
  if (!b || b->dims.size() != 1 || b->dims[0] != n || b->dtype() != dtype) return nullptr;
  return add;
}

// The MatMul computing logits: its output (through a bias Add or a Cast) is a graph output.
bool is_lm_head(const Node* mm) {
  const Value* v = mm->outputs()[0];
  for (int hops = 0; hops < 3; ++hops) {
    if (v->is_graph_output()) return true;
    if (v->uses().size() != 1) return false;
    const Node* next = v->uses()[0].node;
    if (next->op_type != "Add" && next->op_type != "Cast") return false;
    v = next->outputs()[0];
  }
  return false;
}

std::string quantized_type(int bits, bool symmetric) {
  return std::string(symmetric ? "int" : "uint") + std::to_string(bits);
}

std::shared_ptr<Tensor> view_tensor(int32_t dtype, std::vector<int64_t> dims,
                                    const std::shared_ptr<quant::TempFile>& file, uint64_t offset,
                                    uint64_t size) {
  auto t = std::make_shared<Tensor>();
  t->data_type = dtype;
  t->dims = std::move(dims);
  t->storage = Tensor::Storage::kRaw;
  t->has_raw_field = true;
  t->raw = ByteRef{file, offset, size};
  return t;
}

class Quantizer {
 public:
  Quantizer(Model& m, PassContext& ctx) : model_(m), ctx_(ctx), opt_(quant::read_options(ctx)) {}

  int64_t run() {
    if (opt_.embeddings != "keep") {
      throw ModelError("embeddings " + opt_.embeddings +
                       " (GatherBlockQuantized) is not yet supported; use embeddings keep");
    }
    if (opt_.per_channel) {
      throw ModelError(
          "per_channel applies to int8-dynamic, not to weight-only int4/int8 "
          "(which is blockwise; choose the block size)");
    }
    qdq_ = ctx_.target == "onnx";
    if (qdq_ && default_opset(model_) < 21) {
      throw ModelError("target onnx: blocked DequantizeLinear needs opset >= 21, the model has " +
                       std::to_string(default_opset(model_)) + " (convert_version first)");
    }
    model_.for_each_graph([&](Graph& g) { collect(g); });
    if (jobs_.empty()) return 0;
    auto file = quant::TempFile::create(opt_.tmpdir);
    quant::run_jobs(jobs_, *file, opt_.threads, ctx_.progress);
    int64_t rewrites = 0;
    for (Candidate& c : cands_) rewrites += rewrite(c, file);
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
        if (t && t->dims.size() == 2 && is_float(t->dtype())) {
          keep(n->inputs()[0], n, "embedding table (embeddings=keep)", t);
        }
        continue;
      }
      if (n->op_type == "Gemm" && n->inputs().size() >= 2 && n->inputs()[1]) {
        const Tensor* t = constant_tensor_view(n->inputs()[1]);
        if (t) keep(n->inputs()[1], n, "Gemm is not quantized (MatMul only, as onnxruntime)", t);
        continue;
      }
      if (n->op_type != "MatMul" || n->inputs().size() != 2 || !n->inputs()[1]) continue;
      consider(g, n);
    }
  }

  void consider(Graph& g, Node* mm) {
    Value* w = mm->inputs()[1];
    auto t = constant_tensor(w);
    if (!t) return keep(w, mm, "weight is not a constant initializer", nullptr);
    if (!w->initializer())
      return keep(w, mm, "weight is a Constant node, not an initializer", t.get());
    if (t->dims.size() != 2) {
      return keep(w, mm, "weight is not 2-D (rank " + std::to_string(t->dims.size()) + ")",
                  t.get());
    }
    if (!is_float(t->dtype())) {
      return keep(w, mm,
                  "weight type " + dtype_name(t->dtype()) +
                      " (only float32, float16 and bfloat16 are quantized)",
                  t.get());
    }
    const int32_t a_type = value_dtype(mm->inputs()[0]);
    if (a_type != 0 && a_type != t->dtype()) {
      return keep(
          w, mm,
          "input A is " + dtype_name(a_type) + " but the weight is " + dtype_name(t->dtype()),
          t.get());
    }
    if (t->dims[0] == 0 || t->dims[1] == 0) return keep(w, mm, "weight is empty", t.get());
    for (const std::string& name : {mm->name.value, w->name()}) {
      std::string glob = opt_.excluded(name);
      if (!glob.empty()) return keep(w, mm, "excluded by '" + glob + "'", t.get());
    }
    int bits = opt_.bits;
    if (is_lm_head(mm) && !opt_.lm_head.empty()) {
      if (opt_.lm_head == "keep") return keep(w, mm, "lm_head (lm_head=keep)", t.get());
      bits = opt_.lm_head == "int8" ? 8 : 4;
    }
    Candidate c{&g, mm, nullptr, w, t, bits};
    if (!qdq_) c.add = bias_add(mm, t->dims[1], t->dtype());
    auto key = std::make_pair(t.get(), bits);
    auto it = job_of_.find(key);
    if (it == job_of_.end()) {
      quant::WeightJob job;
      job.name = w->name();
      job.src = quant::WeightSource{t->bytes(), t->dtype(), t->dims[0], t->dims[1]};
      job.spec.bits = bits;
      job.spec.block_size = opt_.block_size;
      job.spec.symmetric = opt_.symmetric;
      job.spec.scale_dtype = t->dtype();
      job.layout = qdq_ ? quant::Layout::kQdq : quant::Layout::kNBits;
      it = job_of_.emplace(key, jobs_.size()).first;
      jobs_.push_back(std::move(job));
      first_user_.push_back(cands_.size());
    }
    c.job = it->second;
    cands_.push_back(std::move(c));
  }

  // The quantized initializers of job j in graph g (made once per graph).
  struct Made {
    Value *data, *scales, *zp;
  };
  Made initializers(Graph& g, size_t j, const std::shared_ptr<quant::TempFile>& file) {
    auto key = std::make_pair(&g, j);
    auto it = made_.find(key);
    if (it != made_.end()) return it->second;
    const quant::WeightJob& job = jobs_[j];
    const int64_t K = job.src.K, N = job.src.N, kb = job.k_blocks();
    const std::string base = job.name;
    Made m{nullptr, nullptr, nullptr};
    if (!qdq_) {
      m.data = g.add_initializer(
          base + "_Q" + std::to_string(job.spec.bits),
          view_tensor(kUint8, {N, kb, job.blob()}, file, job.data_offset, job.data_bytes()));
      m.scales = g.add_initializer(
          base + "_scales",
          view_tensor(job.src.dtype, {N, kb}, file, job.scale_offset, job.scale_bytes()));
      if (!job.spec.symmetric) {
        m.zp = g.add_initializer(base + "_zero_points",
                                 view_tensor(kUint8, {N, (kb * job.spec.bits + 7) / 8}, file,
                                             job.zp_offset, job.zp_bytes()));
      }
    } else {
      const int32_t qtype = job.spec.bits == 8 ? (job.spec.symmetric ? kInt8 : kUint8)
                                               : (job.spec.symmetric ? kInt4 : kUint4);
      m.data =
          g.add_initializer(base + "_DQ_Q" + std::to_string(job.spec.bits),
                            view_tensor(qtype, {K, N}, file, job.data_offset, job.data_bytes()));
      m.scales = g.add_initializer(
          base + "_DQ_scales",
          view_tensor(job.src.dtype, {kb, N}, file, job.scale_offset, job.scale_bytes()));
      if (!job.spec.symmetric) {
        m.zp = g.add_initializer(base + "_DQ_zero_points",
                                 view_tensor(qtype, {kb, N}, file, job.zp_offset, job.zp_bytes()));
      }
    }
    made_.emplace(key, m);
    return m;
  }

  int64_t rewrite(Candidate& c, const std::shared_ptr<quant::TempFile>& file) {
    const quant::WeightJob& job = jobs_[c.job];
    if (!job.error.finite()) return 0;  // kept; finish_record says why
    Graph& g = *c.graph;
    Made m = initializers(g, c.job, file);
    if (qdq_) {
      std::vector<Attribute> attrs;
      attrs.push_back(pattern::attr_int("axis", 0));
      attrs.push_back(pattern::attr_int("block_size", job.spec.block_size));
      std::vector<Value*> in{m.data, m.scales};
      if (m.zp) in.push_back(m.zp);
      Node* dq = g.create_node("DequantizeLinear", "", in,
                               {g.unique_name(c.weight->name() + "_DQ")}, c.matmul);
      dq->attributes = std::move(attrs);
      if (!c.matmul->name.value.empty()) dq->name.set(c.matmul->name.value + "_DQ_Q");
      c.matmul->set_input(1, dq->outputs()[0]);
    } else {
      std::vector<Value*> in{c.matmul->inputs()[0], m.data, m.scales, m.zp};
      if (c.add) {
        const Value* mm_out = c.matmul->outputs()[0];
        in.push_back(nullptr);  // g_idx
        in.push_back(c.add->inputs()[1 - mm_out->uses()[0].input_index]);
      } else if (!m.zp) {
        in.pop_back();
      }
      Value* old_out = c.add ? c.add->outputs()[0] : c.matmul->outputs()[0];
      Node* q = g.create_node("MatMulNBits", kMsDomain, in, {g.unique_name(old_out->name() + "_Q")},
                              c.matmul);
      q->attributes.push_back(pattern::attr_int("K", job.src.K));
      q->attributes.push_back(pattern::attr_int("N", job.src.N));
      q->attributes.push_back(pattern::attr_int("bits", job.spec.bits));
      q->attributes.push_back(pattern::attr_int("block_size", job.spec.block_size));
      if (const int64_t level = opt_.accuracy_for(job.src.dtype)) {
        q->attributes.push_back(pattern::attr_int("accuracy_level", level));
      }
      if (!c.matmul->name.value.empty()) {
        q->name.set(c.matmul->name.value + "_Q" + std::to_string(job.spec.bits));
      }
      import_domain(g, kMsDomain);
      pattern::replace_value(g, old_out, q->outputs()[0]);
      std::vector<Node*> dead{c.matmul};
      if (c.add) dead.push_back(c.add);
      pattern::remove_dead(g, dead);
      if (c.add) ++ctx_.counters["bias_folded"];
    }
    if (c.weight->uses().empty() && !c.weight->is_graph_input() && !c.weight->is_graph_output()) {
      c.weight->graph()->remove_initializer(c.weight);
    }
    ++ctx_.counters["matmuls_quantized"];
    return 1;
  }

  void finish_record(size_t j) {
    const quant::WeightJob& job = jobs_[j];
    const Candidate& c = cands_[first_user_[j]];
    if (!job.error.finite()) {
      keep(c.weight, c.matmul, "weight holds NaN or infinite values", c.tensor.get());
      return;
    }
    QuantRecord r = quant::quantized_record(job.name, c.matmul, c.tensor->nbytes(), job.error);
    r.op = qdq_ ? "DequantizeLinear+MatMul" : "MatMulNBits";
    r.dtype_before = dtype_name(job.src.dtype);
    r.dtype_after = quantized_type(job.spec.bits, job.spec.symmetric);
    r.bytes_after = job.data_bytes() + job.scale_bytes() + job.zp_bytes();
    ctx_.quant_records.push_back(std::move(r));
    ++ctx_.counters["weights_quantized"];
  }

  Model& model_;
  PassContext& ctx_;
  quant::QuantOptions opt_;
  bool qdq_ = false;
  std::vector<Candidate> cands_;
  std::vector<quant::WeightJob> jobs_;
  std::vector<size_t> first_user_;  // per job: its first candidate
  std::map<std::pair<const Tensor*, int>, size_t> job_of_;
  std::map<std::pair<Graph*, size_t>, Made> made_;
};

int64_t quantize_weights(Model& model, PassContext& ctx) {
  return Quantizer(model, ctx).run();
}

const PassRegistrar kRegister{{
    "quantize_weights",
    "weight-only int4/int8 (options quant_bits, quant_block_size, quant_symmetric, ...): "
    "MatMul with a constant 2-D float weight -> com.microsoft MatMulNBits (target ort) or "
    "blocked DequantizeLinear + MatMul (target onnx, opset 21); bytes as onnxruntime's "
    "MatMulNBitsQuantizer (RTN)",
    {"quantization"},
    1,
    INT64_MAX,
    false,
    quantize_weights,
}};

}  // namespace
}  // namespace fastopt::passes
