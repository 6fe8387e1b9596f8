#include "ir/graph.h"

#include <algorithm>
#include <deque>
#include <unordered_set>

#include "ir/error.h"

namespace fastopt {

namespace {
void note_edit_of(Graph* g) {
  if (g && g->model()) g->model()->note_edit();
}
}  // namespace

namespace {
// A node of `g` now reads `v`: when `v` lives in an enclosing graph, every graph in between
// records the outer reference, or topological_sort/find_cycle miss the dependency.
void note_outer_use(Graph* g, Value* v) {
  if (!v || !g || v->graph() == g) return;
  for (Graph* s = g->parent(); s; s = s->parent()) {
    if (s != v->graph()) continue;
    for (Graph* t = g; t != s; t = t->parent()) t->add_outer_reference(v);
    return;
  }
}
}  // namespace

void Node::add_use(int index) {
  Value* v = inputs_[index];
  if (use_slots_.size() < inputs_.size()) use_slots_.resize(inputs_.size(), 0);
  use_slots_[index] = static_cast<uint32_t>(v->uses_.size());
  v->uses_.push_back(Use{this, index});
}

void Node::drop_use(int index) {
  // Swap with the last use, then fix the moved use's slot.
  Value* v = inputs_[index];
  auto& uses = v->uses_;
  uint32_t slot = use_slots_[index];
  Use last = uses.back();
  uses[slot] = last;
  last.node->use_slots_[last.input_index] = slot;
  uses.pop_back();
}

void Node::append_input(Value* v) {
  note_edit_of(graph_);
  inputs_.push_back(v);
  use_slots_.push_back(0);
  if (v) add_use(static_cast<int>(inputs_.size()) - 1);
}

void Node::remove_input(int index) {
  note_edit_of(graph_);
  if (index < 0 || static_cast<size_t>(index) >= inputs_.size()) {
    throw ModelError("input index " + std::to_string(index) + " out of range");
  }
  // Uses record input positions: drop those from `index` on, shift, add them back.
  for (size_t i = static_cast<size_t>(index); i < inputs_.size(); ++i) {
    if (inputs_[i]) drop_use(static_cast<int>(i));
  }
  inputs_.erase(inputs_.begin() + index);
  use_slots_.erase(use_slots_.begin() + index);
  for (size_t i = static_cast<size_t>(index); i < inputs_.size(); ++i) {
    if (inputs_[i]) add_use(static_cast<int>(i));
  }
}

bool Node::has_subgraphs() const {
  for (const auto& a : attributes) {
    if (a.g || !a.graphs.empty()) return true;
  }
  return false;
}

AttrType Attribute::kind() const {
  if (type && *type != 0) return static_cast<AttrType>(*type);
  if (f) return AttrType::kFloat;
  if (i) return AttrType::kInt;
  if (s) return AttrType::kString;
  if (t) return AttrType::kTensor;
  if (g) return AttrType::kGraph;
  if (!floats.empty()) return AttrType::kFloats;
  if (!ints.empty()) return AttrType::kInts;
  if (!strings.empty()) return AttrType::kStrings;
  if (!tensors.empty()) return AttrType::kTensors;
  if (!graphs.empty()) return AttrType::kGraphs;
  return AttrType::kUndefined;
}

const Attribute* Node::attribute(const std::string& n) const {
  for (const auto& a : attributes) {
    if (a.name == n) return &a;
  }
  return nullptr;
}

std::vector<Graph*> Node::subgraphs() const {
  std::vector<Graph*> out;
  for (const auto& a : attributes) {
    if (a.g) out.push_back(a.g.get());
    for (const auto& g : a.graphs) out.push_back(g.get());
  }
  return out;
}

void Node::set_input(int index, Value* v) {
  note_edit_of(graph_);
  if (index < 0 || static_cast<size_t>(index) >= inputs_.size()) {
    throw ModelError("input index " + std::to_string(index) + " out of range for node '" +
                     name.value + "'");
  }
  if (inputs_[index]) drop_use(index);
  inputs_[index] = v;
  if (v) add_use(index);
  note_outer_use(graph_, v);
}

std::vector<Node*> Graph::nodes() const {
  std::vector<Node*> out;
  out.reserve(node_count_);
  for (Node* n = head_; n; n = n->next_) out.push_back(n);
  return out;
}

std::vector<Value*> Graph::inputs() const {
  std::vector<Value*> out;
  for (const auto& e : input_entries) out.push_back(e.value);
  return out;
}

std::vector<Value*> Graph::outputs() const {
  std::vector<Value*> out;
  for (const auto& e : output_entries) out.push_back(e.value);
  return out;
}

Value* Graph::lookup(std::string_view name) const {
  for (const Graph* g = this; g; g = g->parent_) {
    auto it = g->scope_.find(name);
    if (it != g->scope_.end() && it->second->defined()) return it->second;
  }
  return nullptr;
}

void Graph::define(Value* v) {
  auto it = scope_.find(std::string_view(v->name_));
  if (it != scope_.end()) {
    if (it->second->defined()) {
      throw ModelError("value '" + v->name_ + "' is defined more than once in graph '" +
                       name.value + "'");
    }
    scope_.erase(it);  // a tombstone: the key views the old value's name, so re-insert
  }
  scope_.emplace(std::string_view(v->name_), v);
}

void Graph::add_outer_reference(Value* v) {
  if (outer_ref_set_.insert(v).second) outer_refs_.push_back(v);
}

Value* Graph::create_value(const std::string& name) {
  Value* raw = &value_storage_.emplace_back();
  raw->name_ = name;
  raw->graph_ = this;
  if (!name.empty()) define(raw);
  return raw;
}

Graph::Graph(Model* model, Graph* parent) : model_(model), parent_(parent) {
  if (model_) model_->graphs.push_back(this);
}

namespace {
const Graph* top_of(const Graph* g) {
  while (g->parent()) g = g->parent();
  return g;
}
}  // namespace

std::string Graph::unique_name(const std::string& base) const {
  // Names are unique within one namespace: the main graph with its nested subgraphs, or one
  // function body with its subgraphs (functions have scopes of their own).
  const Graph* top = top_of(this);
  auto taken = [&](const std::string& name) {
    for (const Graph* g : model_->graphs) {
      auto it = g->scope_.find(name);
      if (it != g->scope_.end() && it->second->defined() && top_of(g) == top) return true;
    }
    return false;
  };
  if (!taken(base)) return base;
  uint64_t& i = model_->next_suffix[base];
  for (;;) {
    std::string candidate = base + "_" + std::to_string(++i);
    if (!taken(candidate)) return candidate;
  }
}

void Graph::link_before(Node* node, Node* before) {
  note_edit_of(this);
  if (before == nullptr) {
    node->prev_ = tail_;
    node->next_ = nullptr;
    if (tail_)
      tail_->next_ = node;
    else
      head_ = node;
    tail_ = node;
  } else {
    node->next_ = before;
    node->prev_ = before->prev_;
    if (before->prev_)
      before->prev_->next_ = node;
    else
      head_ = node;
    before->prev_ = node;
  }
  ++node_count_;
}

void Graph::unlink(Node* node) {
  if (node->prev_)
    node->prev_->next_ = node->next_;
  else
    head_ = node->next_;
  if (node->next_)
    node->next_->prev_ = node->prev_;
  else
    tail_ = node->prev_;
  node->prev_ = node->next_ = nullptr;
  --node_count_;
}

Node* Graph::new_node() {
  Node* n = &node_storage_.emplace_back();
  n->graph_ = this;
  return n;
}

Node* Graph::append_node(Node* node) {
  link_before(node, nullptr);
  return node;
}

Node* Graph::create_node(const std::string& op_type, const std::string& domain,
                         const std::vector<Value*>& inputs,
                         const std::vector<std::string>& output_names, Node* insert_before) {
  if (insert_before && insert_before->graph_ != this) {
    throw ModelError("insert position belongs to another graph");
  }
  Node* raw = new_node();
  raw->op_type = op_type;
  raw->has_op_type = true;
  if (!domain.empty()) raw->domain.set(domain);
  for (Value* in : inputs) {
    raw->append_input(in);
    note_outer_use(this, in);
  }
  for (size_t i = 0; i < output_names.size(); ++i) {
    if (output_names[i].empty()) {
      raw->outputs_.push_back(nullptr);
      continue;
    }
    Value* v = create_value(unique_name(output_names[i]));
    v->producer_ = raw;
    v->producer_output_ = static_cast<int>(i);
    raw->outputs_.push_back(v);
  }
  link_before(raw, insert_before);
  return raw;
}

void Graph::remove_node(Node* node) {
  note_edit_of(this);
  if (node->graph_ != this || !node->alive_) throw ModelError("node is not in this graph");
  for (Value* out : node->outputs_) {
    if (!out) continue;
    if (!out->uses_.empty() || out->is_graph_output()) {
      throw ModelError("cannot remove node '" + node->name.value + "' (" + node->op_type +
                       "): its output '" + out->name_ + "' is still used");
    }
  }
  for (size_t i = 0; i < node->inputs_.size(); ++i) {
    if (node->inputs_[i]) node->drop_use(static_cast<int>(i));
  }
  for (Value* out : node->outputs_) {
    if (out) out->producer_ = nullptr;  // now a tombstone in scope_
  }
  unlink(node);
  node->alive_ = false;
}

void Graph::replace_all_uses(Value* from, Value* to) {
  if (from == to) return;
  // set_input removes each use from the back of the list: no copy needed.
  while (!from->uses_.empty()) {
    Use u = from->uses_.back();
    u.node->set_input(u.input_index, to);
  }
  for (auto& e : output_entries) {
    if (e.value == from) {
      e.value = to;
      --from->graph_output_count_;
      ++to->graph_output_count_;
      note_outer_use(this, to);
    }
  }
}

void Graph::rename(Value* v, const std::string& new_name) {
  if (v->name_ == new_name) return;
  if (new_name.empty()) throw ModelError("cannot rename a value to the empty name");
  if (!v->defined()) throw ModelError("cannot rename '" + v->name_ + "': it was removed");
  if (unique_name(new_name) != new_name) {
    throw ModelError("cannot rename '" + v->name_ + "' to '" + new_name + "': name is taken");
  }
  Graph* home = v->graph_;
  home->scope_.erase(v->name_);
  v->name_ = new_name;
  home->define(v);
  if (v->initializer_) v->initializer_->name.set(new_name);
}

Value* Graph::add_initializer(const std::string& name, std::shared_ptr<Tensor> t) {
  Value* v = create_value(unique_name(name));
  set_initializer(v, std::move(t));
  return v;
}

namespace {
// IR version < 4: every initializer of the main graph must also be a graph input.
bool initializers_are_inputs(const Graph& g) {
  const Model* m = g.model();
  return m && m->graph.get() == &g && m->ir_version && *m->ir_version < 4;
}
}  // namespace

void Graph::set_initializer(Value* v, std::shared_ptr<Tensor> t) {
  note_edit_of(this);
  if (v->producer_) throw ModelError("value '" + v->name_ + "' is produced by a node");
  if (!v->initializer_) initializer_order.push_back(v);
  t->name.set(v->name_);
  if (initializers_are_inputs(*this) && !v->is_graph_input_) {
    TypeInfo type;
    type.known = type.is_tensor = type.has_shape = true;
    type.elem_type = t->dtype();
    for (int64_t d : t->dims) type.dims.push_back(Dim{d, std::nullopt});
    v->type = std::move(type);
    add_input(v);
  }
  v->initializer_ = std::move(t);
}

void Graph::remove_initializer(Value* v) {
  remove_initializers({v});
}

void Graph::remove_initializers(const std::vector<Value*>& values) {
  note_edit_of(this);
  std::unordered_set<const Value*> gone, gone_inputs;
  const bool as_inputs = initializers_are_inputs(*this);
  for (Value* v : values) {
    if (!v->initializer_ || !gone.insert(v).second) continue;
    v->initializer_.reset();
    if (v->is_graph_input_ && as_inputs) {
      // The input entry only existed because IR < 4 lists every initializer as an input.
      gone_inputs.insert(v);
      v->is_graph_input_ = false;
    }
    if (!v->is_graph_input_) scope_.erase(v->name_);
  }
  if (gone.empty()) return;
  initializer_order.erase(std::remove_if(initializer_order.begin(), initializer_order.end(),
                                         [&](const Value* v) { return gone.count(v) != 0; }),
                          initializer_order.end());
  if (gone_inputs.empty()) return;
  input_entries.erase(
      std::remove_if(input_entries.begin(), input_entries.end(),
                     [&](const ValueInfoEntry& e) { return gone_inputs.count(e.value) != 0; }),
      input_entries.end());
}

void Graph::add_output(Value* v) {
  note_edit_of(this);
  ValueInfoEntry e;
  e.value = v;
  output_entries.push_back(std::move(e));
  ++v->graph_output_count_;
}

void Graph::remove_output(size_t index) {
  note_edit_of(this);
  if (index >= output_entries.size()) throw ModelError("graph output index out of range");
  if (Value* v = output_entries[index].value) --v->graph_output_count_;
  output_entries.erase(output_entries.begin() + static_cast<std::ptrdiff_t>(index));
}

void Graph::remove_input(size_t index) {
  note_edit_of(this);
  if (index >= input_entries.size()) throw ModelError("graph input index out of range");
  Value* v = input_entries[index].value;
  if (v && (!v->uses_.empty() || v->is_graph_output() || v->initializer_)) {
    throw ModelError("graph input '" + v->name_ + "' is still used");
  }
  input_entries.erase(input_entries.begin() + static_cast<std::ptrdiff_t>(index));
  if (v) v->is_graph_input_ = false;  // a tombstone in scope_ now
}

void Graph::add_input(Value* v) {
  note_edit_of(this);
  ValueInfoEntry e;
  e.value = v;
  input_entries.push_back(std::move(e));
  v->is_graph_input_ = true;
}

namespace {
// Producers in `g` that `n` depends on, directly or through its subgraphs' outer references.
template <typename F>
void for_each_dependency(const Graph* g, Node* n, F&& fn) {
  for (Value* v : n->inputs()) {
    if (v && v->producer() && v->producer()->graph() == g) fn(v->producer());
  }
  if (!n->has_subgraphs()) return;
  for (Graph* sub : n->subgraphs()) {
    for (Value* v : sub->outer_references()) {
      if (v->producer() && v->producer()->graph() == g) fn(v->producer());
    }
  }
}
}  // namespace

Node* Graph::find_cycle() const {
  // Kahn's algorithm over node positions (kept in Node::scratch); nodes left over lie on or
  // behind a cycle.
  std::vector<Node*> order = nodes();
  for (size_t i = 0; i < order.size(); ++i) order[i]->scratch = static_cast<int64_t>(i);
  std::vector<int> indegree(order.size(), 0);
  std::vector<std::vector<uint32_t>> users(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    for_each_dependency(this, order[i], [&](Node* p) {
      ++indegree[i];
      users[static_cast<size_t>(p->scratch)].push_back(static_cast<uint32_t>(i));
    });
  }
  std::vector<uint32_t> ready;
  for (size_t i = 0; i < order.size(); ++i) {
    if (indegree[i] == 0) ready.push_back(static_cast<uint32_t>(i));
  }
  size_t seen = 0;
  while (!ready.empty()) {
    uint32_t n = ready.back();
    ready.pop_back();
    ++seen;
    for (uint32_t u : users[n]) {
      if (--indegree[u] == 0) ready.push_back(u);
    }
  }
  if (seen == order.size()) return nullptr;
  for (size_t i = 0; i < order.size(); ++i) {
    if (indegree[i] > 0) return order[i];
  }
  return nullptr;
}

void Graph::topological_sort() {
  note_edit_of(this);
  // Stable: among ready nodes, keep the current order.
  std::vector<Node*> order = nodes();
  for (size_t i = 0; i < order.size(); ++i) order[i]->scratch = static_cast<int64_t>(i);
  std::vector<int> indegree(order.size(), 0);
  std::vector<std::vector<size_t>> users(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    for_each_dependency(this, order[i], [&](Node* p) {
      ++indegree[i];
      users[static_cast<size_t>(p->scratch)].push_back(i);
    });
  }
  std::vector<size_t> heap;  // min-heap of positions
  auto cmp = [](size_t a, size_t b) { return a > b; };
  for (size_t i = 0; i < order.size(); ++i) {
    if (indegree[i] == 0) heap.push_back(i);
  }
  std::make_heap(heap.begin(), heap.end(), cmp);
  std::vector<Node*> sorted;
  sorted.reserve(order.size());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    size_t i = heap.back();
    heap.pop_back();
    sorted.push_back(order[i]);
    for (size_t u : users[i]) {
      if (--indegree[u] == 0) {
        heap.push_back(u);
        std::push_heap(heap.begin(), heap.end(), cmp);
      }
    }
  }
  if (sorted.size() != order.size()) {
    Node* bad = find_cycle();
    throw ModelError("graph '" + name.value + "' has a cycle through node '" +
                     (bad ? bad->name.value + "' (" + bad->op_type + ")" : std::string("?'")));
  }
  head_ = tail_ = nullptr;
  node_count_ = 0;
  for (Node* n : sorted) link_before(n, nullptr);
}

