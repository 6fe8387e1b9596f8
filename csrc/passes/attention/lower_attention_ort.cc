// Lowering of the internal Attention op (internal_op.h) for target "ort": com.microsoft
// MultiHeadAttention or GroupQueryAttention, exact to the internal op's semantics or not at all.
//
//   q3 (B,S,Hq*D) -Reshape-Transpose(0,2,1,3)- Q -+
//   k3 (B,T,Hkv*D) ---- ... same split ------- K -+                 q3, k3, v3 (3-D; else
//   v3 (B,T,Hkv*Dv) --- ... same split ------- V -+- Attention ==>  split back from Q/K/V)
//                                          mask? -+     |           bias (B|1,Hq|1,S,T)?
//                                                       Y           MHA | GQA -> (B,S,Hq*Dv)
//                                                       |               |
//                      Transpose(0,2,1,3)-Reshape(B,S,Hq*Dv)          (read directly)
//
// Both exporters split heads as Reshape + Transpose(0,2,1,3) of the projection (rotary before
// or after) and merge them back with the inverse pair. The lowering reads the 3-D projection
// when the Reshape provably keeps (B, S) (else inserts Transpose + Reshape), and hands the 3-D
// output to the merging Reshape's readers when Y's only readers are that pair (else returns Y
// as Reshape + Transpose of it). MHA takes K/V as BNSH when they have no 3-D source.
//
// Which op, per node (latencies in bench/results/lower_attention_ort.md):
//   fp16 / bf16                 -> GroupQueryAttention (CPU fp16; CUDA fp16/bf16)
//   fp32, Hkv == Hq             -> MultiHeadAttention
//   fp32, Hkv <  Hq             -> GroupQueryAttention (CPU only: no fp32 GQA on CUDA), or MHA
//                                  over repeated kv heads when GQA does not fit (below)
//   options cuda=1              -> GQA only for fp16/bf16, causal, without mask (CUDA rejects
//                                  GQA's attention_bias); everything else MHA (repeated kv heads
//                                  when Hkv < Hq)
// GQA fits when T == S is shown (it takes K/V of the query's length) and the head size is
// static, a multiple of 8 (kernel check) and the same for K and V.
//
// Packed QKV (encoders; option packed_attention, below): com.microsoft Attention, the
// projections inside the op, when Q, K, V are head splits of projections of ONE 3-D input:
//
//   x -MatMul(Wq)(+bq)?- q3 -split- Q -+
//   x -MatMul(Wk)(+bk)?- k3 -split- K -+- Attention ==>  Attention(x, [Wq|Wk|Wv], [bq|bk|bv],
//   x -MatMul(Wv)(+bv)?- v3 -split- V -+                    -, -, bias; num_heads, scale,
//                                mask? -+                    unidirectional?, qkv_hidden_sizes?)
//
// Both exporters emit BERT-like self-attention this way (the bias Add on either side). Weights
// must be constant 2-D of Q's dtype, biases 1-D (a missing one packs as zeros: the one place
// bytes are copied, into two new initializers), Hq == Hkv, no cache. The projections must
// feed nothing but the head split, or only shapes besides it (which then read x: same shape when
// the weight is square), so that they go dead. ORT 1.32 CPU runs it in fp32 (fp16 through
// inserted Casts, still faster than GQA on the bert fixtures); its attention_bias must be
// (B|1, 1|N, S, T), which the mask below is. Measured against MHA/GQA (ORT CPU, 2 threads,
// batch 1; bench/bench_encoder_attention.py, bench/results/lower_attention_ort.md): 0.89-0.91x
// the latency on the bert fixtures (seq 128), 0.98-1.00x on a BERT-base-sized export (seq 128,
// 512). So option packed_attention defaults to 1 = non-causal (encoders); 2 = causal too
// (unidirectional=1 is exact: S == T, one input); 0 = off. With option cuda=1 the default is 0
// (the CUDA lowering is unchanged). When packing does not apply the node falls through to
// MHA/GQA below (explained as "not packed into Attention: ...").
//
// Masks become the ops' additive attention_bias (B|1, Hq|1, S, T), expanded over (S, T) when
// the mask broadcasts there: Where(mask, 0, lowest) for bool masks; additive masks are clamped
// to the dtype's lowest unless provably finite (a row of -inf is NaN in GQA fp16, and a NaN pad
// row poisons valid rows in the next layer). GQA gets seqlens_k = S-1 and total_sequence_length
// = S for every batch row, so padding on either side is the bias's job and stays exact. Rows
// whose every key is masked (pad queries) are the one difference from the internal op: 0 there,
// a finite average here. MHA's causal mask is top-left aligned, the internal op's bottom-right:
// causal MHA needs S == T too (or S == 1, where causal masks nothing).
//
// S == T is shown by the types of Q and K, else by the graph (same_sequence): TorchScript
// exports lose the dims, but Q and K of a self-attention both walk back to one hidden state X
// through ops that keep its length (head split Reshape whose target's dim 1 is 0 or
// Shape(X)[1], Transpose, RotaryEmbedding, norms, Cast, MatMul by a 2-D weight, arithmetic with
// a rank <= 1 constant, Slice/Split/Concat of the last axis). Cross-attention (K from another
// input) or a Slice of the sequence axis stops the proof.
//
// The cached form (internal_op.h; add_kv_cache): K = Concat(past_k input, k_new, axis 2) whose
// output is the graph output present_k, same for V. The op takes the cache itself and the
// Concats go (its present outputs take over the graph outputs' names):
//
//   past_k  k_new -> Concat -> present_k        q3 k3_new v3_new past_k past_v seqlens_k total
//      Q ---------> Attention(Q, ., ., mask) ==>    GroupQueryAttention(..., bias, ...,
//                                                     query_seqlens) -> out3, present_k/_v
//   GQA (fp16/bf16, or Hkv < Hq): seqlens_k = T-1 and total = T for every row, T = P + S
//     (from the mask's shape when its type shows (B, 1, S, T)); the bias carries padding; causal
//     = 1 (the form's mask is causal, and query_seqlens needs it); query_seqlens = S per row
//     (ORT >= 1.32), without which a chunk after a past (S > 1, P > 0) runs only for batch 1.
//   MHA (fp32, Hkv == Hq; and options cuda=1, whose GQA rejects a bias): past_key/past_value
//     (B, N, P, H) + attention_bias, unidirectional 0. Hkv < Hq without a fitting GQA fails:
//     MHA over repeated heads would make an Hq-head present.
//   kv_cache == 2 (in place): GQA on one max-length buffer per layer (past and present dims
//     become "max_sequence_length" so a runtime binds one tensor to both; the kernel detects the
//     sharing by pointer), seqlens_k = ReduceSum(attention_mask, 1) - 1 and total =
//     Shape(attention_mask)[1] (int32) once for all layers, no bias: valid tokens must be
//     contiguous from 0 (right padding), which is what the runtimes feed. RotaryEmbedding
//     (com.microsoft, full, same cos/sin for Q and K) folds in as do_rotary when the head size is
//     a multiple of 16 (kernel check); GQA then computes positions past_seqlen + s itself.
//
// Fails (the driver then writes standard ops) when: the dtype is not fp32/fp16/bf16; S == T is
// needed and not shown; GQA does not fit and MHA cannot stand in (fp16, or no static head size
// to repeat kv heads with); softmax_precision is neither the dtype nor fp32 (the kernels
// accumulate the softmax in fp32); inputs after the mask or extra outputs are present.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention/internal_op.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// Shape facts come from value types (infer_shapes runs in the default preset).
const std::vector<Dim>* known_dims(const Value* v) {
  if (!v || !v->type.known || !v->type.is_tensor || !v->type.has_shape) return nullptr;
  return &v->type.dims;
}

