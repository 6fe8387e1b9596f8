// Weight-only int4 / int8 quantization of MatMuls with constant 2-D weights, blockwise along K:
// quant_method 0 (rtn, the default) rounds to nearest, byte for byte what onnxruntime's
// MatMulNBitsQuantizer writes; 1 (search) picks each block's scale and zero point for the least
// weighted squared error (quant/search.cc). quant_importance names an ONNX file of
// float32 [K] initializers, one per weight (mean x^2 of the MatMul's input per channel).
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
// embeddings (Gather tables) unless quant_embeddings says otherwise.
//
// Embeddings (quant_embeddings int4|int8): the table T [vocab, hidden] is quantized per row in
// blocks along hidden, which is MatMulNBits' layout for T's transpose (K = hidden, N = vocab):
//   target ort:   Gather(T, ids)  ==>  GatherBlockQuantized(Tq uint8 [vocab, k_blocks * blob],
//                 ids, scales [vocab, k_blocks], zp?) gather_axis 0, quantize_axis 1
//                 (com.microsoft) (── Slice(0, hidden) when hidden is not a block multiple: padded
//                 rows)
//   target onnx:  Gather(DequantizeLinear(Tq [vocab, hidden], scales [vocab, k_blocks], zp?,
//                 axis 1, block_size), ids)
// A tied lm_head, MatMul(x, Transpose(T)) or MatMul(x, W) with W a copy of T's transpose (what
// the TorchScript exporter writes), shares one quantized tensor with the embedding as the model
// builder does: GatherBlockQuantized reads MatMulNBits' B through a Reshape to 2-D. The copy is
// shared only when its quantized bytes are identical to the table's (compared after quantizing).
// Quantized bytes go to an unlinked temporary file (quant/temp_file.h), not to memory.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <tuple>

