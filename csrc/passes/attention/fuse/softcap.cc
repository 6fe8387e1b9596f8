// Recognises c * tanh(s / c) (softcap.h).
#include "passes/attention/fuse/softcap.h"

#include <cmath>

#include "ir/constant.h"
#include "passes/attention/shapes.h"

namespace fastopt::passes::attention_softcap {
namespace {

// A positive finite constant with one element (a rank-0 or one-element factor: broadcasting it
// changes no shape of the 4-D scores).
std::optional<double> positive_scalar(const Value* v) {
  if (value_rank(v) > 4) return std::nullopt;
  auto c = constant_scalar(v);
  if (!c || !std::isfinite(*c) || *c <= 0) return std::nullopt;
  return c;
}

// Relative agreement of two float constants written for the same c (c and 1/c rounded to float).
bool close(double a, double b) {
  return std::fabs(a - b) <= 1e-6 * std::fabs(b);
}

}  // namespace

std::optional<Softcap> match_softcap(Value* x) {
  Node* outer = standard_producer(x, "Mul", 2);
  if (!outer) return std::nullopt;
  for (int i = 0; i < 2; ++i) {
    auto cap = positive_scalar(outer->inputs()[1 - i]);
    Node* tanh = standard_producer(outer->inputs()[i], "Tanh", 1);
    if (!cap || !tanh) continue;
    Value* inside = tanh->inputs()[0];
    Value* s = nullptr;
    Node* inner = nullptr;
    if (Node* div = standard_producer(inside, "Div", 2)) {
      auto d = positive_scalar(div->inputs()[1]);
      if (d && close(*d, *cap)) {
        inner = div;
        s = div->inputs()[0];
      }
    } else if (Node* mul = standard_producer(inside, "Mul", 2)) {
      for (int j = 0; j < 2 && !inner; ++j) {
        auto m = positive_scalar(mul->inputs()[1 - j]);
        if (m && close(*m * *cap, 1.0)) {
          inner = mul;
          s = mul->inputs()[j];
        }
      }
    }
    if (!inner) continue;
    return Softcap{*cap, s, {outer, tanh, inner}};
  }
  return std::nullopt;
}

}  // namespace fastopt::passes::attention_softcap