const Dim* dim_at(const Value* v, size_t rank, size_t axis) {
  const std::vector<Dim>* d = known_dims(v);
  return d && d->size() == rank ? &(*d)[axis] : nullptr;
}

// passes::same_dim (fusion_util.h) on dims that may be unknown (null): false then.
bool same_dim(const Dim* a, const Dim* b) {
  return a && b && passes::same_dim(*a, *b);
}

// A constant for the rewrite: an initializer, or a Constant node inside a function body.
Value* constant(Rewriter& rw, const std::string& base, std::shared_ptr<Tensor> t) {
  const Graph* top = &rw.graph();
  while (top->parent()) top = top->parent();
  if (top == top->model()->graph.get()) return rw.initializer(base, std::move(t));
  std::vector<Attribute> attrs;
  attrs.push_back(attr_tensor("value", std::move(t)));
  return rw.op1("Constant", {}, std::move(attrs));
}

Value* ints(Rewriter& rw, const std::vector<int64_t>& v, bool scalar = false) {
  std::vector<int64_t> dims;
  if (!scalar) dims.push_back(static_cast<int64_t>(v.size()));
  return constant(rw, "attention_shape", make_int64_tensor(v, dims));
}

Value* int32_scalar(Rewriter& rw, int32_t x) {
  std::string bytes(sizeof x, '\0');
  std::memcpy(bytes.data(), &x, sizeof x);
  return constant(rw, "attention_one", make_tensor(kInt32, {}, std::move(bytes)));
}

// Scalar 0 or the lowest finite value of a float dtype.
Value* float_scalar(Rewriter& rw, int32_t dtype, bool lowest) {
  std::string bytes;
  if (dtype == kFloat) {
    const float x = lowest ? std::numeric_limits<float>::lowest() : 0.0f;
    bytes.assign(reinterpret_cast<const char*>(&x), sizeof x);
  } else {  // fp16 -65504 = 0xFBFF; bf16 lowest = 0xFF7F; 0 is 0x0000 in both
    const uint16_t h = !lowest ? 0 : dtype == kFloat16 ? 0xFBFF : 0xFF7F;
    bytes.assign(reinterpret_cast<const char*>(&h), sizeof h);
  }
  return constant(rw, lowest ? "attention_lowest" : "attention_zero",
                  make_tensor(dtype, {}, std::move(bytes)));
}

// True when `a` precedes `b` in `b`'s graph.
bool precedes(const Node* a, const Node* b) {
  for (const Node* n = b->prev(); n; n = n->prev()) {
    if (n == a) return true;
  }
  return false;
}

bool same_constant(const Value* a, const Value* b) {
  if (a == b) return true;
  auto ta = constant_tensor(a), tb = constant_tensor(b);
  if (!ta || !tb || ta->dtype() != tb->dtype() || ta->dims != tb->dims) return false;
  auto da = constant_doubles(a, 16), db = constant_doubles(b, 16);
  return da && db && *da == *db;
}

bool same_attrs(const Node* n, const std::vector<Attribute>& attrs) {
  if (n->attributes.size() != attrs.size()) return false;
  for (const Attribute& a : attrs) {
    const Attribute* b = n->attribute(a.name);
    if (!b || b->i != a.i || b->f != a.f || b->ints != a.ints) return false;
  }
  return true;
}

// An op on values every layer shares (the mask, its shape): an equal node that an earlier
// lowering made before this one is reused, so the bias / seqlens_k exist once per graph.
Value* shared_op(Rewriter& rw, const std::string& op, const std::vector<Value*>& inputs,
                 std::vector<Attribute> attrs = {}) {
  for (const Use& u : inputs[0]->uses()) {
    const Node* n = u.node;
    if (u.input_index != 0 || n->graph() != &rw.graph() || !n->alive() || n->op_type != op ||
        !n->domain.value.empty() || n->inputs().size() != inputs.size() ||
        n->outputs().size() != 1 || !same_attrs(n, attrs) || !precedes(n, rw.root())) {
      continue;
    }
    bool same = true;
    for (size_t i = 1; i < inputs.size() && same; ++i) {
      same = n->inputs()[i] && same_constant(n->inputs()[i], inputs[i]);
    }
    if (same) return n->outputs()[0];
  }
  return rw.op1(op, inputs, std::move(attrs));
}

// True when every element of `v` is finite for sure (so that no bias row is all -inf).
bool known_finite(const Value* v, int depth = 0) {
  if (depth > 16) return false;
  if (auto t = constant_tensor(v)) {
    auto d = tensor_doubles(*t, uint64_t{1} << 22);
    if (!d) return false;
    for (double x : *d) {
      if (!std::isfinite(x)) return false;
    }
    return true;
  }
  const Node* n = v->producer();
  if (!n || !n->domain.value.empty() || n->inputs().empty()) return false;
  const std::string& op = n->op_type;
  if (op == "Where")
    return known_finite(n->inputs()[1], depth + 1) && known_finite(n->inputs()[2], depth + 1);
  if (op == "Expand" || op == "Unsqueeze" || op == "Squeeze" || op == "Reshape" ||
      op == "Transpose" || op == "Identity" || op == "Slice" || op == "Tile") {
    return n->inputs()[0] && known_finite(n->inputs()[0], depth + 1);
  }
  return false;
}

int32_t dtype_of(const Value* v);
int rank_of(const Value* v);

bool copies_leading_dims(const Value* target, const Value* x3);

