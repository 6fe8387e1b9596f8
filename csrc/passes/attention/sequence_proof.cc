// Sequence-length proofs from the graph: S == T of an attention, and Reshape targets that
// copy (B, S), when the types do not show them (TorchScript exports lose the dims).
#include "passes/attention/sequence_proof.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {

// A position in the walk: `axis` of `v` (of rank `rank`) has the length being tracked.
struct SeqAt {
  const Value* v;
  int axis;
  int rank;
};

bool is_norm(const Node* n) {
  const std::string& op = n->op_type;
  return (is_standard(n) || n->domain.value == kMsDomain) &&
         (op == "SimplifiedLayerNormalization" || op == "LayerNormalization" ||
          op == "RMSNormalization");
}

// The non-constant operand of Add/Sub/Mul/Div whose other operand is a constant of rank <= 1
// (it broadcasts over the last axis at most), or null.
const Value* arithmetic_operand(const Node* n) {
  const std::string& op = n->op_type;
  if (!is_standard(n) || (op != "Add" && op != "Sub" && op != "Mul" && op != "Div") ||
      n->inputs().size() != 2 || !n->inputs()[0] || !n->inputs()[1]) {
    return nullptr;
  }
  for (int i = 0; i < 2; ++i) {
    auto c = constant_tensor(n->inputs()[i]);
    if (c && c->dims.size() <= 1 && !constant_tensor(n->inputs()[1 - i])) return n->inputs()[1 - i];
  }
  return nullptr;
}

bool same_length(const Value* a, int a_axis, int a_rank, const Value* b, int b_axis, int b_rank);

// A head split Reshape(x (B, S, C), [Shape(z)[0], -1, H, D]) (opt's view(bsz, -1, heads, d)):
// the -1 is S when z has x's batch and H * D == C.
bool inferred_dim1(const Node* reshape, const Node* cat) {
  const Value* x = reshape->inputs()[0];
  if (cat->inputs().size() != 4 || rank_of(x) != 3) return false;
  auto c = dims_of(x);
  int64_t width = c && c->size() == 3 && (*c)[2].value ? *(*c)[2].value : -1;
  auto minus_one = constant_ints(cat->inputs()[1]);
  auto h = constant_ints(cat->inputs()[2]), d = constant_ints(cat->inputs()[3]);
  if (width <= 0 || !minus_one || *minus_one != std::vector<int64_t>{-1} || !h || !d ||
      h->size() != 1 || d->size() != 1 || (*h)[0] * (*d)[0] != width) {
    return false;
  }
  int64_t index = -1;
  const Value* z = shape_dim_source(cat->inputs()[0], &index);
  const int z_rank = z ? rank_of(z) : -1;
  return z && index == 0 && z_rank >= 1 && same_length(x, 0, 3, z, 0, z_rank);
}

// Element 1 of a Reshape target: the copy of the input's dim 1 (a constant 0; allowzero 0) or
// dim 1 of Shape(z) (*z set), or inferred (-1) from a batch and a width that are the input's.
// False when it is neither.
bool target_dim1(const Node* reshape, const Value** z) {
  const Value* target = reshape->inputs()[1];
  const bool zero_copies = int_attr_or(reshape, "allowzero", 0) == 0;
  if (auto c = constant_ints(target)) return c->size() > 1 && (*c)[1] == 0 && zero_copies;
  const Node* cat = target ? target->producer() : nullptr;
  if (!cat || !is_standard(cat) || cat->op_type != "Concat") return false;
  if (inferred_dim1(reshape, cat)) return true;
  int64_t pos = 0;  // of the current input's first element in the target
  for (const Value* in : cat->inputs()) {
    int64_t index = -1;
    const Value* src = shape_dim_source(in, &index);
    int64_t value = 0;
    if (!src) {  // elements before 1 must be 1 each
      auto c = constant_ints(in);
      if (!c || c->size() != 1) return false;
      value = c->front();
    }
    if (pos == 1) {
      if (src && index == 1) *z = src;
      return src ? index == 1 : value == 0 && zero_copies;
    }
    ++pos;
  }
  return false;
}

// The step back from `at` to the input of its producer whose `axis` has the same length, when
// the producer provably keeps it. A head split/merge Reshape sets *z when its target takes the
// length from Shape(z).
std::optional<SeqAt> seq_step(const SeqAt& at, const Value** z) {
  const Node* n = at.v->producer();
  if (!n || n->inputs().empty() || !n->inputs()[0]) return std::nullopt;
  const std::string& op = n->op_type;
  const bool last = at.axis == at.rank - 1;
  auto last_axis = [&](int64_t a) { return a == -1 || a == at.rank - 1; };
  if (is_standard(n) && op == "Transpose") {
    const Attribute* perm = n->attribute("perm");
    if (!perm || static_cast<int>(perm->ints.size()) != at.rank || (at.rank != 3 && at.rank != 4))
      return std::nullopt;
    return SeqAt{n->inputs()[0], static_cast<int>(perm->ints[at.axis]), at.rank};
  }
  if (is_standard(n) && op == "Reshape" && n->inputs().size() == 2) {
    // Head split (3-D -> 4-D) or merge (4-D -> 3-D), the length at axis 1 on both sides.
    const int in_rank = 7 - at.rank;
    if (at.axis != 1 || (at.rank != 3 && at.rank != 4) || rank_of(n->inputs()[0]) != in_rank ||
        !target_dim1(n, z)) {
      return std::nullopt;
    }
    return SeqAt{n->inputs()[0], 1, in_rank};
  }
  if (op == "RotaryEmbedding" && (is_standard(n) || n->domain.value == kMsDomain)) {
    return SeqAt{n->inputs()[0], at.axis, at.rank};
  }
  if (is_norm(n) || (is_standard(n) && op == "Cast"))
    return SeqAt{n->inputs()[0], at.axis, at.rank};
  if (!is_standard(n) || last) return std::nullopt;  // the rest change the last axis at most
  if (const Value* x = arithmetic_operand(n)) return SeqAt{x, at.axis, at.rank};
  if (op == "Slice" && n->inputs().size() >= 4 && n->inputs()[3]) {
    auto axes = constant_ints(n->inputs()[3]);
    if (!axes || axes->empty()) return std::nullopt;
    for (int64_t a : *axes) {
      if (!last_axis(a)) return std::nullopt;
    }
    return SeqAt{n->inputs()[0], at.axis, at.rank};
  }
  if ((op == "Split" || op == "Concat") && last_axis(int_attr_or(n, "axis", 0))) {
    return SeqAt{n->inputs()[0], at.axis, at.rank};
  }
  if (op == "MatMul" && n->inputs().size() == 2) {
    auto b = constant_tensor(n->inputs()[1]);
    if (b && b->dims.size() == 2) return SeqAt{n->inputs()[0], at.axis, at.rank};
  }
  return std::nullopt;
}

