// Proves the masks of an encoder-decoder's decoder (see kv_cache_cross.h) by evaluating them on
// probes, as mask_proof.cc does for decoder-only models, over the seq2seq decoder's inputs:
//   input_ids (B, S) and encoder_hidden_states (B, E, D): shapes only;
//   encoder_attention_mask (B, E): values and shape.
// Admitted subgraphs read nothing else (constants aside), through ops the native evaluator
// computes exactly; a Shape of an activation is answered from its type when every dim is fixed or
// a symbol of those inputs' dims.
//
// Probes: every S in 1..8 with every E in 1..8 and, for each integer constant c of the subgraph
// with 8 < c <= 2048, S and E of c-1 .. c+2; each with a batch of encoder_attention_mask rows
// (unpadded, every right and left padding, a hole). The self-attention mask must be causal
// (key t visible to query s iff t <= s, whatever the encoder padding: the decoder has no padding
// of its own); the cross-attention mask must let every query see exactly the keys the row keeps.
// Why probes of this kind suffice for the admitted op set is argued in mask_proof.cc.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention/kv_cache_cross.h"
#include "passes/fold_constants.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::kv_cache {
namespace {

constexpr int64_t kShort = 8;
constexpr int64_t kMaxProbeLength = 2048;
constexpr size_t kMaxNodes = 4096;
constexpr double kMaskedBelow = -1e4;  // exp() underflows to 0 in fp32

using TensorPtr = std::shared_ptr<const Tensor>;

bool integer_type(int32_t t) {
  return t == kInt8 || t == kInt16 || t == kInt32 || t == kInt64 || t == kUint8 || t == kUint16 ||
         t == kUint32 || t == kUint64;
}

enum Role { kBatch, kDecoderLen, kEncoderLen };

struct Probe {
  int64_t seq = 0, enc = 0;
  std::vector<std::vector<uint8_t>> rows;  // encoder_attention_mask (B, E)
};

class Seq2SeqMaskProof {
 public:
  Seq2SeqMaskProof(const Model& m, const Graph& g, const Node* att, bool cross, const Value* mask)
      : m_(m), g_(g), att_(att), cross_(cross), given_(mask) {}

  bool run(std::string* why) {
    mask_ = given_                      ? const_cast<Value*>(given_)
            : att_->inputs().size() > 3 ? att_->inputs()[3]
                                        : nullptr;
    causal_ = int_attr_or(att_, "is_causal", 0) != 0;
    hq_ = int_attr_or(att_, "q_num_heads", 0);
    if (hq_ <= 0) return fail(why, "no q_num_heads");
    if (cross_ && causal_) return fail(why, "a causal cross-attention");
    if (!mask_) {
      if (cross_ || causal_) return true;  // every key, or the causal flag the cache keeps
      return fail(why, "a decoder self-attention that is neither causal nor masked");
    }
    for (const Value* v : g_.inputs()) {
      if (!v) continue;
      if (v->name() == "input_ids") add_roles(v, {{0, kBatch}, {1, kDecoderLen}});
      if (v->name() == "encoder_hidden_states") add_roles(v, {{0, kBatch}, {1, kEncoderLen}});
      if (v->name() == "encoder_attention_mask") {
        add_roles(v, {{0, kBatch}, {1, kEncoderLen}});
        encoder_mask_ = true;
      }
    }
    if (const Node* table = bias_table(mask_)) {
      return fail(why, "it adds a learned position bias (Gather '" + table->name.value +
                           "' from the float table '" + table->inputs()[0]->name() +
                           "', as t5's relative position bias), which depends on the query's "
                           "position: the cached form does not rebuild it for P + s");
    }
    if (!visit(mask_)) return fail(why, why_);
    if (auto it = taint_.find(mask_); it != taint_.end()) {
      return fail(why, "the mask depends on the values of input '" + it->second + "'");
    }
    std::vector<int64_t> lengths;
    for (int64_t n = 1; n <= kShort; ++n) lengths.push_back(n);
    for (int64_t c : constants_) {
      const int64_t a = c < 0 ? -c : c;
      if (a >= std::numeric_limits<int32_t>::max()) continue;  // "to the end" sentinels
      if (a > kMaxProbeLength) {
        return fail(why, "its subgraph holds the constant " + std::to_string(c) +
                             ", beyond the lengths the check probes");
      }
      for (int64_t n = a - 1; n <= a + 2; ++n) {
        if (n > kShort) lengths.push_back(n);
      }
    }
    std::sort(lengths.begin(), lengths.end());
    lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
    for (int64_t s : lengths) {
      for (int64_t e : lengths) {
        if (s > kShort && e > kShort && s != e) continue;  // long lengths: one axis at a time
        std::string err;
        Probe p = probe(s, e);
        auto got = evaluate(p, &err);
        if (!got) return fail(why, err);
        if (!matches(*got, p, &err)) return fail(why, err);
      }
    }
    return true;
  }

