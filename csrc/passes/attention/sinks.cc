// Recognises and writes attention sinks (sinks.h).
#include "passes/attention/sinks.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir/constant.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::attention_sinks {
namespace {
using pattern::attr_int;

bool is_last_axis(const std::optional<std::vector<int64_t>>& axes) {
  return axes && axes->size() == 1 && ((*axes)[0] == -1 || (*axes)[0] == 3);
}

// ReduceMax(x) over the last axis with keepdims (axes as an input from opset 18, else an
// attribute): a per-row shift, which a softmax ignores.
bool row_max_of(const Node* r, const Value* x) {
  if (!r || r->inputs().empty() || r->inputs()[0] != x || int_attr_or(r, "keepdims", 1) != 1) {
    return false;
  }
  if (r->inputs().size() > 1) return is_last_axis(constant_ints(r->inputs()[1], 4));
  const Attribute* axes = r->attribute("axes");
  return axes && is_last_axis(axes->ints);
}

// Whether `c` holds one value per head: (1, H, 1, 1) or (H, 1, 1).
bool per_head(const Tensor& c) {
  const auto& d = c.dims;
  if (d.size() == 4) return d[0] == 1 && d[2] == 1 && d[3] == 1;
  return d.size() == 3 && d[1] == 1 && d[2] == 1;
}

}  // namespace

std::optional<Sinks> match_sinks(Value* probs, std::string& why) {
  Node* slice = standard_producer(probs, "Slice");
  if (!slice) return std::nullopt;
  auto fail = [&why](std::string reason) {
    why = "attention sinks: " + std::move(reason);
    return std::nullopt;
  };
  const std::vector<Value*>& in = slice->inputs();
  if (in.size() < 4 || in.size() > 5) return fail("a Slice of the probabilities without axes");
  const auto starts = constant_ints(in[1], 4), ends = constant_ints(in[2], 4);
  const std::optional<std::vector<int64_t>> steps =
      in.size() == 5 ? constant_ints(in[4], 4) : std::vector<int64_t>{1};
  if (!is_last_axis(constant_ints(in[3], 4)) || starts != std::vector<int64_t>{0} ||
      ends != std::vector<int64_t>{-1} || steps != std::vector<int64_t>{1}) {
    return fail("the probabilities are a Slice other than [..., :-1] on the last axis");
  }
  Sinks s;
  s.nodes.push_back(slice);
  s.softmax = standard_producer(in[0], "Softmax");
  if (!s.softmax) return fail("the sliced probabilities are not a Softmax");
  s.nodes.push_back(s.softmax);
  Value* x = s.softmax->inputs()[0];
  if (Node* sub = standard_producer(x, "Sub")) {  // x - max(x): a shift the softmax ignores
    Node* max = standard_producer(sub->inputs()[1], "ReduceMax");
    if (!row_max_of(max, sub->inputs()[0])) {
      return fail("the softmax reads a Sub other than x - ReduceMax(x) over the keys");
    }
    s.nodes.push_back(sub);
    s.nodes.push_back(max);
    x = sub->inputs()[0];
  }
  Node* cat = standard_producer(x, "Concat");
  if (!cat || cat->inputs().size() != 2 ||
      (int_attr_or(cat, "axis", 0) != -1 && int_attr_or(cat, "axis", 0) != 3)) {
    return fail("the softmax does not read Concat(scores, sink column) on the last axis");
  }
  s.nodes.push_back(cat);
  Value* column = cat->inputs()[1];
  Node* expand = standard_producer(column, "Expand");
  s.logits = expand ? expand->inputs()[0] : column;
  const std::shared_ptr<const Tensor> c = constant_tensor(s.logits);
  if (!c || !per_head(*c))
    return fail("the column joined to the scores is not one constant per head");
  if (resolve_dim(column, -1) != 1) return fail("the sink column is not one key wide");
  if (expand) s.nodes.push_back(expand);
  s.scores = cat->inputs()[0];
  return s;
}

std::shared_ptr<Tensor> head_logits(const Value* logits, int32_t dtype, int64_t heads) {
  const std::shared_ptr<const Tensor> c = constant_tensor(logits);
  if (!c || c->dtype() != dtype || static_cast<int64_t>(c->numel()) != heads) return nullptr;
  const ByteRef bytes = c->bytes();
  return make_tensor(dtype, {heads},
                     std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size));
}

Value* softmax_with_sinks(pattern::Rewriter& rw, Value* s, Value* sinks) {
  auto ints = [&rw](const char* name, std::vector<int64_t> values) {
    const auto n = static_cast<int64_t>(values.size());
    return rw.initializer(name, make_int64_tensor(values, {n}));
  };
  // The (B, H, S, 1) column: the logits as (1, H, 1, 1), expanded to s's leading dims.
  Value* column = rw.op1("Reshape", {sinks, ints("attention_sink_dims", {1, -1, 1, 1})});
  if (const int32_t t = dtype_of(s); t != dtype_of(sinks)) {
    column = rw.op1("Cast", {column}, one_attr(attr_int("to", t)));
  }
  Value* zero = ints("attention_zero_1d", {0});
  Value* leading = rw.op1("Slice", {rw.op1("Shape", {s}), zero, ints("attention_three_1d", {3})});
  Value* target =
      rw.op1("Concat", {leading, ints("attention_one_1d", {1})}, one_attr(attr_int("axis", 0)));
  column = rw.op1("Expand", {column, target});
  Value* p = rw.op1("Softmax", {rw.op1("Concat", {s, column}, one_attr(attr_int("axis", -1)))},
                    one_attr(attr_int("axis", -1)));
  return rw.op1("Slice",
                {p, zero, ints("attention_minus_one_1d", {-1}), ints("attention_last_axis", {-1})});
}

}  // namespace fastopt::passes::attention_sinks
