// Interleaved rotary embeddings (GPT-J's rotate_every_two; cohere, glm): the pairs (x[2i],
// x[2i+1]) rotate by the angle of frequency i. Used by fuse_rotary, which emits
// RotaryEmbedding(interleaved = 1) for them.
//
//   x (B,H,S,D) or (B,S,H,D)
//    |  \___________________
//    |   Slice(1::2)   Slice(0::2)        rotate_every_two(x) = stack(-x_odd, x_even).flatten(-2)
//    |      |              |
//    |     Neg             |
//    |   Unsqueeze(-1)  Unsqueeze(-1)
//    |        \          /
//    |      Concat(axis -1) -> Reshape(.., D)
//  Mul(cos)      Mul(sin)                 cos / sin: repeat_interleave(c, 2) of (.., D/2) values,
//        \      /                         Reshape(Tile|Expand(Unsqueeze(c, -1), [1,..,2]))
//          Add
//
// The cos/sin half-width values c come from (transformers 5, both exporters):
//   gptj:   Split | Slice of [Cast](Gather | GatherND(table (M, r) = [sin | cos], positions)),
//           Unsqueeze(2) for the (B, S, H, D) layout, then repeat_interleave;
//   cohere: Cos(repeat_interleave(f)) [* scaling] [Cast] -> Unsqueeze(1);
//   glm:    Cos(Concat(f, f)) -> Unsqueeze(1) -> Slice(0, r/2) -> repeat_interleave;
// f = positions * inv_freq (rotary_cache.h's trace_frequencies).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ir/graph.h"
#include "passes/rotary/rotary_cache.h"

namespace fastopt::passes::rotary {

// `v` = repeat_interleave(y, 2) along its last axis: y, and the axis of a size-1 dim inserted
// into y on the way (fold_reshapes merges Unsqueeze(Unsqueeze(z, h), -1) into one); y null when
// `v` is not such a repeat.
struct Repeated {
  Value* y = nullptr;
  std::optional<int64_t> head_axis;
};
Repeated repeated_twice(const Value* v);

// Where the cos or sin a rotation multiplies comes from, and on which layout of x: the axis of
// x that the positions run along (2 for (B, H, S, D), 1 for (B, S, H, D)).
struct InterleavedSource {
  CosSinSource source;
  int seq_axis = 2;
};

// Traces `v` (the 4-D cos or sin an interleaved rotation multiplies; `fn` "Cos" or "Sin") back to
// its source; nullopt with the reason in `why` when it is not one of the forms above. With
// `repeated` false, `v` is the (.., D/2) half-width values themselves (no repeat_interleave: the
// even/odd form below).
std::optional<InterleavedSource> trace_interleaved(Value* v, const std::string& fn,
                                                   std::string* why, bool repeated = true);

// The even/odd form (DeepSeek-V2/V3's apply_rotary_pos_emb_interleave, the rope part of a
// multi-latent attention head):
//
//   x1 = x[..., 0::2], x2 = x[..., 1::2]       c, s: (.., D/2) = Cos/Sin(Concat(f, f))[..., :D/2]
//   y  = Concat(x1 * c - x2 * s, x2 * c + x1 * s, axis -1)
//
// The pairs (x[2i], x[2i+1]) rotate by frequency i, but y lays them out in halves (rotated evens,
// then rotated odds): y = rotate_half's rotary of Concat(x1, x2), which fuse_rotary emits
// (RotaryEmbedding, interleaved 0, on the halves). "" when `even` / `odd` are those Slices of x
// (D: x's last dim), else the reason.
std::string check_even_odd(const Node* even, const Node* odd, const Value* x, int64_t d);

// Checks the matched rotate_every_two around x (D: x's last dim): "" when `rot` is
// Reshape(Concat(Unsqueeze(Neg(x[1::2]), -1), Unsqueeze(x[0::2], -1), -1)) back to x's shape,
// else the reason.
std::string check_rotate_every_two(const Value* rot, const Value* x, int64_t d);

// Shared by rotary_interleaved*.cc: a constant one-element int `v`, or nullopt.
std::optional<int64_t> single(const Value* v);

// A Slice with constant start, end and step on the last axis of its input (axes -1, or the
// last index where the rank is known).
struct LastAxisSlice {
  int64_t start, end, step;
};
std::optional<LastAxisSlice> last_axis_slice(const Node* sl);

}  // namespace fastopt::passes::rotary
