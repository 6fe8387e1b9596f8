// Common subexpression elimination: nodes that compute the same thing from the same values, and
// equal small constants, are kept once.
//
//   x ── Shape ── Gather(0) ── a          x ── Shape ── Gather(0) ──┬── a
//   x ── Shape ── Gather(0) ── b    =>                              └── b
//
// Exporters trace each use of `x.shape[0]`, a mask or a rotary table separately, so a
// decoder repeats the same Shape/Gather/Unsqueeze chains and Constant nodes in every layer.
// One walk in topological order: a node's inputs are already canonical when it is hashed, so
// whole chains merge in one pass. Never merged: nodes with subgraphs, random ops, training-mode
// Dropout, ops outside the standard domains (custom ops may have state), big constants.
#include <cstring>
#include <unordered_map>

#include "ir/constant.h"
#include "passes/cleanup/cleanup_util.h"
#include "passes/registry.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {
namespace {
using pattern::can_replace;
using pattern::replace_value;

constexpr uint64_t kMaxConstantBytes = 4096;

size_t mix(size_t h, size_t v) {
  return h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
}

const std::string& normalized_domain(const Node* n) {
  static const std::string kEmpty;
  return n->domain.value == "ai.onnx" ? kEmpty : n->domain.value;
}

bool is_random(const std::string& op) {
  return op == "RandomNormal" || op == "RandomUniform" || op == "RandomNormalLike" ||
         op == "RandomUniformLike" || op == "Multinomial" || op == "Bernoulli";
}

// Dropout draws a mask unless training_mode is a constant false (is_test=0 before opset 7).
bool training_dropout(const Node* n) {
  if (n->op_type != "Dropout") return false;
  if (auto* a = n->attribute("is_test"); a && a->i && *a->i == 0) return true;
  if (n->inputs().size() > 2 && n->inputs()[2]) {
    auto t = constant_scalar(n->inputs()[2]);
    return !t || *t != 0;
  }
  return false;
}

bool same_tensor(const Tensor& a, const Tensor& b) {
  if (&a == &b) return true;
  if (a.dtype() != b.dtype() || a.dims != b.dims) return false;
  if (a.dtype() == kString || a.dtype() == kUndefined) return false;
  if (a.nbytes() != b.nbytes()) return false;
  try {
    ByteRef x = a.bytes(), y = b.bytes();
    return x.size == y.size && (x.size == 0 || std::memcmp(x.data(), y.data(), x.size) == 0);
  } catch (const std::exception&) {
    return false;  // malformed typed data: not worth merging
  }
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Attribute kinds fastopt models; others (graphs, sparse tensors, type protos) never compare
// equal, so their nodes are never merged.
bool comparable(const Attribute& a) {
  switch (a.kind()) {
    case AttrType::kFloat:
    case AttrType::kInt:
    case AttrType::kString:
    case AttrType::kTensor:
    case AttrType::kFloats:
    case AttrType::kInts:
    case AttrType::kStrings:
    case AttrType::kTensors: return !a.g && a.graphs.empty();
    default: return false;
  }
}

bool same_attribute(const Attribute& a, const Attribute& b) {
  if (a.name != b.name || a.kind() != b.kind()) return false;
  if (a.ref_attr_name.value != b.ref_attr_name.value) return false;
  if (a.ref_attr_name.written()) return true;  // same function attribute
  if (a.f.has_value() != b.f.has_value() || a.i != b.i || a.s != b.s) return false;
  if (a.f && std::memcmp(&*a.f, &*b.f, sizeof(float)) != 0) return false;  // bitwise: NaN, -0
  if (!same_floats(a.floats, b.floats) || a.ints != b.ints || a.strings != b.strings) return false;
  if (static_cast<bool>(a.t) != static_cast<bool>(b.t)) return false;
  if (a.t && !same_tensor(*a.t, *b.t)) return false;
  if (a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (!same_tensor(*a.tensors[i], *b.tensors[i])) return false;
  }
  return true;
}

size_t hash_attribute(const Attribute& a) {
  size_t h = mix(std::hash<std::string>{}(a.name), static_cast<size_t>(a.kind()));
  if (a.i) h = mix(h, std::hash<int64_t>{}(*a.i));
  if (a.s) h = mix(h, std::hash<std::string>{}(*a.s));
  for (int64_t v : a.ints) h = mix(h, std::hash<int64_t>{}(v));
  h = mix(h, a.floats.size() + a.strings.size());
  if (a.t) h = mix(h, static_cast<size_t>(a.t->dtype()) * 31 + a.t->dims.size());
  return h;
}

bool eligible(const Node* n) {
  const std::string& d = normalized_domain(n);
  if (!d.empty() && d != "ai.onnx.ml") return false;
  if (is_random(n->op_type) || training_dropout(n)) return false;
  // A node ORT refuses stays as it is (Dropout's is_test as a string would read as absent).
  if (pattern::mistyped_attribute(*n)) return false;
  for (const auto& a : n->attributes) {
    if (!comparable(a)) return false;
  }
  return true;
}

size_t hash_node(const Node* n) {
  size_t h =
      mix(std::hash<std::string>{}(n->op_type), std::hash<std::string>{}(normalized_domain(n)));
  for (const Value* v : n->inputs()) h = mix(h, std::hash<const void*>{}(v));
  h = mix(h, n->outputs().size());
  size_t attrs = 0;  // order-independent: attributes may come in any order
  for (const auto& a : n->attributes) attrs += hash_attribute(a);
  return mix(h, attrs);
}

bool same_node(const Node* a, const Node* b) {
  if (a->op_type != b->op_type || normalized_domain(a) != normalized_domain(b)) return false;
  if (a->overload.value != b->overload.value || a->inputs() != b->inputs()) return false;
  if (a->outputs().size() != b->outputs().size()) return false;
  for (size_t i = 0; i < a->outputs().size(); ++i) {
    // An output b has must exist on a too.
    if (b->outputs()[i] && !a->outputs()[i]) return false;
  }
  if (a->attributes.size() != b->attributes.size()) return false;
  for (const auto& x : a->attributes) {
    const Attribute* y = b->attribute(x.name);
    if (!y || !same_attribute(x, *y)) return false;
  }
  return true;
}

// A small constant's identity: dtype, dims and bytes.
struct ConstantKey {
  int32_t dtype;
  std::vector<int64_t> dims;
  std::string bytes;
  bool operator==(const ConstantKey& o) const {
    return dtype == o.dtype && dims == o.dims && bytes == o.bytes;
  }
};
struct ConstantKeyHash {
  size_t operator()(const ConstantKey& k) const {
    size_t h = mix(std::hash<std::string>{}(k.bytes), static_cast<size_t>(k.dtype));
    for (int64_t d : k.dims) h = mix(h, std::hash<int64_t>{}(d));
    return h;
  }
};

std::optional<ConstantKey> constant_key(const Tensor& t) {
  const int32_t dt = t.dtype();
  if (dt == kString || dt == kUndefined || dtype_bits(dt) == 0) return std::nullopt;
  if (t.nbytes() > kMaxConstantBytes || t.expected_bytes() > kMaxConstantBytes) {
    return std::nullopt;
  }
  try {
    ByteRef b = t.bytes();
    if (b.size != t.expected_bytes()) return std::nullopt;
    std::string bytes(reinterpret_cast<const char*>(b.data()), b.size);
    return ConstantKey{dt, t.dims, std::move(bytes)};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Moves the uses of `from` onto `to`. When `from` is a graph output that `to` cannot take the
// name of (both are graph outputs, say), only node uses move and `from` stays an output.
// Returns whether anything changed.
bool merge_value(Graph& g, Value* from, Value* to) {
  if (from == to) return false;
  if (can_replace(g, from, to)) {
    const bool changed = !from->uses().empty() || from->is_graph_output();
    replace_value(g, from, to);
    return changed;
  }
  std::vector<Use> uses = from->uses();
  for (const Use& u : uses) u.node->set_input(u.input_index, to);
  return !uses.empty();
}

bool unused(const Value* v) {
  return !v || (v->uses().empty() && !v->is_graph_output());
}

// Open addressing over a power-of-two table: no allocation per entry, which matters at 100k+
// nodes (node-based std containers spend most of the pass in malloc).
size_t table_size(size_t entries) {
  size_t n = 16;
  while (n < 2 * entries) n <<= 1;
  return n;
}

size_t pointer_hash(const void* p) {
  return static_cast<size_t>((reinterpret_cast<uintptr_t>(p) >> 4) * 0x9e3779b97f4a7c15ULL);
}

class NodeSet {
 public:
  explicit NodeSet(size_t entries) : slots_(table_size(entries), nullptr) {}
  void insert(const Node* n) {
    size_t i = pointer_hash(n) & (slots_.size() - 1);
    while (slots_[i] && slots_[i] != n) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = n;
  }
  bool contains(const Node* n) const {
    for (size_t i = pointer_hash(n) & (slots_.size() - 1); slots_[i];
         i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i] == n) return true;
    }
    return false;
  }

 private:
  std::vector<const Node*> slots_;
};

// The graph's nodes in a topological order: the list order when it is one (the usual case).
std::vector<Node*> topological_order(const Graph& g) {
  std::vector<Node*> order = g.nodes();
  NodeSet seen(order.size());
  bool sorted = true;
  for (Node* n : order) {
    for (const Value* v : n->inputs()) {
      if (v && v->producer() && v->producer()->graph() == &g && !seen.contains(v->producer())) {
        sorted = false;
      }
    }
    if (!sorted) break;
    seen.insert(n);
  }
  if (sorted) return order;
  // Kahn's algorithm over node inputs (subgraph nodes are never merged, so their outer
  // references do not matter here).
  std::unordered_map<const Node*, int> indegree;
  std::unordered_map<const Node*, std::vector<Node*>> users;
  for (Node* n : order) {
    int& deg = indegree[n];
    for (const Value* v : n->inputs()) {
      if (v && v->producer() && v->producer()->graph() == &g) {
        ++deg;
        users[v->producer()].push_back(n);
      }
    }
  }
  std::vector<Node*> out, ready;
  for (Node* n : order) {
    if (indegree[n] == 0) ready.push_back(n);
  }
  while (!ready.empty()) {
    Node* n = ready.back();
    ready.pop_back();
    out.push_back(n);
    for (Node* u : users[n]) {
      if (--indegree[u] == 0) ready.push_back(u);
    }
  }
  return out;  // nodes on a cycle (the reader refuses those) are left out
}

// Representatives by hash; equal hashes are told apart by same_node.
class NodeTable {
 public:
  explicit NodeTable(size_t entries) : slots_(table_size(entries), {0, nullptr}) {}
  // The representative equal to `n`, or null after making `n` one.
  Node* find_or_insert(Node* n) {
    const size_t h = hash_node(n);
    size_t i = h & (slots_.size() - 1);
    for (; slots_[i].second; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].first == h && same_node(slots_[i].second, n)) return slots_[i].second;
    }
    slots_[i] = {h, n};
    return nullptr;
  }

