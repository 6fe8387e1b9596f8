// Proves what an attention's mask is by evaluating its subgraph on probe inputs (add_kv_cache
// replaces the mask only when this says it is the causal pattern it installs, with or without
// a sliding window).
//
// The subgraph is the mask's ancestry back to graph inputs and constants. It is admitted only
// when it reads:
//   - attention_mask (values and shape),
//   - input_ids and, for a model with a cache, the past_* inputs, for their shapes only (every
//     path from them to the mask passes a Shape or Size; the values never matter),
//   - constants,
// through ai.onnx ops the native constant evaluator computes bit-exactly (fold_constants.h:
// index, compare and logic ops, Range, Where, Expand, GatherND, ...). A Shape of an activation
// (TorchScript exports take S from the embeddings' shape) is answered from its type when every
// dim is fixed or a symbol of the inputs' dims (batch, sequence, total or past length), as the
// rest of the pipeline trusts shape inference. Anything else (position_ids, float arithmetic
// on activations, an op the evaluator lacks) is refused: the mask then is not known.
//
// Probes (P = past length, S = new tokens, T = P + S; P = 0 without a cache), each a batch of
// attention_mask rows:
//   - every T in 1..16, in one batch: the unpadded row, every left and every right padding,
//     every single hole and alternating holes (a standard cache's padding between a short
//     prompt and the tokens generated after the longest row); and a batch of one, unpadded;
//   - T = c-1 .. c+2 around every integer constant c of the subgraph (initializers and what its
//     input-free nodes compute) with 16 < c <= 2048, with
//     rows unpadded, padded by 1 and by T/2 on either side, and a hole; a constant of
//     2048 < |c| < 2^31 - 1 (a window this check would have to probe beyond) refuses the mask;
//   - with a cache, S in {1, 2, T} for each T.
// The mask must agree on every probe, for every query that attention_mask keeps, at every key,
// with transformers' pattern: key t allowed iff attention_mask[b, t] != 0, t <= P + s, and
// (window w > 0) t > P + s - w (positions are indices: padding inside the window counts). Its
// window w is read off the longest unpadded probe.
//
// Why these probes suffice for the admitted subgraphs: their inputs are the lengths and the 0/1
// padding column; the ops compare Range-made index grids with each other, with the lengths and
// with constants, and combine the results elementwise. Such a mask changes with the lengths only
// where a length crosses a constant (or a small offset of one) of the subgraph, and each row's
// answer depends on its own padding column. The probes take every length up to 16, both sides of
// every constant up to 2048, and the paddings and holes a row can have, so a subgraph that
// agrees on all of them is the pattern. This is a check of the exporters' mask builders, not a
// decision procedure for arbitrary programs; what it admits is kept to the op set above for that
// reason.
// Pad queries' rows are not compared: a pad position's output reaches no kept position (no kept
// query may see a pad key, which the comparison checks), and its own output is don't-care.
#include "passes/attention/mask_proof.h"

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
#include "passes/fold_constants.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {

constexpr int64_t kShortLengths = 16;      // every length up to this, with every padding
constexpr int64_t kMaxProbeLength = 2048;  // constants up to this are probed around
constexpr size_t kMaxNodes = 4096;
constexpr double kMaskedBelow = -1e4;  // as fuse_attention: exp() underflows to 0 in fp32

using TensorPtr = std::shared_ptr<const Tensor>;

bool is_integer_type(int32_t t) {
  return t == kInt8 || t == kInt16 || t == kInt32 || t == kInt64 || t == kUint8 || t == kUint16 ||
         t == kUint32 || t == kUint64;
}

enum class Role { kBatch, kSeq, kTotal, kPast };

struct Probe {
  int64_t past = 0, seq = 0;
  std::vector<std::vector<uint8_t>> rows;  // attention_mask, (B, P + S)
  std::string what;                        // for messages
};

class MaskProof {
 public:
  MaskProof(const Model& m, const Graph& g, const Node* att, bool with_past)
      : m_(m), g_(g), att_(att), with_past_(with_past) {}

