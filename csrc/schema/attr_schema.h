// Attribute types from the op schemas (ONNX and ONNX Runtime's contrib ops): a node whose
// attribute has another type than its schema's (Softmax's axis given as a string) is one ONNX
// Runtime refuses to load. Rewriting it would make a model that ORT rejects run, so patterns do
// not match such nodes, and passes that read attributes outside patterns skip them.
#pragma once

#include <string>

#include "ir/graph.h"

namespace fastopt::pattern {

// The first attribute of `n` whose type contradicts its schema, or whose declared type
// contradicts the field that is set; null when all are well typed or `n` has no known schema.
const Attribute* mistyped_attribute(const Node& n);

// "attribute 'axis' of Softmax is a STRING; its schema says INT".
std::string describe_mistyped(const Node& n, const Attribute& a);

}  // namespace fastopt::pattern
