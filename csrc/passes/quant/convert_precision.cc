// float32 -> float16 / bfloat16 (option quant_mode fp16 | bf16): the model computes in the new
// type. Weights are converted while streaming (quant/float_convert.h); float value types, Cast
// targets (to=FLOAT), Constant / ConstantOfShape values and dtype attributes follow.
//
// What stays float32 (Casts are put at the edges, one per value and direction):
//   - ops that have no 16-bit form or whose ORT kernels take float32 only (DynamicQuantizeLinear,
//     DynamicQuantizeMatMul, MatMulIntegerToFloat, Quantize/DequantizeLinear, Range), and the
//     float32-only inputs / outputs of others (Resize scales; the mean / inv_std_var outputs of
//     the norms, whose stash type stays float32 as ORT's fused kernels expect)
//   - default-domain ops whose schema has no 16-bit form at the model's opset (text option
//     precision_f32_ops, which fastopt.precision computes from onnx's schemas; e.g. Range, and
//     Sin / Cos in bfloat16 before opset 22)
//   - nodes and weights named by quant_exclude
//   - nodes whose values overflow fp16 on representative inputs (text option
//     precision_f32_values: output names, one a line, from fastopt.fp16_ranges' range pass)
//   - deliberate fp32 islands: an exporter's Cast to float32 of a float value (a no-op in an
//     fp32 export, written by model code such as `x.to(torch.float32)` around RMSNorm and
//     softmax) whose every path ends, through float math only, at another such Cast:
//
//         x ── Cast(to=f32) ── Pow ── ReduceMean ── Add ── Sqrt ── Div ── Mul ── Cast(to=f32) ──
//                 kept               (float32, as the exporter meant)         becomes to=f16
//
// quant_keep_io_types keeps float graph inputs and outputs float32 (Casts at the boundary).
// Values beyond the target's range are clamped and counted (counter values_clamped).
// Refused (ModelError): control flow (If / Loop / Scan bodies) and model-local functions, which
// this pass does not walk.
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "ir/column_concat.h"
#include "ir/constant.h"
#include "ir/error.h"
#include "passes/fusion_util.h"
#include "passes/quant/options.h"
#include "passes/registry.h"
#include "proto/onnx_writer.h"
#include "quant/float_convert.h"