  std::optional<MaskKind> run(std::string* why) {
    const std::vector<Value*>& in = att_->inputs();
    mask_ = in.size() > 3 ? in[3] : nullptr;
    causal_ = int_attr_or(att_, "is_causal", 0) != 0;
    hq_ = int_attr_or(att_, "q_num_heads", 0);
    if (!mask_) {
      return fail(why, causal_ ? "it has no mask (causal only): it ignores attention_mask, and the "
                                 "cached form applies it"
                               : "it has neither a mask nor is_causal");
    }
    if (hq_ <= 0) return fail(why, "no q_num_heads");
    for (const Value* v : g_.inputs()) {
      if (!v) continue;
      const std::string& n = v->name();
      if (n == "input_ids") add_roles(v, {{0, Role::kBatch}, {1, Role::kSeq}});
      if (n == "attention_mask") add_roles(v, {{0, Role::kBatch}, {1, Role::kTotal}});
      if (with_past_ && n.rfind("past_", 0) == 0) {
        add_roles(v, {{0, Role::kBatch}, {2, Role::kPast}});
      }
    }
    if (!visit(mask_)) return fail(why, why_);
    if (tainted(mask_)) {
      return fail(why, "the mask depends on the values of input '" + taint_source_ +
                           "' (not only its shape)");
    }
    // Constants the subgraph computes (Mul(256, 2) is a window of 512 too): the values of its
    // input-free nodes, from one evaluation.
    {
      std::string err;
      std::vector<int64_t> computed;
      if (!evaluate(make_probe(1, 1, {full_row(1)}, "length 1"), &err, &computed)) {
        return fail(why, err);
      }
      constants_.insert(constants_.end(), computed.begin(), computed.end());
    }
    std::vector<int64_t> lengths;
    for (int64_t t = 1; t <= kShortLengths; ++t) lengths.push_back(t);
    for (int64_t c : constants_) {
      const int64_t a = c < 0 ? -c : c;
      if (a >= std::numeric_limits<int32_t>::max()) continue;  // "to the end" sentinels
      if (a > kMaxProbeLength) {
        return fail(why, "its subgraph holds the constant " + std::to_string(c) +
                             ", beyond the lengths the check probes (" +
                             std::to_string(kMaxProbeLength) + ")");
      }
      for (int64_t t = a - 1; t <= a + 2; ++t) {
        if (t > kShortLengths) lengths.push_back(t);
      }
    }
    std::sort(lengths.begin(), lengths.end());
    lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());

    // The window, from the longest unpadded probe: the keys its last query sees.
    const int64_t longest = lengths.back();
    Probe full = make_probe(longest, longest, {full_row(longest)}, "unpadded");
    std::string err;
    auto got = evaluate(full, &err);
    if (!got) return fail(why, err);
    if ((*got)->dims.size() > 4 || (*got)->expected_bytes() != (*got)->nbytes()) {
      return fail(why, "the mask is not a tensor of rank <= 4 the check can read");
    }
    const ByteRef bytes = (*got)->bytes();
    int64_t visible = 0;
    for (int64_t t = 0; t < longest; ++t) {
      const int a = allowed(*got, bytes.data(), full, 0, 0, longest - 1, t);
      if (a < 0) return fail(why, "the mask is neither boolean nor 0 / a masking value");
      visible += a;
    }
    MaskKind kind;
    kind.window = visible < longest ? visible : 0;
    if (visible == 0) return fail(why, "the last query of an unpadded row sees no key");