// The (B, S, H*D) tensor that `x4` (B, H, S, D) was split from: Transpose(0,2,1,3) of a
// Reshape that keeps dims 0 and 1 (shown by the types, a [0, 0, H, D] shape constant, or a
// shape built from Shape(z)[0], Shape(z)[1] of a z with x3's leading dims), or null.
Value* bsd_source(const Rewriter& rw, const Value* x4, int32_t dtype) {
  const Node* t = x4->producer();
  if (!t || t->op_type != "Transpose" || !t->domain.value.empty() || t->graph() != &rw.graph()) {
    return nullptr;
  }
  const Attribute* perm = t->attribute("perm");
  const Node* r = t->inputs()[0] ? t->inputs()[0]->producer() : nullptr;
  if (!perm || perm->ints != std::vector<int64_t>{0, 2, 1, 3} || !r || r->op_type != "Reshape" ||
      !r->domain.value.empty() || r->inputs().size() != 2 || !r->inputs()[0]) {
    return nullptr;
  }
  Value* x3 = r->inputs()[0];
  const Value* r4 = r->outputs()[0];
  bool keeps =
      same_dim(dim_at(x3, 3, 0), dim_at(r4, 4, 0)) && same_dim(dim_at(x3, 3, 1), dim_at(r4, 4, 1));
  if (!keeps && rank_of(x3) == 3) {
    auto shape = constant_ints(r->inputs()[1]);
    keeps = int_attr_or(r, "allowzero", 0) == 0 && shape && shape->size() == 4 &&
            (*shape)[0] == 0 && (*shape)[1] == 0;
    // Elements that are x3's own dims need no allowzero: they copy whatever the dims are.
    keeps = keeps || copies_leading_dims(r->inputs()[1], x3);
  }
  return keeps && dtype_of(x3) == dtype ? x3 : nullptr;
}

// bsd_source, else Transpose + Reshape(0, 0, -1) of x4.
Value* to_bsd(Rewriter& rw, Value* x4, int32_t dtype) {
  if (Value* x3 = bsd_source(rw, x4, dtype)) return x3;
  std::vector<Attribute> perm;
  perm.push_back(attr_ints("perm", {0, 2, 1, 3}));
  Value* bshd = rw.op1("Transpose", {x4}, std::move(perm));
  return rw.op1("Reshape", {bshd, ints(rw, {0, 0, -1})});
}

// The element type of `v`, looking through layout ops when its type is not recorded.
int32_t dtype_of(const Value* v) {
  for (int i = 0; v && i < 8; ++i) {
    if (int32_t t = value_dtype(v)) return t;
    const Node* n = v->producer();
    const bool layout =
        n && n->domain.value.empty() &&
        (n->op_type == "Transpose" || n->op_type == "Reshape" || n->op_type == "Identity");
    const bool rotary = n && n->op_type == "RotaryEmbedding" && n->domain.value == kMsDomain;
    if (!n || n->inputs().empty() || !(layout || rotary)) {
      return 0;
    }
    v = n->inputs()[0];
  }
  return 0;
}

// The Reshapes that merge Y's heads back, (B, Hq, S, Dv) -Transpose(0,2,1,3)-> (B, S, Hq, Dv)
// -Reshape-> (B, S, Hq*Dv), when they are Y's only readers; empty otherwise.
std::vector<Node*> head_merges(const Value* y, const Value* q) {
  std::vector<Node*> merges;
  for (const Use& u : y->uses()) {
    const Node* t = u.node;
    const Attribute* perm = t->attribute("perm");
    if (t->op_type != "Transpose" || !t->domain.value.empty() || !perm ||
        perm->ints != std::vector<int64_t>{0, 2, 1, 3} || t->outputs()[0]->is_graph_output() ||
        t->outputs()[0]->uses().empty()) {
      return {};
    }
    for (const Use& w : t->outputs()[0]->uses()) {
      Node* r = w.node;
      if (r->op_type != "Reshape" || !r->domain.value.empty() || w.input_index != 0 ||
          r->graph() != y->graph()) {
        return {};
      }
      const Value* out = r->outputs()[0];
      bool merges_last = same_dim(dim_at(out, 3, 0), dim_at(q, 4, 0)) &&
                         same_dim(dim_at(out, 3, 1), dim_at(q, 4, 2));
      if (!merges_last && int_attr_or(r, "allowzero", 0) == 0) {
        auto shape = constant_ints(r->inputs()[1]);
        merges_last = shape && *shape == std::vector<int64_t>{0, 0, -1};
      }
      if (!merges_last) return {};
      merges.push_back(r);
    }
  }
  return merges;
}

// ---- S == T from the graph: Q and K derive from one hidden state by ops that keep its length --
//
// A position in the walk: `axis` of `v` (of rank `rank`) has the length being tracked.
struct SeqAt {
  const Value* v;
  int axis;
  int rank;
};

bool standard(const Node* n) {
  return n->domain.value.empty() || n->domain.value == "ai.onnx";
}

bool is_norm(const Node* n) {
  const std::string& op = n->op_type;
  return (standard(n) || n->domain.value == kMsDomain) &&
         (op == "SimplifiedLayerNormalization" || op == "LayerNormalization" ||
          op == "RMSNormalization");
}

// The non-constant operand of Add/Sub/Mul/Div whose other operand is a constant of rank <= 1
// (it broadcasts over the last axis at most), or null.
const Value* arithmetic_operand(const Node* n) {
  const std::string& op = n->op_type;
  if (!standard(n) || (op != "Add" && op != "Sub" && op != "Mul" && op != "Div") ||
      n->inputs().size() != 2 || !n->inputs()[0] || !n->inputs()[1]) {
    return nullptr;
  }
  for (int i = 0; i < 2; ++i) {
    auto c = constant_tensor(n->inputs()[i]);
    if (c && c->dims.size() <= 1 && !constant_tensor(n->inputs()[1 - i])) return n->inputs()[1 - i];
  }
  return nullptr;
}

// Rank of `v`, looking back through ops that keep the shape when its type does not say.
int rank_of(const Value* v) {
  for (int i = 0; v && i < 8; ++i) {
    if (int r = value_rank(v); r >= 0) return r;
    const Node* n = v->producer();
    if (!n || n->inputs().empty()) return -1;
    if (const Value* x = arithmetic_operand(n)) {
      v = x;
    } else if (is_norm(n) || (n->op_type == "Cast" && standard(n)) ||
               (n->op_type == "RotaryEmbedding" && (standard(n) || n->domain.value == kMsDomain))) {
      v = n->inputs()[0];
    } else {
      return -1;
    }
  }
  return -1;
}