namespace fastopt::passes {
namespace {
using quant::QuantRecord;

enum class Mode { kNone, kLow, kF32 };

bool in(const std::string& op, std::initializer_list<const char*> ops) {
  for (const char* o : ops) {
    if (op == o) return true;
  }
  return false;
}

bool f32_only_op(const Node* n) {
  return in(n->op_type, {"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                         "QuantizeLinear", "DequantizeLinear", "Range", "QLinearMatMul",
                         "QLinearConv", "MatMulInteger", "ConvInteger"});
}

// Inputs whose type is fixed to float32 by the op's schema.
bool f32_input(const Node* n, size_t i) {
  return (n->op_type == "Resize" && i == 2) || (n->op_type == "Upsample" && i == 1);
}

// Outputs whose type is fixed to float32 (norm statistics: type U, the stash type).
bool f32_output(const Node* n, size_t i) {
  if (in(n->op_type,
         {"LayerNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})) {
    return i == 1 || i == 2;
  }
  if (n->op_type == "SimplifiedLayerNormalization") return i == 1;
  return false;
}

// Ops whose inputs may be of any type (their output type does not follow them).
bool any_input_op(const Node* n) {
  return in(n->op_type, {"Cast", "Shape", "Size"});
}

// Ops an fp32 island may hold: float math between an exporter's two Casts.
bool island_op(const Node* n) {
  return n->domain.value.empty() &&
         in(n->op_type,
            {"Pow", "ReduceMean", "ReduceSum",  "ReduceMax", "ReduceMin",  "Add",    "Sub", "Mul",
             "Div", "Sqrt",       "Reciprocal", "Softmax",   "LogSoftmax", "Exp",    "Log", "Max",
             "Min", "Neg",        "Abs",        "Tanh",      "Erf",        "Sigmoid"});
}

class PrecisionConverter {
 public:
  PrecisionConverter(Model& m, PassContext& ctx)
      : model_(m), ctx_(ctx), opt_(quant::read_options(ctx)) {
    to_ = opt_.mode == "bf16" ? kBFloat16 : kFloat16;
    // Default-domain ops whose schema at the model's opset has no form in the new type
    // (fastopt.precision.f32_only_ops reads onnx's schemas), comma separated.
    split_option(ctx, "precision_f32_ops", ',', schema_f32_);
    // Nodes to keep float32 because their values overflow the new type, by output name (value
    // names are unique; node names need not be): one a line, as names may hold commas.
    split_option(ctx, "precision_f32_values", '\n', range_f32_);
  }

  static void split_option(const PassContext& ctx, const char* key, char sep,
                           std::set<std::string>& into) {
    auto it = ctx.text_options.find(key);
    if (it == ctx.text_options.end()) return;
    const std::string& s = it->second;
    for (size_t b = 0; b <= s.size();) {
      size_t e = s.find(sep, b);
      if (e == std::string::npos) e = s.size();
      if (e > b) into.insert(s.substr(b, e - b));
      b = e + 1;
    }
  }

  bool range_kept(const Node* n) const {
    for (const Value* o : n->outputs()) {
      if (o && range_f32_.count(o->name())) return true;
    }
    return false;
  }

  int64_t run() {
    if (opt_.mode != "fp16" && opt_.mode != "bf16") {
      throw ModelError("convert_precision needs quant_mode fp16 or bf16, not '" + opt_.mode + "'");
    }
    Graph& g = *model_.graph;
    if (!model_.functions.empty()) {
      throw ModelError("convert_precision: the model has local functions (" +
                       model_.functions[0]->name.value + ", ...); their bodies are not converted");
    }
    for (Node* n = g.first(); n; n = n->next()) {
      if (n->has_subgraphs()) {
        throw ModelError("convert_precision: node '" + n->name.value + "' (" + n->op_type +
                         ") holds a subgraph; control flow is not converted");
      }
      // Converting retypes attributes (Cast's to, Constant's value_float): never into ones
      // ORT accepts where the original has the wrong type.
      if (std::string bad = mistyped_reason(n); !bad.empty()) {
        throw ModelError("convert_precision: node '" + n->name.value + "': " + bad);
      }
    }
    g.topological_sort();
    infer_types(g);
    decide_modes(g);
    plan_constants(g);
    convert_all();
    apply(g);
    return ctx_.counters["nodes_converted"];
  }

 private:
  // ---- original element types -------------------------------------------------------------
  int32_t type_of(const Value* v) const {
    if (!v) return 0;
    if (v->type.known && v->type.is_tensor && v->type.elem_type) return v->type.elem_type;
    if (v->initializer()) return v->initializer()->dtype();
    auto it = types_.find(v);
    return it == types_.end() ? 0 : it->second;
  }
  bool is_f32(const Value* v) const { return type_of(v) == kFloat; }

  // Element types of outputs that carry none (no shape inference, contrib ops).
  void infer_types(Graph& g) {
    for (Node* n = g.first(); n; n = n->next()) {
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        Value* o = n->outputs()[i];
        if (!o || (o->type.known && o->type.is_tensor && o->type.elem_type)) continue;
        types_[o] = guess(n, i);
      }
    }
  }

  int32_t guess(const Node* n, size_t i) const {
    const std::string& op = n->op_type;
    auto input = [&](size_t k) { return k < n->inputs().size() ? type_of(n->inputs()[k]) : 0; };
    if (op == "Cast") return static_cast<int32_t>(int_attr_or(n, "to", 0));
    if (op == "CastLike") return input(1);
    if (op == "Constant") {
      if (const Attribute* a = n->attribute("value"); a && a->t) return a->t->dtype();
      if (n->attribute("value_float") || n->attribute("value_floats")) return kFloat;
      return kInt64;
    }
    if (op == "ConstantOfShape") {
      const Attribute* a = n->attribute("value");
      return a && a->t ? a->t->dtype() : kFloat;
    }
    if (in(op, {"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})) return kInt64;
    if (in(op, {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or",
                "Xor", "IsNaN", "IsInf"})) {
      return kBool;
    }
    if (op == "Where") return input(1);
    if (op == "TopK" && i == 1) return kInt64;
    if (op == "DynamicQuantizeLinear") return i == 1 ? kFloat : kUint8;
    if (in(op, {"MatMulInteger", "ConvInteger"})) return kInt32;
    if (in(op, {"MatMulIntegerToFloat", "DequantizeLinear"})) return input(op[0] == 'M' ? 2 : 1);
    if (op == "QuantizeLinear") return n->inputs().size() > 2 ? input(2) : kUint8;
    if (f32_output(n, i)) return kFloat;
    if (in(op,
           {"EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike"})) {
      return static_cast<int32_t>(
          int_attr_or(n, "dtype", op.find("Like") != std::string::npos ? input(0) : kFloat));
    }
    for (size_t k = 0; k < n->inputs().size(); ++k) {
      if (int32_t t = input(k)) return t;
    }
    return 0;
  }

  // ---- which nodes run in the new type ------------------------------------------------------
  bool touches_f32(const Node* n) const {
    for (const Value* v : n->inputs()) {
      if (is_f32(v)) return true;
    }
    for (const Value* v : n->outputs()) {
      if (is_f32(v)) return true;
    }
    return n->op_type == "Cast" && int_attr_or(n, "to", 0) == kFloat;
  }

  bool identity_cast(const Node* n) const {
    return n->op_type == "Cast" && n->domain.value.empty() && int_attr_or(n, "to", 0) == kFloat &&
           !n->inputs().empty() && is_f32(n->inputs()[0]);
  }

  // The fp32 island starting at `start` (an identity Cast): its nodes, or empty.
  std::vector<Node*> island(Node* start, std::unordered_set<Node*>& ends) const {
    std::vector<Node*> region;
    std::unordered_set<Node*> seen{start};
    std::vector<Value*> work{start->outputs()[0]};
    while (!work.empty()) {
      Value* v = work.back();
      work.pop_back();
      if (v->is_graph_output() || v->uses().empty()) return {};
      for (const Use& u : v->uses()) {
        Node* c = u.node;
        if (!seen.insert(c).second) continue;
        if (identity_cast(c)) {
          ends.insert(c);
        } else if (island_op(c) && region.size() < 64) {
          region.push_back(c);
          for (Value* o : c->outputs()) work.push_back(o);
        } else {
          return {};
        }
      }
    }
    return ends.empty() ? std::vector<Node*>{} : region;
  }

  void decide_modes(Graph& g) {
    std::unordered_set<Node*> island_ends;
    for (Node* n = g.first(); n; n = n->next()) {
      if (!touches_f32(n)) {
        mode_[n] = Mode::kNone;
        continue;
      }
      if (mode_.count(n)) continue;  // inside an island found before
      std::string glob = opt_.excluded(n->name.value);
      if (!glob.empty()) {
        mode_[n] = Mode::kF32;
        ++ctx_.counters["nodes_excluded"];
        continue;
      }
      if (f32_only_op(n) || (n->domain.value.empty() && schema_f32_.count(n->op_type))) {
        mode_[n] = Mode::kF32;
        ++ctx_.counters["nodes_kept_f32_only"];
        continue;
      }
      if (identity_cast(n) && !island_ends.count(n)) {
        std::unordered_set<Node*> ends;
        std::vector<Node*> region = island(n, ends);
        if (!ends.empty()) {
          mode_[n] = Mode::kF32;
          for (Node* r : region) mode_[r] = Mode::kF32;
          island_ends.insert(ends.begin(), ends.end());
          ++ctx_.counters["fp32_islands"];
          ctx_.counters["fp32_island_nodes"] += static_cast<int64_t>(region.size());
          continue;
        }
      }
      if (range_kept(n)) {
        mode_[n] = Mode::kF32;
        ++ctx_.counters["nodes_kept_range"];
        continue;
      }
      mode_[n] = Mode::kLow;
    }
    // Constant nodes follow their readers: converted unless only float32 ops read them.
    for (Node* n = g.first(); n; n = n->next()) {
      if (n->op_type != "Constant" || mode_[n] != Mode::kLow) continue;
      const Value* o = n->outputs()[0];
      bool low = o->is_graph_output() && !opt_.keep_io_types;
      for (const Use& u : o->uses()) low |= wants_low(u.node, static_cast<size_t>(u.input_index));
      if (!low) mode_[n] = Mode::kF32;
    }
  }

  Mode mode(const Node* n) const {
    auto it = mode_.find(n);
    return it == mode_.end() ? Mode::kNone : it->second;
  }

  // Whether input i of n must be in the new type (else float32, or any type).
  bool wants_low(const Node* n, size_t i) const {
    return mode(n) == Mode::kLow && !any_input_op(n) && !f32_input(n, i);
  }
  bool wants_f32(const Node* n, size_t i) const {
    return !any_input_op(n) && (mode(n) == Mode::kF32 || f32_input(n, i));
  }

  // The type a float32 value has after the conversion.
  int32_t new_type(const Value* v) const {
    if (const Node* p = v->producer()) {
      if (mode(p) != Mode::kLow || f32_output(p, static_cast<size_t>(v->producer_output()))) {
        return kFloat;
      }
      return to_;
    }
    if (v->initializer()) {
      auto it = converted_in_place_.find(v);
      return it != converted_in_place_.end() ? to_ : kFloat;
    }
    return opt_.keep_io_types ? kFloat : to_;  // graph input
  }

  // ---- weights --------------------------------------------------------------------------------
  void plan_constants(Graph& g) {
    for (Value* v : g.initializer_order) {
      const auto& t = v->initializer();
      if (!t || t->dtype() != kFloat) continue;
      bool low = false, f32 = false;
      const Node* first = nullptr;
      for (const Use& u : v->uses()) {
        if (!first) first = u.node;
        low |= wants_low(u.node, static_cast<size_t>(u.input_index));
        f32 |= wants_f32(u.node, static_cast<size_t>(u.input_index));
      }
      if (v->is_graph_input()) {  // overridable: an input of the model
        low = !opt_.keep_io_types;
        f32 = !low;
      }
      std::string glob = opt_.excluded(v->name());
      if (!glob.empty() && low) {
        keep(v, first, "excluded by '" + glob + "'");
        f32 = true;
        low = false;
      }
      if (!low) {
        if (f32 && glob.empty()) keep(v, first, "read by float32 ops only");
        continue;
      }
      Planned p{v, first, f32, jobs_.size()};
      jobs_.push_back(job(v->name(), *t));
      // Room for the framing of the initializer apply() makes (quant/temp_file.h).
      jobs_.back().framing =
          initializer_framing_bytes(f32 ? v->name() + "_" + short_name() : v->name(), t->dims, to_,
                                    jobs_.back().data_bytes());
      planned_.push_back(p);
      if (!f32) converted_in_place_.insert(v);
    }
    // Constant nodes' tensors.
    for (Node* n = g.first(); n; n = n->next()) {
      if (n->op_type != "Constant" || mode(n) != Mode::kLow) continue;
      Attribute* a = attr(n, "value");
      if (a && a->t && a->t->dtype() == kFloat) {
        constant_jobs_.emplace_back(n, jobs_.size());
        jobs_.push_back(job(n->outputs()[0]->name(), *a->t));
      }
    }
  }

  quant::ConvertJob job(const std::string& name, const Tensor& t) const {
    quant::ConvertJob j;
    j.name = name;
    j.src = t.bytes();
    j.numel = t.numel();
    // A packed weight is read as its rows, block by block from its sources (no packed copy).
    if (whole_column_concat(j.src) && t.dims.size() == 2 && t.dims[1] > 0) {
      j.row_elems = static_cast<uint64_t>(t.dims[1]);
    }
    j.to = to_;
    return j;
  }

  void keep(const Value* w, const Node* n, std::string reason) {
    QuantRecord r = quant::kept_record(w, n, std::move(reason), w->initializer().get());
    r.dtype_before = dtype_name(kFloat);  // as the other quant passes name it
    ctx_.quant_records.push_back(std::move(r));
    ++ctx_.counters["weights_kept"];
  }

  // Runs the jobs: the initializers' into one file, the Constant nodes' (planned after them)
  // into another, so that the first holds initializers only, which a self-contained save can
  // keep where they are (quant/temp_file.h).
  void convert_all() {
    const size_t split = constant_jobs_.empty() ? jobs_.size() : constant_jobs_.front().second;
    std::vector<quant::ConvertJob> constants(std::make_move_iterator(jobs_.begin() + split),
                                             std::make_move_iterator(jobs_.end()));
    jobs_.resize(split);
    if (!jobs_.empty()) {
      file_ = quant::TempFile::create(opt_.tmpdir);
      quant::run_convert_jobs(jobs_, *file_, opt_.threads, ctx_.progress);
    }
    if (!constants.empty()) {
      constants_file_ = quant::TempFile::create(opt_.tmpdir);
      quant::run_convert_jobs(constants, *constants_file_, opt_.threads, ctx_.progress);
    }
    for (quant::ConvertJob& j : constants) jobs_.push_back(std::move(j));
  }

  std::shared_ptr<Tensor> converted(const quant::ConvertJob& j, const Tensor& like,
                                    const std::shared_ptr<quant::TempFile>& file) const {
    auto t = std::make_shared<Tensor>();
    t->data_type = to_;
    t->dims = like.dims;
    t->storage = Tensor::Storage::kRaw;
    t->has_raw_field = true;
    t->raw = ByteRef{file, j.offset, j.data_bytes()};
    return t;
  }

  static Attribute* attr(Node* n, const std::string& name) {
    for (Attribute& a : n->attributes) {
      if (a.name == name) return &a;
    }
    return nullptr;
  }

  // ---- the rewrite ------------------------------------------------------------------------------
  void set_type(Value* v, int32_t t) {
    if (!v->type.known || !v->type.is_tensor) {
      types_[v] = t;
      return;
    }
    if (v->type.elem_type == t) return;
    v->type.elem_type = t;
    v->type.encoded = ByteRef{};
  }

  // `v` as type `t`: a Cast made once per value and type, right after v's producer.
  Value* cast_to(Graph& g, Value* v, int32_t t) {
    auto key = std::make_pair(v, t);
    auto it = casts_.find(key);
    if (it != casts_.end()) return it->second;
    Node* at = v->producer() ? v->producer()->next() : g.first();
    const char* suffix = t == kFloat ? "_to_fp32" : t == kFloat16 ? "_to_fp16" : "_to_bf16";
    Node* c = g.create_node("Cast", "", {v}, {g.unique_name(v->name() + suffix)}, at);
    c->name.set(g.unique_name(v->name() + suffix));
    c->attributes.push_back(pattern::attr_int("to", t));
    c->outputs()[0]->type = v->type;
    set_type(c->outputs()[0], t);
    mode_[c] = Mode::kNone;
    casts_.emplace(key, c->outputs()[0]);
    ++ctx_.counters["casts_inserted"];
    return c->outputs()[0];
  }

  void apply(Graph& g) {
    // Weights.
    for (const Planned& p : planned_) {
      const quant::ConvertJob& j = jobs_[p.job];
      auto t = converted(j, *p.value->initializer(), file_);
      record(j, p.value, p.first, *p.value->initializer());
      if (!p.keep_f32) {
        g.set_initializer(p.value, t);
        set_type(p.value, to_);
        continue;
      }
      Value* low = g.add_initializer(g.unique_name(p.value->name() + "_" + short_name()), t);
      std::vector<Use> uses = p.value->uses();
      for (const Use& u : uses) {
        if (wants_low(u.node, static_cast<size_t>(u.input_index))) {
          u.node->set_input(u.input_index, low);
        }
      }
    }
    for (auto& [n, j] : constant_jobs_) {
      attr(n, "value")->t = converted(jobs_[j], *attr(n, "value")->t, constants_file_);
      clamped_ += jobs_[j].clamped;
    }
    // Nodes: attributes, then output types.
    std::vector<Node*> nodes = g.nodes();
    for (Node* n : nodes) {
      if (mode(n) != Mode::kLow) continue;
      retarget_attributes(n);
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        Value* o = n->outputs()[i];
        if (o && type_of(o) == kFloat && !f32_output(n, i)) set_type(o, to_);
      }
      ++ctx_.counters["nodes_converted"];
    }
    // Graph inputs.
    for (Value* v : g.inputs()) {
      if (!v->initializer() && type_of(v) == kFloat && !opt_.keep_io_types) set_type(v, to_);
    }
    // Inputs whose type differs from what their reader takes.
    for (Node* n : nodes) {
      if (mode(n) == Mode::kNone || any_input_op(n)) continue;
      for (size_t i = 0; i < n->inputs().size(); ++i) {
        Value* v = n->inputs()[i];
        if (!v || (type_of(v) != kFloat && type_of(v) != to_)) continue;
        const int32_t want = wants_low(n, i) ? to_ : kFloat;
        if (type_of(v) != want) n->set_input(static_cast<int>(i), cast_to(g, v, want));
      }
    }
    // Graph outputs keep float32 with keep_io_types.
    if (opt_.keep_io_types) {
      std::vector<Value*> outs = g.outputs();
      for (Value* v : outs) {
        if (type_of(v) != to_ || !v->producer()) continue;
        const std::string name = v->name();
        const TypeInfo type = v->type;
        g.rename(v, g.unique_name(name + "_" + short_name()));
        Node* c =
            g.create_node("Cast", "", {v}, {g.unique_name(name + "__cast")}, v->producer()->next());
        c->attributes.push_back(pattern::attr_int("to", kFloat));
        Value* out = c->outputs()[0];
        // Only the graph output moves to the Cast; v's readers keep reading v.
        const std::vector<Use> uses = v->uses();
        g.replace_all_uses(v, out);
        for (const Use& u : uses) u.node->set_input(u.input_index, v);
        g.rename(out, name);
        out->type = type;
        set_type(out, kFloat);
        ++ctx_.counters["casts_inserted"];
      }
    }
    ctx_.counters["values_clamped"] += static_cast<int64_t>(clamped_);
  }

  std::string short_name() const { return to_ == kFloat16 ? "fp16" : "bf16"; }

  void retarget_attributes(Node* n) {
    const std::string& op = n->op_type;
    if (op == "Cast" && int_attr_or(n, "to", 0) == kFloat) {
      attr(n, "to")->i = to_;
      ++ctx_.counters["casts_retargeted"];
    } else if (in(op, {"EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike",
                       "RandomUniformLike"})) {
      if (Attribute* a = attr(n, "dtype"); a && a->i && *a->i == kFloat) a->i = to_;
    } else if (op == "ConstantOfShape") {
      Attribute* a = attr(n, "value");
      if (!a) {
        n->attributes.push_back(pattern::attr_tensor("value", small_tensor({0.0f})));
      } else if (a->t && a->t->dtype() == kFloat) {
        auto v = tensor_doubles(*a->t, 1);
        if (v && v->size() == 1) a->t = small_tensor({static_cast<float>((*v)[0])});
      }
    } else if (op == "Constant") {
      for (const char* name : {"value_float", "value_floats"}) {
        Attribute* a = attr(n, name);
        if (!a) continue;
        std::vector<float> vals = a->f ? std::vector<float>{*a->f} : a->floats;
        std::vector<int64_t> dims;
        if (!a->f) dims.push_back(static_cast<int64_t>(vals.size()));
        auto t = small_tensor(vals);
        t->dims = dims;
        *a = pattern::attr_tensor("value", t);
      }
    }
  }

  std::shared_ptr<Tensor> small_tensor(const std::vector<float>& vals) {
    std::string bytes;
    for (float f : vals) {
      bool c;
      const uint16_t b = quant::convert_float(f, to_, c);
      clamped_ += c;
      bytes.append(reinterpret_cast<const char*>(&b), 2);
    }
    return make_tensor(to_, {static_cast<int64_t>(vals.size())}, std::move(bytes));
  }

  void record(const quant::ConvertJob& j, const Value* w, const Node* n, const Tensor& t) {
    QuantRecord r = quant::quantized_record(w->name(), n, t.nbytes(), j.error);
    r.reason = j.clamped ? std::to_string(j.clamped) + " values clamped to the range" : "";
    r.dtype_before = dtype_name(kFloat);  // as the other quant passes name it
    r.dtype_after = to_ == kFloat16 ? "float16" : "bfloat16";
    r.bytes_after = j.data_bytes();
    ctx_.quant_records.push_back(std::move(r));
    ++ctx_.counters["weights_converted"];
    clamped_ += j.clamped;
  }

  struct Planned {
    Value* value;
    const Node* first;
    bool keep_f32;  // float32 readers too: the converted copy is a new initializer
    size_t job;
  };

  Model& model_;
  PassContext& ctx_;
  quant::QuantOptions opt_;
  int32_t to_ = kFloat16;
  std::set<std::string> schema_f32_;
  std::set<std::string> range_f32_;
  std::unordered_map<const Value*, int32_t> types_;
  std::unordered_map<const Node*, Mode> mode_;
  std::vector<quant::ConvertJob> jobs_;
  std::vector<Planned> planned_;
  std::vector<std::pair<Node*, size_t>> constant_jobs_;
  std::unordered_set<const Value*> converted_in_place_;
  std::map<std::pair<Value*, int32_t>, Value*> casts_;
  std::shared_ptr<quant::TempFile> file_, constants_file_;
  uint64_t clamped_ = 0;
};

int64_t convert_precision(Model& model, PassContext& ctx) {
  return PrecisionConverter(model, ctx).run();
}

const PassRegistrar kRegister{
    PassDecl(
        "convert_precision",
        "float32 -> float16 / bfloat16 (option quant_mode fp16 | bf16, quant_keep_io_types, "
        "quant_exclude): weights converted while streaming, compute in the new type, fp32 kept "
        "where ORT's kernels or the exporter's Casts ask for it")
        .tags({"quantization"})
        .not_idempotent()
        .run(convert_precision)};

}  // namespace
}  // namespace fastopt::passes
