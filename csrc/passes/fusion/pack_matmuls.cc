// MatMuls that share their input and have constant weights -> one wide MatMul + Split; and a
// Split feeding GroupQueryAttention's query/key/value -> GQA's packed-QKV form.
//
//        A [.., K]                                      A [.., K]
//      /     |     \                                       |
//  MatMul  MatMul  MatMul   W_i [K, N_i]    ==>    MatMul(A, concat_N(W_i)) [.., sum N_i]
//  (+b_i)? (+b_i)? (+b_i)?  b_i [N_i]               (+ Add(concat(b_i)))?
//     |      |      |                                      |
//     q      k      v                           Split(axis -1, sizes N_i) -> q, k, v
//
//    Split(qkv, axis -1, (H*D, Hkv*D, Hkv*D)) -> q, k, v -> GroupQueryAttention(q, k, v, ...)
//                             ==>   GroupQueryAttention(qkv, "", "", ...)
//
// Every decoder projects the normed hidden state with Q/K/V MatMuls and a SwiGLU MLP with
// gate/up MatMuls (both exporters; Phi-3 already exports packed qkv and gate_up). Biases (Qwen2's
// q/k/v) are packed too when every MatMul of the group has exactly one reader, an Add of a 1-D
// constant of length N_i.
//
// When it pays: measured on ORT 1.32 CPU (optimizations on, fp32, hidden 896, Q 896 / K,V 128,
// gate/up 4864 each): packing changes nothing (seq 128: qkv 1.70 vs 1.70 ms, gate/up 16.3 vs
// 16.1 ms; seq 1: 0.150 vs 0.161 ms, 1.20 vs 1.22 ms; with biases gate/up got slower, 22 vs 30
// ms), since MLAS runs one GEMM per MatMul at full speed either way and the Split adds a copy.
// So by default (option pack_matmuls = 0) a group is packed only when its outputs are exactly the
// query/key/value of one GroupQueryAttention, which then reads the packed tensor with no Split
// at all. Option pack_matmuls = 1 packs every group (runtimes where fewer, wider GEMMs pay:
// kernel launches on GPUs, small-M decode on some backends); -1 turns packing off.
// Split needs sizes as an input, so packing needs default opset >= 13.
#include <algorithm>
#include <map>

#include "ir/column_concat.h"
#include "ir/constant.h"
#include "ir/uninit_buffer.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

bool is_gqa(const Node* n) {
  return n->op_type == "GroupQueryAttention" && n->domain.value == kMsDomain;
}

// One MatMul of a group: its weight and, when it has one, its bias Add.
struct Member {
  Node* matmul;
  std::shared_ptr<const Tensor> weight;  // [K, N]
  Node* add = nullptr;                   // Add(out, b)
  std::shared_ptr<const Tensor> bias;    // [N]
  int64_t n() const { return weight->dims[1]; }
  Value* out() const { return add ? add->outputs()[0] : matmul->outputs()[0]; }
};

// The bias Add reading `mm` (its only reader), or null.
Node* bias_add(const Node* mm, int64_t n, int32_t dtype, std::shared_ptr<const Tensor>* bias) {
  const Value* out = mm->outputs()[0];
  if (out->is_graph_output() || out->uses().size() != 1) return nullptr;
  Node* add = out->uses()[0].node;
  if (add->op_type != "Add" || !add->domain.value.empty() || add->inputs().size() != 2) {
    return nullptr;
  }
  const Value* other = add->inputs()[1 - out->uses()[0].input_index];
  auto b = constant_tensor(other);
  if (!b || b->dims.size() != 1 || b->dims[0] != n || b->dtype() != dtype) return nullptr;
  *bias = b;
  return add;
}

// Row-major [rows, n_i] tensors side by side along their last axis, as bytes made when read
// (column_concat.h: a save streams them from the sources; typed-field tensors: decoded copies,
// kept alive by the buffer).
std::shared_ptr<const Buffer> concat_columns(const std::vector<std::shared_ptr<const Tensor>>& ts,
                                             int64_t rows, uint64_t elem) {
  std::vector<ByteRef> src;
  std::vector<uint64_t> row_bytes;
  for (const auto& t : ts) {
    src.push_back(t->bytes());
    row_bytes.push_back(static_cast<uint64_t>(t->dims.back()) * elem);
  }
  return std::make_shared<ColumnConcatBuffer>(std::move(src), std::move(row_bytes),
                                              static_cast<uint64_t>(rows));
}

