// Types, attributes, nodes and graphs (main graph, subgraphs, function bodies): names are
// resolved once a graph has defined them all, subgraphs after their enclosing graph.

#include <cstring>

#include "ir/error.h"
#include "proto/onnx_fields.h"
#include "proto/onnx_reader_impl.h"

namespace fastopt {

namespace {

bool same_type(const TypeInfo& a, const TypeInfo& b) {
  if (a.known != b.known) return false;
  if (!a.known) return true;
  return a.encoded.size == b.encoded.size &&
         std::memcmp(a.encoded.data(), b.encoded.data(), a.encoded.size) == 0;
}

}  // namespace

TypeInfo ModelReader::read_type(uint64_t b, uint64_t e, int depth) {
  TypeInfo ti;
  ti.known = true;
  ti.encoded = span(b, e);  // written back verbatim: all of it must parse
  schema::check_message(base, b, e, schema::Msg::kType, depth, "TypeProto");
  wire::Reader r(base, b, e, "TypeProto", depth);
  uint32_t f;
  wire::WireType t;
  while (r.next(&f, &t)) {
    if (f != field::type::kTensorType) {
      r.skip(t, f);
      continue;
    }
    ti.is_tensor = true;
    auto [tb, te] = sub(r, t, "tensor_type");
    wire::Reader tr(base, tb, te, "TypeProto.Tensor", depth + 1);
    while (tr.next(&f, &t)) {
      if (f == field::type::tensor::kElemType) {
        ti.elem_type = static_cast<int32_t>(int64(tr, t, "elem_type"));
      } else if (f == field::type::tensor::kShape) {
        ti.has_shape = true;
        auto [sb, se] = sub(tr, t, "shape");
        wire::Reader sr(base, sb, se, "TensorShapeProto", depth + 2);
        while (sr.next(&f, &t)) {
          if (f != field::type::shape::kDim) {
            sr.skip(t, f);
            continue;
          }
          auto [db, de] = sub(sr, t, "dim");
          wire::Reader dr(base, db, de, "TensorShapeProto.Dimension", depth + 3);
          Dim d;
          while (dr.next(&f, &t)) {
            if (f == field::type::dim::kValue) {
              d.value = int64(dr, t, "dim_value");
              if (*d.value < 0) dr.fail("negative dim_value " + std::to_string(*d.value));
            } else if (f == field::type::dim::kParam)
              d.param = str(dr, t, "dim_param");
            else
              dr.skip(t, f);
          }
          ti.dims.push_back(std::move(d));
        }
      } else {
        tr.skip(t, f);
      }
    }
  }
  return ti;
}

Attribute ModelReader::read_attribute(uint64_t b, uint64_t e,
                                      std::vector<PendingGraph>* pending_raw, int depth) {
  Attribute a;
  wire::Reader r(base, b, e, "AttributeProto", depth);
  uint32_t f;
  wire::WireType t;
  std::vector<std::pair<uint64_t, uint64_t>> graphs;
  std::pair<uint64_t, uint64_t> g{0, 0};
  bool has_g = false;
  while (r.next(&f, &t)) {
    switch (f) {
      case field::attr::kName: a.name = str(r, t, "name"); break;
      case field::attr::kType: a.type = static_cast<int32_t>(int64(r, t, "type")); break;
      case field::attr::kF: {
        r.expect(t, wire::kFixed32, "f");
        uint32_t bits = r.fixed32();
        float v;
        std::memcpy(&v, &bits, 4);
        a.f = v;
        break;
      }
      case field::attr::kI: a.i = int64(r, t, "i"); break;
      case field::attr::kS: a.s = bytes(r, t, "s"); break;
      case field::attr::kT: {
        auto [tb, te] = sub(r, t, "t");
        a.t = read_tensor(tb, te, depth + 1);
        break;
      }
      case field::attr::kG:
        g = sub(r, t, "g");
        has_g = true;
        break;
      case field::attr::kFloats:
        wire::read_repeated_fixed32(r, t, base, [&](uint32_t bits) {
          float v;
          std::memcpy(&v, &bits, 4);
          a.floats.push_back(v);
        });
        break;
      case field::attr::kInts:
        wire::read_repeated_varint(r, t, base,
                                   [&](uint64_t v) { a.ints.push_back(static_cast<int64_t>(v)); });
        break;
      case field::attr::kStrings: a.strings.push_back(bytes(r, t, "strings")); break;
      case field::attr::kTensors: {
        auto [tb, te] = sub(r, t, "tensors");
        a.tensors.push_back(read_tensor(tb, te, depth + 1));
        break;
      }
      case field::attr::kGraphs: graphs.push_back(sub(r, t, "graphs")); break;
      case field::attr::kRefAttrName: a.ref_attr_name.set(str(r, t, "ref_attr_name")); break;
      default: keep(a.extras, r, t, f, schema::Msg::kAttribute);
    }
  }
  if (a.name.empty()) r.fail("attribute has no name");
  if (a.type && (*a.type < 0 || *a.type > static_cast<int32_t>(AttrType::kTypeProtos))) {
    r.fail("attribute '" + a.name + "' has unknown type " + std::to_string(*a.type));
  }
  // Subgraphs are parsed after the enclosing graph has defined all its names.
  if (has_g) pending_raw->push_back({nullptr, -1, g.first, g.second, depth + 1});
  for (size_t i = 0; i < graphs.size(); ++i) {
    pending_raw->push_back(
        {nullptr, static_cast<int>(i), graphs[i].first, graphs[i].second, depth + 1});
  }
  a.graphs.resize(graphs.size());
  return a;
}

ModelReader::PendingNode ModelReader::read_node(Graph& g, uint64_t b, uint64_t e, int depth) {
  Node& n = *g.new_node();
  PendingNode pn{nullptr, {}, {}};
  std::vector<std::string> outputs;
  wire::Reader r(base, b, e, "NodeProto", depth);
  uint32_t f;
  wire::WireType t;
  while (r.next(&f, &t)) {
    switch (f) {
      case field::node::kInput: pn.inputs.push_back(str_view(r, t, "input")); break;
      case field::node::kOutput: outputs.push_back(str(r, t, "output")); break;
      case field::node::kName: n.name.set(str(r, t, "name")); break;
      case field::node::kOpType:
        n.op_type = str(r, t, "op_type");
        n.has_op_type = true;
        break;
      case field::node::kDomain: n.domain.set(str(r, t, "domain")); break;
      case field::node::kOverload: n.overload.set(str(r, t, "overload")); break;
      case field::node::kAttribute: {
        auto [ab, ae] = sub(r, t, "attribute");
        std::vector<PendingGraph> raw;
        n.attributes.push_back(read_attribute(ab, ae, &raw, depth + 1));
        for (auto& pg : raw) pn.graphs.emplace_back(n.attributes.size() - 1, pg);
        break;
      }
      default: keep(n.extras, r, t, f, schema::Msg::kNode);
    }
  }
  if (!n.has_op_type || n.op_type.empty()) r.fail("node '" + n.name.value + "' has no op_type");
  for (size_t i = 0; i < n.attributes.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (n.attributes[i].name == n.attributes[j].name) {
        r.fail("node '" + n.name.value + "' has attribute '" + n.attributes[i].name + "' twice");
      }
    }
  }
  Node* node = g.append_node(&n);
  pn.node = node;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].empty()) {
      node->outputs_.push_back(nullptr);
      continue;
    }
    Value* v = g.create_value(outputs[i]);
    v->producer_ = node;
    v->producer_output_ = static_cast<int>(i);
    node->outputs_.push_back(v);
  }
  return pn;
}

