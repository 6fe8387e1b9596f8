// The cos/sin inputs of a decomposed rotary embedding, traced back to where they come from, and
// the 2-D caches RotaryEmbedding takes in their place (used by fuse_rotary).
//
// Source A, computed on the fly (current Hugging Face rotary classes, both exporters):
//
//   pos (B,S) int64 -> Unsqueeze(2) -> Cast(float) -> Mul(inv_freq (D/2))          = f (B,S,D/2)
//   or: MatMul([Expand](inv_freq (1,D/2,1)), Cast(float)(Unsqueeze(pos, 1))) -> Transpose(0,2,1)
//   Concat(f, f, axis -1) -> Cos | Sin -> [Mul(attention_scaling)] -> [Cast(dtype)] -> Unsqueeze(1)
//
// Casts around the Unsqueeze (fp16 models; fp32 layers of a mixed export) are followed, and a
// round trip through float16 is reproduced in the caches.
//
// Source B, a table (older Hugging Face classes, TorchScript): cos_cached (M, D), maybe sliced
// [:seq_len] along axis 0, then Gather(table, pos) -> [Cast(dtype)] -> Unsqueeze(1).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "schema/attr_schema.h"

namespace fastopt::passes::rotary {

// The most rows options["rotary_max_positions"] may ask for (2^20): the on-the-fly caches are
// (rows, rotary_dim / 2) twice, 512 MB in fp32 at rotary_dim 128. A larger value is refused
// before any pass runs (python/fastopt/options.py), not an allocation that fails.
constexpr int64_t kMaxPositionsLimit = int64_t{1} << 20;

// The producer of `v` when it is the standard op `op` with well-typed attributes, else null: a
// node ORT refuses is never traced through (its attributes would read as the defaults), so the
// caches never replace it.
inline Node* made_by(const Value* v, const char* op) {
  if (!v) return nullptr;
  Node* n = v->producer();
  if (!n || n->op_type != op || !(n->domain.value.empty() || n->domain.value == "ai.onnx")) {
    return nullptr;
  }
  return pattern::mistyped_attribute(*n) ? nullptr : n;
}

// An int attribute of `n`, nullopt when absent.
inline std::optional<int64_t> int_attr(const Node* n, const char* name) {
  const Attribute* a = n->attribute(name);
  if (!a || !a->i) return std::nullopt;
  return *a->i;
}

struct CosSinSource {
  enum class Kind { kFrequencies, kTable };
  Kind kind = Kind::kFrequencies;
  Value* positions = nullptr;  // int64 (B, S), before its Unsqueeze / Cast
  // positions is (S) (an encoder's Range(0, S), unsqueezed at axes 0 and 2 in one node): the
  // ops read Unsqueeze(positions, 0), (1, S).
  bool positions_1d = false;
  int32_t dtype = 0;      // element type of the cos/sin that reach the multiplications
  int64_t half = 0;       // columns of the cache (rotary dim / 2)
  bool via_half = false;  // the fp32 values pass through a Cast to float16
  // kFrequencies: the constant inverse frequencies and the optional attention_scaling factor;
  // `angles` is the Concat(f, f) both Cos and Sin read.
  std::vector<float> inv_freq;
  std::optional<float> scaling;
  // LongRoPE (phi3): inv_freq = Where(switch_cond, switched_inv_freq, inv_freq), switch_cond a
  // scalar Greater(ReduceMax(positions) + c, t) read by every position; inv_freq holds while the
  // positions stay below switch_rows (= t - c + 1). The caches then stack the two tables.
  Value* switch_cond = nullptr;
  std::vector<float> switched_inv_freq;
  int64_t switch_rows = 0;
  const Value* angles = nullptr;
  // kTable: the constant table (M, 2 * half) this one (cos or sin) gathers from; interleaved
  // sources read `half` columns of it from `table_column` (gptj's sin | cos table).
  std::shared_ptr<const Tensor> table;
  int64_t table_column = -1;  // -1: rotate_half's layout (both halves equal)
};

// Unsqueeze axes: input 1 from opset 13 on, the attribute before.
std::optional<std::vector<int64_t>> unsqueeze_axes(const Node* n);

// The frequencies f (B, S, half) = positions * inv_freq, as Mul(Cast(Unsqueeze(pos, 2)), inv)
// or Transpose(0,2,1)(MatMul(inv (1, half, 1), Cast(Unsqueeze(pos, 1)))): fills inv_freq,
// positions and half of `s`, or returns false with the reason in `why`.
bool trace_frequencies(Value* f, CosSinSource* s, std::string* why);

// The Casts between a cos/sin operand and its source (`casts`, outermost first) go to float or
// float16 only (the caches' dtypes); sets s->via_half for a float16 one. false with the reason.
bool take_cache_casts(const std::vector<int32_t>& casts, const std::string& fn, CosSinSource* s,
                      std::string* why);

// A Mul(scalar constant, fn(...)) at *cur (attention_scaling): records the scalar in s->scaling
// and steps *cur past it. True when there is none; false (why set) for another Mul.
bool take_scaling(Value** cur, const std::string& fn, CosSinSource* s, std::string* why);

// Traces `v` (the 4-D cos or sin a rotary multiplication reads) back to its source; `fn` is
// "Cos" or "Sin". On failure returns nullopt with the reason in `why`.
std::optional<CosSinSource> trace_cos_sin(Value* v, const std::string& fn, std::string* why);

// The fp32 values of a frequency source's caches before their dtype: cos/sin(float(p) *
// inv_freq[i]) [* scaling], computed in fp32 as the graph does, (rows, half) row-major; rows =
// max_positions. With a switch: (2 R, half), rows [0, R) from inv_freq, [R, 2 R) from
// switched_inv_freq at position row - R, R = switch_table_rows(s, max_positions); the positions
// are offset by R when the switch is on.
struct TrigTables {
  int64_t rows = 0, half = 0;
  std::vector<float> cos, sin;
};
TrigTables trig_tables(const CosSinSource& s, int64_t max_positions);
// Everything trig_tables(s, max_positions) depends on: sources with equal keys (the caches of
// every dtype, every layer) share one computation.
std::string trig_key(const CosSinSource& s, int64_t max_positions);
// The (rows, half) cache in `dtype` (float or float16) from one table of `t`; via_half: the
// fp32 values pass through float16 first (a Cast to fp16 and back in the graph).
std::shared_ptr<Tensor> frequency_cache(const TrigTables& t, bool cos, int32_t dtype,
                                        bool via_half);
int64_t switch_table_rows(const CosSinSource& s, int64_t max_positions);
// Table: the first `half` columns of the (M, 2 * half) table, after checking that both halves are
// equal (rotate_half's layout); null when they are not. With a table_column: those `half`
// columns.
std::shared_ptr<Tensor> table_cache(const CosSinSource& s);

}  // namespace fastopt::passes::rotary
