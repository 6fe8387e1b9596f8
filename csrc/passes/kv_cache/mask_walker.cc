// The mask walker (mask_walker.h): admission, evaluation on probes, reading the result.
#include "passes/kv_cache/mask_walker.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/fold/fold_constants.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::mask_walk {
namespace {

bool is_integer_type(int32_t t) {
  return t == kInt8 || t == kInt16 || t == kInt32 || t == kInt64 || t == kUint8 || t == kUint16 ||
         t == kUint32 || t == kUint64;
}

// n elements of `dtype`, zero, or one where `ones` says so.
std::string bytes_of(int32_t dtype, uint64_t n, const std::vector<uint8_t>* ones) {
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

// A Concat's dims from its inputs' (each of one rank): the sum on its axis, elsewhere the first
// input's known size (the inputs agree off the axis: a valid Concat).
void concat_dims(const Node* n, const std::vector<std::vector<std::optional<int64_t>>>& parts,
                 std::vector<std::optional<int64_t>>* out) {
  const int64_t r = static_cast<int64_t>(parts[0].size());
  int64_t ax = int_attr_or(n, "axis", 0);
  if (ax < -r || ax >= r) return;
  ax = ax < 0 ? ax + r : ax;
  for (int64_t i = 0; i < r; ++i) {
    std::optional<int64_t> d = i == ax ? std::optional<int64_t>(0) : std::nullopt;
    for (const auto& part : parts) {
      const auto& x = part[static_cast<size_t>(i)];
      if (i == ax) {
        d = d && x ? std::optional<int64_t>(*d + *x) : std::nullopt;
      } else if (!d) {
        d = x;  // the inputs agree off the axis (a valid Concat)
      }
    }
    out->push_back(d);
  }
}

// The small integer values of `t` into `computed` (if given): a node that reads no input
// computes lengths the probes go around too (Mul(256, 2) is a constant 512).
void collect_ints(const Tensor& t, std::vector<int64_t>* computed) {
  if (computed && is_integer_type(t.dtype()) && t.numel() <= 64) {
    if (auto ints = tensor_ints(t, 64))
      computed->insert(computed->end(), ints->begin(), ints->end());
  }
}

// Why a Gather failed, when an index falls outside its data: the export then computes an index
// no input of the probe's lengths can read (a length fixed by a trace), which ONNX Runtime
// rejects as well.
std::string gather_out_of_range(const Node& n, const std::vector<TensorPtr>& ins) {
  if (n.op_type != "Gather" || ins.size() != 2 || !ins[0] || !ins[1]) return "";
  const int64_t r = static_cast<int64_t>(ins[0]->dims.size());
  int64_t axis = int_attr_or(&n, "axis", 0);
  axis = axis < 0 ? axis + r : axis;
  if (axis < 0 || axis >= r) return "";
  const int64_t size = ins[0]->dims[static_cast<size_t>(axis)];
  auto idx = tensor_ints(*ins[1], 1 << 20);
  if (!idx) return "";
  for (int64_t i : *idx) {
    if (i < -size || i >= size) {
      return ": its index " + std::to_string(i) + " is outside the " + std::to_string(size) +
             " entries there (the export reads outside its input at that length, as ONNX "
             "Runtime reports too)";
    }
  }
  return "";
}

// An op of the default domain the native evaluator computes exactly.
bool computable(const Node* p) {
  static const std::unordered_set<std::string> kOps = [] {
    const std::vector<std::string>& ops = native_fold_ops();
    return std::unordered_set<std::string>(ops.begin(), ops.end());
  }();
  const bool standard = p->domain.value.empty() || p->domain.value == "ai.onnx";
  return standard && p->subgraphs().empty() && p->outputs().size() == 1 &&
         kOps.count(p->op_type) != 0;
}

// A normalization: its output 0 has its input 0's shape.
bool is_norm(const std::string& op) {
  return op == "LayerNormalization" || op == "RMSNormalization" ||
         op == "SimplifiedLayerNormalization" || op == "SkipLayerNormalization" ||
         op == "SkipSimplifiedLayerNormalization";
}

// Ops whose output entry at an index reads only their inputs' entries at that index (broadcast):
// a tensor that holds one value along an axis gives one value along it, whatever its size.
bool is_elementwise(const std::string& op) {
  static const std::unordered_set<std::string> kOps = {
      "Add", "Sub",  "Mul", "Div", "Max",   "Min",  "Where",       "Cast",    "Identity",
      "Neg", "Not",  "And", "Or",  "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
      "Abs", "Sqrt", "Exp"};
  return kOps.count(op) != 0;
}

// Ops that move dims (shape arithmetic) from their input 0 (Concat: any input).
bool moves_dims(const std::string& op) {
  return op == "Gather" || op == "Unsqueeze" || op == "Squeeze" || op == "Concat" || op == "Cast" ||
         op == "Identity" || op == "Slice";
}

}  // namespace

MaskWalker::MaskWalker(const Model& m, const Graph& g, std::vector<MaskInput> inputs)
    : m_(m), g_(g), inputs_(std::move(inputs)) {
  for (const Value* v : g_.inputs()) {
    const MaskInput* in = v ? input_of(v) : nullptr;
    if (!in || !v->type.known || !v->type.has_shape) continue;
    for (auto [axis, slot] : in->lengths) {
      if (axis < v->type.dims.size() && v->type.dims[axis].param &&
          !v->type.dims[axis].param->empty()) {
        slots_[*v->type.dims[axis].param].insert(slot);
      }
    }
  }
}

const MaskInput* MaskWalker::input_of(const Value* v) const {
  for (const MaskInput& in : inputs_) {
    if (in.prefix ? v->name().rfind(in.name, 0) == 0 : v->name() == in.name) return &in;
  }
  return nullptr;
}

bool MaskWalker::is_length(const std::string& param) const {
  size_t from = 0;
  while (true) {
    const size_t plus = param.find('+', from);
    if (!slots_.count(param.substr(from, plus - from))) return false;
    if (plus == std::string::npos) return true;
    from = plus + 1;
  }
}

// The dims of `v` from its type; where it has none, through a fused RotaryEmbedding (its
// input's shape; TorchScript's eager attention slices the mask to Shape(keys)) and Concat (the
// sum on its axis: a cache export's keys are Concat(past, new)). A dim is nullopt where its
// size is not known; a known one is the probe's length (0 without a probe). False when the
// probe gives one symbol two lengths.
// The length of a length symbol on probe `p` (0 without one): "a+b" (shape inference's sum of
// two symbols) is the sum of their lengths. False when the probe gives a symbol two lengths.
bool MaskWalker::length_on_probe(const std::string& param, const Probe* p, int64_t* sum) const {
  *sum = 0;
  size_t from = 0;
  while (p) {
    const size_t plus = param.find('+', from);
    auto x = slot_value(param.substr(from, plus - from), *p);
    if (!x) return false;
    *sum += *x;
    if (plus == std::string::npos) break;
    from = plus + 1;
  }
  return true;
}

// The dims of a value with a type (dims_of).
bool MaskWalker::type_dims(const Value* v, const Probe* p,
                           std::vector<std::optional<int64_t>>* out) const {
  for (const Dim& d : v->type.dims) {
    if (d.value) {
      out->push_back(*d.value);
    } else if (d.param && is_length(*d.param)) {
      int64_t sum = 0;
      if (!length_on_probe(*d.param, p, &sum)) return false;
      out->push_back(sum);
    } else {
      out->push_back(std::nullopt);
    }
  }
  return true;
}

bool MaskWalker::dims_of(const Value* v, const Probe* p, std::vector<std::optional<int64_t>>* out,
                         int depth) const {
  out->clear();
  if (!v || depth > 8) return true;
  if (v->type.known && v->type.is_tensor && v->type.has_shape) return type_dims(v, p, out);
  const Node* n = v->producer();
  if (!n || n->outputs().empty() || n->outputs()[0] != v || n->inputs().empty()) return true;
  if (n->op_type == "RotaryEmbedding" || is_norm(n->op_type)) {
    return dims_of(n->inputs()[0], p, out, depth + 1);
  }
  if (n->op_type != "Concat" || !(n->domain.value.empty() || n->domain.value == "ai.onnx")) {
    return true;
  }
  std::vector<std::vector<std::optional<int64_t>>> parts;
  for (const Value* x : n->inputs()) {
    parts.emplace_back();
    if (!dims_of(x, p, &parts.back(), depth + 1)) return false;
    if (parts.back().empty() || parts.back().size() != parts[0].size()) return true;
  }
  concat_dims(n, parts, out);
  return true;
}

bool MaskWalker::shape_from_type(const Node* shape) const {
  std::vector<std::optional<int64_t>> dims;
  dims_of(shape->inputs()[0], nullptr, &dims, 0);
  if (dims.empty()) return false;
  const int64_t r = static_cast<int64_t>(dims.size());
  auto bound = [&](const char* name, int64_t fallback) {
    int64_t x = int_attr_or(shape, name, fallback);
    x = x < 0 ? x + r : x;
    return std::min<int64_t>(std::max<int64_t>(x, 0), r);
  };
  const int64_t start = bound("start", 0), end = bound("end", r);
  std::vector<bool> known;
  for (int64_t i = start; i < end; ++i) known.push_back(dims[static_cast<size_t>(i)].has_value());
  if (std::all_of(known.begin(), known.end(), [](bool k) { return k; })) return true;
  // A dim of unknown size is admitted only when it is never read: every use of the shape is a
  // Gather (axis 0) of constant indices that pick known dims. The evaluation gives it 1.
  const Value* out = shape->outputs()[0];
  if (out->is_graph_output()) return false;
  const int64_t n = static_cast<int64_t>(known.size());
  for (const Use& u : out->uses()) {
    const Node* g = u.node;
    if (g->op_type != "Gather" || u.input_index != 0 || int_attr_or(g, "axis", 0) != 0 ||
        g->inputs().size() != 2) {
      return false;
    }
    TensorPtr idx = constant_tensor(g->inputs()[1]);
    auto ints = idx ? tensor_ints(*idx, 64) : std::nullopt;
    if (!ints) return false;
    for (int64_t i : *ints) {
      if (i < -n || i >= n || !known[static_cast<size_t>(i < 0 ? i + n : i)]) return false;
    }
  }
  return true;
}

// Whether `shape` reads an op the evaluator cannot compute (a norm) whose dims are known in
// number (a dim may be of unknown size): a broadcast leaf then (dims_only_broadcast).
bool MaskWalker::has_rank(const Node* shape) const {
  const Node* p = shape->inputs()[0]->producer();
  if (!p || computable(p)) return false;
  std::vector<std::optional<int64_t>> dims;
  dims_of(shape->inputs()[0], nullptr, &dims, 0);
  return !dims.empty();
}

// How `n` carries the unknown dims of a broadcast leaf: 1, its output holds them (shape
// arithmetic); 2, its output is a tensor they only size (ConstantOfShape, Expand's shape, then
// elementwise ops and Expand over such a tensor): its values are the same whatever they are;
// 0, it reads them otherwise (refused).
int MaskWalker::spread_dims(const Node* n, const std::unordered_set<const Value*>& dims,
                            const std::unordered_set<const Value*>& shaped) const {
  const auto& ins = n->inputs();
  const bool standard = n->domain.value.empty() || n->domain.value == "ai.onnx";
  bool reads_dims = false, reads_shaped = false;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (!ins[i]) continue;
    if (dims.count(ins[i])) {
      reads_dims = true;
      const bool data = i == 0 || n->op_type == "Concat";
      const bool sizes =
          (n->op_type == "ConstantOfShape" && i == 0) || (n->op_type == "Expand" && i == 1);
      if (!standard || !((data && moves_dims(n->op_type)) || sizes)) return 0;
    }
    if (shaped.count(ins[i])) {
      reads_shaped = true;
      if (n->op_type == "Expand" ? i != 0 : !is_elementwise(n->op_type)) return 0;
    }
  }
  if (n->outputs().size() != 1 || !standard) return 0;
  if (n->op_type == "ConstantOfShape" || n->op_type == "Expand" || reads_shaped) return 2;
  return reads_dims ? 1 : 0;
}

