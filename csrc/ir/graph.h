// The graph IR: values with producer and use lists, nodes in an erase-safe intrusive list,
// graphs with subgraphs that reference outer-scope values directly, functions, the model.
//
// Storage: a Graph owns its nodes and values for its whole life. Removing a node unlinks it and
// marks it dead instead of freeing it, so handles held by Python never dangle.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ir/buffer.h"
#include "ir/tensor.h"

namespace fastopt {

namespace analysis {
class ShapeFacts;
}
class Graph;
class Node;
struct Model;

// A dimension of a tensor shape: a number, a symbolic name, or unknown.
struct Dim {
  std::optional<int64_t> value;
  std::optional<std::string> param;
};

// TypeProto. Tensor types are decoded; every type keeps its original encoding, which the writer
// uses as long as the type has not been replaced.
struct TypeInfo {
  bool known = false;      // a TypeProto was present
  bool is_tensor = false;  // tensor_type (dense)
  int32_t elem_type = 0;
  bool has_shape = false;
  std::vector<Dim> dims;
  ByteRef encoded;  // original TypeProto bytes (payload, no tag); empty when built in memory
};

enum class AttrType : int32_t {
  kUndefined = 0,
  kFloat = 1,
  kInt = 2,
  kString = 3,
  kTensor = 4,
  kGraph = 5,
  kFloats = 6,
  kInts = 7,
  kStrings = 8,
  kTensors = 9,
  kGraphs = 10,
  kSparseTensor = 11,
  kSparseTensors = 12,
  kTypeProto = 13,
  kTypeProtos = 14,
};

struct Attribute {
  std::string name;
  std::optional<int32_t> type;  // AttributeProto.type as read (old models may omit it)
  std::optional<float> f;
  std::optional<int64_t> i;
  std::optional<std::string> s;
  std::shared_ptr<Tensor> t;
  std::unique_ptr<Graph> g;
  std::vector<float> floats;
  std::vector<int64_t> ints;
  std::vector<std::string> strings;
  std::vector<std::shared_ptr<Tensor>> tensors;
  std::vector<std::unique_ptr<Graph>> graphs;
  OptString ref_attr_name;
  RawFields extras;  // doc_string, sparse tensors, type protos, unknown fields

  AttrType kind() const;  // from `type`, or inferred from the field that is set
};

struct Use {
  Node* node;
  int input_index;
  bool operator==(const Use& o) const { return node == o.node && input_index == o.input_index; }
};

class Value {
 public:
  const std::string& name() const { return name_; }
  Graph* graph() const { return graph_; }
  Node* producer() const { return producer_; }
  int producer_output() const { return producer_output_; }
  const std::vector<Use>& uses() const { return uses_; }
  bool is_graph_input() const { return is_graph_input_; }
  bool is_graph_output() const { return graph_output_count_ > 0; }
  const std::shared_ptr<Tensor>& initializer() const { return initializer_; }
  const std::shared_ptr<SparseTensor>& sparse_initializer() const { return sparse_; }
  // Something still gives this value its contents. The outputs of a removed node are not
  // defined: they stay in their graph's name table as tombstones, which lookups skip (removing
  // a node then costs no hash-table erase).
  bool defined() const { return producer_ || is_graph_input_ || initializer_ || sparse_; }
  TypeInfo type;

 private:
  friend class Graph;
  friend class Node;
  friend struct ModelReader;
  std::string name_;
  Graph* graph_ = nullptr;
  Node* producer_ = nullptr;
  int producer_output_ = -1;
  std::vector<Use> uses_;
  bool is_graph_input_ = false;
  int graph_output_count_ = 0;
  std::shared_ptr<Tensor> initializer_;
  std::shared_ptr<SparseTensor> sparse_;
};

class Node {
 public:
  OptString name;
  std::string op_type;
  bool has_op_type = false;
  OptString domain;
  OptString overload;
  std::vector<Attribute> attributes;
  RawFields extras;  // doc_string, metadata_props, device configurations, unknown fields

  Graph* graph() const { return graph_; }
  bool alive() const { return alive_; }
  const std::vector<Value*>& inputs() const { return inputs_; }
  const std::vector<Value*>& outputs() const { return outputs_; }
  Node* next() const { return next_; }
  Node* prev() const { return prev_; }
  const Attribute* attribute(const std::string& n) const;
  // Subgraphs held by GRAPH and GRAPHS attributes.
  std::vector<Graph*> subgraphs() const;