// The z of a 1-element int64 value that is dim `*index` of Shape(z): Unsqueeze(Gather(Shape(z),
// i scalar)), Gather(Shape(z), [i]) or Slice(Shape(z), [i], [i+1]); else null.
const Value* shape_element(const Value* v, int64_t* index) {
  const Node* n = v ? v->producer() : nullptr;
  if (!n || !standard(n) || n->inputs().empty() || !n->inputs()[0]) return nullptr;
  if (n->op_type == "Shape" && n->attribute("start") && n->attribute("end")) {
    // Shape-15 reading one dim (dynamo exports): Shape(z, start=i, end=i+1).
    const int64_t start = int_attr_or(n, "start", -1), end = int_attr_or(n, "end", -1);
    if (start < 0 || end != start + 1) return nullptr;
    *index = start;
    return n->inputs()[0];
  }
  bool scalar = false;  // the Gather index must then be a scalar
  if (n->op_type == "Unsqueeze") {
    const Attribute* a = n->attribute("axes");  // opset < 13: an attribute
    auto axes = n->inputs().size() > 1
                    ? constant_ints(n->inputs()[1])
                    : std::optional<std::vector<int64_t>>(a ? a->ints : std::vector<int64_t>{});
    if (!axes || axes->size() != 1 || ((*axes)[0] != 0 && (*axes)[0] != -1)) return nullptr;
    n = n->inputs()[0]->producer();
    scalar = true;
    if (!n || !standard(n) || n->op_type != "Gather" || n->inputs().size() != 2) return nullptr;
  }
  std::optional<std::vector<int64_t>> at;
  if (n->op_type == "Gather" && n->inputs().size() == 2 && int_attr_or(n, "axis", 0) == 0) {
    auto t = constant_tensor(n->inputs()[1]);
    if (!t || t->dims.size() != (scalar ? 0u : 1u)) return nullptr;
    at = constant_ints(n->inputs()[1]);
  } else if (n->op_type == "Slice" && n->inputs().size() >= 3) {
    auto starts = constant_ints(n->inputs()[1]), ends = constant_ints(n->inputs()[2]);
    for (size_t i = 3; i < n->inputs().size(); ++i) {  // axes [0], steps [1]
      if (!n->inputs()[i]) continue;
      auto c = constant_ints(n->inputs()[i]);
      if (!c || *c != std::vector<int64_t>{i == 3 ? 0 : 1}) return nullptr;
    }
    if (starts && ends && starts->size() == 1 && ends->size() == 1 && (*starts)[0] >= 0 &&
        (*ends)[0] == (*starts)[0] + 1) {
      at = starts;
    }
  }
  if (!at || at->size() != 1 || (*at)[0] < 0) return nullptr;
  const Node* shape = n->inputs()[0] ? n->inputs()[0]->producer() : nullptr;
  if (!shape || !standard(shape) || shape->op_type != "Shape" || shape->attribute("start") ||
      shape->attribute("end") || !shape->inputs()[0]) {
    return nullptr;
  }
  *index = (*at)[0];
  return shape->inputs()[0];
}