 private:
  std::vector<std::pair<size_t, Node*>> slots_;
};

struct Counts {
  int64_t nodes = 0, constants = 0, initializers = 0;
};

using ConstantTable = std::unordered_map<ConstantKey, Value*, ConstantKeyHash>;

// Initializers first: they are visible to every node, so they make the best representatives.
void merge_initializers(Graph& g, ConstantTable& constants, Counts& counts) {
  std::vector<Value*> initializers = g.initializer_order, merged;
  for (Value* v : initializers) {
    if (!fixed_initializer(v) || v->is_graph_input()) continue;  // keep the interface
    auto key = constant_key(*v->initializer());
    if (!key) continue;
    auto [it, inserted] = constants.emplace(std::move(*key), v);
    if (inserted) continue;
    bool changed = merge_value(g, v, it->second);
    if (unused(v)) {
      merged.push_back(v);
      changed = true;
    }
    counts.initializers += changed;
  }
  g.remove_initializers(merged);  // one sweep (one by one is quadratic)
}

bool is_plain_constant(const Node* n) {
  return n->op_type == "Constant" && normalized_domain(n).empty() && n->outputs().size() == 1 &&
         n->outputs()[0] && !cleanup::has_attr_refs(n);
}

// A Constant node merged into an equal constant seen before (big or string Constants are left
// alone).
void merge_constant(Graph& g, Node* n, ConstantTable& constants, Counts& counts) {
  Value* out = n->outputs()[0];
  auto t = constant_tensor(out);
  auto key = t ? constant_key(*t) : std::nullopt;
  if (!key) return;
  auto [it, inserted] = constants.emplace(std::move(*key), out);
  if (inserted) return;
  bool changed = merge_value(g, out, it->second);
  if (unused(out)) {
    g.remove_node(n);
    changed = true;
  }
  counts.constants += changed;
}