// The unknown dims a broadcast leaf reads only size broadcasts on the way to the mask: every
// value of the mask is then the same for any size there, so the evaluation's 1 stands for all
// (the sizes at run time broadcast to the attention's, or the export itself fails).
bool MaskWalker::dims_only_broadcast() {
  std::unordered_set<const Value*> dims, shaped;
  for (const Node* s : broadcast_leaves_) dims.insert(s->outputs()[0]);
  for (const Node* n : nodes_) {
    if (broadcast_leaves_.count(n)) continue;
    const bool reads = std::any_of(n->inputs().begin(), n->inputs().end(), [&](const Value* x) {
      return x && (dims.count(x) || shaped.count(x));
    });
    if (!reads) continue;
    const int how = spread_dims(n, dims, shaped);
    if (how == 0) {
      return reject(n->op_type + " '" + n->name.value +
                    "' of the mask reads a dim whose size the types do not give (a Shape of an " +
                    "activation), other than as the size of a broadcast");
    }
    (how == 1 ? dims : shaped).insert(n->outputs()[0]);
  }
  if (dims.count(mask_)) return reject("the mask is a shape whose size the types do not give");
  return true;
}

bool MaskWalker::reject(const std::string& what) {
  why_ = what;
  return false;
}

bool MaskWalker::admit(Value* mask, std::string* why) {
  mask_ = mask;
  if (!visit(mask) || !dims_only_broadcast()) {
    if (why) *why = why_;
    return false;
  }
  if (auto it = taint_.find(mask); it != taint_.end()) {
    if (why)
      *why = "the mask depends on the values of input '" + it->second + "' (not only its shape)";
    return false;
  }
  return true;
}