// Element 1 of a Reshape target: the copy of the input's dim 1 (a constant 0; allowzero 0) or
// dim 1 of Shape(z) (*z set). False when it is neither.
bool target_dim1(const Node* reshape, const Value** z) {
  const Value* target = reshape->inputs()[1];
  const bool zero_copies = int_attr_or(reshape, "allowzero", 0) == 0;
  if (auto c = constant_ints(target)) return c->size() > 1 && (*c)[1] == 0 && zero_copies;
  const Node* cat = target ? target->producer() : nullptr;
  if (!cat || !standard(cat) || cat->op_type != "Concat") return false;
  int64_t pos = 0;  // of the current input's first element in the target
  for (const Value* in : cat->inputs()) {
    int64_t index = -1;
    const Value* src = shape_element(in, &index);
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
  if (standard(n) && op == "Transpose") {
    const Attribute* perm = n->attribute("perm");
    if (!perm || static_cast<int>(perm->ints.size()) != at.rank || (at.rank != 3 && at.rank != 4))
      return std::nullopt;
    return SeqAt{n->inputs()[0], static_cast<int>(perm->ints[at.axis]), at.rank};
  }
  if (standard(n) && op == "Reshape" && n->inputs().size() == 2) {
    // Head split (3-D -> 4-D) or merge (4-D -> 3-D), the length at axis 1 on both sides.
    const int in_rank = 7 - at.rank;
    if (at.axis != 1 || (at.rank != 3 && at.rank != 4) || rank_of(n->inputs()[0]) != in_rank ||
        !target_dim1(n, z)) {
      return std::nullopt;
    }
    return SeqAt{n->inputs()[0], 1, in_rank};
  }
  if (op == "RotaryEmbedding" && (standard(n) || n->domain.value == kMsDomain)) {
    return SeqAt{n->inputs()[0], at.axis, at.rank};
  }
  if (is_norm(n) || (standard(n) && op == "Cast")) return SeqAt{n->inputs()[0], at.axis, at.rank};
  if (!standard(n) || last) return std::nullopt;  // the rest change the last axis at most
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

// A Reshape target Concat(Shape(z)[0], Shape(z)[1], ...) whose z has x3's leading dims.
bool copies_leading_dims(const Value* target, const Value* x3) {
  const Node* cat = target ? target->producer() : nullptr;
  if (!cat || !standard(cat) || cat->op_type != "Concat" || cat->inputs().size() < 2) return false;
  int64_t i0 = -1, i1 = -1;
  const Value* z0 = shape_element(cat->inputs()[0], &i0);
  const Value* z1 = shape_element(cat->inputs()[1], &i1);
  const int z_rank = z0 ? rank_of(z0) : -1;
  return z0 && z0 == z1 && i0 == 0 && i1 == 1 && z_rank >= 2 &&
         same_length(x3, 0, 3, z0, 0, z_rank) && same_length(x3, 1, 3, z0, 1, z_rank);
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

// The RotaryEmbedding (com.microsoft, 3-D) that made `x3`, when GroupQueryAttention can apply
// it instead (do_rotary): full rotary without options; else null. (Other readers keep the node.)
const Node* foldable_rotary(const Value* x3) {
  const Node* r = x3 ? x3->producer() : nullptr;
  if (!r || r->op_type != "RotaryEmbedding" || r->domain.value != kMsDomain ||
      r->inputs().size() != 4 || int_attr_or(r, "rotary_embedding_dim", 0) != 0 ||
      int_attr_or(r, "is_packed_batching", 0) || r->attribute("scale") || !r->inputs()[0] ||
      !r->inputs()[2] || !r->inputs()[3]) {
    return nullptr;
  }
  return r;
}

// Whether only shapes are read from `v`, apart from `replaced` (the node being lowered): every
// use is a Shape, or a Reshape (data input) or Transpose whose output is in turn read only for
// its shape.
bool read_only_for_shape(const Value* v, const Node* replaced, int depth = 0) {
  if (depth > 4 || v->is_graph_output()) return false;
  for (const Use& u : v->uses()) {
    const Node* n = u.node;
    if (n == replaced) continue;
    if (!standard(n)) return false;
    if (n->op_type == "Shape") continue;
    if ((n->op_type == "Reshape" && u.input_index == 0) || n->op_type == "Transpose") {
      if (n->outputs()[0] && read_only_for_shape(n->outputs()[0], replaced, depth + 1)) continue;
    }
    return false;
  }
  return true;
}

// The attention_mask graph input (B, T) of the cached form (kv_cache contract), or null.
Value* attention_mask_input(const Graph& g) {
  for (Value* v : g.inputs()) {
    if (v->name() == "attention_mask" && (value_rank(v) == 2 || value_rank(v) == -1)) return v;
  }
  return nullptr;
}

// Dim 2 of a cache value becomes "max_sequence_length" (in place: past and present are one
// buffer, so one name lets a runtime bind the same tensor to both).
void set_max_length(Value* x) {
  if (!x->type.known || !x->type.is_tensor || !x->type.has_shape || x->type.dims.size() != 4) {
    return;
  }
  x->type.encoded = ByteRef{};
  x->type.dims[2] = Dim{std::nullopt, std::string("max_sequence_length")};
}

// ---- Packed QKV: com.microsoft Attention (encoders) ------------------------------------------

// One projection of the shared input: out = MatMul(x, w) (+ Add(b) of a 1-D constant)?.
struct Projection {
  Value* x = nullptr;
  Value* out = nullptr;  // the 3-D value the head split reads
  std::shared_ptr<const Tensor> w, b;
  int64_t n() const { return w->dims[1]; }
};

std::optional<Projection> projection(Value* out, int32_t dtype, std::string* why) {
  Projection p;
  p.out = out;
  const Node* n = out->producer();
  if (n && standard(n) && n->op_type == "Add" && n->inputs().size() == 2 && n->inputs()[0] &&
      n->inputs()[1]) {
    for (int i = 0; i < 2 && !p.b; ++i) {
      auto b = constant_tensor(n->inputs()[i]);
      const Node* mm = n->inputs()[1 - i]->producer();
      if (b && mm && mm->op_type == "MatMul") {
        p.b = b;
        if (n->inputs()[1 - i]->uses().size() != 1 || n->inputs()[1 - i]->is_graph_output()) {
          *why = "a projection's MatMul has readers besides its bias Add";
          return std::nullopt;
        }
        n = mm;
      }
    }
    if (!p.b) {
      *why = "Q/K/V is an Add that is not MatMul + constant bias";
      return std::nullopt;
    }
  }
  if (!n || !standard(n) || n->op_type != "MatMul" || n->inputs().size() != 2 || !n->inputs()[0] ||
      !n->inputs()[1]) {
    *why = "Q/K/V do not come from a MatMul (+ bias)";
    return std::nullopt;
  }
  p.x = n->inputs()[0];
  p.w = constant_tensor(n->inputs()[1]);
  if (!p.w || p.w->dims.size() != 2 || p.w->dtype() != dtype) {
    *why = "a projection weight is not a constant 2-D tensor of Q's dtype";
    return std::nullopt;
  }
  if (p.b && (p.b->dims.size() != 1 || p.b->dims[0] != p.n() || p.b->dtype() != dtype)) {
    *why = "a projection bias is not 1-D of the weight's width and Q's dtype";
    return std::nullopt;
  }
  return p;
}

// Whether `out` (a projection) reaches nothing but `node` through the head split Reshape +
// Transpose.
bool only_feeds(const Value* out, const Node* node) {
  const Value* v = out;
  for (int i = 0; i < 3; ++i) {
    if (v->is_graph_output() || v->uses().size() != 1) return false;
    const Node* n = v->uses()[0].node;
    if (n == node) return true;
    v = n->outputs()[0];
  }
  return false;
}

// Q, K, V projected from one 3-D input by constant weights (Hq == Hkv checked by the caller):
// the projections (q, k, v order), or null with *why.
std::optional<std::vector<Projection>> packed_qkv(const Rewriter& rw, const Node* node,
                                                  int64_t heads, int32_t dtype, std::string* why) {
  std::vector<Projection> ps;
  for (int i = 0; i < 3; ++i) {
    Value* x3 = bsd_source(rw, node->inputs()[i], dtype);
    if (!x3) {
      *why = "Q/K/V is not a head split of a 3-D projection";
      return std::nullopt;
    }
    auto p = projection(x3, dtype, why);
    if (!p) return std::nullopt;
    ps.push_back(*p);
  }
  if (ps[0].x != ps[1].x || ps[0].x != ps[2].x) {
    *why = "Q, K, V are projections of different inputs";
    return std::nullopt;
  }
  if (ps[0].out == ps[1].out || ps[0].out == ps[2].out || ps[1].out == ps[2].out) {
    *why = "Q, K, V share a projection";
    return std::nullopt;
  }
  if (rank_of(ps[0].x) != 3 || dtype_of(ps[0].x) != dtype) {
    *why = "the shared input is not 3-D of Q's dtype";
    return std::nullopt;
  }
  const int64_t din = ps[0].w->dims[0];
  if (ps[1].w->dims[0] != din || ps[2].w->dims[0] != din) {
    *why = "projection weights differ in their input size";
    return std::nullopt;
  }
  if (ps[0].n() != ps[1].n() || ps[0].n() % heads != 0 || ps[2].n() % heads != 0) {
    *why = "Q and K widths differ or a width is not a multiple of num_heads";
    return std::nullopt;
  }
  for (const Projection& p : ps) {
    // Readers of the projection's shape alone move to x (same shape) so the MatMul goes dead.
    if (!only_feeds(p.out, node) && !(p.n() == din && read_only_for_shape(p.out, node))) {
      *why = "a projection has readers besides the attention";
      return std::nullopt;
    }
  }
  return ps;
}

// Concatenates [rows, n_i] tensors along their last axis; a null tensor is n_i zero columns.
std::string concat_columns(const std::vector<std::shared_ptr<const Tensor>>& ts,
                           const std::vector<int64_t>& widths, int64_t rows, uint64_t elem) {
  uint64_t total_row = 0;
  for (int64_t w : widths) total_row += static_cast<uint64_t>(w) * elem;
  std::string out(total_row * static_cast<uint64_t>(rows), '\0');
  uint64_t col = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const uint64_t row = static_cast<uint64_t>(widths[i]) * elem;
    if (ts[i]) {
      const ByteRef bytes = ts[i]->bytes();
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(bytes.data() + r * row, row, out.data() + r * total_row + col);
      }
    }
    col += row;
  }
  return out;
}

}  // namespace

