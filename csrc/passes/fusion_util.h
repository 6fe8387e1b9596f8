// Helpers shared by the fusion passes: opset imports for the ops they emit, and small checks on
// the constants that decomposed patterns carry (epsilons, scales).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/graph.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {

inline constexpr const char* kMsDomain = "com.microsoft";
// Internal ops that exist only between two stages of one pass run (never written to a file).
inline constexpr const char* kInternalDomain = "ai.fastopt.internal";
// The opset of the standard fused ops target "onnx" emits (RMSNormalization, RotaryEmbedding,
// Attention).
inline constexpr int64_t kFusedOpsOpset = 23;

// Makes sure `domain` is imported (at least `version`) by the model and by the function whose
// body holds `g`, so that nodes of that domain created in `g` are valid.
inline void import_domain(Graph& g, const std::string& domain, int64_t version = 1) {
  auto add = [&](std::vector<OpsetId>& imports) {
    for (OpsetId& o : imports) {
      if (o.domain.value == domain) {
        if (o.version.value_or(0) < version) o.version = version;
        return;
      }
    }
    OpsetId id;
    if (!domain.empty()) id.domain.set(domain);
    id.version = version;
    imports.push_back(std::move(id));
  };
  Model* model = g.model();
  add(model->opset_import);
  const Graph* top = &g;
  while (top->parent()) top = top->parent();
  for (auto& f : model->functions) {
    if (f->body.get() == top) add(f->opset_import);
  }
}

// Removes the model's (and functions') import of `domain` when no node uses it any more.
inline void drop_unused_domain(Model& m, const std::string& domain) {
  bool used = false;
  m.for_each_graph([&](Graph& g) {
    for (Node* n = g.first(); n && !used; n = n->next()) used = n->domain.value == domain;
  });
  if (used) return;
  auto drop = [&](std::vector<OpsetId>& imports) {
    imports.erase(std::remove_if(imports.begin(), imports.end(),
                                 [&](const OpsetId& o) { return o.domain.value == domain; }),
                  imports.end());
  };
  drop(m.opset_import);
  for (auto& f : m.functions) drop(f->opset_import);
}

// Opset of `domain` imported by the model, or 0.
inline int64_t imported_opset(const Model& m, const std::string& domain) {
  for (const OpsetId& o : m.opset_import) {
    if (o.domain.value == domain) return o.version.value_or(1);
  }
  return 0;
}

// Dims of `v` from its type or its constant tensor; nullopt when the shape is unknown.
inline std::optional<std::vector<Dim>> dims_of(const Value* v) {
  if (v->type.is_tensor && v->type.has_shape) return v->type.dims;
  if (auto t = constant_tensor(v)) {
    std::vector<Dim> out;
    for (int64_t d : t->dims) out.push_back(Dim{d, std::nullopt});
    return out;
  }
  return std::nullopt;
}

inline bool is_one(const Dim& d) {
  return d.value && *d.value == 1;
}

// The same size for sure: equal numbers, or the same symbolic name.
inline bool same_dim(const Dim& a, const Dim& b) {
  if (a.value && b.value) return *a.value == *b.value;
  return a.param && b.param && !a.param->empty() && *a.param == *b.param;
}

// One attribute as the list Rewriter::op takes (Attribute is move-only).
inline std::vector<Attribute> one_attr(Attribute a) {
  std::vector<Attribute> v;
  v.push_back(std::move(a));
  return v;
}

inline int64_t int_attr_or(const Node* n, const std::string& name, int64_t fallback) {
  const Attribute* a = n->attribute(name);
  return a && a->i ? *a->i : fallback;
}

inline float float_attr(const Node* n, const std::string& name, float fallback) {
  const Attribute* a = n->attribute(name);
  return a && a->f ? *a->f : fallback;
}

// Why a plain walk must leave `n` alone: an attribute of the wrong type (ORT refuses the node,
// and the accessors above would read the default), or "" when `n` is well typed.
inline std::string mistyped_reason(const Node* n) {
  const Attribute* bad = n ? pattern::mistyped_attribute(*n) : nullptr;
  return bad ? pattern::describe_mistyped(*n, *bad) : std::string();
}

}  // namespace fastopt::passes
