// adopt_presents (internal_op.h): a lowering's op takes over the cached form's present outputs.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "ir/types.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {
namespace {

// One cache tensor: the present the op's output replaces, the past and the new rows it was
// concatenated from, and the new rows as the op reads them (B, S, H*D), when it does.
struct Present {
  Value* present;
  Value* op_present;
  Value* past;
  Value* rows;
  Value* rows3;
};

// Nodes the op's inputs depend on that read the present: after the takeover they would read
// the op's own output. Only a present with readers besides the attention being lowered is walked.
std::vector<Node*> upstream_readers(const Present& p, const Node* attention) {
  for (const Use& u : p.present->uses()) {
    if (u.node != attention) return pattern::readers_feeding(p.present, p.op_present);
  }
  return {};
}

Value* make(Graph& g, Node* before, const std::string& op, const std::vector<Value*>& inputs) {
  Node* n = g.create_node(op, "", inputs, {g.unique_name("cache_shape_" + op)}, before);
  n->name.set(n->outputs()[0]->name());
  analysis::type_new_node(*g.model(), *n);
  return n->outputs()[0];
}

Value* ints(Graph& g, const std::vector<int64_t>& v) {
  return g.add_initializer("cache_shape_ints",
                           make_int64_tensor(v, {static_cast<int64_t>(v.size())}));
}

// Shape(present) without the present: Concat on axis 2 of the past (B, H, P, D) and the new rows
// (B, H, S, D) is (B, H, P + S, D), so Shape(past) + (0, 0, S, 0); S from the rows the op reads
// (dim 1 of (B, S, H*D)) where it has them, which keeps no 4-D copy of them alive. Shape's
// start/end become a Slice of that (the same clamping).
void shape_without_present(Graph& g, const Present& p, Node* shape) {
  Value* axis2 = ints(g, {0, 0, 1, 0});
  Value* s = p.rows3 ? make(g, shape, "Gather", {make(g, shape, "Shape", {p.rows3}), ints(g, {1})})
                     : make(g, shape, "Shape", {p.rows});
  Value* full =
      make(g, shape, "Add", {make(g, shape, "Shape", {p.past}), make(g, shape, "Mul", {s, axis2})});
  const Attribute* start = shape->attribute("start");
  const Attribute* end = shape->attribute("end");
  if (start || end) {
    const int64_t from = start && start->i ? *start->i : 0;
    const int64_t to = end && end->i ? *end->i : INT64_MAX;
    full = make(g, shape, "Slice", {full, ints(g, {from}), ints(g, {to})});
  }
  Value* out = shape->outputs()[0];
  if (out->type.known) refine_type(full->type, out->type);
  if (out->is_graph_output()) {
    pattern::replace_value(g, out, full);
  } else {
    g.replace_all_uses(out, full);
  }
  g.remove_node(shape);
}

}  // namespace

std::string adopt_presents(Graph& g, const CachedKV& c, Value* pk, Value* pv, const Node* attention,
                           Value* k3, Value* v3, bool inplace) {
  const Present presents[] = {{c.present_k, pk, c.past_k, c.k_new, k3},
                              {c.present_v, pv, c.past_v, c.v_new, v3}};
  std::vector<std::pair<const Present*, Node*>> shape_reads;
  for (const Present& p : presents) {
    if (!pattern::can_replace(g, p.present, p.op_present)) {
      return "the present outputs cannot take over the Concats' graph outputs";
    }
    for (Node* r : upstream_readers(p, attention)) {
      const std::string what = r->op_type + " '" + r->name.value + "'";
      if (r->op_type != "Shape" || !r->domain.value.empty() || pattern::mistyped_attribute(*r) ||
          r->has_subgraphs() || r->outputs().size() != 1 || !r->outputs()[0]) {
        return "present '" + p.present->name() + "' is read by " + what +
               ", which the attention's inputs depend on: the op's present output cannot "
               "replace it (a cycle)";
      }
      if (inplace) {
        return "the shape of present '" + p.present->name() + "' is read by " + what +
               ", which the attention's inputs depend on: in place the present is the "
               "max-length buffer, whose shape is not the keys'";
      }
      if (rank_of(p.past) != 4 || (!p.rows3 && rank_of(p.rows) != 4)) {
        return "the shape of present '" + p.present->name() + "' is read by " + what +
               " and the past or new rows are not known 4-D";
      }
      shape_reads.emplace_back(&p, r);
    }
  }
  // ---- edits (nothing above changed the graph) ----
  for (auto [p, shape] : shape_reads) shape_without_present(g, *p, shape);
  // The new rows the op reads may be made by the lowering (before the attention, after the
  // Shape read): the order is restored (stable, only where a read was given the shape).
  if (!shape_reads.empty()) g.topological_sort();
  for (const Present& p : presents) {
    Node* cat = p.present->producer();
    p.op_present->type = p.present->type;
    pattern::replace_value(g, p.present, p.op_present);
    if (cat && cat->alive() && p.present->uses().empty() && !p.present->is_graph_output()) {
      g.remove_node(cat);
    }
  }
  return "";
}

}  // namespace fastopt::passes
