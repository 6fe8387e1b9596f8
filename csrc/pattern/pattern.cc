#include "pattern/pattern.h"

#include <algorithm>
#include <cmath>

#include "ir/constant.h"
#include "ir/error.h"
#include "schema/attr_schema.h"

namespace fastopt::pattern {

namespace {
bool same_domain(const std::string& a, const std::string& b) {
  auto norm = [](const std::string& d) -> const std::string& {
    static const std::string kEmpty;
    return d == "ai.onnx" ? kEmpty : d;
  };
  return norm(a) == norm(b);
}

size_t effective_inputs(const Node* n) {
  // Trailing omitted optional inputs do not count.
  size_t k = n->inputs().size();
  while (k > 0 && n->inputs()[k - 1] == nullptr) --k;
  return k;
}
}  // namespace

// ---- builder ----

P& P::commutative() {
  pattern_->node(id_).commutative = true;
  return *this;
}
P& P::output(int index) {
  pattern_->node(id_).output_index = index;
  return *this;
}
P& P::extra_inputs() {
  pattern_->node(id_).extra_inputs = true;
  return *this;
}
P& P::shared() {
  pattern_->node(id_).shared = true;
  return *this;
}
P& P::attr_check(const std::string& name, std::function<bool(const Attribute*)> check,
                 std::string description) {
  pattern_->node(id_).attrs.push_back({name, std::move(check), std::move(description)});
  return *this;
}
P& P::attr_int(const std::string& name, int64_t value) {
  return attr_check(
      name, [value](const Attribute* a) { return a && a->i && *a->i == value; },
      name + " == " + std::to_string(value));
}
P& P::attr_ints(const std::string& name, std::vector<int64_t> value) {
  std::string text = name + " == [";
  for (size_t i = 0; i < value.size(); ++i) text += (i ? "," : "") + std::to_string(value[i]);
  return attr_check(
      name, [value](const Attribute* a) { return a && a->ints == value; }, text + "]");
}
P& P::attr_float(const std::string& name, float value, float tolerance) {
  return attr_check(
      name,
      [value, tolerance](const Attribute* a) {
        return a && a->f && std::fabs(*a->f - value) <= tolerance;
      },
      name + " ~= " + std::to_string(value));
}
P& P::attr_string(const std::string& name, const std::string& value) {
  return attr_check(
      name, [value](const Attribute* a) { return a && a->s && *a->s == value; },
      name + " == '" + value + "'");
}
P& P::attr_absent(const std::string& name) {
  return attr_check(name, [](const Attribute* a) { return a == nullptr; }, name + " is absent");
}
P& P::check(std::function<bool(const Value*)> check, std::string description) {
  pattern_->node(id_).checks.push_back({std::move(check), std::move(description)});
  return *this;
}
P& P::dtype_in(std::vector<int32_t> dtypes) {
  std::string text = "dtype in {";
  for (size_t i = 0; i < dtypes.size(); ++i) text += (i ? "," : "") + dtype_name(dtypes[i]);
  return check(
      [dtypes](const Value* v) {
        int32_t t = value_dtype(v);
        return std::find(dtypes.begin(), dtypes.end(), t) != dtypes.end();
      },
      text + "}");
}
P& P::dim(int axis, const std::string& symbol) {
  pattern_->node(id_).dims.push_back({axis, symbol});
  return *this;
}

P& P::rank(int r) {
  return check([r](const Value* v) { return value_rank(v) == r; }, "rank == " + std::to_string(r));
}

int Pattern::add(PatternNode n) {
  nodes_.push_back(std::move(n));
  return static_cast<int>(nodes_.size()) - 1;
}

P Pattern::var(const std::string& name) {
  int existing = find(name);
  if (existing >= 0 && nodes_[existing].kind == PatternNode::Kind::kVar) return P(this, existing);
  PatternNode n;
  n.kind = PatternNode::Kind::kVar;
  n.name = name;
  return P(this, add(std::move(n)));
}

P Pattern::op(const std::string& op_type, std::vector<P> inputs, const std::string& domain) {
  return op_any({op_type}, std::move(inputs), domain);
}

P Pattern::op_any(std::vector<std::string> op_types, std::vector<P> inputs,
                  const std::string& domain) {
  PatternNode n;
  n.kind = PatternNode::Kind::kOp;
  n.name = op_types.front() + "#" + std::to_string(nodes_.size());
  n.op_types = std::move(op_types);
  n.domain = domain;
  for (const P& in : inputs) {
    if (!in.valid()) throw ModelError("pattern input is not set");
    n.inputs.push_back(in.id());
  }
  return P(this, add(std::move(n)));
}

P Pattern::constant(const std::string& name, std::function<bool(const std::vector<double>&)> check,
                    std::string description) {
  PatternNode n;
  n.kind = PatternNode::Kind::kConst;
  n.name = name;
  n.const_check = std::move(check);
  n.const_description = std::move(description);
  return P(this, add(std::move(n)));
}

P Pattern::scalar(const std::string& name, double value, double tolerance) {
  return constant(
      name,
      [value, tolerance](const std::vector<double>& v) {
        if (v.empty()) return false;
        for (double x : v) {
          if (!(std::fabs(x - value) <= tolerance)) return false;
        }
        return true;
      },
      "constant ~= " + std::to_string(value));
}

P Pattern::any_constant(const std::string& name) {
  return constant(name, [](const std::vector<double>&) { return true; }, "constant");
}

P Pattern::alt(const std::string& name, std::vector<P> alternatives) {
  PatternNode n;
  n.kind = PatternNode::Kind::kAlt;
  n.name = name;
  for (const P& a : alternatives) n.inputs.push_back(a.id());
  return P(this, add(std::move(n)));
}

P Pattern::optional(P op) {
  const PatternNode& inner = nodes_[op.id()];
  if (inner.kind != PatternNode::Kind::kOp || inner.inputs.empty()) {
    throw ModelError("optional() takes an op pattern with at least one input");
  }
  PatternNode n;
  n.kind = PatternNode::Kind::kOptional;
  n.name = inner.name + "?";
  n.inputs = {op.id()};
  return P(this, add(std::move(n)));
}

std::vector<std::string> Pattern::root_op_types() const {
  if (root_ < 0) throw ModelError("pattern '" + name_ + "' has no root");
  const PatternNode& r = nodes_[root_];
  if (r.kind != PatternNode::Kind::kOp) {
    throw ModelError("pattern '" + name_ + "' root must be an op");
  }
  return r.op_types;
}

int Pattern::benefit() const {
  int n = 0;
  for (const auto& p : nodes_) n += p.kind == PatternNode::Kind::kOp;
  return n;
}

int Pattern::find(const std::string& name) const {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

// ---- match results ----

Value* Match::value(const std::string& name) const {
  int id = pattern_->find(name);
  return id < 0 ? nullptr : values_[id];
}
Node* Match::node(const std::string& name) const {
  int id = pattern_->find(name);
  return id < 0 ? nullptr : nodes_[id];
}
std::vector<Node*> Match::matched_nodes() const {
  std::vector<Node*> out;
  out.reserve(nodes_.size() + 1);
  out.push_back(root());
  for (Node* n : nodes_) {
    if (n && std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  }
  return out;
}

std::string MatchFailure::format(const Pattern& p) const {
  std::string s = "stopped at ";
  if (pattern_node >= 0) {
    const PatternNode& pn = p.node(pattern_node);
    s += "pattern node '" + pn.name + "'";
    if (pn.kind == PatternNode::Kind::kOp) {
      s += " (";
      for (size_t i = 0; i < pn.op_types.size(); ++i) s += (i ? "|" : "") + pn.op_types[i];
      s += ")";
    }
  } else {
    s += "the root";
  }
  if (value) {
    s += " on value '" + value->name() + "'";
    if (value->producer()) s += " from " + value->producer()->op_type;
  }
  s += ": ";
  s += reason;
  if (detail) s += " [" + *detail + "]";
  return s;
}

// ---- matcher ----

void Matcher::fail(int pn, const Value* v, const char* reason, const std::string* detail) {
  if (why_ && depth_ >= why_->depth) {
    why_->pattern_node = pn;
    why_->value = v;
    why_->reason = reason;
    why_->detail = detail;
    why_->depth = depth_;
  }
}

bool Matcher::used(const Node* n) const {
  return std::find(used_nodes_.begin(), used_nodes_.end(), n) != used_nodes_.end();
}

bool Matcher::bind(int pn, Value* v, Node* n) {
  if (n && used(n)) {
    fail(pn, v, "the node is already part of the match");
    return false;
  }
  if (!bind_dims(pn, v)) return false;
  if (n) used_nodes_.push_back(n);
  m_->values_[pn] = v;
  m_->nodes_[pn] = n;
  ++depth_;
  return true;
}

namespace {
bool same_dim(const Dim& a, const Dim& b) {
  if (a.value && b.value) return *a.value == *b.value;
  if (a.param && b.param) return *a.param == *b.param;
  return false;
}
}  // namespace

bool Matcher::bind_dims(int pn, const Value* v) {
  const PatternNode& node = pattern_.node(pn);
  if (node.dims.empty()) return true;
  const TypeInfo& t = v->type;
  if (!t.is_tensor || !t.has_shape) {
    fail(pn, v, "the value's shape is unknown");
    return false;
  }
  const int rank = static_cast<int>(t.dims.size());
  const size_t mark = dim_bindings_.size();
  for (const DimConstraint& c : node.dims) {
    int axis = c.axis < 0 ? c.axis + rank : c.axis;
    if (axis < 0 || axis >= rank || (!t.dims[axis].value && !t.dims[axis].param)) {
      fail(pn, v, "a constrained dim is unknown");
      dim_bindings_.resize(mark);
      return false;
    }
    const Dim& d = t.dims[axis];
    const DimBinding* bound = nullptr;
    for (const auto& b : dim_bindings_) {
      if (*b.symbol == c.symbol) bound = &b;
    }
    if (bound && !same_dim(bound->dim, d)) {
      fail(pn, v, "a symbolic dim differs from where it was first bound");
      dim_bindings_.resize(mark);
      return false;
    }
    if (!bound) dim_bindings_.push_back({&c.symbol, d, pn});
  }
  return true;
}

void Matcher::unbind(int pn) {
  while (!dim_bindings_.empty() && dim_bindings_.back().pn == pn) dim_bindings_.pop_back();
  if (m_->nodes_[pn]) used_nodes_.pop_back();  // bindings are undone in reverse order
  m_->values_[pn] = nullptr;
  m_->nodes_[pn] = nullptr;
  --depth_;
}

bool Matcher::match(Node* node, Match* out, MatchFailure* why) {
  const int root = pattern_.root_id();
  const PatternNode& r = pattern_.node(root);
  m_ = out;
  why_ = why;
  depth_ = 0;
  used_nodes_.clear();
  std::fill(out->values_.begin(), out->values_.end(), nullptr);
  std::fill(out->nodes_.begin(), out->nodes_.end(), nullptr);
  if (static_cast<size_t>(r.output_index) >= node->outputs().size() ||
      !node->outputs()[r.output_index]) {
    fail(root, nullptr, "the root node lacks the output the pattern names");
    return false;
  }
  goals_.clear();
  dim_bindings_.clear();
  goals_.push_back({root, node->outputs()[r.output_index]});
  return solve(goals_);
}

bool Matcher::solve(std::vector<Goal>& goals) {
  if (goals.empty()) return no_outside_uses();
  Goal g = goals.back();
  goals.pop_back();
  if (match_one(g, goals)) return true;
  goals.push_back(g);
  return false;
}

bool Matcher::no_outside_uses() {
  const int root = pattern_.root_id();
  const auto& pnodes = pattern_.nodes();
  for (size_t i = 0; i < pnodes.size(); ++i) {
    Node* n = m_->nodes_[i];
    if (!n || static_cast<int>(i) == root || pnodes[i].shared) continue;
    for (Value* o : n->outputs()) {
      if (!o) continue;
      if (o->is_graph_output()) {
        fail(static_cast<int>(i), o, "an intermediate value is a graph output");
        return false;
      }
      for (const Use& u : o->uses()) {
        if (!used(u.node)) {
          fail(static_cast<int>(i), o, "an intermediate value has uses outside the match");
          return false;
        }
      }
    }
  }
  return true;
}

bool Matcher::match_one(const Goal& g, std::vector<Goal>& goals) {
  const PatternNode& pn = pattern_.node(g.pn);
  Value* v = g.value;
  if (m_->values_[g.pn]) {  // reached again through another path: must be the same value
    if (m_->values_[g.pn] != v) {
      fail(g.pn, v, "a variable bound twice to different values");
      return false;
    }
    return solve(goals);
  }
  if (!v) {
    fail(g.pn, v, "the input is omitted");
    return false;
  }
  for (const Constraint& c : pn.checks) {
    if (!c.check(v)) {
      fail(g.pn, v, "value constraint failed", &c.description);
      return false;
    }
  }
  const size_t mark = goals.size();
  switch (pn.kind) {
    case PatternNode::Kind::kVar: {
      if (!bind(g.pn, v, nullptr)) return false;
      if (solve(goals)) return true;
      unbind(g.pn);
      return false;
    }
    case PatternNode::Kind::kConst: {
      // The common case (an initializer or a Constant's tensor) takes no reference.
      const Tensor* view = constant_tensor_view(v);
      std::shared_ptr<const Tensor> owned;
      if (!view) {
        owned = constant_tensor(v);
        view = owned.get();
      }
      if (!view) {
        fail(g.pn, v, "not a constant");
        return false;
      }
      if (!decode_doubles(*view, 4096, constant_) || !pn.const_check(constant_)) {
        fail(g.pn, v, "constant value constraint failed", &pn.const_description);
        return false;
      }
      // A Constant node is usually shared; it is not part of the match (DCE removes it later).
      if (!bind(g.pn, v, nullptr)) return false;
      if (solve(goals)) return true;
      unbind(g.pn);
      return false;
    }
    case PatternNode::Kind::kAlt: {
      if (!bind(g.pn, v, nullptr)) return false;
      for (int alternative : pn.inputs) {
        goals.push_back({alternative, v});
        if (solve(goals)) return true;
        goals.resize(mark);
      }
      unbind(g.pn);
      return false;
    }
    case PatternNode::Kind::kOptional: {
      const int inner = pn.inputs[0];
      if (!bind(g.pn, v, nullptr)) return false;
      goals.push_back({inner, v});
      if (solve(goals)) return true;
      goals.resize(mark);
      goals.push_back({pattern_.node(inner).inputs[0], v});  // skip the op
      if (solve(goals)) return true;
      goals.resize(mark);
      unbind(g.pn);
      return false;
    }
    case PatternNode::Kind::kOp: {
      Node* n = v->producer();
      if (!n) {
        fail(g.pn, v, "not produced by a node");
        return false;
      }
      if (v->producer_output() != pn.output_index) {
        fail(g.pn, v, "a different output of the node");
        return false;
      }
      if (std::find(pn.op_types.begin(), pn.op_types.end(), n->op_type) == pn.op_types.end()) {
        fail(g.pn, v, "op type differs");
        return false;
      }
      if (!same_domain(n->domain.value, pn.domain)) {
        fail(g.pn, v, "domain differs");
        return false;
      }
      const size_t have = effective_inputs(n);
      if (pn.extra_inputs ? have < pn.inputs.size() : have != pn.inputs.size()) {
        fail(g.pn, v, "input count differs");
        return false;
      }
      for (const AttrConstraint& a : pn.attrs) {
        if (!a.check(n->attribute(a.name))) {
          fail(g.pn, v, "attribute constraint failed", &a.description);
          return false;
        }
      }
      // A node ORT refuses (an attribute of the wrong type) is never rewritten into one it runs,
      // and its attribute is never read as the default.
      if (const Attribute* bad = mistyped_attribute(*n)) {
        if (why_) {
          // The reason to report, whatever other alternatives reach further.
          details_.push_back(describe_mistyped(*n, *bad));
          const int depth = depth_;
          depth_ += 1 << 20;
          fail(g.pn, v, "an attribute has the wrong type", &details_.back());
          depth_ = depth;
        }
        return false;
      }
      if (!bind(g.pn, v, n)) return false;
      const size_t k = pn.inputs.size();
      const int orders = pn.commutative && k == 2 ? 2 : 1;
      for (int order = 0; order < orders; ++order) {
        // Pushed in reverse so that the first input is matched first.
        for (size_t i = k; i-- > 0;) {
          size_t src = order == 0 ? i : 1 - i;
          goals.push_back({pn.inputs[i], n->inputs()[src]});
        }
        if (solve(goals)) return true;
        goals.resize(mark);
      }
      unbind(g.pn);
      return false;
    }
  }
  return false;
}

}  // namespace fastopt::pattern