  void set_input(int index, Value* v);  // keeps use lists right; nullptr = omitted input
  // Appends an input (reader and IR use).
  void append_input(Value* v);
  // Removes input `index`; later inputs move down one position.
  void remove_input(int index);

 private:
  friend class Graph;
  friend struct ModelReader;
  Graph* graph_ = nullptr;
  std::vector<Value*> inputs_;
  // Position of each input's Use in that value's use list: removing a use is O(1) even for a
  // constant read by 100k nodes.
  std::vector<uint32_t> use_slots_;
  std::vector<Value*> outputs_;
  void add_use(int index);
  void drop_use(int index);
  Node* prev_ = nullptr;
  Node* next_ = nullptr;
  bool alive_ = true;

 public:
  // Scratch space for graph algorithms (topological order, cycle search); no meaning between
  // calls.
  mutable int64_t scratch = 0;
  // Marks a node as queued in the rewrite driver's current round (a round number).
  mutable uint32_t queued_round = 0;
  bool has_subgraphs() const;
  // Where input `index`'s use sits in that value's use list.
  uint32_t use_slot(int index) const { return use_slots_[index]; }
};

// A ValueInfoProto entry of graph.input/output/value_info: the value plus the bytes of the fields
// fastopt does not model. `value` may be null for value_info naming nothing in the graph.
struct ValueInfoEntry {
  Value* value = nullptr;
  std::string orphan_name;           // name when value is null
  std::optional<TypeInfo> own_type;  // set when this entry's type differs from value->type
  RawFields extras;
};

class Graph {
 public:
  // Registers itself with `model` (see Model::graphs).
  explicit Graph(Model* model, Graph* parent = nullptr);
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  OptString name;
  RawFields extras;  // doc_string, quantization_annotation, metadata_props, unknown fields
  std::vector<ValueInfoEntry> input_entries, output_entries, value_info_entries;
  std::vector<Value*> initializer_order;  // initializers in file order
  std::vector<Value*> sparse_initializer_order;

  Model* model() const { return model_; }
  Graph* parent() const { return parent_; }
  Node* owner_node() const { return owner_node_; }
  Node* first() const { return head_; }
  Node* last() const { return tail_; }
  size_t node_count() const { return node_count_; }
  std::vector<Node*> nodes() const;
  std::vector<Value*> inputs() const;
  std::vector<Value*> outputs() const;
  // Values used by this graph (or its subgraphs) but defined in an enclosing graph.
  const std::vector<Value*>& outer_references() const { return outer_refs_; }
  // Looks a name up in this graph, then in enclosing graphs.
  Value* lookup(std::string_view name) const;

  // --- edits ---
  Value* create_value(const std::string& name);  // name must be unique; ModelError otherwise
  std::string unique_name(const std::string& base) const;
  Node* create_node(const std::string& op_type, const std::string& domain,
                    const std::vector<Value*>& inputs, const std::vector<std::string>& output_names,
                    Node* insert_before = nullptr);
  // Unlinks `node`; its outputs must have no uses and not be graph outputs.
  void remove_node(Node* node);
  void replace_all_uses(Value* from, Value* to);  // including graph outputs and subgraph uses
  void rename(Value* v, const std::string& new_name);
  Value* add_initializer(const std::string& name, std::shared_ptr<Tensor> t);
  void set_initializer(Value* v, std::shared_ptr<Tensor> t);
  void remove_initializer(Value* v);
  // Removes many at once in one sweep of the lists (remove_initializer one by one is linear in
  // the initializer count each time: quadratic over a model's worth).
  void remove_initializers(const std::vector<Value*>& values);
  void add_output(Value* v);
  // Removes graph output `index` (its value stays, with its producer and uses).
  void remove_output(size_t index);
  void add_input(Value* v);
  // Removes graph input `index` (its value must be unused and not an initializer).
  void remove_input(size_t index);
  // Reorders nodes so producers come first; ModelError naming a node on a cycle if there is one.
  void topological_sort();
  // Finds a cycle or returns nullptr. Considers subgraph outer references as dependencies.
  Node* find_cycle() const;