// A graph input the mask reads: one the probes give (tainted where only its shape may be read).
bool MaskWalker::visit_input(const Value* v) {
  const MaskInput* in = input_of(v);
  if (!in) return reject("the mask reads the graph input '" + v->name() + "'");
  if (!in->values) taint_[v] = v->name();
  return true;
}

// A small integer constant's values are lengths the probes go around (probe_lengths).
void MaskWalker::note_constants(const Value* v, const Tensor& t) {
  if (is_integer_type(t.dtype()) && t.numel() <= 64) {
    if (auto ints = tensor_ints(t, 64)) constants_.emplace_back(v, std::move(*ints));
  }
}

// The op computing part of the mask is one the evaluator computes exactly.
bool MaskWalker::evaluable(const Node* p, bool standard) {
  if (!standard || !computable(p)) {
    return reject("the mask is computed by " + p->op_type + " '" + p->name.value +
                  "', which the check cannot evaluate exactly");
  }
  return true;
}

// An op's output reads the data of the first tainted input (a Shape or Size reads none).
void MaskWalker::carry_taint(const Node* p) {
  if (p->op_type == "Shape" || p->op_type == "Size") return;
  for (Value* x : p->inputs()) {
    if (auto it = taint_.find(x); x && it != taint_.end()) {
      taint_[p->outputs()[0]] = it->second;
      break;
    }
  }
}