void for_each_subgraph(const Graph& g, const std::function<void(Graph&)>& fn) {
  for (Node* n = g.first(); n; n = n->next()) {
    if (!n->has_subgraphs()) continue;
    for (Graph* sub : n->subgraphs()) {
      fn(*sub);
      for_each_subgraph(*sub, fn);
    }
  }
}

namespace {
// A graph is live when every node owning it, up to the top, is still in its graph.
bool graph_live(const Graph* g) {
  for (; g; g = g->parent()) {
    Node* owner = g->owner_node();
    if (owner && !owner->alive()) return false;
  }
  return true;
}
}  // namespace

void Model::for_each_graph(const std::function<void(Graph&)>& fn) const {
  // Index-based: fn may add graphs (they are visited too).
  for (size_t i = 0; i < graphs.size(); ++i) {
    if (graph_live(graphs[i])) fn(*graphs[i]);
  }
}

std::map<std::string, int64_t> Model::op_counts() const {
  std::map<std::string, int64_t> counts;
  for_each_graph([&](Graph& g) {
    for (Node* n = g.first(); n; n = n->next()) {
      const std::string& d = n->domain.value;
      bool standard = d.empty() || d == "ai.onnx";
      ++counts[standard ? n->op_type : d + "::" + n->op_type];
    }
  });
  return counts;
}

