// Casts that change nothing, and Cast chains through a lossless intermediate type.
//
//   x:T ── Cast(to=T) ── y                 =>  x
//   x:T ── CastLike(like:T) ── y           =>  x
//   x:X ── Cast(to=A) ── Cast(to=B) ── y   =>  x:X ── Cast(to=B) ── y   (x when B == X)
//
// Mixed-precision exports (torch autocast, fp16 conversion scripts) wrap ops in Cast pairs such
// as fp16 -> fp32 -> fp16, and TorchScript exports Cast a value to the type it already has. The
// chain folds only when A holds every value of X exactly: int64 -> int32 -> int64 truncates, so
// it must stay. Types come from value_info, initializers and Constant nodes; unknown -> no-op.
#include "ir/constant.h"
#include "passes/cleanup/cleanup_util.h"
#include "passes/registry.h"

namespace fastopt::passes {
namespace {
using namespace pattern;
using cleanup::forward;
using cleanup::has_attr_refs;

bool is_float(int32_t t) {
  return t == kFloat || t == kFloat16 || t == kBFloat16 || t == kDouble;
}

bool is_int(int32_t t) {
  switch (t) {
    case kBool:
    case kInt8:
    case kUint8:
    case kInt16:
    case kUint16:
    case kInt32:
    case kUint32:
    case kInt64:
    case kUint64: return true;
    default: return false;
  }
}

// Every value of `from` is exactly representable in `to`. 8-bit and 4-bit floats are left out
// on purpose (saturation and NaN encodings differ between them).
bool lossless(int32_t from, int32_t to) {
  if (from == to) return true;
  auto in = [to](std::initializer_list<int32_t> types) {
    return std::find(types.begin(), types.end(), to) != types.end();
  };
  switch (from) {
    case kBool: return is_int(to) || is_float(to);
    case kUint8:
      return in({kUint16, kInt16, kUint32, kInt32, kUint64, kInt64, kFloat16, kBFloat16, kFloat,
                 kDouble});
    case kInt8: return in({kInt16, kInt32, kInt64, kFloat16, kBFloat16, kFloat, kDouble});
    case kUint16: return in({kUint32, kInt32, kUint64, kInt64, kFloat, kDouble});
    case kInt16: return in({kInt32, kInt64, kFloat, kDouble});
    case kUint32: return in({kUint64, kInt64, kDouble});
    case kInt32: return in({kInt64, kDouble});
    case kFloat16:
    case kBFloat16: return in({kFloat, kDouble});
    case kFloat: return to == kDouble;
    default: return false;
  }
}

// The `to` of a plain Cast: only `to` and `saturate` (which matters for 8-bit floats only,
// excluded above) are understood; anything else (round_mode, refs) leaves the node alone.
std::optional<int32_t> cast_to(const Node* n) {
  if (has_attr_refs(n)) return std::nullopt;
  std::optional<int32_t> to;
  for (const auto& a : n->attributes) {
    if (a.name == "to" && a.i) {
      to = static_cast<int32_t>(*a.i);
    } else if (a.name != "saturate") {
      return std::nullopt;
    }
  }
  return to;
}

Replacement same_type_cast(const Match& m, Rewriter& rw) {
  Value* x = m.value("x");
  auto to = cast_to(m.root());
  if (!to) return rw.fail("Cast without a plain 'to' attribute");
  const int32_t from = value_dtype(x);
  if (from == 0) return rw.fail("the input's type is unknown");
  if (from != *to) return rw.fail("the Cast changes the type");
  return forward(x, m, rw);
}

Replacement same_type_cast_like(const Match& m, Rewriter& rw) {
  if (has_attr_refs(m.root())) return rw.fail("attribute refers to a function attribute");
  const int32_t from = value_dtype(m.value("x"));
  if (from == 0 || from != value_dtype(m.value("like"))) return rw.fail("types differ or unknown");
  return forward(m.value("x"), m, rw);
}

Replacement cast_chain(const Match& m, Rewriter& rw, P inner) {
  Value* x = m.value("x");
  Node* outer = m.root();
  auto a = cast_to(m.node(inner));
  auto b = cast_to(outer);
  if (!a || !b) return rw.fail("Cast without a plain 'to' attribute");
  const int32_t t = value_dtype(x);
  if (t == 0) return rw.fail("the input's type is unknown");
  if (!lossless(t, *a)) return rw.fail("the intermediate type loses values of the input type");
  // int -> float -> int: out-of-range float-to-int conversion is not the wrap-around of a direct
  // int-to-int Cast. Fold only when the final type holds the input exactly.
  if (is_int(t) && is_float(*a) && is_int(*b) && *b != kBool && !lossless(t, *b)) {
    return rw.fail("int -> float -> narrower int differs from a direct Cast out of range");
  }
  if (*b == t && can_replace(rw.graph(), outer->outputs()[0], x)) return std::vector<Value*>{x};
  outer->set_input(0, x);  // every check is done: edit in place, keeping the node's name
  return outer->outputs();
}

std::vector<Rule> rules(const PassContext&) {
  std::vector<Rule> out;
  {
    auto p = std::make_shared<Pattern>("fold_cast_chain");
    P inner = p->op("Cast", {p->var("x")}).shared();  // other users keep it
    p->root(p->op("Cast", {inner}));
    out.push_back({"fold_cast_chain", p,
                   [inner](const Match& m, Rewriter& rw) { return cast_chain(m, rw, inner); }});
  }
  {
    auto p = std::make_shared<Pattern>("eliminate_cast");
    p->root(p->op("Cast", {p->var("x")}));
    out.push_back({"eliminate_cast", p, same_type_cast});
  }
  {
    auto p = std::make_shared<Pattern>("eliminate_cast_like");
    p->root(p->op("CastLike", {p->var("x"), p->var("like")}));
    out.push_back({"eliminate_cast_like", p, same_type_cast_like});
  }
  return out;
}

const PassRegistrar kRegister{rule_pass(
    "eliminate_cast",
    "remove Casts to the type a value already has; fold Cast chains through lossless types",
    {"cleanup"}, rules)};

}  // namespace
}  // namespace fastopt::passes
