// What fuse_rotary's rules share: x's layout (head splits, widths, last-axis slices) and the
// emitter of RotaryEmbedding (com.microsoft or ai.onnx 23) with its precomputed cos/sin caches,
// made once per source and shared by every layer's q and k.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "ir/graph.h"
#include "passes/registry.h"
#include "passes/rotary/rotary_cache.h"

namespace fastopt::passes::rotary_emit {

using pattern::Rewriter;

// x (B,H,S,D) = Transpose(0,2,1,3)(Reshape(x3d (B,S,H*D), shape)).
struct HeadSplit {
  Node* reshape = nullptr;
  Value* x3d = nullptr;
  int64_t heads = 0;
  int64_t head_dim = 0;
};

// x (B,S,H,D) = Reshape(x3d (B,S,H*D), shape): the split before the Transpose (gptj rotates
// there).
std::optional<HeadSplit> reshape_split(const Value* x);

// x (B,H,S,D) = Transpose(0,2,1,3)(Reshape(x3d (B,S,H*D), shape)).
std::optional<HeadSplit> head_split(const Value* x);

// Constant start/end of a Slice on the last axis of a rank-4 value with step 1, or nullopt.
struct SliceBounds {
  const Value* start;
  const Value* end;
};

std::optional<SliceBounds> last_axis_slice(const Node* sl);

// A constant one-element int, or nullopt.
std::optional<int64_t> single_int(const Value* v);

// D of a rank-4 value: its type, the head split that makes it, or the Slice that cuts it.
std::optional<int64_t> head_dim(const Value* x);

// H of a rank-4 value, (B,H,S,D) (seq_axis 2) or (B,S,H,D) (seq_axis 1): its type, or the head
// split under last-axis Slices.
std::optional<int64_t> num_heads_4d(const Value* x, int seq_axis = 2);

// Any last-axis Slice, for the interleaved form's x[..., :r] (step 1 or 2 checked elsewhere).
bool is_rank4(const Value* x);

// rotate_half's split point: the constant D/2, or Unsqueeze(Div(Gather(Shape(x), -1), 2)).
bool is_half_of(const Value* b, const Value* x, int64_t d);

// A RotaryEmbedding of either domain (a rule's earlier output).
bool is_rotary(const Node* n);

// Per pass run: the cache initializers made so far, shared by every layer's q and k, and the
// fp32 tables they were made from, shared by the caches of every dtype.
struct CacheMemo {
  std::map<std::string, std::pair<Value*, Value*>> caches;
  std::map<std::string, std::shared_ptr<const rotary::TrigTables>> trig;
};

// Builds the rules' RotaryEmbedding nodes: ctx for the target, options and counters; memo
// shared by every rule of one pass run.
struct Emitter {
  PassContext* ctx;
  std::shared_ptr<CacheMemo> memo;

  bool onnx() const { return ctx->target == Target::kOnnx; }

  std::optional<std::string> target_problem(const Graph& g) const;

  // position_ids (B, S) as the ops want them. The positions broadcast against x in the
  // original graph, so their first dim is B or 1 ((1, S) when the model computes them with
  // Range): unless it is known to be B, Expand them to [B, S] of the op's input.
  Value* positions(Rewriter& rw, Value* pos, Value* in, Value* x, int64_t seq_axis) const;

  // The source's positions as (B, S) or (1, S): (S) ones get a leading axis.
  Value* position_ids(Rewriter& rw, const rotary::CosSinSource& c) const;

  int64_t max_positions() const;

  // LongRoPE: the rows of the switched table follow the first table's R rows in the caches, so
  // positions + R * Cast(switch_cond) read the table the graph picks.
  Value* switched_positions(Rewriter& rw, const rotary::CosSinSource& c, Value* pos) const;

  // RotaryEmbedding over x (B,H,S,D) (seq_axis 2) or (B,S,H,D) (seq_axis 1): the 3-D form on
  // x3d when x is a head split of it; (B,S,H,D) otherwise goes through Transposes to the 4-D form.
  Value* emit(Rewriter& rw, Value* x, Value* pos, Value* cos, Value* sin, int64_t interleaved,
              int64_t rotary_dim, int seq_axis = 2) const;

  // The (cos, sin) cache initializers for a traced source, made once per distinct source and
  // dtype (the fp32 values once per distinct frequency source); nullopt (and nothing added)
  // when a table's two halves differ (not rotate_half's layout).
  std::optional<std::pair<Value*, Value*>> caches(Graph& g, const rotary::CosSinSource& c,
                                                  const rotary::CosSinSource& s) const;
};

}  // namespace fastopt::passes::rotary_emit