Replacement lower_attention_ort(Node* node, Rewriter& rw, PassContext& ctx) {
  const std::vector<Value*>& in = node->inputs();
  if (in.size() < 3 || !in[0] || !in[1] || !in[2]) return rw.fail("Q, K or V is missing");
  if (in.size() > 4) return rw.fail("inputs after the mask (past key/value) are not supported");
  if (node->outputs().size() != 1) return rw.fail("outputs after Y are not supported");
  Value *q = in[0], *k = in[1], *v = in[2];
  Value* mask = in.size() > 3 ? in[3] : nullptr;
  // The cached form: the ops take past/present themselves and read only the new rows.
  const std::optional<CachedKV> cache = cached_kv(node);
  const auto kv_option = ctx.options.find("kv_cache");
  const bool inplace = cache && kv_option != ctx.options.end() && kv_option->second == 2;
  Value* kn = cache ? cache->k_new : k;
  Value* vn = cache ? cache->v_new : v;

  const Attribute* scale_attr = node->attribute("scale");
  if (!scale_attr || !scale_attr->f) return rw.fail("no scale attribute");
  const float scale = *scale_attr->f;
  // Both ops read scale 0 as "1/sqrt(D)".
  if (!std::isfinite(scale) || scale == 0.0f) return rw.fail("scale is 0 or not finite");
  const bool causal = int_attr_or(node, "is_causal", 0) != 0;
  const int64_t hq = int_attr_or(node, "q_num_heads", 0);
  const int64_t hkv = int_attr_or(node, "kv_num_heads", 0);
  if (hq <= 0 || hkv <= 0 || hq % hkv != 0) return rw.fail("bad q_num_heads / kv_num_heads");

  const int32_t dtype = dtype_of(q);
  if (dtype != kFloat && dtype != kFloat16 && dtype != kBFloat16) {
    return rw.fail("dtype " + dtype_name(dtype) + " (MHA/GQA: float, float16, bfloat16)");
  }
  if (dtype_of(k) != dtype || dtype_of(v) != dtype) return rw.fail("Q, K, V dtypes differ");
  if (cache && (dtype_of(kn) != dtype || dtype_of(vn) != dtype ||
                value_dtype(cache->past_k) != dtype || value_dtype(cache->past_v) != dtype)) {
    return rw.fail("the cache's dtype is not Q's");
  }
  for (const Value* x : {q, k, v, kn, vn}) {
    if (value_rank(x) != -1 && value_rank(x) != 4) return rw.fail("Q, K, V must be 4-D");
  }
  // The kernels accumulate the softmax in fp32 (fp16 too): a wider request is met, others not.
  const int64_t precision = int_attr_or(node, "softmax_precision", dtype);
  if (precision != dtype && precision != kFloat) {
    return rw.fail("softmax_precision " + dtype_name(static_cast<int32_t>(precision)));
  }
  const int32_t mask_dtype = mask ? value_dtype(mask) : 0;
  if (mask && mask_dtype != kBool && mask_dtype != dtype) {
    return rw.fail("mask dtype " + dtype_name(mask_dtype) + " (bool or the dtype of Q)");
  }
  if (mask && value_rank(mask) > 4) return rw.fail("mask of rank > 4");
  if (default_opset(*rw.graph().model()) < 13) return rw.fail("default opset < 13");

  const Dim* s_dim = dim_at(q, 4, 2);
  const Dim* t_dim = dim_at(k, 4, 2);
  const Dim* head_dim = dim_at(kn, 4, 3);
  if (cache && !(head_dim && head_dim->value)) head_dim = dim_at(cache->past_k, 4, 3);
  const Dim* v_head_dim = dim_at(vn, 4, 3);
  if (cache && !(v_head_dim && v_head_dim->value)) v_head_dim = dim_at(cache->past_v, 4, 3);
  const bool static_head = head_dim && head_dim->value;
  // From the types, else from the graph (TorchScript exports lose the dims). With a cache: the
  // new rows have the query's length (T = P + S is the ops' business).
  const bool same_len = same_dim(s_dim, dim_at(kn, 4, 2)) || same_sequence(q, kn);
  // One query row sees every key under bottom-right alignment: no causal mask at all.
  const bool one_row = s_dim && s_dim->value && *s_dim->value == 1;
  const bool mha_causal = causal && !one_row;
  // GQA takes K/V of the query's length, one head size for K and V, a multiple of 8.
  const bool gqa_fits =
      same_len && static_head && *head_dim->value % 8 == 0 && same_dim(head_dim, v_head_dim);
  const bool cuda = ctx.options.count("cuda") && ctx.options.at("cuda") != 0;
  // Packed QKV (com.microsoft Attention): option packed_attention 0 = off, 1 = non-causal
  // self-attention (encoders; the default), 2 = causal too (unidirectional; S == T holds since
  // Q and K are projections of one input). Decoders keep MHA/GQA by default.
  const auto packed_option = ctx.options.find("packed_attention");
  const int64_t packed_mode =
      packed_option != ctx.options.end() ? packed_option->second : (cuda ? 0 : 1);
  std::optional<std::vector<Projection>> qkv;
  if (!cache && hq == hkv && packed_mode > 0 && (!causal || packed_mode >= 2)) {
    std::string why;
    qkv = packed_qkv(rw, node, hq, dtype, &why);
    if (!qkv && !ctx.explain_rule.empty() &&
        (ctx.explain_rule == "*" || ctx.explain_rule == "lower_attention")) {
      ctx.explain_lines.push_back("lower_attention: " + node->name.value +
                                  ": not packed into Attention: " + why);
    }
  }
  bool use_gqa = qkv             ? false
                 : inplace       ? true
                 : cuda && cache ? false  // CUDA GQA rejects the cache's bias
                 : cuda          ? dtype != kFloat && causal && !mask
                                 : dtype != kFloat || hkv != hq;
  // fp32 has MHA over repeated kv heads to fall back on (not with a cache: present has Hkv).
  if (use_gqa && !inplace && dtype == kFloat && !gqa_fits && static_head && !cache) {
    use_gqa = false;
  }
  const bool repeat_kv = !use_gqa && hkv != hq;

  if (inplace && cuda && dtype == kFloat) {
    return rw.fail("in-place cache: GroupQueryAttention has no fp32 CUDA kernel");
  }
  if (use_gqa && !same_len) {
    return rw.fail("GroupQueryAttention (" + dtype_name(dtype) +
                   (dtype == kFloat ? ", Hkv < Hq" : "") +
                   (cache ? ") needs the new K/V rows of the query's length"
                          : ") needs S == T, not shown by the shapes of Q and K nor by the graph"));
  }
  if (use_gqa && !gqa_fits) {
    return rw.fail(
        "GroupQueryAttention needs a static head size, a multiple of 8, the same for K and V");
  }
  if (cache && !use_gqa && mha_causal) {
    return rw.fail("causal MultiHeadAttention with a cache: its causal mask is top-left aligned");
  }
  if (!use_gqa && mha_causal && !same_len) {
    return rw.fail(
        "causal MultiHeadAttention needs S == T (its causal mask is top-left "
        "aligned), not shown by the shapes of Q and K nor by the graph");
  }
  if (cache && repeat_kv) {
    return rw.fail("a grouped cache (Hkv < Hq) needs GroupQueryAttention, which does not fit");
  }
  if (repeat_kv && !static_head) {
    return rw.fail("repeating kv heads for MultiHeadAttention needs a static head size");
  }
  Value* mask_input = inplace ? attention_mask_input(rw.graph()) : nullptr;
  if (inplace && !mask_input) {
    return rw.fail("in-place cache: no attention_mask graph input (B, total_sequence_length)");
  }
  if (inplace && !causal && !mask) return rw.fail("in-place cache: neither causal nor a mask");
  if (int_attr_or(node, "sliding_window", 0) > 0 && !cache) {
    return rw.fail("a sliding_window attribute outside the cached form");
  }

  // 3-D operands: Q always; K/V for GQA, and for MHA when they exist already (else BNSH). MHA
  // with a cache takes 3-D new rows too (4-D K means cross-attention to it).
  Value* q3 = to_bsd(rw, q, dtype);
  Value *k3 = nullptr, *v3 = nullptr;
  if (use_gqa || cache) {
    k3 = to_bsd(rw, kn, dtype);
    v3 = to_bsd(rw, vn, dtype);
  } else if (!repeat_kv) {
    k3 = bsd_source(rw, k, dtype);
    v3 = bsd_source(rw, v, dtype);
    if (!k3 || !v3) k3 = v3 = nullptr;
  }
  // In place: RoPE goes into GQA (do_rotary) when both rotaries can fold there.
  const Node* rot_q = inplace ? foldable_rotary(q3) : nullptr;
  const Node* rot_k = inplace ? foldable_rotary(k3) : nullptr;
  const bool fold_rotary =
      rot_q && rot_k && *head_dim->value % 16 == 0 && rot_q->inputs()[2] == rot_k->inputs()[2] &&
      rot_q->inputs()[3] == rot_k->inputs()[3] &&
      int_attr_or(rot_q, "interleaved", 0) == int_attr_or(rot_k, "interleaved", 0);

  // The additive bias (B|1, Hq|1, S, T). In place, GQA's causal flag and seqlens_k stand for the
  // mask (right padding: the cache holds each row's tokens from position 0).
  Value* bias = nullptr;
  if (mask && !inplace) {
    const bool full = same_dim(dim_at(mask, 4, 2), s_dim) && same_dim(dim_at(mask, 4, 3), t_dim);
    Value* m = mask;
    if (mask_dtype != kBool && !known_finite(mask)) {
      m = shared_op(rw, "Max", {m, float_scalar(rw, dtype, true)});
    }
    if (!full) {
      Value* s = nullptr;
      Value* t = nullptr;
      if (qkv) {  // S == T: one input; its shape keeps the projections dead
        s = rw.op1("Gather", {rw.op1("Shape", {qkv->front().x}), ints(rw, {1})});
        t = s;
      } else if (cache) {  // T = P + S (K itself is the Concat that goes away)
        s = rw.op1("Gather", {rw.op1("Shape", {q3}), ints(rw, {1})});
        t = rw.op1("Add", {rw.op1("Gather", {rw.op1("Shape", {cache->past_k}), ints(rw, {2})}), s});
      } else {
        s = rw.op1("Gather", {rw.op1("Shape", {q3}), ints(rw, {1})});
        t = k3 ? rw.op1("Gather", {rw.op1("Shape", {k3}), ints(rw, {1})})
               : rw.op1("Gather", {rw.op1("Shape", {k}), ints(rw, {2})});
      }
      Value* shape = rw.op1("Concat", {ints(rw, {1, 1}), s, t}, one_attr(attr_int("axis", 0)));
      m = rw.op1("Expand", {m, shape});
    }
    if (mask_dtype == kBool) {
      m = shared_op(rw, "Where",
                    {m, float_scalar(rw, dtype, false), float_scalar(rw, dtype, true)});
    }
    bias = m;
  }

  Value* none = nullptr;
  Value* out3 = nullptr;
  Value *present_k = nullptr, *present_v = nullptr;
  if (qkv) {
    // The one place bytes are copied: the packed weight [Din, Nq+Nk+Nv] and bias (zeros where
    // a projection had none).
    const std::vector<Projection>& ps = *qkv;
    const int64_t din = ps[0].w->dims[0];
    const uint64_t elem = static_cast<uint64_t>(dtype_bits(dtype) / 8);
    std::vector<int64_t> widths;
    std::vector<std::shared_ptr<const Tensor>> ws, bs;
    for (const Projection& p : ps) {
      widths.push_back(p.n());
      ws.push_back(p.w);
      bs.push_back(p.b);
    }
    const int64_t total = widths[0] + widths[1] + widths[2];
    Value* w =
        rw.initializer("packed_qkv_weight",
                       make_tensor(dtype, {din, total}, concat_columns(ws, widths, din, elem)));
    Value* b = rw.initializer("packed_qkv_bias",
                              make_tensor(dtype, {total}, concat_columns(bs, widths, 1, elem)));
    std::vector<Attribute> a;
    a.push_back(attr_int("num_heads", hq));
    a.push_back(attr_float("scale", scale));
    if (causal) a.push_back(attr_int("unidirectional", 1));
    if (widths[2] != widths[0]) a.push_back(attr_ints("qkv_hidden_sizes", widths));
    std::vector<Value*> inputs = {ps[0].x, w, b};
    if (bias) inputs.insert(inputs.end(), {none, none, bias});
    out3 = rw.op1("Attention", inputs, std::move(a), kMsDomain);
    // Readers of a projection's shape alone read x's (same shape): the projections go dead.
    for (const Projection& p : ps) {
      if (only_feeds(p.out, node)) continue;
      const std::vector<Use> readers = p.out->uses();
      for (const Use& u : readers) u.node->set_input(u.input_index, ps[0].x);
    }
    ctx.counters["Attention (packed QKV)"] += 1;
  } else if (use_gqa) {
    Value *seqlens = nullptr, *total = nullptr, *query_lens = nullptr;
    if (inplace) {
      // seqlens_k = valid tokens - 1 per row, total = the mask's width: once for all layers.
      Value* shape = shared_op(rw, "Shape", {mask_input});
      Value* width =
          shared_op(rw, "Gather", {shape, ints(rw, {1}, true)}, one_attr(attr_int("axis", 0)));
      total = shared_op(rw, "Cast", {width}, one_attr(attr_int("to", kInt32)));
      Value* valid = shared_op(rw, "ReduceSum", {mask_input, ints(rw, {1})},
                               one_attr(attr_int("keepdims", 0)));
      Value* valid32 = shared_op(rw, "Cast", {valid}, one_attr(attr_int("to", kInt32)));
      seqlens = shared_op(rw, "Sub", {valid32, int32_scalar(rw, 1)});
    } else {
      // seqlens_k = T-1 and total = T for every row: every key is "valid" to GQA and the bias
      // does the padding, whichever side it is on. T from the mask's shape when it has (B, S)
      // or (B, S, T) (one chain for every layer), else from Q's / the past's.
      const Dim* mask_batch = mask ? dim_at(mask, 4, 0) : nullptr;
      const bool mask_bs = mask && same_dim(mask_batch, dim_at(q, 4, 0)) &&
                           same_dim(dim_at(mask, 4, 2), s_dim) &&
                           !(mask_batch->value && *mask_batch->value == 1);
      const bool mask_t = mask_bs && same_dim(dim_at(mask, 4, 3), t_dim);
      Value* shape = shared_op(rw, "Shape", {mask_bs ? mask : q3});
      Value* s = shared_op(rw, "Gather", {shape, ints(rw, {mask_bs ? 2 : 1}, true)},
                           one_attr(attr_int("axis", 0)));
      Value* t = s;
      if (cache && mask_t) {
        t = shared_op(rw, "Gather", {shape, ints(rw, {3}, true)}, one_attr(attr_int("axis", 0)));
      } else if (cache) {
        Value* p = rw.op1("Gather", {rw.op1("Shape", {cache->past_k}), ints(rw, {2}, true)},
                          one_attr(attr_int("axis", 0)));
        t = rw.op1("Add", {p, s});
      }
      total = shared_op(rw, "Cast", {t}, one_attr(attr_int("to", kInt32)));
      Value* last = shared_op(rw, "Sub", {total, int32_scalar(rw, 1)});
      Value* batch = shared_op(rw, "Gather", {shape, ints(rw, {0})}, one_attr(attr_int("axis", 0)));
      seqlens = shared_op(rw, "Expand", {last, batch});
      if (cache) {
        // query_seqlens (ORT >= 1.32): S for every row, so that a chunk after a past (S > 1,
        // P > 0) runs for batch > 1 too ("subsequent prompt" needs batch 1 without it).
        Value* s32 = shared_op(rw, "Cast", {s}, one_attr(attr_int("to", kInt32)));
        query_lens = shared_op(rw, "Expand", {s32, batch});
      }
    }
    std::vector<Attribute> a;
    a.push_back(attr_int("num_heads", hq));
    a.push_back(attr_int("kv_num_heads", hkv));
    a.push_back(attr_float("scale", scale));
    // With a cache the mask is causal by contract (internal_op.h), so GQA's causal flag (which
    // query_seqlens requires) masks nothing more.
    if (!causal && !cache) a.push_back(attr_int("causal", 0));
    // In place, GQA reads no mask: a sliding window (add_kv_cache's sliding_window, the keys a
    // query sees, itself included) must be its local_window_size, which counts the same way in
    // ORT >= 1.32 (tests/test_sliding_window.py checks). The rows are contiguous from 0 there,
    // so positions and kept keys agree. Elsewhere the bias carries the window: GQA's own would
    // count positions, holes included.
    const int64_t window = int_attr_or(node, "sliding_window", 0);
    if (window > 0 && inplace) a.push_back(attr_int("local_window_size", window));
    Value *cos = none, *sin = none;
    Value *gq = q3, *gk = k3;
    if (fold_rotary) {
      a.push_back(attr_int("do_rotary", 1));
      a.push_back(attr_int("rotary_interleaved", int_attr_or(rot_q, "interleaved", 0)));
      gq = rot_q->inputs()[0];
      gk = rot_k->inputs()[0];
      cos = rot_q->inputs()[2];
      sin = rot_q->inputs()[3];
      ctx.counters["rotary folded into GroupQueryAttention"] += 1;
      // A rotary has its input's shape: readers of its shape alone need not keep it alive.
      for (const Node* rot : {rot_q, rot_k}) {
        Value* out = rot->outputs()[0];
        if (!read_only_for_shape(out, node)) continue;
        const std::vector<Use> readers = out->uses();
        for (const Use& u : readers) u.node->set_input(u.input_index, rot->inputs()[0]);
      }
    }
    Value* past_k = cache ? cache->past_k : none;
    Value* past_v = cache ? cache->past_v : none;
    std::vector<Value*> inputs = {gq,   gk,   v3,   past_k, past_v, seqlens, total, cos,       sin,
                                  none, bias, none, none,   none,   none,    none,  query_lens};
    while (!inputs.back()) inputs.pop_back();
    std::vector<Value*> outs = rw.op("GroupQueryAttention", inputs, std::move(a), 3, kMsDomain);
    out3 = outs[0];
    present_k = outs[1];
    present_v = outs[2];
    ctx.counters[inplace ? "GroupQueryAttention (in-place cache)"
                 : cache ? "GroupQueryAttention (past/present)"
                         : "GroupQueryAttention"] += 1;
  } else {
    Value *kx = k3 ? k3 : k, *vx = v3 ? v3 : v;
    if (repeat_kv) {
      // (B, Hkv, T, D) -> (B, Hkv, G, T, D) -> (B, Hq, T, D): query head h reads kv head h/G.
      Value* expand = ints(rw, {1, 1, hq / hkv, 1, 1});
      Value* target = ints(rw, {0, hq, -1, *head_dim->value});
      auto repeat = [&](Value* x) {
        Value* x5 = rw.op1("Unsqueeze", {x, ints(rw, {2})});
        return rw.op1("Reshape", {rw.op1("Expand", {x5, expand}), target});
      };
      kx = repeat(k);
      vx = repeat(v);
    }
    std::vector<Attribute> a;
    a.push_back(attr_int("num_heads", hq));
    a.push_back(attr_float("scale", scale));
    if (mha_causal) a.push_back(attr_int("unidirectional", 1));
    std::vector<Value*> inputs = {q3, kx, vx};
    if (bias || cache) inputs.insert(inputs.end(), {none, none, bias});
    if (cache) inputs.insert(inputs.end(), {cache->past_k, cache->past_v});
    std::vector<Value*> outs =
        rw.op("MultiHeadAttention", inputs, std::move(a), cache ? 3 : 1, kMsDomain);
    out3 = outs[0];
    if (cache) {
      present_k = outs[1];
      present_v = outs[2];
    }
    ctx.counters[repeat_kv ? "MultiHeadAttention (repeated kv heads)"
                 : cache   ? "MultiHeadAttention (past/present)"
                           : "MultiHeadAttention"] += 1;
  }
  if (cache) {
    if (!adopt_presents(rw.graph(), *cache, present_k, present_v)) {
      return rw.fail("the present outputs cannot take over the Concats' graph outputs");
    }
    if (inplace) {
      for (Value* x : {cache->past_k, cache->past_v, present_k, present_v}) set_max_length(x);
    }
  }
  Graph& g = rw.graph();
  import_domain(g, kMsDomain);

  // The usual reader merges the heads back: hand it the 3-D output directly.
  Value* y = node->outputs()[0];
  std::vector<Node*> merges = head_merges(y, q);
  if (!merges.empty() && !y->is_graph_output()) {
    for (Node* r : merges) {
      if (!can_replace(g, r->outputs()[0], out3)) {
        merges.clear();
        break;
      }
    }
  }
  if (!merges.empty() && !y->is_graph_output()) {
    std::vector<Node*> transposes;
    for (const Use& u : y->uses()) transposes.push_back(u.node);
    for (Node* r : merges) {
      replace_value(g, r->outputs()[0], out3);
      g.remove_node(r);
    }
    for (Node* t : transposes) {
      if (t->alive()) g.remove_node(t);
    }
    ctx.counters["head merges folded"] += static_cast<int64_t>(merges.size());
    return std::vector<Value*>{nullptr};
  }
  Value* bshd = rw.op1("Reshape", {out3, ints(rw, {0, 0, hq, -1})});
  return std::vector<Value*>{
      rw.op1("Transpose", {bshd}, one_attr(attr_ints("perm", {0, 2, 1, 3})))};
}

}  // namespace fastopt::passes