#include "ir/constant.h"
#include "ir/error.h"
#include "passes/fusion_util.h"
#include "passes/quant/options.h"
#include "passes/registry.h"
#include "proto/onnx_reader.h"
#include "proto/onnx_writer.h"
#include "quant/quantize_job.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {
namespace {
using quant::QuantRecord;

struct Candidate {
  Graph* graph;
  Node* matmul;
  Node* add = nullptr;  // bias Add folded into MatMulNBits (target ort)
  Value* weight;        // the MatMul's input B
  std::shared_ptr<const Tensor> tensor;
  int bits;
  size_t job = 0;
  Value* initializer = nullptr;  // B, or T when B is Transpose(T)
  bool lm_head = false;
};

struct Embedding {
  Graph* graph;
  Node* gather;
  Value* table;
  std::shared_ptr<const Tensor> tensor;
  size_t job = 0;
  std::string shared_with;  // the lm_head weight whose quantized tensors it reads, if any
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

// The 2-D initializer T when `w` is Transpose(T) (perm [1, 0] or none), else null.
Value* transposed_initializer(const Value* w) {
  const Node* t = w->producer();
  if (!t || t->op_type != "Transpose" || !t->domain.value.empty() || t->inputs().size() != 1 ||
      !t->inputs()[0] || pattern::mistyped_attribute(*t)) {
    return nullptr;
  }
  Value* src = t->inputs()[0];
  const Tensor* tensor = constant_tensor_view(src);
  if (!tensor || !src->initializer() || tensor->dims.size() != 2) return nullptr;
  const Attribute* perm = t->attribute("perm");
  if (perm && perm->ints != std::vector<int64_t>{1, 0}) return nullptr;
  return src;
}

// Whether two reserved ranges of the temporary file hold the same bytes (read in chunks).
bool same_bytes(const quant::TempFile& f, uint64_t a, uint64_t b, uint64_t n) {
  std::vector<uint8_t> x(1 << 20), y(1 << 20);
  for (uint64_t done = 0; done < n;) {
    const uint64_t k = std::min<uint64_t>(x.size(), n - done);
    if (::pread(f.fd(), x.data(), k, static_cast<off_t>(a + done)) != static_cast<ssize_t>(k) ||
        ::pread(f.fd(), y.data(), k, static_cast<off_t>(b + done)) != static_cast<ssize_t>(k) ||
        std::memcmp(x.data(), y.data(), k) != 0) {
      return false;
    }
    done += k;
  }
  return true;
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

// The name, type and shape of one quantized initializer.
struct Part {
  std::string name;
  int32_t dtype;
  std::vector<int64_t> dims;
};
struct Parts {
  Part data, scales, zp;
};

// The initializers of a job's parts as the rewrites name and shape them: MatMulNBits' or
// DequantizeLinear's (qdq), a MatMul's or a Gather's (embedding).
Parts parts_of(const quant::WeightJob& job, bool qdq, bool embedding) {
  const int64_t K = job.src.K, N = job.src.N, kb = job.k_blocks();
  const int bits = job.spec.bits;
  const std::string& base = job.name;
  if (!qdq) {
    std::vector<int64_t> data_dims{N, kb, job.blob()};
    if (embedding) data_dims = {N, kb * job.blob()};
    return {{base + "_Q" + std::to_string(bits), kUint8, data_dims},
            {base + "_scales", job.src.dtype, {N, kb}},
            {base + "_zero_points", kUint8, {N, (kb * bits + 7) / 8}}};
  }
  const int32_t qtype =
      bits == 8 ? (job.spec.symmetric ? kInt8 : kUint8) : (job.spec.symmetric ? kInt4 : kUint4);
  const std::vector<int64_t> data_dims =
      embedding ? std::vector<int64_t>{N, K} : std::vector<int64_t>{K, N};
  const std::vector<int64_t> block_dims =
      embedding ? std::vector<int64_t>{N, kb} : std::vector<int64_t>{kb, N};
  return {{base + "_DQ_Q" + std::to_string(bits), qtype, data_dims},
          {base + "_DQ_scales", job.src.dtype, block_dims},
          {base + "_DQ_zero_points", qtype, block_dims}};
}

uint64_t framing(const Part& p, uint64_t nbytes) {
  return initializer_framing_bytes(p.name, p.dims, p.dtype, nbytes);
}

Value* add_part(Graph& g, const Part& p, const std::shared_ptr<quant::TempFile>& file,
                uint64_t offset, uint64_t size) {
  return g.add_initializer(p.name, view_tensor(p.dtype, p.dims, file, offset, size));
}

class Quantizer {
 public:
  Quantizer(Model& m, PassContext& ctx) : model_(m), ctx_(ctx), opt_(quant::read_options(ctx)) {}

  int64_t run() {
    if (opt_.per_channel) {
      throw ModelError(
          "per_channel applies to int8-dynamic, not to weight-only int4/int8 "
          "(which is blockwise; choose the block size)");
    }
    qdq_ = ctx_.target == Target::kOnnx;
    if (qdq_ && default_opset(model_) < 21) {
      throw ModelError("target onnx: blocked DequantizeLinear needs opset >= 21, the model has " +
                       std::to_string(default_opset(model_)) + " (convert_version first)");
    }
    model_.for_each_graph([&](Graph& g) { collect(g); });
    if (jobs_.empty()) return 0;
    read_importance();
    read_hessian();
    // Room for each part's framing as its first user will name it, so that a self-contained
    // save can keep the quantized bytes where they are written (quant/temp_file.h).
    for (size_t j = 0; j < jobs_.size(); ++j) {
      quant::WeightJob& job = jobs_[j];
      const Parts p = parts_of(job, qdq_, first_user_[j] == kEmbeddingJob);
      job.data_framing = framing(p.data, job.data_bytes());
      job.scale_framing = framing(p.scales, job.scale_bytes());
      job.zp_framing = framing(p.zp, job.zp_bytes());
    }
    auto file = quant::TempFile::create(opt_.tmpdir);
    quant::run_jobs(jobs_, *file, opt_.threads, ctx_.progress);
    int64_t rewrites = 0;
    for (Candidate& c : cands_) rewrites += rewrite(c, file);
    for (Embedding& e : embeds_) rewrites += rewrite_embedding(e, file);
    for (size_t j = 0; j < jobs_.size(); ++j) {
      if (first_user_[j] != kEmbeddingJob) finish_record(j);
    }
    return rewrites;
  }

 private:
  // quant_importance: each job whose weight has an entry gets its K weights (read in place from
  // the file's mapping; copied only when unaligned).
  void read_importance() {
    if (opt_.importance.empty()) return;
    importance_model_ = read_model_file(opt_.importance);
    std::map<std::string, const Value*> by_name;
    for (const Value* v : importance_model_->graph->initializer_order)
      by_name.emplace(v->name(), v);
    for (quant::WeightJob& job : jobs_) {
      auto it = by_name.find(job.name);
      if (it == by_name.end()) continue;  // uniform
      const Tensor* t = constant_tensor_view(it->second);
      const std::string where = "importance '" + job.name + "' in " + opt_.importance;
      if (!t || t->dtype() != kFloat) {
        throw ModelError(where + ": must be float32, not " + (t ? dtype_name(t->dtype()) : "?"));
      }
      if (t->dims.size() != 1 || t->dims[0] != job.src.K) {
        std::string shape;
        for (int64_t d : t->dims) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        throw ModelError(where + ": must be 1-D of length " + std::to_string(job.src.K) +
                         " (the weight's input channels), not [" + shape + "]");
      }
      importance_bytes_.push_back(t->bytes());  // a view, or the decoded copy of typed fields
      const ByteRef& bytes = importance_bytes_.back();
      if (bytes.size != static_cast<uint64_t>(job.src.K) * 4) {
        throw ModelError(where + ": holds " + std::to_string(bytes.size) + " bytes, not " +
                         std::to_string(job.src.K * 4));
      }
      const float* p = reinterpret_cast<const float*>(bytes.data());
      if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) {
        importance_copies_.emplace_back(static_cast<size_t>(job.src.K));
        std::memcpy(importance_copies_.back().data(), bytes.data(), bytes.size);
        p = importance_copies_.back().data();
      }
      for (int64_t k = 0; k < job.src.K; ++k) {
        if (!(p[k] >= 0.0f) || !std::isfinite(p[k])) {
          throw ModelError(where + ": value " + std::to_string(k) + " is negative or not finite (" +
                           std::to_string(p[k]) + ")");
        }
      }
      job.importance = p;
    }
  }

  // quant_hessian (quant_method gptq): each int4 job whose weight has an entry gets its factor
  // [K, K] (read in place from the file's mapping; copied only when unaligned). int8 weights
  // and embedding tables keep the search.
  void read_hessian() {
    if (opt_.hessian.empty()) return;
    if (qdq_) {
      throw ModelError(
          "quant_method gptq writes MatMulNBits (target ort); target onnx's blocked "
          "DequantizeLinear is not supported by it");
    }
    hessian_model_ = read_model_file(opt_.hessian);
    std::map<std::string, const Value*> by_name;
    for (const Value* v : hessian_model_->graph->initializer_order) by_name.emplace(v->name(), v);
    for (size_t j = 0; j < jobs_.size(); ++j) {
      quant::WeightJob& job = jobs_[j];
      auto it = by_name.find(job.name);
      if (it == by_name.end() || job.spec.bits != 4 || embedding_job(j)) continue;
      job.gptq_factor = hessian_factor(it->second, job);
      auto order = by_name.find(job.name + "#order");
      if (order != by_name.end()) job.gptq_order = coding_order(order->second, job);
    }
  }

  bool embedding_job(size_t j) const {
    if (first_user_[j] == kEmbeddingJob) return true;
    for (const Embedding& e : embeds_) {
      if (e.job == j) return true;
    }
    return false;
  }

  // "<weight>#order": int64 [K], a permutation of 0..K-1 (GPTQ's act order).
  const int64_t* coding_order(const Value* v, const quant::WeightJob& job) {
    const Tensor* t = constant_tensor_view(v);
    const std::string where = "hessian order '" + v->name() + "' in " + opt_.hessian;
    const int64_t K = job.src.K;
    if (!t || t->dtype() != kInt64 || t->dims.size() != 1 || t->dims[0] != K) {
      throw ModelError(where + ": must be int64 [" + std::to_string(K) + "]");
    }
    hessian_bytes_.push_back(t->bytes());
    const ByteRef& bytes = hessian_bytes_.back();
    hessian_orders_.emplace_back(static_cast<size_t>(K));
    std::vector<int64_t>& order = hessian_orders_.back();
    if (bytes.size != static_cast<uint64_t>(K) * 8) throw ModelError(where + ": wrong size");
    std::memcpy(order.data(), bytes.data(), bytes.size);
    std::vector<bool> seen(static_cast<size_t>(K), false);
    for (int64_t i : order) {
      if (i < 0 || i >= K || seen[static_cast<size_t>(i)]) {
        throw ModelError(where + ": not a permutation of 0.." + std::to_string(K - 1));
      }
      seen[static_cast<size_t>(i)] = true;
    }
    return order.data();
  }

  const float* hessian_factor(const Value* v, const quant::WeightJob& job) {
    const Tensor* t = constant_tensor_view(v);
    const std::string where = "hessian '" + job.name + "' in " + opt_.hessian;
    const int64_t K = job.src.K;
    if (!t || t->dtype() != kFloat) {
      throw ModelError(where + ": must be float32, not " + (t ? dtype_name(t->dtype()) : "?"));
    }
    if (t->dims.size() != 2 || t->dims[0] != K || t->dims[1] != K) {
      throw ModelError(where + ": must be [" + std::to_string(K) + ", " + std::to_string(K) +
                       "] (the weight's input channels)");
    }
    hessian_bytes_.push_back(t->bytes());
    const ByteRef& bytes = hessian_bytes_.back();
    if (bytes.size != static_cast<uint64_t>(K * K) * 4) {
      throw ModelError(where + ": holds " + std::to_string(bytes.size) + " bytes, not " +
                       std::to_string(K * K * 4));
    }
    const float* p = reinterpret_cast<const float*>(bytes.data());
    if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) {
      hessian_copies_.emplace_back(static_cast<size_t>(K * K));
      std::memcpy(hessian_copies_.back().data(), bytes.data(), bytes.size);
      p = hessian_copies_.back().data();
    }
    for (int64_t k = 0; k < K; ++k) {
      if (!(p[k * K + k] > 0.0f) || !std::isfinite(p[k * K + k])) {
        throw ModelError(where + ": diagonal value " + std::to_string(k) +
                         " is not positive and finite");
      }
    }
    return p;
  }

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
          if (opt_.embeddings == "keep") {
            keep(n->inputs()[0], n, "embedding table (embeddings=keep)", t);
          } else {
            consider_embedding(g, n);
          }
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
    // MatMul(x, Transpose(T)): a tied lm_head reading the embedding table (target ort).
    Value* tied = t ? nullptr : transposed_initializer(w);
    if (tied && !qdq_) {
      w = tied;
      t = constant_tensor(w);
    }
    if (!t) {
      return keep(w, mm,
                  tied && qdq_ ? "weight is a Transpose (target onnx quantizes initializers only)"
                               : "weight is not a constant initializer",
                  nullptr);
    }
    if (std::string bad = mistyped_reason(mm); !bad.empty()) return keep(w, mm, bad, t.get());
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
    const bool transposed = tied != nullptr;
    for (const std::string& name : {mm->name.value, w->name()}) {
      std::string glob = opt_.excluded(name);
      if (!glob.empty()) return keep(w, mm, "excluded by '" + glob + "'", t.get());
    }
    int bits = opt_.bits;
    if (is_lm_head(mm) && !opt_.lm_head.empty()) {
      if (opt_.lm_head == "keep") return keep(w, mm, "lm_head (lm_head=keep)", t.get());
      bits = opt_.lm_head == "int8" ? 8 : 4;
    }
    if (opt_.forced_int8(w->name())) bits = 8;  // --bits-budget's allocation
    Candidate c{&g, mm, nullptr, mm->inputs()[1], t, bits, 0, w, is_lm_head(mm)};
    if (!qdq_) c.add = bias_add(mm, transposed ? t->dims[0] : t->dims[1], t->dtype());
    c.job = job_for(w->name(), t, bits, transposed,
                    qdq_ ? quant::Layout::kQdq : quant::Layout::kNBits, cands_.size());
    cands_.push_back(std::move(c));
  }

