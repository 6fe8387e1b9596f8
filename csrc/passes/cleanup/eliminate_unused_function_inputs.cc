// Unused inputs of model-local functions: removed from the FunctionProto and from every call.
//
//   function f(a, b, c) { y = Relu(a) + c }      ->   function f(a, c) { ... }
//   n = f(x, t, z)  (in any graph or function)   ->   n = f(x, z)
//
// Exporters inline modules as functions and keep every argument of the original signature;
// inputs the body never reads still force the caller to compute and pass them.
#include "passes/registry.h"

namespace fastopt::passes {
namespace {

bool calls(const Node* n, const Function& f) {
  const std::string& d = n->domain.value;
  return n->op_type == f.name.value && d == f.domain.value && n->overload.value == f.overload.value;
}

int64_t eliminate_unused_function_inputs(Model& model, PassContext& ctx) {
  int64_t removed = 0;
  for (const auto& f : model.functions) {
    Graph& body = *f->body;
    for (size_t i = body.input_entries.size(); i-- > 0;) {
      Value* v = body.input_entries[i].value;
      if (!v || !v->uses().empty() || v->is_graph_output()) continue;
      body.remove_input(i);
      model.for_each_graph([&](Graph& g) {
        for (Node* n = g.first(); n; n = n->next()) {
          if (calls(n, *f) && n->inputs().size() > i) n->remove_input(static_cast<int>(i));
        }
      });
      ++removed;
    }
  }
  ctx.counters["unused_function_inputs"] += removed;
  return removed;
}

const PassRegistrar kRegister{
    PassDecl("eliminate_unused_function_inputs",
             "remove inputs a model-local function never reads, from the function and its calls")
        .tags({"cleanup"})
        .run(eliminate_unused_function_inputs)};

}  // namespace
}  // namespace fastopt::passes
