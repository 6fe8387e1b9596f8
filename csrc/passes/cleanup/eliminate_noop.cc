// Shape ops that provably leave their input unchanged are replaced by the input.
//
//   x:[B,S,4] ── Reshape([0,0,4]) ── y        =>  x      (also Expand([1,4]), Transpose([0,1,2]),
//   x ── Slice(0, INT64_MAX, step 1) ── y     =>  x       Pad(0...), Unsqueeze([]), Concat(x),
//   x:[2,3] ── Squeeze() ── y                 =>  x       Split(x) with one output)
//
// Exporters emit these when shapes are generic in the source (x.reshape(b, s, -1),
// x[:, :], torch.cat([x])) but static or unchanged in the export. Shapes come from value types
// (the exporter's or shape inference's value_info) and constants: when a dim that matters is
// unknown, the node stays. Squeeze without axes squeezes every 1-dim, so it is only a no-op when
// no dim can be 1.
#include <climits>

#include "ir/constant.h"
#include "passes/cleanup/cleanup_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;
using cleanup::Dims;
using cleanup::forward;
using cleanup::has_attr_refs;
using cleanup::int_attr;
using cleanup::int_list;
using cleanup::IntList;
using cleanup::normalize_axes;
using cleanup::value_dims;

using Check = const char* (*)(const Node*);  // null when a no-op, else why not

const char* reshape_noop(const Node* n) {
  auto dims = value_dims(n->inputs()[0]);
  if (!dims) return "the input's rank is unknown";
  auto shape = int_list(n, "shape", 1);
  if (!shape.known) return "the target shape is not a constant";
  const auto& s = shape.values;
  if (s.size() != dims->size()) return "the rank changes";
  const bool allowzero = int_attr(n, "allowzero").value_or(0) != 0;
  int inferred = -1;  // position of a -1
  for (size_t i = 0; i < s.size(); ++i) {
    const auto& d = (*dims)[i];
    if (s[i] == -1) {
      if (inferred >= 0) return "more than one -1";
      inferred = static_cast<int>(i);
    } else if (s[i] == 0 && !allowzero) {
      continue;  // copies the input dim
    } else if (!d || *d != s[i]) {
      return "a target dim differs from (or may differ from) the input dim";
    }
  }
  if (inferred >= 0) {
    // The -1 gets numel / (product of the others), which is the input dim as long as that
    // product is not 0 (ONNX Runtime rejects -1 then): the others must be known and non-zero.
    for (size_t i = 0; i < dims->size(); ++i) {
      if (static_cast<int>(i) == inferred) continue;
      if (!(*dims)[i] || *(*dims)[i] == 0) return "-1 next to an unknown or zero dim";
    }
  }
  return nullptr;
}

const char* expand_noop(const Node* n) {
  auto dims = value_dims(n->inputs()[0]);
  if (!dims) return "the input's rank is unknown";
  if (n->inputs().size() < 2) return "no shape input";  // invalid, but not ours to crash on
  auto shape = constant_ints(n->inputs()[1], 4096);
  if (!shape) return "the shape is not a constant";
  if (shape->size() > dims->size()) return "the rank grows";
  const size_t offset = dims->size() - shape->size();
  for (size_t j = 0; j < shape->size(); ++j) {
    const auto& d = (*dims)[offset + j];
    if ((*shape)[j] == 1) continue;  // broadcasts to the input dim
    if (!d || *d != (*shape)[j]) return "a dim may grow";
  }
  return nullptr;
}

const char* transpose_noop(const Node* n) {
  if (const Attribute* a = n->attribute("perm")) {
    for (size_t i = 0; i < a->ints.size(); ++i) {
      if (a->ints[i] != static_cast<int64_t>(i)) return "perm is not the identity";
    }
    return nullptr;
  }
  // No perm: the dims are reversed, which changes nothing only up to rank 1.
  auto dims = value_dims(n->inputs()[0]);
  if (!dims || dims->size() > 1) return "no perm, and the rank is not known to be <= 1";
  return nullptr;
}

// Whether [s, e) covers an axis of size d (unknown: nullopt) whole.
bool full_range(int64_t s, int64_t e, std::optional<int64_t> d) {
  const bool from_start = s == 0 || (d && s < 0 && s + *d <= 0);
  const bool to_end = e == INT64_MAX || (d && e >= *d);
  return from_start && to_end;
}

// Constant starts, ends, axes and steps of one length; nullptr or the reason.
const char* slice_inputs_problem(const IntList& starts, const IntList& ends, const IntList& axes,
                                 const IntList& steps) {
  if (!starts.known || !ends.known) return "starts or ends are not constants";
  if ((axes.present && !axes.known) || (steps.present && !steps.known)) {
    return "axes or steps are not constants";
  }
  const size_t k = starts.values.size();
  if (ends.values.size() != k || (axes.present && axes.values.size() != k) ||
      (steps.present && steps.values.size() != k)) {
    return "starts, ends, axes and steps differ in length";
  }
  return nullptr;
}