ValueInfoEntry ModelReader::read_value_info(uint64_t b, uint64_t e, std::string* name,
                                            TypeInfo* type, int depth) {
  ValueInfoEntry entry;
  wire::Reader r(base, b, e, "ValueInfoProto", depth);
  uint32_t f;
  wire::WireType t;
  while (r.next(&f, &t)) {
    if (f == field::value_info::kName) {
      *name = str(r, t, "name");
    } else if (f == field::value_info::kType) {
      auto [tb, te] = sub(r, t, "type");
      *type = read_type(tb, te, depth + 1);
    } else {
      keep(entry.extras, r, t, f, schema::Msg::kValueInfo);
    }
  }
  return entry;
}

void ModelReader::attach_type(ValueInfoEntry& entry, Value* v, TypeInfo type, bool first) {
  if (first) {
    v->type = std::move(type);
  } else if (!same_type(v->type, type)) {
    entry.own_type = std::move(type);
  }
}

void ModelReader::resolve_inputs(Graph& g, PendingNode& pn) {
  Node* node = pn.node;
  for (size_t i = 0; i < pn.inputs.size(); ++i) {
    std::string_view name = pn.inputs[i];
    if (name.empty()) {
      node->append_input(nullptr);
      continue;
    }
    Value* v = g.lookup(name);
    if (!v) {
      throw ModelError("node '" + node->name.value + "' (" + node->op_type + ") input '" +
                       std::string(name) + "' is not defined (dangling input) in graph '" +
                       g.name.value + "'");
    }
    node->append_input(v);
    for (Graph* s = &g; s && s != v->graph(); s = s->parent()) s->add_outer_reference(v);
  }
}