bool MaskWalker::visit(Value* v) {
  if (!v || !seen_.insert(v).second) return true;
  if (v->is_graph_input()) return visit_input(v);
  if (TensorPtr t = constant_tensor(v)) {
    note_constants(v, *t);
    return true;
  }
  Node* p = v->producer();
  if (!p || p->graph() != &g_) return reject("the mask reads '" + v->name() + "' from outside");
  if (nodes_.size() >= kMaxNodes) return reject("the mask's subgraph is too large to evaluate");
  const bool standard = p->domain.value.empty() || p->domain.value == "ai.onnx";
  if (standard && p->op_type == "Shape" && p->inputs().size() == 1 &&
      !p->inputs()[0]->is_graph_input() && (shape_from_type(p) || has_rank(p))) {
    if (!shape_from_type(p)) broadcast_leaves_.insert(p);  // checked by dims_only_broadcast
    shape_leaves_.insert(p);
    nodes_.push_back(p);
    return true;
  }
  if (!evaluable(p, standard)) return false;
  const bool shape_read = p->op_type == "Shape" || p->op_type == "Size";
  for (Value* x : p->inputs()) {
    if (shape_read && x && x->is_graph_input() && !input_of(x)) {
      return reject("the mask reads the shape of graph input '" + x->name() +
                    "', whose dims are not tied to the lengths the check probes (input_ids' "
                    "batch and sequence symbols)");
    }
    if (!visit(x)) return false;
  }
  nodes_.push_back(p);
  carry_taint(p);
  return true;
}