// A node merged into an equal one seen before (same op, attributes and inputs).
void merge_node(Graph& g, Node* n, NodeTable& table, Counts& counts) {
  if (n->outputs().empty() || !eligible(n)) return;
  Node* same = table.find_or_insert(n);
  if (!same) return;
  bool changed = false;
  bool dead = true;
  for (size_t i = 0; i < n->outputs().size(); ++i) {
    Value* o = n->outputs()[i];
    if (!o) continue;
    changed = merge_value(g, o, same->outputs()[i]) || changed;
    dead = dead && unused(o);
  }
  if (dead) g.remove_node(n);
  counts.nodes += changed || dead;
}

void cse_graph(Graph& g, Counts& counts) {
  ConstantTable constants;
  merge_initializers(g, constants, counts);
  std::vector<Node*> order = topological_order(g);
  NodeTable table(order.size());
  for (Node* n : order) {
    if (!n->alive()) continue;
    if (is_plain_constant(n)) {
      merge_constant(g, n, constants, counts);
    } else {
      merge_node(g, n, table, counts);
    }
  }
}

int64_t eliminate_common_subexpressions(Model& model, PassContext& ctx) {
  Counts counts;
  std::vector<Graph*> graphs;
  model.for_each_graph([&](Graph& g) { graphs.push_back(&g); });
  for (Graph* g : graphs) cse_graph(*g, counts);
  ctx.counters["merged_nodes"] += counts.nodes;
  ctx.counters["merged_constants"] += counts.constants;
  ctx.counters["merged_initializers"] += counts.initializers;
  return counts.nodes + counts.constants + counts.initializers;
}

const PassRegistrar kRegister{
    PassDecl(
        "eliminate_common_subexpressions",
        "merge nodes that compute the same thing from the same inputs, and equal small constants")
        .tags({"cleanup"})
        .run(eliminate_common_subexpressions)};

}  // namespace
}  // namespace fastopt::passes
