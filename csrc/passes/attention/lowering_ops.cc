#include "passes/attention/lowering_ops.h"

#include <cstring>
#include <limits>
#include <utility>

#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/fusion_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

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

}  // namespace

using pattern::Rewriter;

// A scalar (rank 0) of a float dtype; null for other dtypes.
std::shared_ptr<Tensor> scalar_tensor(int32_t dtype, double value) {
  std::string bytes;
  if (dtype == kFloat) {
    const float f = static_cast<float>(value);
    bytes.assign(reinterpret_cast<const char*>(&f), 4);
  } else if (dtype == kDouble) {
    bytes.assign(reinterpret_cast<const char*>(&value), 8);
  } else if (dtype == kFloat16) {
    const uint16_t h = float_to_half(static_cast<float>(value));
    bytes.assign(reinterpret_cast<const char*>(&h), 2);
  } else if (dtype == kBFloat16) {
    const float f = static_cast<float>(value);
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t b = static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
    bytes.assign(reinterpret_cast<const char*>(&b), 2);
  } else {
    return nullptr;
  }
  return make_tensor(dtype, {}, std::move(bytes));
}

Value* constant(Rewriter& rw, const std::string& base, std::shared_ptr<Tensor> t) {
  const Graph* top = &rw.graph();
  while (top->parent()) top = top->parent();
  if (top == top->model()->graph.get()) return rw.initializer(base, std::move(t));
  std::vector<Attribute> attrs;
  attrs.push_back(attr_tensor("value", std::move(t)));
  return rw.op1("Constant", {}, std::move(attrs));
}

Value* ints(Rewriter& rw, const std::vector<int64_t>& v, bool scalar) {
  std::vector<int64_t> dims;
  if (!scalar) dims.push_back(static_cast<int64_t>(v.size()));
  return constant(rw, "attention_shape", make_int64_tensor(v, dims));
}

Value* int32_scalar(Rewriter& rw, int32_t x) {
  std::string bytes(sizeof x, '\0');
  std::memcpy(bytes.data(), &x, sizeof x);
  return constant(rw, "attention_one", make_tensor(kInt32, {}, std::move(bytes)));
}

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

Value* shared_op(Rewriter& rw, const std::string& op, const std::vector<Value*>& inputs,
                 std::vector<Attribute> attrs) {
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

Value* reduce(Rewriter& rw, const std::string& op, Value* x, const std::vector<int64_t>& axes,
              bool keepdims, bool shared) {
  std::vector<Attribute> attrs;
  attrs.push_back(attr_int("keepdims", keepdims ? 1 : 0));
  std::vector<Value*> inputs = {x};
  if (default_opset(*rw.graph().model()) >= (op == "ReduceSum" ? 13 : 18)) {
    inputs.push_back(ints(rw, axes));
  } else {
    attrs.push_back(attr_ints("axes", axes));
  }
  return shared ? shared_op(rw, op, inputs, std::move(attrs))
                : rw.op1(op, inputs, std::move(attrs));
}

}  // namespace fastopt::passes