 private:
  bool fail(std::string* why, const std::string& what) {
    if (why) *why = what;
    return false;
  }

  // A Gather from a constant float table in the mask's ancestry (a bias learned per position
  // bucket), or null.
  const Node* bias_table(const Value* v) const {
    std::vector<const Value*> todo = {v};
    std::unordered_set<const Value*> seen;
    while (!todo.empty() && seen.size() < kMaxNodes) {
      const Value* x = todo.back();
      todo.pop_back();
      if (!x || !seen.insert(x).second) continue;
      const Node* p = x->producer();
      if (!p || p->graph() != &g_ || p->op_type == "Shape" || p->op_type == "Size") continue;
      if (p->op_type == "Gather" && !p->inputs().empty()) {
        if (TensorPtr t = constant_tensor(p->inputs()[0]);
            t && (t->dtype() == kFloat || t->dtype() == kFloat16 || t->dtype() == kBFloat16)) {
          return p;
        }
      }
      for (const Value* in : p->inputs()) todo.push_back(in);
    }
    return nullptr;
  }

  void add_roles(const Value* v, std::vector<std::pair<size_t, Role>> roles) {
    if (!v->type.known || !v->type.has_shape) return;
    for (auto [axis, role] : roles) {
      if (axis < v->type.dims.size() && v->type.dims[axis].param &&
          !v->type.dims[axis].param->empty()) {
        roles_[*v->type.dims[axis].param].insert(role);
      }
    }
  }

  bool shape_from_type(const Value* v) const {
    if (!v || !v->type.known || !v->type.is_tensor || !v->type.has_shape) return false;
    for (const Dim& d : v->type.dims) {
      if (!d.value && (!d.param || !roles_.count(*d.param))) return false;
    }
    return true;
  }

  bool reject(const std::string& what) {
    why_ = what;
    return false;
  }

  bool visit(Value* v) {
    if (!v || !seen_.insert(v).second) return true;
    if (v->is_graph_input()) {
      const std::string& n = v->name();
      if (n == "encoder_attention_mask") return true;
      if (n == "input_ids" || n == "encoder_hidden_states") {
        taint_[v] = n;
        return true;
      }
      return reject("the mask reads the graph input '" + n + "'");
    }
    if (TensorPtr t = constant_tensor(v)) {
      if (integer_type(t->dtype()) && t->numel() <= 64) {
        if (auto ints = tensor_ints(*t, 64)) {
          constants_.insert(constants_.end(), ints->begin(), ints->end());
        }
      }
      return true;
    }
    Node* p = v->producer();
    if (!p || p->graph() != &g_) return reject("the mask reads '" + v->name() + "' from outside");
    if (nodes_.size() >= kMaxNodes) return reject("the mask's subgraph is too large to evaluate");
    const bool standard = p->domain.value.empty() || p->domain.value == "ai.onnx";
    if (standard && p->op_type == "Shape" && p->inputs().size() == 1 &&
        !p->inputs()[0]->is_graph_input() && shape_from_type(p->inputs()[0])) {
      shape_leaves_.insert(p);
      nodes_.push_back(p);
      return true;
    }
    static const std::unordered_set<std::string> kOps = [] {
      const std::vector<std::string>& ops = native_fold_ops();
      return std::unordered_set<std::string>(ops.begin(), ops.end());
    }();
    if (!standard || !p->subgraphs().empty() || p->outputs().size() != 1 ||
        !kOps.count(p->op_type)) {
      return reject("the mask is computed by " + p->op_type + " '" + p->name.value +
                    "', which the check cannot evaluate exactly");
    }
    for (Value* x : p->inputs()) {
      if (!visit(x)) return false;
    }
    nodes_.push_back(p);
    if (p->op_type != "Shape" && p->op_type != "Size") {
      for (Value* x : p->inputs()) {
        if (auto it = taint_.find(x); x && it != taint_.end()) {
          taint_[p->outputs()[0]] = it->second;
          break;
        }
      }
    }
    return true;
  }