std::optional<int64_t> MaskWalker::slot_value(const std::string& param, const Probe& p) const {
  auto it = slots_.find(param);
  if (it == slots_.end()) return std::nullopt;
  std::optional<int64_t> v;
  for (size_t slot : it->second) {
    const int64_t x = slot == 0 ? static_cast<int64_t>(p.rows.size()) : p.lengths.at(slot);
    if (v && *v != x) return std::nullopt;
    v = x;
  }
  return v;
}

std::optional<TensorPtr> MaskWalker::input_tensor(const Value* v, const Probe& p,
                                                  std::string* err) const {
  const MaskInput* in = input_of(v);
  const int64_t b = static_cast<int64_t>(p.rows.size());
  const int32_t dt = value_dtype(v);
  if (!in || dt == 0 || dtype_bits(dt) % 8 != 0) {
    *err = "input '" + v->name() + "' has no known fixed-size dtype";
    return std::nullopt;
  }
  if (in->values) {
    std::vector<uint8_t> flat;
    for (const auto& r : p.rows) flat.insert(flat.end(), r.begin(), r.end());
    if (!(is_integer_type(dt) || dt == kBool || dt == kFloat || dt == kFloat16 || dt == kDouble)) {
      *err = v->name() + "'s dtype is not one the check can write";
      return std::nullopt;
    }
    const int64_t width = p.rows.empty() ? 0 : static_cast<int64_t>(p.rows[0].size());
    return make_tensor(dt, {b, width}, bytes_of(dt, flat.size(), &flat));
  }
  // Only its shape is read: the probe's lengths on the length axes, the type's fixed sizes on
  // the others.
  size_t rank = 0;
  for (auto [axis, slot] : in->lengths) rank = std::max(rank, axis + 1);
  if (v->type.known && v->type.has_shape) rank = std::max(rank, v->type.dims.size());
  std::vector<int64_t> dims(rank, -1);
  for (auto [axis, slot] : in->lengths) dims[axis] = slot == 0 ? b : p.lengths.at(slot);
  uint64_t n = 1;
  for (size_t i = 0; i < rank; ++i) {
    if (dims[i] < 0) {
      const Dim* d = v->type.known && v->type.has_shape && i < v->type.dims.size()
                         ? &v->type.dims[i]
                         : nullptr;
      if (!d || !d->value) {
        *err = "input '" + v->name() + "' has no fixed size on axis " + std::to_string(i) +
               " (only its length axes may vary)";
        return std::nullopt;
      }
      dims[i] = *d->value;
    }
    n *= static_cast<uint64_t>(dims[i]);
  }
  return make_tensor(dt, dims, bytes_of(dt, n, nullptr));
}