  // The job quantizing tensor t (read as its transpose when `transposed`), made on first use.
  size_t job_for(const std::string& name, const std::shared_ptr<const Tensor>& t, int bits,
                 bool transposed, quant::Layout layout, size_t first_user) {
    auto key = std::make_tuple(t.get(), bits, transposed, static_cast<int>(layout));
    auto it = job_of_.find(key);
    if (it != job_of_.end()) {
      if (first_user_[it->second] == kEmbeddingJob) first_user_[it->second] = first_user;
      return it->second;
    }
    quant::WeightJob job;
    job.name = name;
    const int64_t rows = t->dims[0], cols = t->dims[1];
    job.src = quant::WeightSource{t->bytes(), t->dtype(), transposed ? cols : rows,
                                  transposed ? rows : cols, transposed};
    job.spec.bits = bits;
    job.spec.block_size = opt_.block_size;
    job.spec.symmetric = opt_.symmetric;
    job.spec.scale_dtype = t->dtype();
    job.spec.method = opt_.method;
    job.layout = layout;
    job_of_.emplace(key, jobs_.size());
    jobs_.push_back(std::move(job));
    first_user_.push_back(first_user);
    return jobs_.size() - 1;
  }

  // Gather(T, ids) with T a constant 2-D float table: quantized per row (see the top).
  void consider_embedding(Graph& g, Node* gather) {
    Value* table = gather->inputs()[0];
    auto t = constant_tensor(table);
    const std::string what = "embedding table";
    if (!t) return keep(table, gather, what + " is not a constant initializer", nullptr);
    if (!table->initializer()) return keep(table, gather, what + " is a Constant node", t.get());
    if (gather->inputs().size() != 2 || !gather->inputs()[1] ||
        pattern::mistyped_attribute(*gather)) {
      return keep(table, gather, what + ": Gather without indices or with mistyped attributes",
                  t.get());
    }
    const int64_t axis = int_attr_or(gather, "axis", 0);
    if (axis != 0) {
      return keep(table, gather, what + " gathered on axis " + std::to_string(axis) + ", not 0",
                  t.get());
    }
    if (t->dims[0] == 0 || t->dims[1] == 0) return keep(table, gather, what + " is empty", t.get());
    for (const std::string& name : {gather->name.value, table->name()}) {
      std::string glob = opt_.excluded(name);
      if (!glob.empty()) return keep(table, gather, "excluded by '" + glob + "'", t.get());
    }
    if (t->dtype() == kBFloat16 && !opt_.cuda) {
      // onnxruntime 1.32's CPU provider has neither GatherBlockQuantized nor DequantizeLinear
      // for bfloat16 (checked: NOT_IMPLEMENTED at session creation).
      return keep(table, gather,
                  what + " is bfloat16: no CPU kernel dequantizes it (cuda=1 quantizes it)",
                  t.get());
    }
    const int bits = opt_.embeddings == "int8" ? 8 : 4;
    const int64_t hidden = t->dims[1];
    if (qdq_ && hidden * bits % 8 != 0) {
      return keep(table, gather,
                  what + ": target onnx needs whole bytes per row (hidden " +
                      std::to_string(hidden) + ", int" + std::to_string(bits) + ")",
                  t.get());
    }
    Embedding e{&g, gather, table, t, 0, ""};
    e.job = job_for(table->name(), t, bits, true,
                    qdq_ ? quant::Layout::kQdqRows : quant::Layout::kNBits, kEmbeddingJob);
    embeds_.push_back(std::move(e));
  }