  static Probe probe(int64_t s, int64_t e) {
    Probe p;
    p.seq = s;
    p.enc = e;
    p.rows.emplace_back(e, 1);
    const std::vector<int64_t> pads =
        e <= kShort ? std::vector<int64_t>{} : std::vector<int64_t>{1, e / 2};
    auto padded = [&](int64_t k, bool right) {
      std::vector<uint8_t> r(e, 1);
      for (int64_t i = 0; i < k; ++i) r[right ? e - 1 - i : i] = 0;
      p.rows.push_back(std::move(r));
    };
    if (e <= kShort) {
      for (int64_t k = 1; k < e; ++k) {
        padded(k, true);
        padded(k, false);
      }
    } else {
      for (int64_t k : pads) {
        padded(k, true);
        padded(k, false);
      }
    }
    if (e > 2) {
      std::vector<uint8_t> r(e, 1);
      r[e / 2] = 0;
      p.rows.push_back(std::move(r));
    }
    return p;
  }

  std::optional<int64_t> role_value(const std::string& param, const Probe& p) const {
    auto it = roles_.find(param);
    if (it == roles_.end()) return std::nullopt;
    std::optional<int64_t> v;
    for (int r : it->second) {
      const int64_t x = r == kBatch        ? static_cast<int64_t>(p.rows.size())
                        : r == kDecoderLen ? p.seq
                                           : p.enc;
      if (v && *v != x) return std::nullopt;
      v = x;
    }
    return v;
  }

  static std::string bytes_of(int32_t dtype, uint64_t n, const std::vector<uint8_t>* ones) {
    const size_t esize = static_cast<size_t>(dtype_bits(dtype) / 8);
    std::string out(n * esize, '\0');
    if (!ones) return out;
    for (uint64_t i = 0; i < n; ++i) {
      if (!(*ones)[i]) continue;
      char* at = &out[i * esize];
      if (dtype == kFloat) {
        const float one = 1.0f;
        std::memcpy(at, &one, 4);
      } else if (dtype == kFloat16) {
        const uint16_t one = 0x3C00;
        std::memcpy(at, &one, 2);
      } else if (dtype == kDouble) {
        const double one = 1.0;
        std::memcpy(at, &one, 8);
      } else {
        at[0] = 1;  // little-endian integer or bool 1
      }
    }
    return out;
  }