// The group reordered as GQA's (query, key, value) when its outputs are exactly those three
// inputs of one GQA node with sizes (H*D, Hkv*D, Hkv*D); empty otherwise.
std::vector<Member> gqa_order(const std::vector<Member>& group) {
  if (group.size() != 3) return {};
  std::vector<Member> out(3, group[0]);
  const Node* gqa = nullptr;
  bool seen[3] = {false, false, false};
  for (const Member& m : group) {
    const Value* v = m.out();
    if (v->is_graph_output() || v->uses().size() != 1) return {};
    const Use& u = v->uses()[0];
    if (!is_gqa(u.node) || u.input_index > 2 || (gqa && u.node != gqa)) return {};
    gqa = u.node;
    if (seen[u.input_index]) return {};
    seen[u.input_index] = true;
    out[u.input_index] = m;
  }
  if (!mistyped_reason(gqa).empty()) return {};  // ORT refuses it: never rewired
  const int64_t h = int_attr_or(gqa, "num_heads", 0), hkv = int_attr_or(gqa, "kv_num_heads", 0);
  if (h <= 0 || hkv <= 0 || out[0].n() % h) return {};
  const int64_t d = out[0].n() / h;
  if (out[1].n() != hkv * d || out[2].n() != hkv * d) return {};
  return out;
}

class Packer {
 public:
  Packer(Graph& g, PassContext& ctx) : g_(g), ctx_(ctx) {}

  // MatMul groups keyed by (A, dtype, K), in node order.
  int64_t pack_all(int64_t mode) {
    std::map<std::tuple<Value*, int32_t, int64_t>, std::vector<Member>> groups;
    std::vector<std::tuple<Value*, int32_t, int64_t>> order;
    for (Node* n = g_.first(); n; n = n->next()) {
      if (n->op_type != "MatMul" || !n->domain.value.empty() || n->inputs().size() != 2) continue;
      if (!mistyped_reason(n).empty()) continue;
      Value *a = n->inputs()[0], *b = n->inputs()[1];
      if (!a || !b || a == b) continue;
      auto w = constant_tensor(b);
      if (!w || w->dims.size() != 2 || dtype_bits(w->dtype()) % 8 != 0 || w->numel() == 0) {
        continue;
      }
      if (value_dtype(a) != 0 && value_dtype(a) != w->dtype()) continue;
      auto key = std::make_tuple(a, w->dtype(), w->dims[0]);
      auto& members = groups[key];
      if (members.empty()) order.push_back(key);
      members.push_back(Member{n, w, nullptr, nullptr});
    }
    int64_t packed = 0;
    for (const auto& key : order) {
      std::vector<Member>& group = groups[key];
      if (group.size() < 2) continue;
      // Biases: all or none.
      std::vector<Member> with_bias = group;
      bool all = true;
      for (Member& m : with_bias) {
        m.add = bias_add(m.matmul, m.n(), m.weight->dtype(), &m.bias);
        all = all && m.add;
      }
      if (all) group = with_bias;
      Node* first = group[0].matmul;  // the earliest: members were collected in node order
      if (mode == 0) {
        group = gqa_order(group);
        if (group.empty()) continue;
      }
      pack(group, first);
      ++packed;
    }
    return packed;
  }

  // GQA(q, k, v) where q, k, v = Split(qkv) -> GQA(qkv, "", "").
  int64_t unsplit_gqa() {
    int64_t changed = 0;
    for (Node* n = g_.first(); n; n = n->next()) {
      Node* split = qkv_split(n);
      if (!split || !splits_heads(split, n)) continue;
      n->set_input(0, split->inputs()[0]);
      n->set_input(1, nullptr);
      n->set_input(2, nullptr);
      remove_dead(g_, {split});
      ++ctx_.counters["gqa_packed_qkv"];
      ++changed;
    }
    return changed;
  }

 private:
  // The Split whose outputs 0, 1, 2 are the GQA node `n`'s q, k, v, or null.
  static Node* qkv_split(const Node* n) {
    if (!is_gqa(n) || n->inputs().size() < 3 || !mistyped_reason(n).empty()) return nullptr;
    const Value *q = n->inputs()[0], *k = n->inputs()[1], *v = n->inputs()[2];
    if (!q || !k || !v) return nullptr;
    Node* split = q->producer();
    if (!split || split->op_type != "Split" || !split->domain.value.empty() ||
        k->producer() != split || v->producer() != split || split->outputs().size() != 3 ||
        q->producer_output() != 0 || k->producer_output() != 1 || v->producer_output() != 2 ||
        !mistyped_reason(split).empty()) {
      return nullptr;
    }
    return split;
  }

