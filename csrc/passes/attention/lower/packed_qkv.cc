// Packed QKV for com.microsoft Attention (encoders): Q, K, V as head splits of projections of
// one 3-D input by constant weights, packed into one weight [Din, Nq+Nk+Nv] and bias.
#include "passes/attention/lower/packed_qkv.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention/head_split.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

// Add(MatMul, constant bias): the bias into `p`, `n` to the MatMul; false with the reason.
bool peel_bias(const Node*& n, Projection& p, std::string* why) {
  for (int i = 0; i < 2 && !p.b; ++i) {
    auto b = constant_tensor(n->inputs()[i]);
    const Value* product = n->inputs()[1 - i];
    const Node* mm = product->producer();
    if (!b || !mm || mm->op_type != "MatMul") continue;
    p.b = b;
    if (product->uses().size() != 1 || product->is_graph_output()) {
      *why = "a projection's MatMul has readers besides its bias Add";
      return false;
    }
    n = mm;
  }
  if (!p.b) *why = "Q/K/V is an Add that is not MatMul + constant bias";
  return p.b != nullptr;
}

bool is_binary(const Node* n, const char* op) {
  return n && is_standard(n) && n->op_type == op && n->inputs().size() == 2 && n->inputs()[0] &&
         n->inputs()[1];
}

// A constant 2-D weight and 1-D bias of its width, in Q's dtype.
std::string weights_problem(const Projection& p, int32_t dtype) {
  if (!p.w || p.w->dims.size() != 2 || p.w->dtype() != dtype) {
    return "a projection weight is not a constant 2-D tensor of Q's dtype";
  }
  if (p.b && (p.b->dims.size() != 1 || p.b->dims[0] != p.n() || p.b->dtype() != dtype)) {
    return "a projection bias is not 1-D of the weight's width and Q's dtype";
  }
  return "";
}

std::optional<Projection> projection(Value* out, int32_t dtype, std::string* why) {
  Projection p;
  p.out = out;
  const Node* n = out->producer();
  if (is_binary(n, "Add") && !peel_bias(n, p, why)) return std::nullopt;
  if (!is_binary(n, "MatMul")) {
    *why = "Q/K/V do not come from a MatMul (+ bias)";
    return std::nullopt;
  }
  p.x = n->inputs()[0];
  p.w = constant_tensor(n->inputs()[1]);
  if (std::string problem = weights_problem(p, dtype); !problem.empty()) {
    *why = std::move(problem);
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

// Q, K, V projected from one 3-D input by constant weights (Hq == Hkv checked by the caller):
// the projections (q, k, v order), or null with *why.
std::optional<std::vector<Projection>> packed_qkv(const Graph& g, const Node* node, int64_t heads,
                                                  int32_t dtype, std::string* why) {
  std::vector<Projection> ps;
  for (int i = 0; i < 3; ++i) {
    Value* x3 = bsd_source(g, node->inputs()[i], dtype);
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

Value* build_packed_attention(Rewriter& rw, const Node* node, const std::vector<Projection>& ps,
                              int64_t heads, float scale, bool causal, Value* bias) {
  // The one place bytes are copied: the packed weight [Din, Nq+Nk+Nv] and bias (zeros where
  // a projection had none).
  const int32_t dtype = ps[0].w->dtype();
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
  Value* w = rw.initializer(
      "packed_qkv_weight", make_tensor(dtype, {din, total}, concat_columns(ws, widths, din, elem)));
  Value* b = rw.initializer("packed_qkv_bias",
                            make_tensor(dtype, {total}, concat_columns(bs, widths, 1, elem)));
  std::vector<Attribute> a;
  a.push_back(attr_int("num_heads", heads));
  a.push_back(attr_float("scale", scale));
  if (causal) a.push_back(attr_int("unidirectional", 1));
  if (widths[2] != widths[0]) a.push_back(attr_ints("qkv_hidden_sizes", widths));
  Value* none = nullptr;
  std::vector<Value*> inputs = {ps[0].x, w, b};
  if (bias) inputs.insert(inputs.end(), {none, none, bias});
  Value* out3 = rw.op1("Attention", inputs, std::move(a), kMsDomain);
  // Readers of a projection's shape alone read x's (same shape): the projections go dead.
  for (const Projection& p : ps) {
    if (only_feeds(p.out, node)) continue;
    const std::vector<Use> readers = p.out->uses();
    for (const Use& u : readers) u.node->set_input(u.input_index, ps[0].x);
  }
  return out3;
}

}  // namespace fastopt::passes