const char* slice_noop(const Node* n) {
  auto dims = value_dims(n->inputs()[0]);
  const int64_t rank = dims ? static_cast<int64_t>(dims->size()) : -1;
  auto starts = int_list(n, "starts", 1);
  auto ends = int_list(n, "ends", 2);
  auto axes = int_list(n, "axes", 3);
  auto steps = int_list(n, "steps", 4);
  if (const char* why = slice_inputs_problem(starts, ends, axes, steps)) return why;
  const size_t k = starts.values.size();
  std::vector<int64_t> ax = axes.present ? axes.values : std::vector<int64_t>();
  if (!axes.present) {
    for (size_t i = 0; i < k; ++i) ax.push_back(static_cast<int64_t>(i));
  }
  auto norm = normalize_axes(ax, rank);
  if (!norm) return "axes are out of range, repeated, or negative with an unknown rank";
  for (size_t i = 0; i < k; ++i) {
    if (steps.present && steps.values[i] != 1) return "a step is not 1";
    std::optional<int64_t> d;
    if (dims) d = (*dims)[(*norm)[i]];
    if (!full_range(starts.values[i], ends.values[i], d)) {
      return "an axis is not sliced over its full range";
    }
  }
  return nullptr;
}

const char* pad_noop(const Node* n) {
  if (const Attribute* mode = n->attribute("mode"); mode && mode->s && *mode->s != "constant") {
    return "mode is not 'constant'";
  }
  IntList pads = int_list(n, "pads", 1);
  if (!pads.present) pads = int_list(n, "paddings", 1);  // opset 1
  if (!pads.known) return "pads are not a constant";
  for (int64_t p : pads.values) {
    if (p != 0) return "a pad is not 0";
  }
  return nullptr;
}

const char* squeeze_noop(const Node* n) {
  auto axes = int_list(n, "axes", 1);
  if (axes.present && !axes.known) return "axes are not a constant";
  if (!axes.values.empty()) return "squeezes an axis";
  // No axes: every 1-dim goes. A no-op only when no dim is (or may be) 1.
  auto dims = value_dims(n->inputs()[0]);
  if (!dims) return "the input's rank is unknown";
  for (const auto& d : *dims) {
    if (!d || *d == 1) return "a dim is (or may be) 1";
  }
  return nullptr;
}

const char* unsqueeze_noop(const Node* n) {
  auto axes = int_list(n, "axes", 1);
  if (!axes.known) return "axes are absent or not a constant";
  if (!axes.values.empty()) return "inserts an axis";
  return nullptr;
}

const char* concat_noop(const Node* n) {
  return n->inputs().size() == 1 ? nullptr : "more than one input";
}

const char* split_noop(const Node* n) {
  if (n->outputs().size() != 1) return "more than one output";
  if (auto k = int_attr(n, "num_outputs"); k && *k != 1) return "num_outputs is not 1";
  auto split = int_list(n, "split", 1);
  if (!split.present) return nullptr;
  if (!split.known || split.values.size() != 1) return "split is not one constant size";
  auto dims = value_dims(n->inputs()[0]);
  if (!dims) return "the input's rank is unknown";
  auto axis = normalize_axes({int_attr(n, "axis").value_or(0)}, static_cast<int64_t>(dims->size()));
  if (!axis) return "axis out of range";
  const auto& d = (*dims)[(*axis)[0]];
  if (!d || *d != split.values[0]) return "the split size may differ from the dim";
  return nullptr;
}

Rule noop_rule(const std::string& op, Check check) {
  auto p = std::make_shared<Pattern>("eliminate_noop_" + op);
  p->root(p->op(op, {p->var("x")}).extra_inputs());
  return {"noop_" + op, p, [check](const Match& m, Rewriter& rw) -> Replacement {
            if (has_attr_refs(m.root())) return rw.fail("an attribute refers to a function's");
            if (const char* why = check(m.root())) return rw.fail(why);
            return forward(m.value("x"), m, rw);
          }};
}

std::vector<Rule> rules(const PassContext&) {
  return {
      noop_rule("Reshape", reshape_noop),
      noop_rule("Expand", expand_noop),
      noop_rule("Transpose", transpose_noop),
      noop_rule("Slice", slice_noop),
      noop_rule("Pad", pad_noop),
      noop_rule("Squeeze", squeeze_noop),
      noop_rule("Unsqueeze", unsqueeze_noop),
      noop_rule("Concat", concat_noop),
      noop_rule("Split", split_noop),
  };
}

const PassRegistrar kRegister{rule_pass(
    "eliminate_noop",
    "remove Reshape/Expand/Transpose/Slice/Pad/Squeeze/Unsqueeze/Concat/Split that change nothing",
    {"cleanup"}, rules)};

}  // namespace
}  // namespace fastopt::passes