// A Shape answered from its input's type (shape_from_type) on probe `p`.
std::optional<TensorPtr> MaskWalker::shape_leaf(const Node* n, const Probe& p,
                                                std::string* err) const {
  std::vector<std::optional<int64_t>> known;
  if (!dims_of(n->inputs()[0], &p, &known, 0)) {
    *err = "the shape of '" + n->inputs()[0]->name() + "' ties symbols the probe (" + p.what +
           ") gives different lengths";
    return std::nullopt;
  }
  std::vector<int64_t> dims;
  // A dim of unknown size is never read (shape_from_type): any value does.
  for (const auto& d : known) dims.push_back(d.value_or(1));
  const int64_t r = static_cast<int64_t>(dims.size());
  auto bound = [&](const char* name, int64_t fallback) {
    int64_t x = int_attr_or(n, name, fallback);
    x = x < 0 ? x + r : x;
    return std::min<int64_t>(std::max<int64_t>(x, 0), r);
  };
  const int64_t start = bound("start", 0), end = bound("end", r);
  std::vector<int64_t> part(dims.begin() + start, dims.begin() + std::max(start, end));
  const int64_t len = static_cast<int64_t>(part.size());
  return make_int64_tensor(part, {len});
}

std::optional<TensorPtr> MaskWalker::evaluate(const Probe& p, std::string* err,
                                              std::vector<int64_t>* computed) const {
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
    if (auto it = substituted_.find(x); it != substituted_.end()) return it->second;
    if (TensorPtr t = constant_tensor(x)) return t;
    *err = "no value for '" + x->name() + "'";
    return std::nullopt;
  };
  FoldLimits limits;
  limits.max_bytes = limits.max_expand_bytes = uint64_t{1} << 30;
  limits.half_arith = true;  // float16 masks (transformers 4.49): exact, see FoldLimits
  const int64_t opset = graph_opset(m_, g_);
  for (const Node* n : nodes_) {
    if (std::string bad = mistyped_reason(n); !bad.empty()) {  // never read as the defaults
      *err = bad;
      return std::nullopt;
    }
    if (shape_leaves_.count(n)) {
      auto shape = shape_leaf(n, p, err);
      if (!shape) return std::nullopt;
      vals[n->outputs()[0]] = *shape;
      reads_input.insert(n->outputs()[0]);  // the lengths (fixed dims too: conservative)
      continue;
    }
    if (n->op_type == "Identity") {
      auto t = value_of(n->inputs()[0]);
      if (!t) return std::nullopt;
      vals[n->outputs()[0]] = *t;
      Value* x = n->inputs()[0];
      if (x && (x->is_graph_input() || reads_input.count(x))) reads_input.insert(n->outputs()[0]);
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
             "probe (" + p.what + ")" + gather_out_of_range(*n, ins);
      return std::nullopt;
    }
    vals[n->outputs()[0]] = (*out)[0];
    const bool free = std::none_of(n->inputs().begin(), n->inputs().end(), [&](Value* x) {
      return x && (x->is_graph_input() || reads_input.count(x));
    });
    if (!free) {
      reads_input.insert(n->outputs()[0]);
    } else {
      collect_ints(*(*out)[0], computed);
    }
  }
  return value_of(mask_);
}

std::vector<int64_t> MaskWalker::constants() const {
  std::vector<int64_t> out;
  for (const auto& [leaf, values] : constants_) {
    auto it = substituted_.find(leaf);
    if (it == substituted_.end()) {
      out.insert(out.end(), values.begin(), values.end());
    } else if (auto ints = tensor_ints(*it->second, 64)) {
      out.insert(out.end(), ints->begin(), ints->end());
    }
  }
  return out;
}