void ModelReader::read_subgraphs(Graph& g, std::vector<PendingNode>& pending) {
  for (auto& pn : pending) {
    for (auto& [attr_index, pg] : pn.graphs) {
      Attribute& a = pn.node->attributes[attr_index];
      auto sub = std::make_unique<Graph>(model, &g);
      sub->set_owner_node(pn.node);
      read_graph_body(*sub, {{pg.begin, pg.end}}, pg.depth);
      if (pg.index < 0)
        a.g = std::move(sub);
      else
        a.graphs[pg.index] = std::move(sub);
    }
  }
}

void ModelReader::read_graph_body(Graph& g, const std::vector<std::pair<uint64_t, uint64_t>>& spans,
                                  int depth) {
  if (depth > wire::kMaxNesting) wire::nesting_error();
  std::vector<std::pair<uint64_t, uint64_t>> nodes, inputs, outputs, inits, sparse, infos;
  for (auto [b, e] : spans) {
    wire::Reader r(base, b, e, "GraphProto", depth);
    uint32_t f;
    wire::WireType t;
    while (r.next(&f, &t)) {
      switch (f) {
        case field::graph::kNode: nodes.push_back(sub(r, t, "node")); break;
        case field::graph::kName: g.name.set(str(r, t, "name")); break;
        case field::graph::kInitializer: inits.push_back(sub(r, t, "initializer")); break;
        case field::graph::kSparseInitializer:
          sparse.push_back(sub(r, t, "sparse_initializer"));
          break;
        case field::graph::kInput: inputs.push_back(sub(r, t, "input")); break;
        case field::graph::kOutput: outputs.push_back(sub(r, t, "output")); break;
        case field::graph::kValueInfo: infos.push_back(sub(r, t, "value_info")); break;
        default: keep(g.extras, r, t, f, schema::Msg::kGraph);
      }
    }
  }
  const std::string gname = "graph '" + g.name.value + "'";
  g.reserve_scope(inputs.size() + inits.size() + sparse.size() + 2 * nodes.size());
  for (auto [ib, ie] : inputs) {
    std::string name;
    TypeInfo type;
    ValueInfoEntry entry = read_value_info(ib, ie, &name, &type, depth + 1);
    if (name.empty()) throw ModelError(gname + " has an input with an empty name");
    Value* v = g.create_value(name);
    v->is_graph_input_ = true;
    entry.value = v;
    attach_type(entry, v, std::move(type), true);
    g.input_entries.push_back(std::move(entry));
  }
  // The value an initializer defines: a graph input of that name, or a new value.
  auto initializer_value = [&](const std::string& name) {
    if (name.empty()) throw ModelError(gname + " has an initializer with an empty name");
    auto it = g.scope().find(name);
    Value* v = it != g.scope().end() ? it->second : g.create_value(name);
    if (v->initializer_ || v->sparse_) {
      throw ModelError(gname + " has two initializers named '" + name + "'");
    }
    return v;
  };
  for (auto [tb, te] : inits) {
    auto tensor = read_tensor(tb, te, depth + 1);
    Value* v = initializer_value(tensor->name.value);
    v->initializer_ = std::move(tensor);
    g.initializer_order.push_back(v);
  }
  for (auto [sb, se] : sparse) {
    auto sp = read_sparse(sb, se, depth + 1);
    Value* v = initializer_value(sp->values->name.value);
    v->sparse_ = std::move(sp);
    g.sparse_initializer_order.push_back(v);
  }
  std::vector<PendingNode> pending;
  pending.reserve(nodes.size());
  for (auto [nb, ne] : nodes) pending.push_back(read_node(g, nb, ne, depth + 1));
  for (auto& pn : pending) resolve_inputs(g, pn);
  for (auto [ib, ie] : infos) {
    std::string name;
    TypeInfo type;
    ValueInfoEntry entry = read_value_info(ib, ie, &name, &type, depth + 1);
    auto it = g.scope().find(name);
    if (it == g.scope().end()) {
      entry.orphan_name = name;  // describes nothing in this graph; kept as written
      entry.own_type = std::move(type);
    } else {
      Value* v = it->second;
      entry.value = v;
      attach_type(entry, v, std::move(type), !v->type.known);
    }
    g.value_info_entries.push_back(std::move(entry));
  }
  for (auto [ob, oe] : outputs) {
    std::string name;
    TypeInfo type;
    ValueInfoEntry entry = read_value_info(ob, oe, &name, &type, depth + 1);
    Value* v = g.lookup(name);
    if (!v) {
      throw ModelError(gname + " output '" + name + "' is not defined (dangling output)");
    }
    if (v->graph() != &g) {
      for (Graph* s = &g; s && s != v->graph(); s = s->parent()) s->add_outer_reference(v);
    }
    entry.value = v;
    attach_type(entry, v, std::move(type), !v->type.known);
    ++v->graph_output_count_;
    g.output_entries.push_back(std::move(entry));
  }
  read_subgraphs(g, pending);
  if (Node* bad = g.find_cycle()) {
    throw ModelError(gname + " has a cycle through node '" + bad->name.value + "' (" +
                     bad->op_type + ")");
  }
}