  // For the reader and the IR's own use.
  Node* new_node();               // allocated in this graph's storage, not yet linked
  Node* append_node(Node* node);  // links a node made by new_node() at the end
  void set_owner_node(Node* n) { owner_node_ = n; }
  void define(Value* v);
  void add_outer_reference(Value* v);
  // Names defined in this graph; keys view the values' own names.
  const std::unordered_map<std::string_view, Value*>& scope() const { return scope_; }
  void reserve_scope(size_t n) { scope_.reserve(n); }

 private:
  void link_before(Node* node, Node* before);
  void unlink(Node* node);
  Model* model_;
  Graph* parent_;
  Node* owner_node_ = nullptr;
  Node* head_ = nullptr;
  Node* tail_ = nullptr;
  size_t node_count_ = 0;
  // Chunked storage: stable addresses, few allocations, and nodes made together (a whole
  // graph at load) sit together in memory, which the matcher's walks feel.
  std::deque<Node> node_storage_;
  std::deque<Value> value_storage_;
  std::unordered_map<std::string_view, Value*> scope_;
  std::vector<Value*> outer_refs_;
  std::unordered_set<Value*> outer_ref_set_;
};

struct OpsetId {
  OptString domain;
  std::optional<int64_t> version;
  RawFields extras;
};

struct Function {
  OptString name, domain, overload;
  std::vector<std::string> attribute_names;   // FunctionProto.attribute
  std::vector<Attribute> attribute_defaults;  // FunctionProto.attribute_proto
  std::vector<OpsetId> opset_import;
  std::unique_ptr<Graph> body;  // inputs/outputs/value_info/nodes of the function
  RawFields extras;             // doc_string, metadata_props, unknown fields
};

struct Model {
  std::optional<int64_t> ir_version;
  std::vector<OpsetId> opset_import;
  OptString producer_name, producer_version, domain, doc_string;
  std::optional<int64_t> model_version;
  std::unique_ptr<Graph> graph;
  std::vector<std::pair<std::string, std::string>> metadata_props;
  RawFields metadata_extras;  // metadata entries that carry unknown fields (kept verbatim)
  std::vector<std::unique_ptr<Function>> functions;
  RawFields extras;      // training_info, configuration, unknown fields (kept verbatim)
  std::string path;      // file it was loaded from ("" when from memory)
  std::string base_dir;  // folder external data is resolved against
  std::shared_ptr<const Buffer> source;  // the serialized model
  // External data files opened by the reader, by resolved path.
  std::map<std::string, std::shared_ptr<const FileBuffer>> external_files;

  // Every Graph ever made for this model, parents before their subgraphs. Graphs are never
  // freed before the model; one whose owner node was removed is skipped by for_each_graph.
  std::vector<Graph*> graphs;
  // Suffix counters for unique_name, so a name taken many times is not probed from _1 again.
  std::unordered_map<std::string, uint64_t> next_suffix;
  uint64_t next_node_id = 0;   // numbers the names of nodes made by rewrites
  uint32_t rewrite_round = 0;  // numbers the rounds of every apply_rules call (Node::queued_round)
  // Bumped by every structural edit (nodes, inputs, initializers, graph inputs/outputs) of any
  // graph: analyses memoized on the model (analysis::ShapeFacts) recompute when it moved.
  // Editing attributes in place does not bump it; such a pass calls note_edit().
  uint64_t edit_generation = 0;
  void note_edit() { ++edit_generation; }
  // The shape analysis shared by the passes of a run (analysis::facts_of); it recomputes itself
  // when edit_generation moved.
  std::shared_ptr<analysis::ShapeFacts> shape_facts;

  // Tensors that skeletons (serialize_skeleton) stand in for with placeholders, by placeholder
  // index. Append-only, so every skeleton made from this model stays valid while it lives.
  std::vector<std::shared_ptr<const Tensor>> skeleton_tensors;
  std::unordered_map<const Tensor*, uint64_t> skeleton_index;

  // Visits every live graph: the main graph, functions, nested subgraphs (parents first).
  void for_each_graph(const std::function<void(Graph&)>& fn) const;
  std::map<std::string, int64_t> op_counts() const;
  // Throws ModelError describing the first broken invariant.
  void verify() const;
};

void for_each_subgraph(const Graph& g, const std::function<void(Graph&)>& fn);

}  // namespace fastopt
