// The head split and merge around an attention. Both exporters split heads as
// Reshape + Transpose(0,2,1,3) of the projection (rotary before or after) and merge them back
// with the inverse pair; the lowerings read the 3-D projection and hand the 3-D output on.
#pragma once

#include <cstdint>
#include <vector>

#include "ir/graph.h"

namespace fastopt::passes {

// The (B, S, H*D) tensor of dtype `dtype` that `x4` (B, H, S, D) was split from in `g`:
// Transpose(0,2,1,3) of a Reshape that keeps dims 0 and 1 (shown by the types, a [0, 0, H, D]
// shape constant, or a shape built from Shape(z)[0], Shape(z)[1] of a z with x3's leading
// dims), or null.
Value* bsd_source(const Graph& g, const Value* x4, int32_t dtype);

// The Reshapes that merge Y's heads back, (B, Hq, S, Dv) -Transpose(0,2,1,3)-> (B, S, Hq, Dv)
// -Reshape-> (B, S, Hq*Dv), when they are Y's only readers; empty otherwise.
std::vector<Node*> head_merges(const Value* y, const Value* q);

}  // namespace fastopt::passes