namespace {

// Input i of `n` (in graph g): in its value's use list, defined in scope, from a live node.
void verify_input(const Graph& g, Node* n, size_t i) {
  Value* v = n->inputs()[i];
  if (!v) return;
  const auto& uses = v->uses();
  const uint32_t slot = n->use_slot(static_cast<int>(i));
  if (slot >= uses.size() || !(uses[slot] == Use{n, static_cast<int>(i)})) {
    throw ModelError("use list of '" + v->name() + "' misses node '" + n->name.value + "'");
  }
  if (v->name().empty() || g.lookup(v->name()) != v) {
    throw ModelError("node '" + n->name.value + "' (" + n->op_type + ") reads '" + v->name() +
                     "', which is not defined in scope");
  }
  if (v->producer() && !v->producer()->alive()) {
    throw ModelError("'" + v->name() + "' is produced by a removed node");
  }
}

// A live node of g whose inputs are sound and whose outputs point back to it.
void verify_node(const Graph& g, Node* n, const std::string& gname) {
  if (!n->alive()) throw ModelError(gname + " links a removed node");
  if (n->graph() != &g) throw ModelError(gname + " holds a node of another graph");
  for (size_t i = 0; i < n->inputs().size(); ++i) verify_input(g, n, i);
  for (size_t i = 0; i < n->outputs().size(); ++i) {
    Value* v = n->outputs()[i];
    if (v && (v->producer() != n || v->producer_output() != static_cast<int>(i))) {
      throw ModelError("output '" + v->name() + "' does not point back to its producer");
    }
  }
}

// Every use of a value in scope is a live node's input that reads it.
void verify_use_lists(const Graph& g) {
  for (const auto& kv : g.scope()) {
    if (!kv.second->defined()) continue;
    for (const Use& u : kv.second->uses()) {
      if (!u.node->alive() || u.input_index < 0 ||
          static_cast<size_t>(u.input_index) >= u.node->inputs().size() ||
          u.node->inputs()[u.input_index] != kv.second) {
        throw ModelError("use list of '" + std::string(kv.first) + "' holds a stale use");
      }
    }
  }
}

}  // namespace

