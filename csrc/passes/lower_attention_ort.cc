// Lowering of the internal Attention op (attention.h) for target "ort": com.microsoft
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
// GQA fits when T == S is shown by the shapes (it takes K/V of the query's length) and the
// head size is static, a multiple of 8 (kernel check) and the same for K and V.
//
// Masks become the ops' additive attention_bias (B|1, Hq|1, S, T), expanded over (S, T) when
// the mask broadcasts there: Where(mask, 0, lowest) for bool masks; additive masks are clamped
// to the dtype's lowest unless provably finite (a row of -inf is NaN in GQA fp16, and a NaN pad
// row poisons valid rows in the next layer). GQA gets seqlens_k = S-1 and total_sequence_length
// = S for every batch row, so padding on either side is the bias's job and stays exact. Rows
// whose every key is masked (pad queries) are the one difference from the internal op: 0 there,
// a finite average here. MHA's causal mask is top-left aligned, the internal op's bottom-right:
// causal MHA needs S == T from the shapes too (or S == 1, where causal masks nothing).
//
// Fails (the driver then writes standard ops) when: the dtype is not fp32/fp16/bf16; S == T is
// needed and not shown; GQA does not fit and MHA cannot stand in (fp16, or no static head size
// to repeat kv heads with); softmax_precision is neither the dtype nor fp32 (the kernels
// accumulate the softmax in fp32); past key/value inputs or extra outputs are present.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention.h"
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

// The same size for sure: equal numbers, or the same symbolic name.
bool same_dim(const Dim* a, const Dim* b) {
  if (!a || !b) return false;
  if (a->value && b->value) return *a->value == *b->value;
  return a->param && b->param && !a->param->empty() && *a->param == *b->param;
}