  std::optional<TensorPtr> input_tensor(const Value* v, const Probe& p, std::string* err) const {
    const int64_t b = static_cast<int64_t>(p.rows.size());
    const int32_t dt = value_dtype(v);
    if (dt == 0 || dtype_bits(dt) % 8 != 0) {
      *err = "input '" + v->name() + "' has no known fixed-size dtype";
      return std::nullopt;
    }
    if (v->name() == "encoder_attention_mask") {
      std::vector<uint8_t> flat;
      for (const auto& r : p.rows) flat.insert(flat.end(), r.begin(), r.end());
      if (!(integer_type(dt) || dt == kBool || dt == kFloat || dt == kFloat16 || dt == kDouble)) {
        *err = "encoder_attention_mask's dtype is not one the check can write";
        return std::nullopt;
      }
      return make_tensor(dt, {b, p.enc}, bytes_of(dt, flat.size(), &flat));
    }
    if (v->name() == "input_ids") {
      return make_tensor(dt, {b, p.seq}, bytes_of(dt, static_cast<uint64_t>(b * p.seq), nullptr));
    }
    // encoder_hidden_states (B, E, D): only its shape is read.
    const Dim* d =
        v->type.known && v->type.has_shape && v->type.dims.size() == 3 ? &v->type.dims[2] : nullptr;
    if (!d || !d->value) {
      *err = "encoder_hidden_states has no fixed (B, E, D) layout";
      return std::nullopt;
    }
    return make_tensor(dt, {b, p.enc, *d->value},
                       bytes_of(dt, static_cast<uint64_t>(b * p.enc * *d->value), nullptr));
  }

  std::optional<TensorPtr> evaluate(const Probe& p, std::string* err) const {
    std::unordered_map<const Value*, TensorPtr> vals;
    auto value_of = [&](Value* x) -> std::optional<TensorPtr> {
      if (!x) return TensorPtr{};
      if (auto it = vals.find(x); it != vals.end()) return it->second;
      if (x->is_graph_input()) {
        auto t = input_tensor(x, p, err);
        if (t) vals[x] = *t;
        return t;
      }
      if (TensorPtr t = constant_tensor(x)) return t;
      *err = "no value for '" + x->name() + "'";
      return std::nullopt;
    };
    FoldLimits limits;
    limits.max_bytes = limits.max_expand_bytes = uint64_t{1} << 30;
    const int64_t opset = graph_opset(m_, g_);
    for (const Node* n : nodes_) {
      if (std::string bad = mistyped_reason(n); !bad.empty()) {
        *err = bad;
        return std::nullopt;
      }
      if (shape_leaves_.count(n)) {
        std::vector<int64_t> dims;
        for (const Dim& d : n->inputs()[0]->type.dims) {
          auto x = d.value ? d.value : role_value(*d.param, p);
          if (!x) {
            *err = "the shape of '" + n->inputs()[0]->name() +
                   "' ties symbols a probe gives different lengths";
            return std::nullopt;
          }
          dims.push_back(*x);
        }
        const int64_t r = static_cast<int64_t>(dims.size());
        auto bound = [&](const char* name, int64_t fallback) {
          int64_t x = int_attr_or(n, name, fallback);
          x = x < 0 ? x + r : x;
          return std::min<int64_t>(std::max<int64_t>(x, 0), r);
        };
        const int64_t start = bound("start", 0), end = bound("end", r);
        std::vector<int64_t> part(dims.begin() + start, dims.begin() + std::max(start, end));
        vals[n->outputs()[0]] = make_int64_tensor(part, {static_cast<int64_t>(part.size())});
        continue;
      }
      std::vector<TensorPtr> ins;
      for (Value* x : n->inputs()) {
        auto t = value_of(x);
        if (!t) return std::nullopt;
        ins.push_back(*t);
      }
      if (n->op_type == "Identity") {
        vals[n->outputs()[0]] = ins.at(0);
        continue;
      }
      auto out = evaluate_node_on(*n, opset, limits, ins);
      if (!out || out->size() != 1 || !(*out)[0]) {
        *err = n->op_type + " '" + n->name.value + "' of the mask could not be evaluated";
        return std::nullopt;
      }
      vals[n->outputs()[0]] = (*out)[0];
    }
    return value_of(mask_);
  }