void Model::verify() const {
  for_each_graph([&](Graph& g) {
    const std::string gname = "graph '" + g.name.value + "'";
    size_t count = 0;
    for (Node* n = g.first(); n; n = n->next()) {
      ++count;
      verify_node(g, n, gname);
    }
    if (count != g.node_count()) throw ModelError(gname + " node count is inconsistent");
    verify_use_lists(g);
    for (const auto& e : g.output_entries) {
      if (e.value && g.lookup(e.value->name()) != e.value) {
        throw ModelError(gname + " output '" + e.value->name() + "' is not defined");
      }
    }
    if (Node* bad = g.find_cycle()) {
      throw ModelError(gname + " has a cycle through node '" + bad->name.value + "' (" +
                       bad->op_type + ")");
    }
  });
}

std::string dtype_name(int32_t t) {
  static const char* names[] = {
      "undefined",      "float",    "uint8",        "int8",           "uint16",
      "int16",          "int32",    "int64",        "string",         "bool",
      "float16",        "double",   "uint32",       "uint64",         "complex64",
      "complex128",     "bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2",
      "float8e5m2fnuz", "uint4",    "int4",         "float4e2m1",     "float8e8m0",
      "uint2",          "int2"};
  if (t >= 0 && t < static_cast<int32_t>(sizeof(names) / sizeof(names[0]))) return names[t];
  return "dtype" + std::to_string(t);
}

}  // namespace fastopt