  // The Split cuts the last axis into H * D, Hkv * D, Hkv * D (the heads of GQA node `n`).
  static bool splits_heads(const Node* split, const Node* n) {
    const int rank = value_rank(split->inputs()[0]);
    const int64_t axis = int_attr_or(split, "axis", 0);
    if (!(axis == -1 || (rank > 0 && axis == rank - 1))) return false;
    std::optional<std::vector<int64_t>> sizes;
    if (split->inputs().size() > 1 && split->inputs()[1]) {
      sizes = constant_ints(split->inputs()[1]);
    } else if (const Attribute* a = split->attribute("split")) {
      sizes = a->ints;
    }
    if (!sizes || sizes->size() != 3) return false;
    const int64_t h = int_attr_or(n, "num_heads", 0), hkv = int_attr_or(n, "kv_num_heads", 0);
    if (h <= 0 || hkv <= 0 || (*sizes)[0] % h) return false;
    const int64_t d = (*sizes)[0] / h;
    return (*sizes)[1] == hkv * d && (*sizes)[2] == hkv * d;
  }

  // `first`: the group's earliest MatMul (where A is defined for all of them).
  void pack(const std::vector<Member>& group, Node* first) {
    const int64_t k = group[0].weight->dims[0];
    const int32_t dtype = group[0].weight->dtype();
    const uint64_t elem = static_cast<uint64_t>(dtype_bits(dtype) / 8);
    std::vector<std::shared_ptr<const Tensor>> ws, bs;
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (const Member& m : group) {
      ws.push_back(m.weight);
      if (m.bias) bs.push_back(m.bias);
      sizes.push_back(m.n());
      total += m.n();
    }
    Rewriter rw(g_, first);  // inserts before the group's first MatMul, where A is defined
    Value* w = rw.initializer("packed_weight",
                              make_tensor(dtype, {k, total}, concat_columns(ws, k, elem)));
    Value* y = rw.op1("MatMul", {first->inputs()[0], w});
    if (!bs.empty()) {
      Value* b =
          rw.initializer("packed_bias", make_tensor(dtype, {total}, concat_columns(bs, 1, elem)));
      y = rw.op1("Add", {y, b});
    }
    std::vector<Attribute> attrs;
    attrs.push_back(attr_int("axis", -1));
    std::vector<Value*> parts =
        rw.op("Split",
              {y, rw.initializer("split_sizes", make_int64_tensor(sizes, {int64_t(sizes.size())}))},
              std::move(attrs), static_cast<int>(sizes.size()));
    std::vector<Node*> old;
    for (size_t i = 0; i < group.size(); ++i) {
      replace_value(g_, group[i].out(), parts[i]);
      old.push_back(group[i].matmul);
      if (group[i].add) old.push_back(group[i].add);
    }
    remove_dead(g_, old);
    ++ctx_.counters[bs.empty() ? "packed_matmuls" : "packed_matmuls_with_bias"];
    ctx_.counters["matmuls_packed"] += static_cast<int64_t>(group.size());
  }

  Graph& g_;
  PassContext& ctx_;
};

int64_t pack_matmuls(Model& model, PassContext& ctx) {
  const int64_t mode = option(ctx, "pack_matmuls", 0);
  const bool can_split = default_opset(model) >= 13;
  int64_t total = 0;
  model.for_each_graph([&](Graph& g) {
    Packer p(g, ctx);
    if (mode >= 0 && can_split) total += p.pack_all(mode);
    if (ctx.target == Target::kOrt) total += p.unsplit_gqa();
  });
  return total;
}

const PassRegistrar kRegister{
    PassDecl("pack_matmuls",
             "pack MatMuls sharing an input with constant 2-D weights (and 1-D bias Adds) into one "
             "MatMul + Split (option pack_matmuls: 0 = only for GroupQueryAttention's packed QKV, "
             "1 = always, -1 = never); Split -> GQA q/k/v becomes GQA's packed-QKV input")
        .tags({"fusion", "llm"})
        .run(pack_matmuls)
        .options(
            {OptionDecl("pack_matmuls", "pack projections sharing an input into one MatMul")
                 .default_value(0)
                 .choices(
                     {{-1, "never"}, {0, "Q/K/V of a GroupQueryAttention"}, {1, "every group"}})})};

}  // namespace
}  // namespace fastopt::passes
