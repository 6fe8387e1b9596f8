// The evaluator's arithmetic: Cast/CastLike, Neg/Abs/Not/Sqrt and the elementwise binary ops
// (arithmetic, comparisons, logic, Min/Max), bit-exact with ONNX Runtime's CPU kernels or
// declined (float16 arithmetic goes to the ONNX Runtime fallback, except where
// FoldLimits::half_arith asks for it: the mask proof).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "eval/evaluator_class.h"

namespace fastopt::eval {

Result Evaluator::cast() {
  auto x = in(0);
  if (!x) return std::nullopt;
  int32_t to;
  if (n_.op_type == "Cast") {
    if (opset_ < 6 || !attr_i("to")) return std::nullopt;  // a string attribute before 6
    to = static_cast<int32_t>(*attr_i("to"));
  } else {
    if (!has_input(1)) return std::nullopt;
    to = inputs_[1]->dtype();
  }
  if (to == x->dtype) {
    if (!view_fits(*x)) return std::nullopt;
    return one(view(*x, x->dims));
  }
  if (!fits(to, x->dims)) return std::nullopt;
  const bool from_ok = is_float(x->dtype) || is_int(x->dtype) || x->dtype == kUint64;
  const bool to_half = to == kFloat16 && limits_.half_arith && x->dtype != kDouble &&
                       x->dtype != kUint64;  // a double would be rounded twice
  const bool to_ok = to == kFloat || to == kDouble || is_int(to) || to == kUint64 || to_half;
  if (!from_ok || !to_ok) return unsupported();
  std::string bytes;
  for (uint64_t i = 0; i < x->numel; ++i) {
    if (is_float(x->dtype)) {
      const double v = x->f(i);
      if (to == kFloat || to == kDouble || to == kFloat16) {
        put_float(bytes, to, v);
      } else if (to == kBool) {
        put_int(bytes, to, v != 0 || std::isnan(v));
      } else {
        // Out of range (or NaN) is undefined behaviour in the runtime's static_cast (x86 gives
        // INT_MIN, other machines saturate).
        const double t = std::trunc(v);
        if (!std::isfinite(v) || !in_range(t, to)) {
          return refuse("undefined_cast",
                        "a float out of the integer type's range (or NaN): ONNX Runtime's "
                        "result is machine-dependent");
        }
        if (to == kUint64)
          put_int(bytes, to, static_cast<int64_t>(static_cast<uint64_t>(t)));
        else
          put_int(bytes, to, static_cast<int64_t>(t));
      }
    } else if (x->dtype == kUint64) {
      const uint64_t u = static_cast<uint64_t>(x->i64(i));
      if (to == kFloat)
        put_float(bytes, to, static_cast<float>(u));
      else if (to == kDouble)
        put_float(bytes, to, static_cast<double>(u));
      else
        put_int(bytes, to, to == kBool ? u != 0 : static_cast<int64_t>(u));
    } else {
      const int64_t v = x->i64(i);
      if (to == kFloat16 && (v < -2048 || v > 2048)) return unsupported();  // exact up to 2048
      if (to == kFloat || to == kFloat16)
        put_float(bytes, to, static_cast<float>(v));  // one rounding, as the runtime does
      else if (to == kDouble)
        put_float(bytes, to, static_cast<double>(v));
      else
        put_int(bytes, to, v);  // wraps, as static_cast does
    }
  }
  return one(owned(to, x->dims, std::move(bytes)));
}

bool Evaluator::in_range(double t, int32_t to) {
  switch (to) {
    case kInt8: return t >= -128 && t <= 127;
    case kUint8: return t >= 0 && t <= 255;
    case kInt16: return t >= -32768 && t <= 32767;
    case kUint16: return t >= 0 && t <= 65535;
    case kInt32: return t >= -2147483648.0 && t <= 2147483647.0;
    case kUint32: return t >= 0 && t <= 4294967295.0;
    case kInt64: return t >= -9223372036854775808.0 && t < 9223372036854775808.0;
    case kUint64: return t >= 0 && t < 18446744073709551616.0;
    default: return false;
  }
}

Result Evaluator::unary() {
  auto x = in(0);
  if (!x) return std::nullopt;
  const std::string& op = n_.op_type;
  const int32_t dt = x->dtype;
  if (!fits(dt, x->dims)) return std::nullopt;
  const bool floats = dt == kFloat || dt == kDouble;
  const bool ok = op == "Not"    ? dt == kBool
                  : op == "Sqrt" ? floats
                                 : floats || (is_int(dt) && dt != kBool);
  if (!ok) return unsupported();
  std::string bytes;
  for (uint64_t i = 0; i < x->numel; ++i) {
    if (op == "Not") {
      put_int(bytes, dt, x->i64(i) == 0);
    } else if (op == "Sqrt") {
      // IEEE square roots are correctly rounded: float's own, not a rounded double's.
      const double v = x->f(i);
      put_float(bytes, dt, dt == kFloat ? std::sqrt(static_cast<float>(v)) : std::sqrt(v));
    } else if (floats) {
      const double v = x->f(i);
      put_float(bytes, dt, op == "Neg" ? -v : std::fabs(v));
    } else {
      const uint64_t u = static_cast<uint64_t>(x->i64(i));
      const bool negate = op == "Neg" || x->i64(i) < 0;
      put_int(bytes, dt, static_cast<int64_t>(negate ? uint64_t{0} - u : u));
    }
  }
  return one(owned(dt, x->dims, std::move(bytes)));
}

Result Evaluator::elementwise() {
  static const std::unordered_map<std::string, std::pair<Kind, int64_t>> kOps = {
      {"Add", {Kind::kArith, 7}},
      {"Sub", {Kind::kArith, 7}},
      {"Mul", {Kind::kArith, 7}},
      {"Div", {Kind::kArith, 7}},
      {"Equal", {Kind::kCompare, 7}},
      {"Less", {Kind::kCompare, 7}},
      {"Greater", {Kind::kCompare, 7}},
      {"LessOrEqual", {Kind::kCompare, 12}},
      {"GreaterOrEqual", {Kind::kCompare, 12}},
      {"And", {Kind::kLogic, 7}},
      {"Or", {Kind::kLogic, 7}},
      {"Xor", {Kind::kLogic, 7}},
      {"Min", {Kind::kMinMax, 8}},
      {"Max", {Kind::kMinMax, 8}},
  };
  auto it = kOps.find(n_.op_type);
  if (it == kOps.end() || opset_ < it->second.second) return std::nullopt;
  const Kind kind = it->second.first;
  std::vector<Arr> xs;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    auto a = in(i);
    if (!a) return std::nullopt;
    xs.push_back(std::move(*a));
  }
  if (xs.empty() || (kind != Kind::kMinMax && xs.size() != 2)) return std::nullopt;
  const int32_t dt = xs[0].dtype;
  for (const Arr& a : xs) {
    if (a.dtype != dt) return std::nullopt;
  }
  std::vector<const Dims*> shapes;
  for (const Arr& a : xs) shapes.push_back(&a.dims);
  auto out = broadcast(shapes);
  const int32_t out_dt = kind == Kind::kCompare ? kBool : dt;
  if (!out || !fits(out_dt, *out)) return std::nullopt;
  const bool fp = dt == kFloat || dt == kDouble;
  const bool integral = is_int(dt) && dt != kBool;
  const bool half_ok = dt == kFloat16 && limits_.half_arith && kind == Kind::kArith &&
                       n_.op_type != "Div";  // FoldLimits::half_arith
  switch (kind) {
    case Kind::kArith:
    case Kind::kMinMax:
      if (!fp && !integral && !half_ok) return unsupported();
      break;
    case Kind::kCompare:
      if (!is_float(dt) && !is_int(dt)) return unsupported();
      break;
    case Kind::kLogic:
      if (dt != kBool) return unsupported();
      break;
  }
  std::vector<std::vector<uint64_t>> strides;
  for (const Arr& a : xs) strides.push_back(broadcast_strides(a.dims, *out));
  const std::string& op = n_.op_type;
  std::string bytes;
  bool failed = false, nan_minmax = false;
  const bool float_math = is_float(dt);
  for_each_broadcast(*out, strides, [&](const std::vector<uint64_t>& o) {
    if (failed) return;
    if (float_math) {
      double acc = xs[0].f(o[0]);
      for (size_t k = 1; k < xs.size(); ++k) {
        const double b = xs[k].f(o[k]);
        if (kind == Kind::kCompare) {
          put_int(bytes, kBool, compare(op, acc, b));
          return;
        }
        if (kind == Kind::kMinMax) {
          if (std::isnan(acc) || std::isnan(b)) {
            failed = nan_minmax = true;  // NaN propagation: the runtime's own rule
            return;
          }
          acc = op == "Min" ? std::min(acc, b) : std::max(acc, b);
          continue;
        }
        // One double operation, rounded once to the element type: exact for float (double
        // has more than 2*24+2 bits of precision).
        acc = op == "Add" ? acc + b : op == "Sub" ? acc - b : op == "Mul" ? acc * b : acc / b;
      }
      put_float(bytes, dt, acc);
      return;
    }
    int64_t acc = xs[0].i64(o[0]);
    for (size_t k = 1; k < xs.size(); ++k) {
      const int64_t b = xs[k].i64(o[k]);
      const uint64_t ua = static_cast<uint64_t>(acc), ub = static_cast<uint64_t>(b);
      if (kind == Kind::kCompare) {
        put_int(bytes, kBool, compare(op, acc, b));
        return;
      }
      if (kind == Kind::kLogic) {
        const bool r = op == "And"  ? (acc && b)
                       : op == "Or" ? (acc || b)
                                    : ((acc != 0) != (b != 0));
        put_int(bytes, kBool, r);
        return;
      }
      if (kind == Kind::kMinMax) {
        acc = op == "Min" ? std::min(acc, b) : std::max(acc, b);
        continue;
      }
      if (op == "Div") {
        // Truncates toward zero, as the runtime's integer division; it fails on a zero divisor
        // and traps on INT_MIN / -1.
        auto q = ort::divide(dt, acc, b);
        if (!q) {
          failed = true;
          refuse(b == 0 ? "division_by_zero" : "int_min_by_minus_1",
                 b == 0 ? "integer division by zero (ONNX Runtime fails)"
                        : "INT_MIN / -1 (ONNX Runtime traps: SIGFPE)");
          return;
        }
        acc = *q;
      } else {
        const uint64_t r = op == "Add" ? ua + ub : op == "Sub" ? ua - ub : ua * ub;
        acc = static_cast<int64_t>(r);
      }
      acc = wrap(dt, acc);  // narrow types wrap as they would in their own width
    }
    put_int(bytes, dt, acc);
  });
  if (nan_minmax) return unsupported();
  if (failed) return std::nullopt;
  return one(owned(out_dt, std::move(*out), std::move(bytes)));
}

}  // namespace fastopt::eval