int64_t int_attr_or(const Node* n, const std::string& name, int64_t fallback) {
  const Attribute* a = n->attribute(name);
  return a && a->i ? *a->i : fallback;
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

// The (B, S, H*D) tensor that `x4` (B, H, S, D) was split from: Transpose(0,2,1,3) of a
// Reshape that keeps dims 0 and 1 (shown by the types, or a [0, 0, H, D] shape constant), or
// null.
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
  if (!keeps && int_attr_or(r, "allowzero", 0) == 0 && value_rank(x3) == 3) {
    auto shape = constant_ints(r->inputs()[1]);
    keeps = shape && shape->size() == 4 && (*shape)[0] == 0 && (*shape)[1] == 0;
  }
  return keeps && value_dtype(x3) == dtype ? x3 : nullptr;
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
    if (!n || !n->domain.value.empty() || n->inputs().empty() ||
        (n->op_type != "Transpose" && n->op_type != "Reshape" && n->op_type != "Identity")) {
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

std::vector<Attribute> attrs_of(Attribute a) {
  std::vector<Attribute> out;
  out.push_back(std::move(a));
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
  for (const Value* x : {q, k, v}) {
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
  const Dim* head_dim = dim_at(k, 4, 3);
  const bool static_head = head_dim && head_dim->value;
  const bool same_len = same_dim(s_dim, t_dim);
  // One query row sees every key under bottom-right alignment: no causal mask at all.
  const bool one_row = s_dim && s_dim->value && *s_dim->value == 1;
  const bool mha_causal = causal && !one_row;
  // GQA takes K/V of the query's length, one head size for K and V, a multiple of 8.
  const bool gqa_fits =
      same_len && static_head && *head_dim->value % 8 == 0 && same_dim(head_dim, dim_at(v, 4, 3));
  const bool cuda = ctx.options.count("cuda") && ctx.options.at("cuda") != 0;
  bool use_gqa = cuda ? dtype != kFloat && causal && !mask : dtype != kFloat || hkv != hq;
  // fp32 has MHA over repeated kv heads to fall back on.
  if (use_gqa && dtype == kFloat && !gqa_fits && static_head) use_gqa = false;
  const bool repeat_kv = !use_gqa && hkv != hq;

  if (use_gqa && !same_len) {
    return rw.fail("GroupQueryAttention (" + dtype_name(dtype) +
                   (dtype == kFloat ? ", Hkv < Hq" : "") +
                   ") needs S == T, not shown by the shapes of Q and K");
  }
  if (use_gqa && !gqa_fits) {
    return rw.fail(
        "GroupQueryAttention needs a static head size, a multiple of 8, the same for K and V");
  }
  if (!use_gqa && mha_causal && !same_len) {
    return rw.fail(
        "causal MultiHeadAttention needs S == T (its causal mask is top-left "
        "aligned), not shown by the shapes of Q and K");
  }
  if (repeat_kv && !static_head) {
    return rw.fail("repeating kv heads for MultiHeadAttention needs a static head size");
  }

  // 3-D operands: Q always; K/V for GQA, and for MHA when they exist already (else BNSH).
  Value* q3 = to_bsd(rw, q, dtype);
  Value *k3 = nullptr, *v3 = nullptr;
  if (use_gqa) {
    k3 = to_bsd(rw, k, dtype);
    v3 = to_bsd(rw, v, dtype);
  } else if (!repeat_kv) {
    k3 = bsd_source(rw, k, dtype);
    v3 = bsd_source(rw, v, dtype);
    if (!k3 || !v3) k3 = v3 = nullptr;
  }

  // The additive bias (B|1, Hq|1, S, T).
  Value* bias = nullptr;
  if (mask) {
    const bool full = same_dim(dim_at(mask, 4, 2), s_dim) && same_dim(dim_at(mask, 4, 3), t_dim);
    Value* m = mask;
    if (mask_dtype != kBool && !known_finite(mask)) {
      m = shared_op(rw, "Max", {m, float_scalar(rw, dtype, true)});
    }
    if (!full) {
      Value* s = rw.op1("Gather", {rw.op1("Shape", {q3}), ints(rw, {1})});
      Value* t = k3 ? rw.op1("Gather", {rw.op1("Shape", {k3}), ints(rw, {1})})
                    : rw.op1("Gather", {rw.op1("Shape", {k}), ints(rw, {2})});
      Value* shape = rw.op1("Concat", {ints(rw, {1, 1}), s, t}, attrs_of(attr_int("axis", 0)));
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
  if (use_gqa) {
    // seqlens_k = S-1 and total = S for every row: the whole prompt is "valid" to GQA and the
    // bias does the padding, whichever side it is on. From the mask's shape when it has (B, S)
    // (one chain for every layer), else from Q's.
    const Dim* mask_batch = mask ? dim_at(mask, 4, 0) : nullptr;
    const bool mask_shape = mask && same_dim(mask_batch, dim_at(q, 4, 0)) &&
                            same_dim(dim_at(mask, 4, 2), s_dim) &&
                            !(mask_batch->value && *mask_batch->value == 1);
    Value* shape = shared_op(rw, "Shape", {mask_shape ? mask : q3});
    Value* s = shared_op(rw, "Gather", {shape, ints(rw, {mask_shape ? 2 : 1}, true)},
                         attrs_of(attr_int("axis", 0)));
    Value* total = shared_op(rw, "Cast", {s}, attrs_of(attr_int("to", kInt32)));
    Value* last = shared_op(rw, "Sub", {total, int32_scalar(rw, 1)});
    Value* batch = shared_op(rw, "Gather", {shape, ints(rw, {0})}, attrs_of(attr_int("axis", 0)));
    Value* seqlens = shared_op(rw, "Expand", {last, batch});
    std::vector<Attribute> a;
    a.push_back(attr_int("num_heads", hq));
    a.push_back(attr_int("kv_num_heads", hkv));
    a.push_back(attr_float("scale", scale));
    if (!causal) a.push_back(attr_int("causal", 0));
    std::vector<Value*> inputs = {q3, k3, v3, none, none, seqlens, total, none, none, none, bias};
    if (!bias) inputs.resize(7);
    out3 = rw.op("GroupQueryAttention", inputs, std::move(a), 3, kMsDomain)[0];
    ctx.counters["GroupQueryAttention"] += 1;
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
    if (bias) inputs.insert(inputs.end(), {none, none, bias});
    out3 = rw.op1("MultiHeadAttention", inputs, std::move(a), kMsDomain);
    ctx.counters[repeat_kv ? "MultiHeadAttention (repeated kv heads)" : "MultiHeadAttention"] += 1;
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
      rw.op1("Transpose", {bshd}, attrs_of(attr_ints("perm", {0, 2, 1, 3})))};
}

}  // namespace fastopt::passes
