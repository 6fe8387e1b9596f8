// Dead-code elimination: nodes none of whose outputs reach a graph output, and initializers
// nothing reads. Subgraphs count as readers of the outer values they use. A node with an
// attribute of the wrong type stays: ORT refuses the model for it, and a rewrite that made it
// dead (a Reshape target folded from the output's type, say) must not make the model one ORT
// runs.
#include "ir/constant.h"
#include "passes/registry.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {
namespace {

bool unused(const Value* v) {
  return !v || (v->uses().empty() && !v->is_graph_output());
}

int64_t eliminate_dead_nodes(Model& model, PassContext& ctx) {
  int64_t removed_nodes = 0, removed_initializers = 0;
  std::vector<Graph*> graphs;
  model.for_each_graph([&](Graph& g) { graphs.push_back(&g); });
  // Innermost graphs last in the list: walk it backwards so a subgraph's dead uses of outer
  // values are gone before the outer graph is swept.
  for (auto it = graphs.rbegin(); it != graphs.rend(); ++it) {
    Graph& g = **it;
    for (Node* n = g.last(); n;) {
      Node* prev = n->prev();
      bool dead = true;
      for (Value* o : n->outputs()) dead = dead && unused(o);
      if (dead && !pattern::mistyped_attribute(*n)) {
        g.remove_node(n);
        ++removed_nodes;
      }
      n = prev;
    }
    std::vector<Value*> dead;
    for (Value* v : g.initializer_order) {
      // IR < 4 lists every initializer as a graph input; those are still weights.
      if (v->uses().empty() && !v->is_graph_output() &&
          (!v->is_graph_input() || fixed_initializer(v))) {
        dead.push_back(v);
      }
    }
    g.remove_initializers(dead);  // one sweep: linear in the initializers, not quadratic
    removed_initializers += static_cast<int64_t>(dead.size());
  }
  ctx.counters["dead_nodes"] += removed_nodes;
  ctx.counters["unused_initializers"] += removed_initializers;
  return removed_nodes + removed_initializers;
}

const PassRegistrar kRegister{
    PassDecl("eliminate_dead_nodes",
             "remove nodes whose outputs are never used, and unused initializers")
        .tags({"cleanup"})
        .run(eliminate_dead_nodes)};

}  // namespace
}  // namespace fastopt::passes
