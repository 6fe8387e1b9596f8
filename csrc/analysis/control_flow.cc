// Facts through If, Loop and Scan: their bodies are swept with the node, the body values get
// facts like any other, and the node's outputs get what the bodies prove.
//
// If: a constant condition picks a branch (its outputs' facts, shape values included);
// otherwise each output is the merge of the branches' (equal dims kept, differing dims a
// fresh symbol). Loop / Scan: a loop-carried value's facts hold in every iteration only when
// the body maps them onto themselves, so the body is swept with the initial facts and, where
// an output differs from its input, swept again with that input widened (a differing dim
// becomes a fresh symbol, a differing rank unranked, a differing shape value dropped) until
// one sweep proves them invariant. Scan outputs stack one slice per iteration: a leading dim
// of the trip count when it is known (Loop: the trip count input with a condition that stays
// true; Scan: the scanned axis), fresh otherwise; per-iteration dims (symbols made inside
// the body) become fresh dims outside it.
#include <unordered_set>

#include "analysis/rule_util.h"
#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "ir/dtype.h"

namespace fastopt::analysis {

namespace {

constexpr int kMaxWidenings = 4;
// Loops nested deeper than this claim nothing of their carried values (one sweep, which then
// holds): each level's fixpoint re-sweeps the levels inside it, so proving at every depth
// would cost rounds^depth sweeps on a deeply nested (or hostile) model.
constexpr int kMaxProvenDepth = 2;

Graph* body_attr(const Node& n, const char* name) {
  const Attribute* a = n.attribute(name);
  return a && a->g ? a->g.get() : nullptr;
}

// A known constant boolean (an initializer or Constant), or nullopt.
std::optional<bool> constant_bool(const Value* v) {
  if (!v) return std::nullopt;
  auto t = constant_tensor(v);
  if (!t || t->dtype() != kBool) return std::nullopt;
  auto x = tensor_ints(*t, 1);
  if (!x || x->size() != 1) return std::nullopt;
  return (*x)[0] != 0;
}

bool uses_symbol_from(const DimExpr& e, int32_t first) {
  for (const auto& t : e.terms()) {
    for (int32_t s : t.symbols) {
      if (s >= first) return true;
    }
  }
  return false;
}

// f as seen outside a body whose own symbols are those >= `first`: such dims become fresh
// (a per-iteration or body-internal size is unknown outside), and so does a shape value
// that reads them.
Facts outside(RuleContext& ctx, Facts f, int32_t first) {
  for (DimExpr& d : f.dims) {
    if (uses_symbol_from(d, first)) d = ctx.fresh_dim();
  }
  if (f.has_value) {
    for (const DimExpr& e : f.value) {
      if (uses_symbol_from(e, first)) {
        f.has_value = false;
        f.value.clear();
        break;
      }
    }
  }
  return f;
}

// The facts both branches' outputs share.
Facts merge_branches(RuleContext& ctx, const Facts& a, const Facts& b) {
  Facts f;
  // Branch outputs must have one element type; an unknown side takes the other's.
  f.dtype = a.dtype == b.dtype ? a.dtype : (!a.dtype ? b.dtype : (!b.dtype ? a.dtype : 0));
  if (a.ranked && b.ranked && a.dims.size() == b.dims.size()) {
    f.ranked = true;
    for (size_t i = 0; i < a.dims.size(); ++i) {
      f.dims.push_back(a.dims[i] == b.dims[i] ? a.dims[i] : ctx.fresh_dim());
    }
  }
  if (a.has_value && b.has_value && a.value == b.value) {
    f.has_value = true;
    f.value = a.value;
  }
  return f;
}

// Whether `in` (a carried input's facts, with `widened` its dims already made fresh) holds
// for `out` (what the body gives the next iteration).
bool holds_for(const Facts& in, const std::vector<bool>& widened, const Facts& out) {
  if (in.dtype && in.dtype != out.dtype) return false;
  if (in.has_value && !(out.has_value && out.value == in.value)) return false;
  if (!in.ranked) return true;
  if (!out.ranked || out.dims.size() != in.dims.size()) return false;
  for (size_t i = 0; i < in.dims.size(); ++i) {
    if (!widened[i] && in.dims[i] != out.dims[i]) return false;
  }
  return true;
}

// The least widening of `in` that `out` fits.
void widen(RuleContext& ctx, Facts& in, std::vector<bool>& widened, const Facts& out) {
  if (in.dtype && in.dtype != out.dtype) in.dtype = 0;
  if (in.has_value && !(out.has_value && out.value == in.value)) {
    in.has_value = false;
    in.value.clear();
  }
  if (!in.ranked) return;
  if (!out.ranked || out.dims.size() != in.dims.size()) {
    in.ranked = false;
    in.dims.clear();
    widened.clear();
    return;
  }
  for (size_t i = 0; i < in.dims.size(); ++i) {
    if (!widened[i] && in.dims[i] != out.dims[i]) {
      in.dims[i] = ctx.fresh_dim();
      widened[i] = true;
    }
  }
}

Facts scalar(int32_t dtype) {
  Facts f;
  f.dtype = dtype;
  f.ranked = true;
  return f;
}

}  // namespace

bool ShapeFacts::control_flow(const Node& n, int64_t opset, std::vector<Facts>& outs) {
  const std::string& d = n.domain.value;
  if (!d.empty() && d != "ai.onnx") return false;
  bool ok = false;
  if (n.op_type == "If") {
    ok = if_facts(n, opset, outs);
  } else if (n.op_type == "Loop") {
    ok = loop_facts(n, opset, outs);
  } else if (n.op_type == "Scan" && opset >= 9) {  // Scan-8 has a batch axis: not modelled
    ok = scan_facts(n, opset, outs);
  }
  return ok;
}

bool ShapeFacts::if_facts(const Node& n, int64_t opset, std::vector<Facts>& outs) {
  const Graph* then_g = body_attr(n, "then_branch");
  const Graph* else_g = body_attr(n, "else_branch");
  if (!then_g || !else_g || n.inputs().empty() || !n.inputs()[0]) return false;
  if (then_g->outputs().size() != outs.size() || else_g->outputs().size() != outs.size()) {
    return false;
  }
  // Both branches are swept (their values get facts), whichever runs.
  sweep(*then_g, opset);
  sweep(*else_g, opset);
  bodies_ += 2;
  const auto picked = constant_bool(n.inputs()[0]);
  RuleContext ctx(symbols_, opset);
  for (size_t i = 0; i < outs.size(); ++i) {
    const Facts& a = facts_slot(then_g->outputs()[i]);
    const Facts& b = facts_slot(else_g->outputs()[i]);
    outs[i] = picked ? (*picked ? a : b) : merge_branches(ctx, a, b);
  }
  return true;
}

bool ShapeFacts::fixpoint(const Graph& body, int64_t opset, const std::vector<Facts>& leading,
                          std::vector<Facts>& carried, size_t first_carried_out) {
  const std::vector<Value*> body_in = body.inputs();
  const std::vector<Value*> body_out = body.outputs();
  if (body_in.size() < leading.size() + carried.size() ||
      body_out.size() < first_carried_out + carried.size()) {
    return false;
  }
  RuleContext ctx(symbols_, opset);
  // Only the last sweep's unknown ops count (earlier ones saw facts that did not hold).
  const auto unknown_before = unknown_;
  const int64_t analysed_before = analysed_, bodies_before = bodies_;
  if (loop_depth_ >= kMaxProvenDepth) {
    for (Facts& f : carried) f = Facts{};
  }
  std::vector<std::vector<bool>> widened;
  for (const Facts& f : carried) widened.emplace_back(f.dims.size(), false);
  for (int round = 0;; ++round) {
    unknown_ = unknown_before;
    analysed_ = analysed_before;
    bodies_ = bodies_before;
    for (size_t i = 0; i < body_in.size(); ++i) {
      Facts f;
      if (i < leading.size()) {
        f = leading[i];
      } else if (i < leading.size() + carried.size()) {
        f = carried[i - leading.size()];
      } else {
        continue;  // a scan slice: set by the caller
      }
      // What the body declares fills only an unknown element type: its dims could be stale,
      // and a declared dim must not stand in for one the widening made fresh.
      if (!f.dtype) f.dtype = facts_from_type(symbols_, body_in[i]->type).dtype;
      facts_[body_in[i]] = std::move(f);
    }
    ++loop_depth_;
    sweep(body, opset);
    --loop_depth_;
    bool stable = true;
    for (size_t k = 0; k < carried.size(); ++k) {
      const Facts& out = facts_slot(body_out[first_carried_out + k]);
      if (holds_for(carried[k], widened[k], out)) continue;
      stable = false;
      if (round + 1 >= kMaxWidenings) {
        carried[k] = Facts{};
      } else {
        widen(ctx, carried[k], widened[k], out);
      }
    }
    if (stable) break;
  }
  ++bodies_;
  return true;
}

bool ShapeFacts::loop_facts(const Node& n, int64_t opset, std::vector<Facts>& outs) {
  const Graph* body = body_attr(n, "body");
  const auto& in = n.inputs();
  if (!body || in.size() < 2) return false;
  const size_t n_carried = in.size() - 2;
  if (outs.size() < n_carried || body->outputs().size() != 1 + outs.size()) return false;
  const int32_t first_body_symbol = static_cast<int32_t>(symbols_.size());
  std::vector<Facts> carried;
  for (size_t k = 0; k < n_carried; ++k) {
    if (!in[2 + k]) return false;
    carried.push_back(facts_slot(in[2 + k]));
  }
  // Iteration number and condition: scalars with no value (they change every iteration).
  const std::vector<Facts> leading = {scalar(kInt64), scalar(kBool)};
  if (!fixpoint(*body, opset, leading, carried, 1)) return false;  // cond_out comes first
  RuleContext ctx(symbols_, opset);
  for (size_t k = 0; k < n_carried; ++k) outs[k] = outside(ctx, carried[k], first_body_symbol);

  // The number of iterations, when the condition never stops the loop early.
  std::optional<DimExpr> trips;
  const bool no_cond = !in[1] || constant_bool(in[1]) == std::optional<bool>(true);
  const Value* cond_out = body->outputs()[0];
  while (cond_out && cond_out->producer() && cond_out->producer()->op_type == "Identity" &&
         cond_out->producer()->graph() == body && !cond_out->producer()->inputs().empty()) {
    cond_out = cond_out->producer()->inputs()[0];  // exporters pass the condition through
  }
  const bool stays_true =
      cond_out == body->inputs()[1] || constant_bool(cond_out) == std::optional<bool>(true);
  if (in[0] && no_cond && stays_true) {
    const Facts& m = facts_slot(in[0]);
    if (m.has_value && m.value.size() == 1) {
      const DimExpr& e = m.value[0];
      if (auto c = e.constant_value()) {
        trips = DimExpr::constant(*c < 0 ? 0 : *c);  // a trip count <= 0 runs no iteration
      } else if (symbols_.nonneg(e)) {
        trips = e;
      }
    }
  }
  for (size_t j = n_carried; j < outs.size(); ++j) {
    Facts slice = outside(ctx, facts_slot(body->outputs()[1 + j]), first_body_symbol);
    Facts f;
    f.dtype = slice.dtype;
    if (slice.ranked) {
      f.ranked = true;
      f.dims.push_back(trips ? *trips : ctx.fresh_dim());
      f.dims.insert(f.dims.end(), slice.dims.begin(), slice.dims.end());
    }
    outs[j] = std::move(f);
  }
  return true;
}

bool ShapeFacts::scan_facts(const Node& n, int64_t opset, std::vector<Facts>& outs) {
  const Graph* body = body_attr(n, "body");
  const auto n_scan_in = rules::attr_i(n, "num_scan_inputs");
  const auto& in = n.inputs();
  if (!body || !n_scan_in || *n_scan_in < 1 || static_cast<size_t>(*n_scan_in) > in.size()) {
    return false;
  }
  const size_t n_scan = static_cast<size_t>(*n_scan_in);
  const size_t n_state = in.size() - n_scan;
  if (outs.size() < n_state || body->inputs().size() != in.size() ||
      body->outputs().size() != outs.size()) {
    return false;
  }
  const auto in_axes = rules::attr_is(n, "scan_input_axes");
  const auto out_axes = rules::attr_is(n, "scan_output_axes");
  if ((in_axes && in_axes->size() != n_scan) ||
      (out_axes && out_axes->size() != outs.size() - n_state)) {
    return false;
  }
  const int32_t first_body_symbol = static_cast<int32_t>(symbols_.size());
  RuleContext ctx(symbols_, opset);
  // The scanned inputs' slices (the scan axis removed) and the sequence length.
  std::optional<DimExpr> length;
  std::vector<Facts> slices;
  for (size_t s = 0; s < n_scan; ++s) {
    const Value* v = in[n_state + s];
    if (!v) return false;
    const Facts& f = facts_slot(v);
    Facts slice;
    slice.dtype = f.dtype;
    if (f.ranked) {
      const auto axis =
          rules::norm_axis(in_axes ? (*in_axes)[s] : 0, static_cast<int64_t>(f.dims.size()));
      if (!axis) return false;
      slice.ranked = true;
      for (size_t i = 0; i < f.dims.size(); ++i) {
        if (static_cast<int64_t>(i) == *axis) {
          if (!length) length = f.dims[i];
        } else {
          slice.dims.push_back(f.dims[i]);
        }
      }
    }
    slices.push_back(std::move(slice));
  }
  std::vector<Facts> carried;
  for (size_t k = 0; k < n_state; ++k) {
    if (!in[k]) return false;
    carried.push_back(facts_slot(in[k]));
  }
  // Slices are the same facts every iteration: set them once, then the states' fixpoint.
  for (size_t s = 0; s < n_scan; ++s) facts_[body->inputs()[n_state + s]] = slices[s];
  if (!fixpoint(*body, opset, {}, carried, 0)) return false;
  for (size_t k = 0; k < n_state; ++k) outs[k] = outside(ctx, carried[k], first_body_symbol);
  for (size_t j = n_state; j < outs.size(); ++j) {
    Facts slice = outside(ctx, facts_slot(body->outputs()[j]), first_body_symbol);
    Facts f;
    f.dtype = slice.dtype;
    if (slice.ranked) {
      const auto axis = rules::norm_axis(out_axes ? (*out_axes)[j - n_state] : 0,
                                         static_cast<int64_t>(slice.dims.size()) + 1);
      if (!axis) return false;
      f.ranked = true;
      f.dims = slice.dims;
      f.dims.insert(f.dims.begin() + *axis, length ? *length : ctx.fresh_dim());
    }
    outs[j] = std::move(f);
  }
  return true;
}

}  // namespace fastopt::analysis