// The values whose tracked axis provably has the length of `axis` of `x` (x first), by seq_step;
// the walk stops at a Reshape that takes the length from elsewhere.
std::vector<SeqAt> axis_chain(const Value* x, int axis, int rank) {
  std::vector<SeqAt> chain{{x, axis, rank}};
  while (chain.size() < 30) {
    const Value* z = nullptr;
    auto prev = seq_step(chain.back(), &z);
    if (!prev || z) break;
    chain.push_back(*prev);
  }
  return chain;
}

// Two values provably equal in length at the given axes: their chains meet, or reach recorded
// dims that are the same.
bool same_length(const Value* a, int a_axis, int a_rank, const Value* b, int b_axis, int b_rank) {
  const std::vector<SeqAt> as = axis_chain(a, a_axis, a_rank);
  const std::vector<SeqAt> bs = axis_chain(b, b_axis, b_rank);
  for (const SeqAt& x : as) {
    for (const SeqAt& y : bs) {
      if (x.v == y.v && x.axis == y.axis) return true;
      const Dim* dx = dim_at(x.v, static_cast<size_t>(x.rank), static_cast<size_t>(x.axis));
      const Dim* dy = dim_at(y.v, static_cast<size_t>(y.rank), static_cast<size_t>(y.axis));
      if (same_dim(dx, dy)) return true;
    }
  }
  return false;
}

// The values whose tracked axis provably has the length of axis 2 of `x4` (B, H, S, D).
std::vector<SeqAt> seq_chain(const Value* x4) {
  std::vector<SeqAt> chain{{x4, 2, 4}};
  std::vector<std::pair<size_t, const Value*>> jumps;  // a Reshape's input index, its z
  while (chain.size() < 30) {
    const Value* z = nullptr;
    auto prev = seq_step(chain.back(), &z);
    if (!prev) break;
    if (z) jumps.emplace_back(chain.size(), z);
    chain.push_back(*prev);
  }
  // Such a Reshape ties its output to z, not to its input: z must be further back (axis 1), and
  // the values from the input to z prove nothing.
  std::vector<bool> proven(chain.size(), true);
  std::vector<SeqAt> out;
  for (auto [i, z] : jumps) {
    size_t j = i;
    while (j < chain.size() && !(chain[j].v == z && chain[j].axis == 1)) ++j;
    const bool found = j < chain.size();
    // Not found: nothing from the input on holds, but z does (a dynamo export sizes head splits
    // from the attention mask, no ancestor of the states: Q and K splits share that z).
    std::fill(proven.begin() + static_cast<std::ptrdiff_t>(i),
              found ? proven.begin() + static_cast<std::ptrdiff_t>(j) : proven.end(), false);
    if (!found) {
      if (int r = rank_of(z); r >= 2) out.push_back({z, 1, r});
      break;
    }
  }
  for (size_t i = 0; i < chain.size(); ++i) {
    if (proven[i]) out.push_back(chain[i]);
  }
  return out;
}

}  // namespace

// A Reshape target Concat(Shape(z)[0], Shape(z)[1], ...) whose z has x3's leading dims.
bool copies_leading_dims(const Value* target, const Value* x3) {
  const Node* cat = target ? target->producer() : nullptr;
  if (!cat || !is_standard(cat) || cat->op_type != "Concat" || cat->inputs().size() < 2)
    return false;
  int64_t i0 = -1, i1 = -1;
  const Value* z0 = shape_dim_source(cat->inputs()[0], &i0);
  const Value* z1 = shape_dim_source(cat->inputs()[1], &i1);
  const int z_rank = z0 ? rank_of(z0) : -1;
  return z0 && z0 == z1 && i0 == 0 && i1 == 1 && z_rank >= 2 &&
         same_length(x3, 0, 3, z0, 0, z_rank) && same_length(x3, 1, 3, z0, 1, z_rank);
}

// S == T of a self-attention: Q (B, Hq, S, D) and K (B, Hkv, T, D) reach one value with the
// length at the same axis. Not for cross-attention (K from another input) or when an op on the
// way may change the length (a Slice of the sequence axis stops the walk).
bool same_sequence(const Value* q4, const Value* k4) {
  const std::vector<SeqAt> qs = seq_chain(q4);
  for (const SeqAt& k : seq_chain(k4)) {
    for (const SeqAt& q : qs) {
      if (q.v == k.v && q.axis == k.axis) return true;
    }
  }
  return false;
}

}  // namespace fastopt::passes