    for (int64_t t : lengths) {
      std::vector<int64_t> seqs = {t};
      if (with_past_) seqs = {1, 2, t};
      for (int64_t s : seqs) {
        if (s > t || (s == 2 && t < 3)) continue;
        for (const Probe& p : probes_of(t, s)) {
          auto r = evaluate(p, &err);
          if (!r) return fail(why, err);
          if (!matches(*r, p, kind.window, &err)) return fail(why, err);
        }
      }
    }
    return kind;
  }

 private:
  std::optional<MaskKind> fail(std::string* why, const std::string& what) {
    if (why) *why = what;
    return std::nullopt;
  }

  void add_roles(const Value* v, std::vector<std::pair<size_t, Role>> roles) {
    if (!v->type.known || !v->type.has_shape) return;
    for (auto [axis, role] : roles) {
      if (axis < v->type.dims.size() && v->type.dims[axis].param &&
          !v->type.dims[axis].param->empty()) {
        roles_[*v->type.dims[axis].param].insert(static_cast<int>(role));
      }
    }
  }

  // True when every dim of v's type is fixed or a symbol of the inputs' dims.
  bool shape_from_type(const Value* v) const {
    if (!v || !v->type.known || !v->type.is_tensor || !v->type.has_shape) return false;
    for (const Dim& d : v->type.dims) {
      if (d.value) continue;
      if (!d.param || !roles_.count(*d.param)) return false;
    }
    return true;
  }

  bool reject(const std::string& what) {
    why_ = what;
    return false;
  }

  bool visit(Value* v) {
    if (!v || seen_.count(v)) return true;
    seen_.insert(v);
    if (v->is_graph_input()) {
      const std::string& n = v->name();
      if (n == "attention_mask") return true;
      if (n == "input_ids" || (with_past_ && n.rfind("past_", 0) == 0)) {
        taint_[v] = n;
        return true;
      }
      return reject("the mask reads the graph input '" + n + "'");
    }
    if (TensorPtr t = constant_tensor(v)) {
      if (is_integer_type(t->dtype()) && t->numel() <= 64) {
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

  bool tainted(const Value* v) {
    auto it = taint_.find(v);
    if (it == taint_.end()) return false;
    taint_source_ = it->second;
    return true;
  }

  static std::vector<uint8_t> full_row(int64_t t) { return std::vector<uint8_t>(t, 1); }

  Probe make_probe(int64_t total, int64_t seq, std::vector<std::vector<uint8_t>> rows,
                   std::string what) const {
    Probe p;
    p.past = total - seq;
    p.seq = seq;
    p.rows = std::move(rows);
    p.what = std::move(what);
    return p;
  }

  std::vector<Probe> probes_of(int64_t total, int64_t seq) const {
    std::vector<std::vector<uint8_t>> rows = {full_row(total)};
    auto padded = [&](int64_t k, bool right) {
      std::vector<uint8_t> r(total, 1);
      for (int64_t i = 0; i < k; ++i) r[right ? total - 1 - i : i] = 0;
      rows.push_back(std::move(r));
    };
    auto holed = [&](int64_t at) {
      std::vector<uint8_t> r(total, 1);
      r[at] = 0;
      rows.push_back(std::move(r));
    };
    if (total <= kShortLengths) {
      for (int64_t k = 1; k < total; ++k) padded(k, true);
      for (int64_t k = 1; k < total; ++k) padded(k, false);
      for (int64_t k = 1; k + 1 < total; ++k) holed(k);
      for (int64_t phase = 0; phase < 2 && total > 2; ++phase) {
        std::vector<uint8_t> r(total, 1);
        for (int64_t t = phase; t < total - 1; t += 2) r[t] = 0;
        rows.push_back(std::move(r));
      }
    } else {
      for (int64_t k : {int64_t{1}, total / 2}) {
        padded(k, true);
        padded(k, false);
      }
      holed(total / 2);
    }
    const std::string at = "length " + std::to_string(total) +
                           (with_past_ ? " (past " + std::to_string(total - seq) + ")" : "");
    return {make_probe(total, seq, {full_row(total)}, at + ", batch 1"),
            make_probe(total, seq, std::move(rows), at + ", padded rows and rows with holes")};
  }

  std::optional<int64_t> role_value(const std::string& param, const Probe& p) const {
    auto it = roles_.find(param);
    if (it == roles_.end()) return std::nullopt;
    std::optional<int64_t> v;
    for (int r : it->second) {
      const int64_t x = r == static_cast<int>(Role::kBatch)   ? static_cast<int64_t>(p.rows.size())
                        : r == static_cast<int>(Role::kSeq)   ? p.seq
                        : r == static_cast<int>(Role::kTotal) ? p.past + p.seq
                                                              : p.past;
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
    if (v->name() == "attention_mask") {
      std::vector<uint8_t> flat;
      for (const auto& r : p.rows) flat.insert(flat.end(), r.begin(), r.end());
      if (!(is_integer_type(dt) || dt == kBool || dt == kFloat || dt == kFloat16 ||
            dt == kDouble)) {
        *err = "attention_mask's dtype is not one the check can write";
        return std::nullopt;
      }
      return make_tensor(dt, {b, p.past + p.seq}, bytes_of(dt, flat.size(), &flat));
    }
    if (v->name() == "input_ids") {
      return make_tensor(dt, {b, p.seq}, bytes_of(dt, static_cast<uint64_t>(b * p.seq), nullptr));
    }
    // A past input (B, Hkv, P, D): its shape is all the mask may read.
    if (!v->type.known || !v->type.has_shape || v->type.dims.size() != 4 ||
        !v->type.dims[1].value || !v->type.dims[3].value) {
      *err = "past input '" + v->name() + "' has no fixed (B, Hkv, P, D) layout";
      return std::nullopt;
    }
    const int64_t h = *v->type.dims[1].value, d = *v->type.dims[3].value;
    return make_tensor(dt, {b, h, p.past, d},
                       bytes_of(dt, static_cast<uint64_t>(b * h * p.past * d), nullptr));
  }

  // The mask on probe `p`; `computed` (if given) collects the small integer values of the
  // nodes that read no graph input.
  std::optional<TensorPtr> evaluate(const Probe& p, std::string* err,
                                    std::vector<int64_t>* computed = nullptr) const {
    std::unordered_set<const Value*> reads_input;
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
      if (std::string bad = mistyped_reason(n); !bad.empty()) {  // never read as the defaults
        *err = bad;
        return std::nullopt;
      }
      if (shape_leaves_.count(n)) {
        std::vector<int64_t> dims;
        for (const Dim& d : n->inputs()[0]->type.dims) {
          auto x = d.value ? d.value : role_value(*d.param, p);
          if (!x) {
            *err = "the shape of '" + n->inputs()[0]->name() + "' ties symbols the probe " + "(" +
                   p.what + ") gives different lengths";
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
        const int64_t len = static_cast<int64_t>(part.size());
        vals[n->outputs()[0]] = make_int64_tensor(part, {len});
        reads_input.insert(n->outputs()[0]);  // the lengths (fixed dims too: conservative)
        continue;
      }
      if (n->op_type == "Identity") {
        auto t = value_of(n->inputs()[0]);
        if (!t) return std::nullopt;
        vals[n->outputs()[0]] = *t;
        Value* x = n->inputs()[0];
        if (x && (x->is_graph_input() || reads_input.count(x))) {
          reads_input.insert(n->outputs()[0]);
        }
        continue;
      }
      std::vector<TensorPtr> ins;
      for (Value* x : n->inputs()) {
        auto t = value_of(x);
        if (!t) return std::nullopt;
        ins.push_back(*t);
      }
      auto out = evaluate_node_on(*n, opset, limits, ins);
      if (!out || out->size() != 1 || !(*out)[0]) {
        *err = n->op_type + " '" + n->name.value + "' of the mask could not be evaluated on a " +
               "probe (" + p.what + ")";
        return std::nullopt;
      }
      vals[n->outputs()[0]] = (*out)[0];
      const bool free = std::none_of(n->inputs().begin(), n->inputs().end(), [&](Value* x) {
        return x && (x->is_graph_input() || reads_input.count(x));
      });
      if (!free) {
        reads_input.insert(n->outputs()[0]);
      } else if (computed && is_integer_type((*out)[0]->dtype()) && (*out)[0]->numel() <= 64) {
        if (auto ints = tensor_ints(*(*out)[0], 64)) {
          computed->insert(computed->end(), ints->begin(), ints->end());
        }
      }
    }
    return value_of(mask_);
  }

  // 1 when the evaluated mask lets query s of row b see key t (any head: all must agree, which
  // matches() checks), 0 when it removes it, -1 for a value that is neither.
  int allowed(const TensorPtr& mask, const uint8_t* base, const Probe& p, int64_t b, int64_t h,
              int64_t s, int64_t t) const {
    const int64_t full[4] = {static_cast<int64_t>(p.rows.size()), hq_, p.seq, p.past + p.seq};
    const int64_t at[4] = {b, h, s, t};
    const size_t r = mask->dims.size();
    uint64_t index = 0;
    for (size_t i = 0; i < r; ++i) {
      const int64_t d = mask->dims[i];
      const int64_t want = full[4 - r + i];
      const int64_t x = d == 1 ? 0 : at[4 - r + i];
      if (d != 1 && d != want) return -2;
      index = index * static_cast<uint64_t>(d) + static_cast<uint64_t>(x);
    }
    const uint8_t* e = base + index * static_cast<uint64_t>(dtype_bits(mask->dtype()) / 8);
    int v = -1;
    double x = 0;
    switch (mask->dtype()) {
      case kBool: v = e[0] != 0; break;
      case kFloat: {
        float f;
        std::memcpy(&f, e, 4);
        x = f;
        v = 2;
        break;
      }
      case kFloat16: {
        uint16_t h16;
        std::memcpy(&h16, e, 2);
        x = half_to_float(h16);
        v = 2;
        break;
      }
      case kDouble:
        std::memcpy(&x, e, 8);
        v = 2;
        break;
      default: return -1;
    }
    if (v == 2) v = x == 0.0 ? 1 : x <= kMaskedBelow ? 0 : -1;
    if (v == 1 && causal_ && t > p.past + s) v = 0;  // is_causal, bottom-right aligned
    return v;
  }

  bool matches(const TensorPtr& mask, const Probe& p, int64_t window, std::string* err) const {
    if (mask->dims.size() > 4 || mask->expected_bytes() != mask->nbytes()) {
      *err = "the mask is not a tensor of rank <= 4 the check can read";
      return false;
    }
    const ByteRef bytes = mask->bytes();
    const int64_t total = p.past + p.seq;
    for (size_t b = 0; b < p.rows.size(); ++b) {
      const std::vector<uint8_t>& row = p.rows[b];
      for (int64_t s = 0; s < p.seq; ++s) {
        const int64_t q = p.past + s;
        if (!row[q]) continue;  // a pad query: don't-care
        for (int64_t h = 0; h < hq_; ++h) {
          for (int64_t t = 0; t < total; ++t) {
            const bool in_window = window == 0 || t > q - window;
            const int want = row[t] && t <= q && in_window;
            const int got = allowed(mask, bytes.data(), p, static_cast<int64_t>(b), h, s, t);
            if (got == -2) {
              *err = "the mask's shape does not broadcast to (B, Hq, S, T) on a probe (" + p.what +
                     ")";
              return false;
            }
            if (got == -1) {
              *err =
                  "the mask holds values other than 0 and a masking value (a bias, not a "
                  "mask)";
              return false;
            }
            if (got != want) {
              *err = "on a probe (" + p.what + ", row " + std::to_string(b) + ") query " +
                     std::to_string(s) + " " + (got ? "sees" : "does not see") + " key " +
                     std::to_string(t) + ", unlike a causal mask with padding" +
                     (window ? " and a window of " + std::to_string(window) + " keys" : "");
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
  bool with_past_;
  Value* mask_ = nullptr;
  bool causal_ = false;
  int64_t hq_ = 0;
  std::map<std::string, std::unordered_set<int>> roles_;  // dim symbol -> what it stands for
  std::unordered_set<const Value*> seen_;
  std::vector<const Node*> nodes_;  // topological
  std::unordered_set<const Node*> shape_leaves_;
  std::unordered_map<const Value*, std::string> taint_;  // value -> input whose data it reads
  std::vector<int64_t> constants_;
  std::string why_, taint_source_;
};

}  // namespace

std::optional<MaskKind> classify_attention_mask(const Model& m, const Graph& g, const Node* att,
                                                bool with_past, std::string* why) {
  return MaskProof(m, g, att, with_past).run(why);
}

}  // namespace fastopt::passes