  // 1: query s of row b sees key t; 0: it does not; -1: a value that is neither; -2: the mask
  // does not broadcast to (B, Hq, S, keys).
  int allowed(const TensorPtr& mask, const uint8_t* base, const Probe& p, int64_t b, int64_t h,
              int64_t s, int64_t t) const {
    const int64_t keys = cross_ ? p.enc : p.seq;
    const int64_t full[4] = {static_cast<int64_t>(p.rows.size()), hq_, p.seq, keys};
    const int64_t at[4] = {b, h, s, t};
    const size_t r = mask->dims.size();
    uint64_t index = 0;
    for (size_t i = 0; i < r; ++i) {
      const int64_t d = mask->dims[i];
      if (d != 1 && d != full[4 - r + i]) return -2;
      index = index * static_cast<uint64_t>(d) + static_cast<uint64_t>(d == 1 ? 0 : at[4 - r + i]);
    }
    const uint8_t* e = base + index * static_cast<uint64_t>(dtype_bits(mask->dtype()) / 8);
    double x = 0;
    switch (mask->dtype()) {
      case kBool: return (e[0] != 0 && !(causal_ && t > s)) ? 1 : 0;
      case kFloat: {
        float f;
        std::memcpy(&f, e, 4);
        x = f;
        break;
      }
      case kFloat16: {
        uint16_t h16;
        std::memcpy(&h16, e, 2);
        x = half_to_float(h16);
        break;
      }
      case kDouble: std::memcpy(&x, e, 8); break;
      default: return -1;
    }
    const int v = x == 0.0 ? 1 : x <= kMaskedBelow ? 0 : -1;
    return v == 1 && causal_ && t > s ? 0 : v;
  }

  bool matches(const TensorPtr& mask, const Probe& p, std::string* err) const {
    if (mask->dims.size() > 4 || mask->expected_bytes() != mask->nbytes()) {
      *err = "the mask is not a tensor of rank <= 4 the check can read";
      return false;
    }
    const ByteRef bytes = mask->bytes();
    const int64_t keys = cross_ ? p.enc : p.seq;
    for (size_t b = 0; b < p.rows.size(); ++b) {
      for (int64_t s = 0; s < p.seq; ++s) {
        for (int64_t h = 0; h < hq_; ++h) {
          for (int64_t t = 0; t < keys; ++t) {
            const int want = cross_ ? !encoder_mask_ || p.rows[b][t] != 0 : t <= s;
            const int got = allowed(mask, bytes.data(), p, static_cast<int64_t>(b), h, s, t);
            if (got == -2) {
              *err = "the mask's shape does not broadcast to (B, Hq, S, keys)";
              return false;
            }
            if (got == -1) {
              *err =
                  "the mask holds values other than 0 and a masking value (a bias, such as a "
                  "relative position bias, not a mask)";
              return false;
            }
            if (got != want) {
              *err = "on a probe (decoder length " + std::to_string(p.seq) + ", encoder length " +
                     std::to_string(p.enc) + ", row " + std::to_string(b) + ") query " +
                     std::to_string(s) + (got ? " sees" : " does not see") + " key " +
                     std::to_string(t) +
                     (cross_ ? ", unlike the encoder padding" : ", unlike a causal mask");
              return false;
            }
          }
        }
      }
    }
    return true;
  }

  const Model& m_;
  const Graph& g_;
  const Node* att_;
  bool cross_;
  const Value* given_;
  Value* mask_ = nullptr;
  bool causal_ = false;
  bool encoder_mask_ = false;  // the graph has an encoder_attention_mask input
  int64_t hq_ = 0;
  std::map<std::string, std::unordered_set<int>> roles_;
  std::unordered_set<const Value*> seen_;
  std::vector<const Node*> nodes_;  // topological
  std::unordered_set<const Node*> shape_leaves_;
  std::unordered_map<const Value*, std::string> taint_;  // value -> input whose data it reads
  std::vector<int64_t> constants_;
  std::string why_;
};

}  // namespace

bool prove_seq2seq_mask(const Model& m, const Graph& g, const Node* att, bool cross,
                        std::string* why, const Value* mask) {
  return Seq2SeqMaskProof(m, g, att, cross, mask).run(why);
}

}  // namespace fastopt::passes::kv_cache
