#include "ir/types.h"

#include <unordered_set>

namespace fastopt {

namespace {

// A type that owns its encoding (or re-encodes from the decoded fields), so that it does not
// keep the buffer it was read from alive.
TypeInfo detached(const TypeInfo& t) {
  TypeInfo out = t;
  if (t.is_tensor)
    out.encoded = ByteRef{};  // the writer encodes elem_type and dims
  else if (!t.encoded.empty())
    out.encoded = ByteRef::owned(
        std::string(reinterpret_cast<const char*>(t.encoded.data()), t.encoded.size));
  return out;
}

// onnx shape inference names the dims it cannot tell "unk__<n>", unique within one run only:
// kept, they would claim that dims of unrelated values, typed by different runs, are equal.
TypeInfo without_generated_dims(const TypeInfo& t) {
  if (!t.is_tensor) return t;
  TypeInfo out = t;
  for (Dim& d : out.dims) {
    if (d.param && d.param->rfind("unk__", 0) == 0) {
      d.param.reset();
      out.encoded = ByteRef{};
    }
  }
  return out;
}

int64_t merge_graph(Graph& dst, const Graph& src);

void merge_values(Graph& dst, const Graph& src, const std::vector<Value*>& values,
                  std::unordered_set<const Value*>& described, int64_t& changed) {
  for (Value* v : values) {
    if (!v || v->is_graph_input()) continue;
    auto it = src.scope().find(v->name());
    if (it == src.scope().end()) continue;
    if (!refine_type(v->type, without_generated_dims(it->second->type))) continue;
    ++changed;
    if (described.insert(v).second) {
      ValueInfoEntry e;
      e.value = v;
      dst.value_info_entries.push_back(std::move(e));
    }
  }
}

int64_t merge_graph(Graph& dst, const Graph& src) {
  int64_t changed = 0;
  std::unordered_set<const Value*> described;
  for (const auto* entries : {&dst.input_entries, &dst.output_entries, &dst.value_info_entries}) {
    for (const auto& e : *entries) described.insert(e.value);
  }
  // Node outputs in node order (deterministic value_info order), then graph outputs that are
  // not node outputs of this graph (outer values, initializers) are left alone.
  std::vector<Value*> values;
  for (Node* n = dst.first(); n; n = n->next()) {
    for (Value* v : n->outputs()) values.push_back(v);
  }
  merge_values(dst, src, values, described, changed);
  // Subgraphs: paired through their nodes when both graphs have the same nodes.
  if (dst.node_count() == src.node_count()) {
    for (Node *a = dst.first(), *b = src.first(); a && b; a = a->next(), b = b->next()) {
      if (a->op_type != b->op_type) break;
      std::vector<Graph*> sa = a->subgraphs(), sb = b->subgraphs();
      if (sa.size() != sb.size()) continue;
      for (size_t i = 0; i < sa.size(); ++i) changed += merge_graph(*sa[i], *sb[i]);
    }
  }
  return changed;
}

}  // namespace

bool refine_type(TypeInfo& type, const TypeInfo& inferred) {
  if (!inferred.known) return false;
  if (!type.known) {
    type = detached(inferred);
    return true;
  }
  if (!type.is_tensor || !inferred.is_tensor) return false;
  if (type.elem_type && inferred.elem_type && type.elem_type != inferred.elem_type) return false;
  if (type.has_shape && inferred.has_shape && type.dims.size() != inferred.dims.size()) {
    return false;
  }
  TypeInfo out = type;
  bool changed = false;
  if (!out.elem_type && inferred.elem_type) {
    out.elem_type = inferred.elem_type;
    changed = true;
  }
  if (!out.has_shape && inferred.has_shape) {
    out.has_shape = true;
    out.dims = inferred.dims;
    changed = true;
  } else if (out.has_shape && inferred.has_shape) {
    for (size_t i = 0; i < out.dims.size(); ++i) {
      Dim& d = out.dims[i];
      const Dim& n = inferred.dims[i];
      if (d.value) continue;
      if (n.value || (!d.param && n.param)) {
        d = n;
        changed = true;
      }
    }
  }
  if (!changed) return false;
  out.encoded = ByteRef{};
  type = std::move(out);
  return true;
}

int64_t apply_types(Model& model, const Model& inferred) {
  int64_t changed = 0;
  if (model.graph && inferred.graph) changed += merge_graph(*model.graph, *inferred.graph);
  for (const auto& f : model.functions) {
    for (const auto& g : inferred.functions) {
      if (f->name.value == g->name.value && f->domain.value == g->domain.value &&
          f->overload.value == g->overload.value) {
        changed += merge_graph(*f->body, *g->body);
        break;
      }
    }
  }
  return changed;
}

}  // namespace fastopt
