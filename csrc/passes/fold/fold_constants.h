// Constant folding: the edits that put computed values in place of the nodes that produced
// them, over the native evaluator (eval/evaluator.h). Used by the fold_constants and
// fold_shapes passes and by the bindings (for the ONNX Runtime fallback).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "eval/evaluator.h"
#include "ir/graph.h"

namespace fastopt::passes {

// The evaluator lives in csrc/eval; its names are used here by the folding passes.
using eval::evaluate_node;
using eval::evaluate_node_on;
using eval::FoldLimits;
using eval::native_fold_ops;

// Puts a constant holding `t` in place of `v` (every use, graph outputs included) and returns
// it: a new initializer, or a Constant node where initializers cannot go (function bodies, IR
// version < 4) or where `v` is a graph output (which keeps its name). The producer of `v` is
// left in place.
Value* replace_with_constant(Graph& g, Value* v, std::shared_ptr<Tensor> t);

// The opset of the default domain that applies in `g` (its function's, inside a function).
int64_t graph_opset(const Model& model, const Graph& g);
// True when `g` is a function body or nested in one (no initializers there).
bool in_function(const Model& model, const Graph& g);

// A self-contained model that computes `nodes` (of one graph, in topological order; every input
// is a constant or an output of an earlier node of the list): constant inputs become
// initializers; `outputs` (outputs of the nodes; all of them when empty) the graph outputs. For
// evaluating nodes in ONNX Runtime.
std::string constant_nodes_model(const Model& model, const std::vector<Node*>& nodes,
                                 const std::vector<Value*>& outputs = {});

// The nodes of `g` the ONNX Runtime fallback (fold_constants_ort) evaluates, in graph order:
// standard-domain nodes without subgraphs, not in `skip`, with at least one input, every input a
// constant of at most limits.max_bytes or an output of an earlier such node; a native op on
// plain constants only when fold_constants declined it for its types (evaluate_node's
// `unsupported`); Div, Mod and Pow only when `safe_division` accepts them. `origin` gets, for every
// output of those nodes, the bytes of the constants it is computed from. The walk the Python pass
// did node by node, without a call into Python per node.
std::vector<Node*> ort_fold_candidates(const Model& model, Graph& g, const FoldLimits& limits,
                                       const std::unordered_set<std::string>& skip,
                                       const std::function<bool(Node*)>& safe_division,
                                       std::unordered_map<Value*, uint64_t>* origin);

}  // namespace fastopt::passes