std::vector<const Value*> MaskWalker::compared_offsets(int64_t value) const {
  static const std::unordered_set<std::string> kCompare = {"Less", "LessOrEqual", "Greater",
                                                           "GreaterOrEqual"};
  auto standard = [](const Node* n) {
    return n->domain.value.empty() || n->domain.value == "ai.onnx";
  };
  std::vector<const Value*> leaves;
  for (const auto& [leaf, values] : constants_) {
    if (std::find(values.begin(), values.end(), value) == values.end()) continue;
    const TensorPtr t = constant_tensor(leaf);
    if (values.size() != 1 || leaf->is_graph_output() || !t ||
        (t->dtype() != kInt64 && t->dtype() != kInt32)) {
      return {};
    }
    for (const Use& u : leaf->uses()) {
      const Node* n = u.node;
      if (!std::count(nodes_.begin(), nodes_.end(), n)) continue;  // outside the mask
      const bool offset =
          standard(n) && (n->op_type == "Add" || (n->op_type == "Sub" && u.input_index == 1));
      if (!offset || n->outputs().size() != 1 || n->outputs()[0] == mask_ ||
          n->outputs()[0]->is_graph_output()) {
        return {};
      }
      for (const Use& c : n->outputs()[0]->uses()) {
        if (!standard(c.node) || !kCompare.count(c.node->op_type)) return {};
      }
    }
    leaves.push_back(leaf);
  }
  return leaves;
}

void MaskWalker::substitute(const Value* leaf, int64_t value) {
  TensorPtr t = constant_tensor(leaf);
  std::string bytes(t->nbytes(), '\0');
  if (t->dtype() == kInt32) {
    const int32_t v32 = static_cast<int32_t>(value);
    std::memcpy(&bytes[0], &v32, 4);
  } else {
    std::memcpy(&bytes[0], &value, 8);
  }
  substituted_[leaf] = make_tensor(t->dtype(), t->dims, std::move(bytes));
}

bool readable(const Tensor& mask) {
  return mask.dims.size() <= 4 && mask.expected_bytes() == mask.nbytes();
}

int read_mask(const Tensor& mask, const uint8_t* base, const int64_t full[4], const int64_t at[4]) {
  const size_t r = mask.dims.size();
  uint64_t index = 0;
  for (size_t i = 0; i < r; ++i) {
    const int64_t d = mask.dims[i];
    if (d != 1 && d != full[4 - r + i]) return -2;
    index = index * static_cast<uint64_t>(d) + static_cast<uint64_t>(d == 1 ? 0 : at[4 - r + i]);
  }
  const uint8_t* e = base + index * static_cast<uint64_t>(dtype_bits(mask.dtype()) / 8);
  double x = 0;
  switch (mask.dtype()) {
    case kBool: return e[0] != 0 ? 1 : 0;
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
  return x == 0.0 ? 1 : x <= kMaskedBelow ? 0 : -1;
}

std::optional<std::vector<int64_t>> probe_lengths(const std::vector<int64_t>& constants,
                                                  int64_t every, std::string* why) {
  std::vector<int64_t> lengths;
  for (int64_t t = 1; t <= every; ++t) lengths.push_back(t);
  for (int64_t c : constants) {
    if (c == std::numeric_limits<int64_t>::min()) continue;
    const int64_t a = c < 0 ? -c : c;
    if (a >= std::numeric_limits<int32_t>::max()) continue;  // "to the end" sentinels
    if (a > kMaxProbeLength) {
      if (why) {
        *why = "its subgraph holds the constant " + std::to_string(c) +
               ", beyond the lengths the check probes (" + std::to_string(kMaxProbeLength) + ")";
      }
      return std::nullopt;
    }
    for (int64_t t = a - 1; t <= a + 2; ++t) {
      if (t > every) lengths.push_back(t);
    }
  }
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  return lengths;
}

}  // namespace fastopt::passes::mask_walk
