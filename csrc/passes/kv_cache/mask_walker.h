// The one walk over the masks add_kv_cache replaces: it admits an attention mask's subgraph (what
// it may read, through ops the native evaluator computes exactly), evaluates it on probe inputs
// and reads the result. The two proofs built on it differ only in their inputs, their probes and
// the pattern they expect: mask_proof.cc (a decoder-only model: causal with padding, with or
// without a sliding window) and kv_cache_cross_mask.cc (an encoder-decoder's decoder: causal
// self-attention, cross-attention over the encoder padding). Why the probes suffice is argued
// at the top of mask_proof.cc.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ir/graph.h"

namespace fastopt::passes::mask_walk {

using TensorPtr = std::shared_ptr<const Tensor>;

inline constexpr size_t kMaxNodes = 4096;
inline constexpr int64_t kMaxProbeLength = 2048;  // constants up to this are probed around
inline constexpr double kMaskedBelow = -1e4;      // as fuse_attention: exp() underflows in fp32

// A graph input the mask may read: the values of the padding mask (`values`), or only the shape
// of anything else (every path from it to the mask passes a Shape or Size). `lengths` maps axes
// to probe length slots (Probe::lengths; slot 0 is the batch, the number of rows).
struct MaskInput {
  std::string name;
  bool prefix = false;  // every input whose name starts with `name` (the past_* inputs)
  bool values = false;
  std::vector<std::pair<size_t, size_t>> lengths;  // axis -> slot
};

// One probe: the lengths of the slots and the padding mask's rows (B, width).
struct Probe {
  std::vector<int64_t> lengths;
  std::vector<std::vector<uint8_t>> rows;
  std::string what;  // for messages
};

class MaskWalker {
 public:
  MaskWalker(const Model& m, const Graph& g, std::vector<MaskInput> inputs);

  // Admits `mask`'s ancestry back to graph inputs and constants: false, with `why`, when it reads
  // another input, an input's values where only its shape may be read, or an op the evaluator
  // cannot compute exactly. A Shape of an activation is answered from its type when every dim is
  // fixed or a symbol of the inputs' length axes (the rest of the pipeline trusts shape
  // inference as much); a dim of unknown size only where it sizes a broadcast and nothing else
  // (dims_only_broadcast: t5's zero position bias, ConstantOfShape((1, H, S, E)) read off
  // Shape(hidden), added to the padding).
  bool admit(Value* mask, std::string* why);

  // The integer constants the admitted subgraph holds (small initializers and Constants), with
  // the substitutions below.
  std::vector<int64_t> constants() const;

  // The one-element integer constants of the subgraph holding `value` whose every use is an
  // offset compared with something: Add(x, c) or Sub(x, c) read only by Less, LessOrEqual,
  // Greater or GreaterOrEqual. Empty when one of them is used otherwise (or none holds it).
  std::vector<const Value*> compared_offsets(int64_t value) const;
  // Evaluates `leaf` (a constant of the subgraph) as `value` from now on (same dtype and shape).
  void substitute(const Value* leaf, int64_t value);

  // The mask on probe `p`; `computed` (if given) collects the small integer values of the nodes
  // that read no graph input (Mul(256, 2) is a constant 512 too).
  std::optional<TensorPtr> evaluate(const Probe& p, std::string* err,
                                    std::vector<int64_t>* computed = nullptr) const;

 private:
  const MaskInput* input_of(const Value* v) const;
  // A dim symbol the probes give a length: an input's length symbol, or a sum "a+b" of them.
  bool is_length(const std::string& param) const;
  bool dims_of(const Value* v, const Probe* p, std::vector<std::optional<int64_t>>* out,
               int depth) const;
  bool type_dims(const Value* v, const Probe* p, std::vector<std::optional<int64_t>>* out) const;
  bool length_on_probe(const std::string& param, const Probe* p, int64_t* sum) const;
  bool shape_from_type(const Node* shape) const;
  bool has_rank(const Node* shape) const;
  bool dims_only_broadcast();
  int spread_dims(const Node* n, const std::unordered_set<const Value*>& dims,
                  const std::unordered_set<const Value*>& shaped) const;
  bool reject(const std::string& what);
  bool visit(Value* v);
  std::optional<TensorPtr> shape_leaf(const Node* n, const Probe& p, std::string* err) const;
  bool visit_input(const Value* v);
  void note_constants(const Value* v, const Tensor& t);
  bool evaluable(const Node* p, bool standard);
  void carry_taint(const Node* p);
  std::optional<int64_t> slot_value(const std::string& param, const Probe& p) const;
  std::optional<TensorPtr> input_tensor(const Value* v, const Probe& p, std::string* err) const;

  const Model& m_;
  const Graph& g_;
  std::vector<MaskInput> inputs_;
  Value* mask_ = nullptr;
  std::map<std::string, std::unordered_set<size_t>> slots_;  // dim symbol -> its slots
  std::unordered_set<const Value*> seen_;
  std::vector<const Node*> nodes_;  // topological
  std::unordered_set<const Node*> shape_leaves_;
  // Shapes with a dim of unknown size that is read, admitted when it only sizes a broadcast
  // (dims_only_broadcast); the evaluation gives it 1.
  std::unordered_set<const Node*> broadcast_leaves_;
  std::unordered_map<const Value*, std::string> taint_;  // value -> input whose data it reads
  std::vector<std::pair<const Value*, std::vector<int64_t>>> constants_;  // leaf -> its values
  std::unordered_map<const Value*, TensorPtr> substituted_;
  std::string why_;
};

// Whether an evaluated mask is a tensor of rank <= 4 whose bytes can be read.
bool readable(const Tensor& mask);

// Entry (b, h, s, t) of an evaluated mask broadcast to `full` = (B, H, S, T): 1 when it lets the
// query see the key (true, or an additive 0), 0 when it removes it (false, or <= kMaskedBelow),
// -1 for a value that is neither, -2 when the mask does not broadcast to `full`.
int read_mask(const Tensor& mask, const uint8_t* base, const int64_t full[4], const int64_t at[4]);

// The lengths to probe: 1 .. `every`, and c - 1 .. c + 2 around each constant c with
// every < |c| <= kMaxProbeLength; nullopt, with `why`, for a constant beyond (what the probes
// cannot reach), "to the end" sentinels (|c| >= 2^31 - 1) aside.
std::optional<std::vector<int64_t>> probe_lengths(const std::vector<int64_t>& constants,
                                                  int64_t every, std::string* why);

}  // namespace fastopt::passes::mask_walk
