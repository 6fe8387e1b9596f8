#include "analysis/shape_facts.h"

#include <unordered_set>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "ir/types.h"
#include "schema/attr_schema.h"

namespace fastopt::analysis {

int32_t SymbolTable::named(const std::string& name) {
  auto it = by_name_.find(name);
  if (it != by_name_.end()) return it->second;
  const int32_t id = static_cast<int32_t>(names_.size());
  names_.push_back(name);
  kinds_.push_back(SymbolKind::kNamed);
  by_name_.emplace(name, id);
  return id;
}

int32_t SymbolTable::fresh(SymbolKind kind) {
  const int32_t id = static_cast<int32_t>(names_.size());
  names_.emplace_back();
  kinds_.push_back(kind);
  return id;
}

bool SymbolTable::all_named(const DimExpr& e) const {
  for (const auto& t : e.terms()) {
    for (int32_t s : t.symbols) {
      if (kind(s) != SymbolKind::kNamed) return false;
    }
  }
  return true;
}

bool SymbolTable::nonneg(const DimExpr& e) const {
  if (!e.nonneg_coeffs()) return false;
  for (const auto& t : e.terms()) {
    for (int32_t s : t.symbols) {
      if (kind(s) == SymbolKind::kFreshData) return false;
    }
  }
  return true;
}

std::optional<std::vector<int64_t>> RuleContext::ints(size_t i) const {
  const Facts& f = in(i);
  if (!f.has_value) return std::nullopt;
  std::vector<int64_t> out;
  out.reserve(f.value.size());
  for (const DimExpr& e : f.value) {
    auto c = e.constant_value();
    if (!c) return std::nullopt;
    out.push_back(*c);
  }
  return out;
}

namespace {

bool is_int_type(int32_t t) {
  return t == kInt64 || t == kInt32 || t == kInt16 || t == kInt8 || t == kUint8 || t == kUint16 ||
         t == kUint32 || t == kUint64;
}

int64_t main_opset(const Model& m) {
  for (const auto& o : m.opset_import) {
    if ((o.domain.value.empty() || o.domain.value == "ai.onnx") && o.version) return *o.version;
  }
  return 0;
}

bool has_fresh(const SymbolTable& s, const DimExpr& e) {
  return !s.all_named(e);
}

Facts facts_from_tensor(const Tensor& t) {
  Facts f;
  f.dtype = t.dtype();
  f.ranked = true;
  for (int64_t d : t.dims) f.dims.push_back(DimExpr::constant(d));
  // Booleans too (0 / 1): the flags of a size's floor division (math_rules.cc, comparison).
  if ((is_int_type(t.dtype()) || t.dtype() == kBool) && t.dims.size() <= 1) {
    if (auto v = tensor_ints(t, kMaxShapeValue)) {
      f.has_value = true;
      for (int64_t x : *v) f.value.push_back(DimExpr::constant(x));
    }
  }
  return f;
}

}  // namespace

Facts facts_from_type(SymbolTable& symbols, const TypeInfo& t, bool named) {
  Facts f;
  if (!t.known || !t.is_tensor) return f;
  f.dtype = t.elem_type;
  if (t.has_shape) {
    f.ranked = true;
    for (const Dim& d : t.dims) {
      if (d.value && *d.value >= 0) {
        f.dims.push_back(DimExpr::constant(*d.value));
      } else if (named && d.param && !d.param->empty() && d.param->rfind("unk__", 0) != 0) {
        f.dims.push_back(DimExpr::symbol(symbols.named(*d.param)));
      } else {
        f.dims.push_back(DimExpr::symbol(symbols.fresh(SymbolKind::kFreshDim)));
      }
    }
  }
  return f;
}

// Facts of `v` when nothing computed them: its fixed initializer, else its declared type.
Facts leaf_facts(SymbolTable& symbols, const Value* v) {
  if (fixed_initializer(v) && v->initializer()) return facts_from_tensor(*v->initializer());
  Facts f = facts_from_type(symbols, v->type);
  if (!f.dtype && v->initializer()) f.dtype = v->initializer()->dtype();
  return f;
}

void merge_facts(SymbolTable& symbols, Facts& inferred, const Facts& declared) {
  if (!inferred.dtype) inferred.dtype = declared.dtype;
  if (!declared.ranked) return;
  if (!inferred.ranked) {
    inferred.ranked = true;
    inferred.dims = declared.dims;
    return;
  }
  if (inferred.dims.size() != declared.dims.size()) return;
  for (size_t i = 0; i < inferred.dims.size(); ++i) {
    if (has_fresh(symbols, inferred.dims[i]) && !has_fresh(symbols, declared.dims[i])) {
      inferred.dims[i] = declared.dims[i];
    }
  }
}

void ShapeFacts::ensure() {
  if (generation_ == model_.edit_generation) return;
  // Kept across edits (KeepAcrossEdits): every surviving value still holds what it held, and
  // values made since get their facts on first query (facts()).
  if (keep_ && computations_ > 0 && generation_ >= keep_since_) {
    generation_ = model_.edit_generation;
    return;
  }
  compute();
  generation_ = model_.edit_generation;
}

void ShapeFacts::compute() {
  ++computations_;
  facts_.clear();
  unknown_.clear();
  equal_to_.clear();
  analysed_ = bodies_ = 0;
  loop_depth_ = 0;
  symbols_ = SymbolTable{};
  if (!model_.graph) return;
  const Graph& g = *model_.graph;
  facts_.reserve(g.scope().size() + 16);
  for (Value* v : g.inputs()) facts_[v] = leaf_facts(symbols_, v);
  opset_ = main_opset(model_);
  sweep(g, opset_);
}

Facts& ShapeFacts::facts_slot(const Value* v) {
  auto it = facts_.find(v);
  if (it == facts_.end()) it = facts_.emplace(v, leaf_facts(symbols_, v)).first;
  return it->second;
}

void ShapeFacts::sweep(const Graph& g, int64_t opset) {
  for (Value* v : g.initializer_order) {
    if (!facts_.count(v)) facts_[v] = leaf_facts(symbols_, v);
  }
  RuleContext ctx(symbols_, opset);
  for (Node* n = g.first(); n; n = n->next()) sweep_node(*n, opset, ctx);
}

void ShapeFacts::sweep_node(const Node& n, int64_t opset, RuleContext& ctx) {
  // A node ORT refuses (an attribute of the wrong type) has no facts: its attributes would
  // read as the defaults, and folds would then replace it with what it never computes.
  const bool mistyped = pattern::mistyped_attribute(n);
  bool ok = false;
  std::vector<Facts> outs(n.outputs().size());
  if (n.has_subgraphs()) {
    const int depth = loop_depth_;
    try {
      ok = !mistyped && control_flow(n, opset, outs);
    } catch (const std::exception&) {  // a malformed attribute: no facts, not a failure
      loop_depth_ = depth;
      ok = false;
    }
  } else {
    std::vector<const Facts*> ins;
    std::vector<bool> present;
    ins.reserve(n.inputs().size());
    present.reserve(n.inputs().size());
    for (Value* v : n.inputs()) {
      present.push_back(v != nullptr);
      // An outer or out-of-order value: what it declares.
      ins.push_back(v ? &facts_slot(v) : nullptr);
    }
    ctx.set_inputs(std::move(ins), std::move(present));
    OpRule rule = mistyped ? nullptr : find_rule(n.domain.value, n.op_type);
    if (rule) {
      try {
        ok = rule(n, ctx, outs) && !ctx.missing_input();
      } catch (const std::exception&) {  // a malformed attribute: no facts, not a failure
        ok = false;
      }
    }
  }
  if (ok) {
    ++analysed_;
  } else {
    ++unknown_[(n.domain.value.empty() ? "" : n.domain.value + "::") + n.op_type];
    outs.assign(n.outputs().size(), Facts{});
  }
  for (size_t i = 0; i < n.outputs().size(); ++i) {
    Value* o = n.outputs()[i];
    if (!o) continue;
    const Facts declared = facts_from_type(symbols_, o->type, loop_depth_ == 0);
    if (loop_depth_ == 0) note_declared(outs[i], declared);
    merge_facts(symbols_, outs[i], declared);
    facts_[o] = std::move(outs[i]);
  }
}

// Facts of a value made after the last sweep (kept mode): its producer's, computed once the
// producers of its inputs that are new too have theirs.
const Facts* ShapeFacts::extend(const Value* v) {
  const Graph* g = model_.graph.get();
  if (!g || v->graph() != g || !v->defined()) return nullptr;
  if (!v->producer()) return &facts_slot(v);
  RuleContext ctx(symbols_, opset_);
  std::vector<const Node*> stack{v->producer()};
  while (!stack.empty()) {
    if (stack.size() > 4096) return nullptr;  // not a chain a rewrite makes: leave it unknown
    const Node* n = stack.back();
    bool ready = true;
    for (const Value* in : n->inputs()) {
      if (!in || facts_.count(in)) continue;
      const Node* p = in->producer();
      if (p && p->graph() == g && p->alive()) {
        stack.push_back(p);
        ready = false;
      }
    }
    if (!ready) continue;
    stack.pop_back();
    const Value* first = nullptr;
    for (const Value* o : n->outputs()) first = first ? first : o;
    if (first && !facts_.count(first)) sweep_node(*n, opset_, ctx);
  }
  auto it = facts_.find(v);
  return it == facts_.end() ? nullptr : &it->second;
}

const Facts* ShapeFacts::facts(const Value* v) {
  if (!v) return nullptr;
  ensure();
  auto it = facts_.find(v);
  if (it != facts_.end()) return &it->second;
  return extend(v);  // made under KeepAcrossEdits, else not in the graph (null)
}

int32_t ShapeFacts::dtype(const Value* v) {
  const Facts* f = facts(v);
  return f ? f->dtype : 0;
}

int ShapeFacts::rank(const Value* v) {
  const Facts* f = facts(v);
  return f && f->ranked ? static_cast<int>(f->dims.size()) : -1;
}

std::optional<DimExpr> ShapeFacts::dim(const Value* v, int axis) {
  const Facts* f = facts(v);
  if (!f || !f->ranked) return std::nullopt;
  const int r = static_cast<int>(f->dims.size());
  if (axis < 0) axis += r;
  if (axis < 0 || axis >= r) return std::nullopt;
  return f->dims[static_cast<size_t>(axis)];
}

std::optional<int64_t> ShapeFacts::known_dim(const Value* v, int axis) {
  auto d = dim(v, axis);
  return d ? d->constant_value() : std::nullopt;
}

bool ShapeFacts::same_dim(const Value* a, int axis_a, const Value* b, int axis_b) {
  auto x = dim(a, axis_a), y = dim(b, axis_b);
  return x && y && equal(*x, *y);
}

void ShapeFacts::note_declared(const Facts& inferred, const Facts& declared) {
  if (!inferred.ranked || !declared.ranked || declared.dims.size() != inferred.dims.size()) return;
  for (size_t i = 0; i < declared.dims.size(); ++i) {
    const DimExpr &d = declared.dims[i], &e = inferred.dims[i];
    // A declared name for a computed sum or product of sizes (an export naming P+S
    // total_sequence_length) defines it. Two different names of sizes, or a name for a number,
    // are not equated: a model whose run would fail on the mismatch must keep failing.
    if (d == e || d.as_symbol() < 0 || has_fresh(symbols_, d) || has_fresh(symbols_, e) ||
        e.as_symbol() >= 0 || e.is_constant()) {
      continue;
    }
    const std::string a = representative(symbols_.str(d)), b = representative(symbols_.str(e));
    if (a != b) equal_to_[a] = b;
  }
}

const std::string& ShapeFacts::representative(const std::string& e) {
  auto it = equal_to_.find(e);
  if (it == equal_to_.end()) return e;
  const std::string& root = representative(it->second);
  it->second = root;  // path compression
  return it->second;
}

bool ShapeFacts::equal(const DimExpr& a, const DimExpr& b) {
  if (a == b) return true;
  ensure();
  if (equal_to_.empty()) return false;
  const std::string sa = symbols_.str(a), sb = symbols_.str(b);
  return representative(sa) == representative(sb);
}

const std::vector<DimExpr>* ShapeFacts::shape_value(const Value* v) {
  const Facts* f = facts(v);
  return f && f->has_value ? &f->value : nullptr;
}

std::optional<std::vector<int64_t>> ShapeFacts::constant_shape_value(const Value* v) {
  const auto* sv = shape_value(v);
  if (!sv) return std::nullopt;
  std::vector<int64_t> out;
  for (const DimExpr& e : *sv) {
    auto c = e.constant_value();
    if (!c) return std::nullopt;
    out.push_back(*c);
  }
  return out;
}

const std::map<std::string, int64_t>& ShapeFacts::unknown_ops() {
  ensure();
  return unknown_;
}

int64_t ShapeFacts::analysed_nodes() {
  ensure();
  return analysed_;
}

int64_t ShapeFacts::analysed_bodies() {
  ensure();
  return bodies_;
}

Dim ShapeFacts::to_dim(const DimExpr& e) const {
  Dim d;
  if (auto c = e.constant_value()) {
    if (*c >= 0) d.value = *c;
  } else if (symbols_.all_named(e) && symbols_.nonneg(e)) {
    d.param = symbols_.str(e);
  }
  return d;
}

namespace {
TypeInfo type_of(const ShapeFacts& sf, const Facts& f) {
  TypeInfo t;
  if (!f.dtype) return t;
  t.known = true;
  t.is_tensor = true;
  t.elem_type = f.dtype;
  t.has_shape = f.ranked;
  for (const DimExpr& e : f.dims) t.dims.push_back(sf.to_dim(e));
  return t;
}
}  // namespace

int64_t ShapeFacts::apply_to_types(Model& model) {
  ensure();
  if (!model.graph) return 0;
  int64_t changed = 0;
  auto apply = [&](Graph& g) {
    std::unordered_set<const Value*> described;
    for (const auto* entries : {&g.input_entries, &g.output_entries, &g.value_info_entries}) {
      for (const auto& e : *entries) described.insert(e.value);
    }
    for (Node* n = g.first(); n; n = n->next()) {
      for (Value* v : n->outputs()) {
        if (!v) continue;
        auto it = facts_.find(v);
        if (it == facts_.end()) continue;
        if (!refine_type(v->type, type_of(*this, it->second))) continue;
        ++changed;
        if (described.insert(v).second) {
          ValueInfoEntry e;
          e.value = v;
          g.value_info_entries.push_back(std::move(e));
        }
      }
    }
  };
  apply(*model.graph);
  // If/Loop/Scan bodies the sweep analysed (their values have facts); a subgraph's
  // value_info lists its own values.
  for_each_subgraph(*model.graph, apply);
  // Our own writes need no recomputation: types only refine what the facts already hold.
  return changed;
}

ShapeFacts& facts_of(Model& model) {
  if (!model.shape_facts) model.shape_facts = std::make_shared<ShapeFacts>(model);
  return *model.shape_facts;
}

namespace {

// What the rules know of `v`: its leaf facts, or a Constant's value.
Facts input_facts(SymbolTable& symbols, const Value* v) {
  Facts f = leaf_facts(symbols, v);
  if (!f.has_value && v->producer() && v->producer()->op_type == "Constant") {
    if (auto t = constant_tensor(v)) f = facts_from_tensor(*t);
  }
  return f;
}

// The type that facts `f` give an output (symbolic dims named where the symbols allow).
TypeInfo type_of(const Facts& f, const SymbolTable& symbols) {
  TypeInfo t;
  t.known = t.is_tensor = true;
  t.elem_type = f.dtype;
  t.has_shape = f.ranked;
  for (const DimExpr& e : f.dims) {
    Dim d;
    if (auto c = e.constant_value(); c && *c >= 0) {
      d.value = *c;
    } else if (symbols.all_named(e) && symbols.nonneg(e)) {
      d.param = symbols.str(e);
    }
    t.dims.push_back(std::move(d));
  }
  return t;
}

bool has_untyped_output(const Node& node) {
  for (const Value* o : node.outputs()) {
    if (o && !o->type.known) return true;
  }
  return false;
}

}  // namespace

void type_new_node(const Model& model, Node& node) {
  if (!has_untyped_output(node) || node.has_subgraphs()) return;
  OpRule rule = find_rule(node.domain.value, node.op_type);
  if (!rule) return;
  SymbolTable symbols;
  std::vector<Facts> in_facts;
  in_facts.reserve(node.inputs().size());
  std::vector<const Facts*> ins;
  std::vector<bool> present;
  for (Value* v : node.inputs()) {
    present.push_back(v != nullptr);
    in_facts.push_back(v ? input_facts(symbols, v) : Facts{});
  }
  for (size_t i = 0; i < in_facts.size(); ++i) ins.push_back(present[i] ? &in_facts[i] : nullptr);
  RuleContext ctx(symbols, main_opset(model));
  ctx.set_inputs(ins, present);
  std::vector<Facts> outs(node.outputs().size());
  try {
    if (!rule(node, ctx, outs) || ctx.missing_input()) return;
  } catch (const std::exception&) {
    return;
  }
  for (size_t i = 0; i < node.outputs().size(); ++i) {
    Value* o = node.outputs()[i];
    if (o && !o->type.known && outs[i].dtype) o->type = type_of(outs[i], symbols);
  }
}

}  // namespace fastopt::analysis