std::unique_ptr<Function> ModelReader::read_function(uint64_t b, uint64_t e) {
  const int depth = 1;  // FunctionProto is a field of ModelProto
  auto fn = std::make_unique<Function>();
  fn->body = std::make_unique<Graph>(model, nullptr);
  Graph& g = *fn->body;
  wire::Reader r(base, b, e, "FunctionProto", depth);
  uint32_t f;
  wire::WireType t;
  std::vector<std::string> inputs, outputs;
  std::vector<std::pair<uint64_t, uint64_t>> nodes, infos;
  while (r.next(&f, &t)) {
    switch (f) {
      case field::function::kName: fn->name.set(str(r, t, "name")); break;
      case field::function::kDomain: fn->domain.set(str(r, t, "domain")); break;
      case field::function::kOverload: fn->overload.set(str(r, t, "overload")); break;
      case field::function::kInput: inputs.push_back(str(r, t, "input")); break;
      case field::function::kOutput: outputs.push_back(str(r, t, "output")); break;
      case field::function::kAttribute:
        fn->attribute_names.push_back(str(r, t, "attribute"));
        break;
      case field::function::kAttributeProto: {
        auto [ab, ae] = sub(r, t, "attribute_proto");
        std::vector<PendingGraph> raw;
        fn->attribute_defaults.push_back(read_attribute(ab, ae, &raw, depth + 1));
        if (!raw.empty()) {
          throw ModelError("function '" + fn->name.value +
                           "' has a graph-valued attribute default (unsupported)");
        }
        break;
      }
      case field::function::kNode: nodes.push_back(sub(r, t, "node")); break;
      case field::function::kOpsetImport: {
        auto [ob, oe] = sub(r, t, "opset_import");
        fn->opset_import.push_back(read_opset(ob, oe, depth + 1));
        break;
      }
      case field::function::kValueInfo: infos.push_back(sub(r, t, "value_info")); break;
      default: keep(fn->extras, r, t, f, schema::Msg::kFunction);
    }
  }
  g.name.value = fn->name.value;  // for error messages only; not written
  for (const auto& name : inputs) {
    Value* v = g.create_value(name);
    v->is_graph_input_ = true;
    ValueInfoEntry entry;
    entry.value = v;
    g.input_entries.push_back(std::move(entry));
  }
  std::vector<PendingNode> pending;
  for (auto [nb, ne] : nodes) pending.push_back(read_node(g, nb, ne, depth + 1));
  for (auto& pn : pending) resolve_inputs(g, pn);
  for (const auto& name : outputs) {
    Value* v = g.lookup(name);
    if (!v) {
      throw ModelError("function '" + fn->name.value + "' output '" + name + "' is not defined");
    }
    ValueInfoEntry entry;
    entry.value = v;
    ++v->graph_output_count_;
    g.output_entries.push_back(std::move(entry));
  }
  for (auto [ib, ie] : infos) {
    std::string name;
    TypeInfo type;
    ValueInfoEntry entry = read_value_info(ib, ie, &name, &type, depth + 1);
    auto it = g.scope().find(name);
    if (it == g.scope().end()) {
      entry.orphan_name = name;
      entry.own_type = std::move(type);
    } else {
      entry.value = it->second;
      attach_type(entry, it->second, std::move(type), !it->second->type.known);
    }
    g.value_info_entries.push_back(std::move(entry));
  }
  read_subgraphs(g, pending);
  if (Node* bad = g.find_cycle()) {
    throw ModelError("function '" + fn->name.value + "' has a cycle through node '" +
                     bad->name.value + "' (" + bad->op_type + ")");
  }
  return fn;
}

}  // namespace fastopt