  // (After the MatMul rewrites: candidates' nodes may be gone.) A MatMulNBits candidate in
  // the embedding's graph, the lm_head, whose job has the same settings as the embedding's and
  // identical quantized bytes (a TorchScript-style copy of the table's transpose), or null.
  const Candidate* tied_copy(const Embedding& e, const quant::TempFile& file) const {
    const quant::WeightJob& ej = jobs_[e.job];
    for (const Candidate& c : cands_) {
      const quant::WeightJob& cj = jobs_[c.job];
      if (c.graph != e.graph || c.job == e.job || cj.layout != ej.layout ||
          cj.spec.bits != ej.spec.bits || cj.src.K != ej.src.K || cj.src.N != ej.src.N ||
          cj.src.dtype != ej.src.dtype || !cj.error.finite() || !c.lm_head) {
        continue;
      }
      if (same_bytes(file, cj.data_offset, ej.data_offset, ej.data_bytes()) &&
          same_bytes(file, cj.scale_offset, ej.scale_offset, ej.scale_bytes()) &&
          same_bytes(file, cj.zp_offset, ej.zp_offset, ej.zp_bytes())) {
        return &c;
      }
    }
    return nullptr;
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
    const Parts p = parts_of(job, qdq_, /*embedding=*/false);
    Made m{nullptr, nullptr, nullptr};
    m.data = add_part(g, p.data, file, job.data_offset, job.data_bytes());
    m.scales = add_part(g, p.scales, file, job.scale_offset, job.scale_bytes());
    if (!job.spec.symmetric) m.zp = add_part(g, p.zp, file, job.zp_offset, job.zp_bytes());
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
      if (c.weight != c.initializer) dead.push_back(c.weight->producer());  // the Transpose
      pattern::remove_dead(g, dead);
      if (c.add) ++ctx_.counters["bias_folded"];
    }
    Value* init = c.initializer;
    if (init->uses().empty() && !init->is_graph_input() && !init->is_graph_output()) {
      init->graph()->remove_initializer(init);
    }
    ++ctx_.counters["matmuls_quantized"];
    return 1;
  }

  int64_t rewrite_embedding(Embedding& e, const std::shared_ptr<quant::TempFile>& file) {
    const quant::WeightJob& job = jobs_[e.job];
    if (!job.error.finite()) {
      keep(e.table, e.gather, "embedding table holds NaN or infinite values", e.tensor.get());
      return 0;
    }
    Graph& g = *e.graph;
    Node* gather = e.gather;
    QuantRecord r = quant::quantized_record(job.name, gather, e.tensor->nbytes(), job.error);
    const int64_t K = job.src.K, N = job.src.N, kb = job.k_blocks();
    const std::string base = e.table->name();
    const Parts p = parts_of(job, qdq_, /*embedding=*/true);
    if (qdq_) {
      std::vector<Value*> in{add_part(g, p.data, file, job.data_offset, job.data_bytes()),
                             add_part(g, p.scales, file, job.scale_offset, job.scale_bytes())};
      if (!job.spec.symmetric) in.push_back(add_part(g, p.zp, file, job.zp_offset, job.zp_bytes()));
      Node* dq = g.create_node("DequantizeLinear", "", in, {g.unique_name(base + "_DQ")}, gather);
      dq->attributes.push_back(pattern::attr_int("axis", 1));
      dq->attributes.push_back(pattern::attr_int("block_size", job.spec.block_size));
      if (!gather->name.value.empty()) dq->name.set(gather->name.value + "_DQ_Q");
      gather->set_input(0, dq->outputs()[0]);
    } else {
      // B, scales and zero points: the lm_head's when it reads the same quantized tensor.
      const Candidate* copy = nullptr;
      auto made = made_.find(std::make_pair(&g, e.job));
      if (made == made_.end() && (copy = tied_copy(e, *file))) {
        made = made_.find(std::make_pair(&g, copy->job));
      }
      Value *data, *scales, *zp = nullptr;
      if (made != made_.end()) {
        e.shared_with = made->second.data->name();
        Value* shape = g.add_initializer(g.unique_name(base + "_Q_shape"),
                                         make_int64_tensor({N, kb * job.blob()}, {2}));
        Node* reshape = g.create_node("Reshape", "", {made->second.data, shape},
                                      {g.unique_name(base + "_Q_2d")}, gather);
        data = reshape->outputs()[0];
        scales = made->second.scales;
        zp = made->second.zp;
      } else {
        data = add_part(g, p.data, file, job.data_offset, job.data_bytes());
        scales = add_part(g, p.scales, file, job.scale_offset, job.scale_bytes());
        if (!job.spec.symmetric) zp = add_part(g, p.zp, file, job.zp_offset, job.zp_bytes());
      }
      std::vector<Value*> in{data, gather->inputs()[1], scales};
      if (zp) in.push_back(zp);
      Value* old_out = gather->outputs()[0];
      Node* q = g.create_node("GatherBlockQuantized", kMsDomain, in,
                              {g.unique_name(old_out->name() + "_Q")}, gather);
      q->attributes.push_back(pattern::attr_int("bits", job.spec.bits));
      q->attributes.push_back(pattern::attr_int("block_size", job.spec.block_size));
      q->attributes.push_back(pattern::attr_int("gather_axis", 0));
      q->attributes.push_back(pattern::attr_int("quantize_axis", 1));
      if (!gather->name.value.empty()) {
        q->name.set(gather->name.value + "_Q" + std::to_string(job.spec.bits));
      }
      Value* out = q->outputs()[0];
      if (kb * job.spec.block_size != K) {  // padded rows: slice the padding off
        std::vector<Value*> sin{
            out, g.add_initializer(g.unique_name(base + "_Q_start"), make_int64_tensor({0}, {1})),
            g.add_initializer(g.unique_name(base + "_Q_end"), make_int64_tensor({K}, {1})),
            g.add_initializer(g.unique_name(base + "_Q_axis"), make_int64_tensor({-1}, {1}))};
        out =
            g.create_node("Slice", "", sin, {g.unique_name(old_out->name() + "_Q_sliced")}, gather)
                ->outputs()[0];
      }
      import_domain(g, kMsDomain);
      pattern::replace_value(g, old_out, out);
      pattern::remove_dead(g, {gather});
    }
    if (e.table->uses().empty() && !e.table->is_graph_input() && !e.table->is_graph_output()) {
      e.table->graph()->remove_initializer(e.table);
    }
    r.op = qdq_ ? "DequantizeLinear+Gather" : "GatherBlockQuantized";
    if (!e.shared_with.empty()) r.op += " (shares the lm_head's " + e.shared_with + ")";
    r.dtype_before = dtype_name(job.src.dtype);
    r.dtype_after = quantized_type(job.spec.bits, job.spec.symmetric);
    r.bytes_after =
        e.shared_with.empty() ? job.data_bytes() + job.scale_bytes() + job.zp_bytes() : 0;
    ctx_.quant_records.push_back(std::move(r));
    ++ctx_.counters["weights_quantized"];
    ++ctx_.counters[e.shared_with.empty() ? "embeddings_quantized" : "embeddings_shared"];
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
  std::vector<Embedding> embeds_;
  static constexpr size_t kEmbeddingJob = SIZE_MAX;  // first_user_ of a job made for an embedding
  std::vector<size_t> first_user_;                   // per job: its first candidate
  std::map<std::tuple<const Tensor*, int, bool, int>, size_t> job_of_;
  std::map<std::pair<Graph*, size_t>, Made> made_;
  std::unique_ptr<Model> importance_model_;  // its mapping backs the jobs' importance
  std::list<ByteRef> importance_bytes_;
  std::list<std::vector<float>> importance_copies_;
  std::unique_ptr<Model> hessian_model_;  // its mapping backs the jobs' GPTQ factors
  std::list<ByteRef> hessian_bytes_;
  std::list<std::vector<float>> hessian_copies_;
  std::list<std::vector<int64_t>> hessian_orders_;
};

int64_t quantize_weights(Model& model, PassContext& ctx) {
  return Quantizer(model, ctx).run();
}

const PassRegistrar kRegister{
    PassDecl("quantize_weights",
             "weight-only int4/int8 (options quant_bits, quant_block_size, quant_symmetric, ...): "
             "MatMul with a constant 2-D float weight -> com.microsoft MatMulNBits (target ort) or "
             "blocked DequantizeLinear + MatMul (target onnx, opset 21); quant_method search "
             "(least weighted squared error per block), gptq (error feedback along K from "
             "calibration's Hessians, quant_hessian) or rtn (onnxruntime's bytes)")
        .tags({"quantization"})
        .not_idempotent()
        .options({OptionDecl("quant_method",
                             "weight-only int4/int8 rounding: each block's scale (and zero point) "
                             "searched for the least weighted squared error, or onnxruntime's "
                             "round-to-nearest bytes")
                      .default_value(quant::kDefaultMethod)
                      .choices({{0, "rtn"}, {1, "search"}, {2, "gptq"}})
                      .internal()})
        .run(quantize_weights)};

}  // namespace
}  // namespace fastopt::passes
