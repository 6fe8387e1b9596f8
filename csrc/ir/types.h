// Merging value types found elsewhere (the result of onnx shape inference on a skeleton) into a
// model: a type is set where a value has none, and refined where the other one says more.
#pragma once

#include <cstdint>

#include "ir/graph.h"

namespace fastopt {

// Refines `type` with `inferred`: takes it whole when `type` is unknown; for tensor types,
// fills the element type, a missing shape, and dims that are unknown (or symbolic where
// `inferred` has a number). Conflicting element types or ranks leave `type` unchanged.
// Returns true when `type` changed.
bool refine_type(TypeInfo& type, const TypeInfo& inferred);

// Applies the types of `inferred` (a copy of `model`'s structure, e.g. a shape-inferred
// skeleton) to `model`: graphs are paired (main graph, subgraphs through their nodes, functions
// by name) and values matched by name. Graph inputs keep their declared types; dims onnx named
// "unk__<n>" (unknown, named per run) stay unknown. A value whose
// type changed gets a value_info entry if it has none, so that the type is written out.
// Returns the number of values whose type changed.
int64_t apply_types(Model& model, const Model& inferred);

}  // namespace fastopt
