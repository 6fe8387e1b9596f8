// Small helpers shared by the cleanup passes: int lists that moved from attributes to inputs
// across opsets (axes, perm, pads, shape), what is known about a value's shape, and the
// "forward the input" rewrite of a node that turned out to be a no-op.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir/constant.h"
#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes::cleanup {

// True when an attribute of `n` refers to an attribute of the enclosing function: its value is
// not known here, so nothing may be concluded from it.
inline bool has_attr_refs(const Node* n) {
  for (const auto& a : n->attributes) {
    if (a.ref_attr_name.written()) return true;
  }
  return false;
}

// An int list given as attribute `name` (older opsets) or as input `index` (newer ones).
struct IntList {
  bool present = false;  // given at all
  bool known = false;    // given, and its value is a constant
  std::vector<int64_t> values;
};

inline IntList int_list(const Node* n, const std::string& name, size_t index) {
  IntList out;
  if (const Attribute* a = n->attribute(name)) {
    out.present = out.known = true;
    out.values = a->ints;
    return out;
  }
  if (index > 0 && index < n->inputs().size() && n->inputs()[index]) {
    out.present = true;
    if (auto v = constant_ints(n->inputs()[index], 4096)) {
      out.known = true;
      out.values = std::move(*v);
    }
  }
  return out;
}

inline std::optional<int64_t> int_attr(const Node* n, const std::string& name) {
  const Attribute* a = n->attribute(name);
  if (!a || !a->i) return std::nullopt;
  return *a->i;
}

// A value's dims: nullopt when the rank is unknown; an entry is nullopt when that dim is
// symbolic or unknown. From the value's type (value_info), or a constant's tensor.
using Dims = std::vector<std::optional<int64_t>>;

inline std::optional<Dims> value_dims(const Value* v) {
  if (!v) return std::nullopt;
  if (v->type.known && v->type.is_tensor && v->type.has_shape) {
    Dims d;
    for (const Dim& dim : v->type.dims) {
      if (dim.value && *dim.value >= 0) {
        d.push_back(*dim.value);
      } else {
        d.push_back(std::nullopt);
      }
    }
    return d;
  }
  if (auto t = constant_tensor(v)) return Dims(t->dims.begin(), t->dims.end());
  return std::nullopt;
}

// Axes made non-negative against `rank` (-1: unknown, then negative axes fail); nullopt when
// an axis is out of range or repeated.
inline std::optional<std::vector<int64_t>> normalize_axes(std::vector<int64_t> axes, int64_t rank) {
  for (int64_t& a : axes) {
    if (a < 0) {
      if (rank < 0) return std::nullopt;
      a += rank;
    }
    if (a < 0 || (rank >= 0 && a >= rank)) return std::nullopt;
  }
  std::vector<int64_t> sorted = axes;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return std::nullopt;
  return axes;
}

// A small int64 constant for a rewrite: an initializer, or a Constant node inside a function
// body (FunctionProto has no initializers).
inline Value* int64_constant(pattern::Rewriter& rw, const std::string& base,
                             const std::vector<int64_t>& values) {
  auto t = make_int64_tensor(values, {static_cast<int64_t>(values.size())});
  const Graph* top = &rw.graph();
  while (top->parent()) top = top->parent();
  if (top == top->model()->graph.get()) return rw.initializer(base, std::move(t));
  std::vector<Attribute> attrs;  // Attribute is move-only: no initializer list
  attrs.push_back(pattern::attr_tensor("value", std::move(t)));
  return rw.op1("Constant", {}, std::move(attrs));
}

// The root's first output becomes `x`; declines when the output is a graph output that `x`
// cannot take the name of (a graph input, say).
inline pattern::Replacement forward(Value* x, const pattern::Match& m, pattern::Rewriter& rw) {
  Value* y = m.root()->outputs()[0];
  if (!pattern::can_replace(rw.graph(), y, x)) {
    return rw.fail("the output is a graph output that the input cannot take the name of");
  }
  return std::vector<Value*>{x};
}

}  // namespace fastopt::passes::cleanup
