// Constant folding: nodes whose inputs are all constants become constants.
//
//   c1 (initializer) ──┐
//   c2 = Constant() ───┴─ Op ── y ── ...       =>       y' (initializer) ── ...
//
// Exporters leave constant subexpressions behind, above all in the shape arithmetic around
// Reshape/Expand/Slice (Unsqueeze, Concat, Cast, Gather, Range over constants; TorchScript
// exports emit a Constant node for every literal). The ops of such chains are evaluated here,
// natively and bit-exactly (see fold_constants.h); other ops are left to the ONNX Runtime
// fallback (the Python pass fold_constants_ort).
//
// What folds: ai.onnx nodes without subgraphs whose inputs are initializers that are not graph
// inputs, or Constant outputs; deterministic ops only; outputs within the size limits
// (options fold_max_bytes, fold_max_expand_bytes). Constant nodes themselves become
// initializers (zero copy), except in function bodies, which cannot hold initializers, in
// models of IR version < 4, whose initializers are all graph inputs, and for graph outputs.
// Identity of a constant forwards the constant.
#include "passes/fold_constants.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "ir/constant.h"
#include "ir/error.h"
#include "passes/registry.h"
#include "pattern/attr_schema.h"
#include "pattern/rewrite.h"
#include "proto/onnx_writer.h"

namespace fastopt::passes {

namespace {

// Equal, Less, Greater, LessOrEqual, GreaterOrEqual on two elements.
template <typename T>
bool compare(const std::string& op, T a, T b) {
  return op == "Equal"         ? a == b
         : op == "Less"        ? a < b
         : op == "Greater"     ? a > b
         : op == "LessOrEqual" ? a <= b
                               : a >= b;
}

using Tensors = std::vector<std::shared_ptr<Tensor>>;
using Result = std::optional<Tensors>;
using Dims = std::vector<int64_t>;

bool standard_domain(const Node& n) {
  return n.domain.value.empty() || n.domain.value == "ai.onnx";
}

// ---- element access ----

bool is_float(int32_t t) {
  return t == kFloat || t == kDouble || t == kFloat16 || t == kBFloat16;
}
// Integer types whose values fit int64 (uint64 does not), and bool.
bool is_int(int32_t t) {
  switch (t) {
    case kInt8:
    case kInt16:
    case kInt32:
    case kInt64:
    case kUint8:
    case kUint16:
    case kUint32:
    case kBool: return true;
    default: return false;
  }
}
// Types with whole-byte elements: data movement works on their bytes.
bool is_bytewise(int32_t t) {
  return t != kString && dtype_bits(t) >= 8;
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// A constant input: its tensor and little-endian element bytes (a view).
struct Arr {
  std::shared_ptr<const Tensor> tensor;
  int32_t dtype = 0;
  Dims dims;
  ByteRef bytes;
  uint64_t numel = 0;
  size_t esize = 0;

  const uint8_t* at(uint64_t i) const { return bytes.data() + i * esize; }
  double f(uint64_t i) const {
    const uint8_t* p = at(i);
    switch (dtype) {
      case kFloat: return load<float>(p);
      case kDouble: return load<double>(p);
      case kFloat16: return half_to_float(load<uint16_t>(p));
      case kBFloat16: {
        uint32_t bits = static_cast<uint32_t>(load<uint16_t>(p)) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        return v;
      }
      default: return static_cast<double>(i64(i));
    }
  }
  int64_t i64(uint64_t i) const {
    const uint8_t* p = at(i);
    switch (dtype) {
      case kInt8: return load<int8_t>(p);
      case kInt16: return load<int16_t>(p);
      case kInt32: return load<int32_t>(p);
      case kInt64: return load<int64_t>(p);
      case kUint8: return load<uint8_t>(p);
      case kBool: return load<uint8_t>(p) != 0;
      case kUint16: return load<uint16_t>(p);
      case kUint32: return load<uint32_t>(p);
      case kUint64: return static_cast<int64_t>(load<uint64_t>(p));
      default: return 0;
    }
  }
};

std::optional<Arr> to_arr(std::shared_ptr<const Tensor> t, bool need_bytes) {
  Arr a;
  a.dtype = t->dtype();
  a.dims = t->dims;
  a.numel = t->numel();
  if (need_bytes) {
    if (!is_bytewise(a.dtype)) return std::nullopt;
    a.esize = static_cast<size_t>(dtype_bits(a.dtype) / 8);
    a.bytes = t->bytes();
    if (a.bytes.size != a.numel * a.esize) return std::nullopt;
  }
  a.tensor = std::move(t);
  return a;
}

void put_int(std::string& out, int32_t dt, int64_t v) {
  const uint64_t u = static_cast<uint64_t>(v);
  switch (dt) {
    case kInt8:
    case kUint8: out.push_back(static_cast<char>(u & 0xff)); break;
    case kBool: out.push_back(v != 0 ? 1 : 0); break;
    case kInt16:
    case kUint16: {
      uint16_t x = static_cast<uint16_t>(u);
      out.append(reinterpret_cast<const char*>(&x), 2);
      break;
    }
    case kInt32:
    case kUint32: {
      uint32_t x = static_cast<uint32_t>(u);
      out.append(reinterpret_cast<const char*>(&x), 4);
      break;
    }
    default: out.append(reinterpret_cast<const char*>(&u), 8);  // int64, uint64
  }
}

// `v` as the `dt` element it would be after a store (narrow integer types wrap).
int64_t wrap(int32_t dt, int64_t v) {
  switch (dt) {
    case kInt8: return static_cast<int8_t>(v);
    case kUint8: return static_cast<uint8_t>(v);
    case kInt16: return static_cast<int16_t>(v);
    case kUint16: return static_cast<uint16_t>(v);
    case kInt32: return static_cast<int32_t>(v);
    case kUint32: return static_cast<uint32_t>(v);
    case kBool: return v != 0;
    default: return v;
  }
}

void put_float(std::string& out, int32_t dt, double v) {
  if (dt == kDouble) {
    out.append(reinterpret_cast<const char*>(&v), 8);
  } else {
    float f = static_cast<float>(v);
    out.append(reinterpret_cast<const char*>(&f), 4);
  }
}

// Product of d[from:to] (to: the end when negative).
uint64_t product(const Dims& d, int64_t from = 0, int64_t to = -1) {
  auto b = d.begin() + from, e = to < 0 ? d.end() : d.begin() + to;
  uint64_t n = 1;
  for (auto it = b; it < e; ++it) n *= static_cast<uint64_t>(*it);
  return n;
}

// Element count of `d`, or nullopt when a dim is negative or the count is absurd.
std::optional<uint64_t> checked_numel(const Dims& d) {
  uint64_t n = 1;
  for (int64_t x : d) {
    if (x < 0) return std::nullopt;
  }
  for (int64_t x : d) {
    if (x == 0) return 0;
    if (n > (uint64_t{1} << 40) / static_cast<uint64_t>(x)) return std::nullopt;
    n *= static_cast<uint64_t>(x);
  }
  return n;
}

// Row-major strides (in elements).
std::vector<uint64_t> strides_of(const Dims& d) {
  std::vector<uint64_t> s(d.size(), 1);
  for (size_t i = d.size(); i-- > 1;) s[i - 1] = s[i] * static_cast<uint64_t>(d[i]);
  return s;
}

// Numpy-style broadcast of several shapes.
std::optional<Dims> broadcast(const std::vector<const Dims*>& shapes) {
  size_t rank = 0;
  for (const Dims* s : shapes) rank = std::max(rank, s->size());
  Dims out(rank, 1);
  for (size_t i = 0; i < rank; ++i) {
    bool set = false;
    for (const Dims* s : shapes) {
      if (i + s->size() < rank) continue;
      int64_t d = (*s)[i + s->size() - rank];
      if (d == 1) continue;
      if (!set) {
        out[i] = d;
        set = true;
      } else if (out[i] != d) {
        return std::nullopt;
      }
    }
  }
  return out;
}

// Strides of `in` (in elements) indexed by the output's dims: 0 where broadcast.
std::vector<uint64_t> broadcast_strides(const Dims& in, const Dims& out) {
  std::vector<uint64_t> s(out.size(), 0);
  std::vector<uint64_t> own = strides_of(in);
  const size_t off = out.size() - in.size();
  for (size_t i = 0; i < in.size(); ++i) s[off + i] = in[i] == 1 ? 0 : own[i];
  return s;
}

// Calls fn(offsets) for every element of `out` in row-major order, with the element offset in
// each input (strides from broadcast_strides).
template <typename F>
void for_each_broadcast(const Dims& out, const std::vector<std::vector<uint64_t>>& strides,
                        F&& fn) {
  const uint64_t n = product(out);
  std::vector<int64_t> idx(out.size(), 0);
  std::vector<uint64_t> offs(strides.size(), 0);
  for (uint64_t e = 0; e < n; ++e) {
    fn(offs);
    for (size_t d = out.size(); d-- > 0;) {
      if (++idx[d] < out[d]) {
        for (size_t k = 0; k < strides.size(); ++k) offs[k] += strides[k][d];
        break;
      }
      for (size_t k = 0; k < strides.size(); ++k) {
        offs[k] -= strides[k][d] * static_cast<uint64_t>(out[d] - 1);
      }
      idx[d] = 0;
    }
  }
}

std::shared_ptr<Tensor> owned(int32_t dtype, Dims dims, std::string bytes) {
  return make_tensor(dtype, std::move(dims), std::move(bytes));
}

// The input's tensor with other dims: its bytes (and storage: raw, external or typed) shared.
std::shared_ptr<Tensor> view(const Arr& a, Dims dims) {
  auto t = std::make_shared<Tensor>(*a.tensor);
  t->name = OptString{};
  t->dims = std::move(dims);
  t->extras.clear();
  return t;
}

// ---- the evaluator ----

class Evaluator {
 public:
  Evaluator(const Node& n, int64_t opset, const FoldLimits& limits,
            const std::vector<std::shared_ptr<const Tensor>>* given = nullptr)
      : n_(n), opset_(opset), limits_(limits), given_(given) {}

  bool declined_for_types() const { return unsupported_; }

  Result run() {
    for (size_t i = 0; i < n_.inputs().size(); ++i) {
      Value* v = n_.inputs()[i];
      if (!v) {
        inputs_.push_back(nullptr);
        continue;
      }
      auto t = given_ ? (i < given_->size() ? (*given_)[i] : nullptr) : constant_tensor(v);
      if (!t) return std::nullopt;
      inputs_.push_back(std::move(t));
      in_bytes_ += inputs_.back()->nbytes();
    }
    const std::string& op = n_.op_type;
    if (op == "Shape") return shape();
    if (op == "Size") return size();
    if (op == "Gather") return gather();
    if (op == "GatherND") return gather_nd();
    if (op == "Unsqueeze") return unsqueeze();
    if (op == "Squeeze") return squeeze();
    if (op == "Flatten") return flatten();
    if (op == "Reshape") return reshape();
    if (op == "Concat") return concat();
    if (op == "Cast" || op == "CastLike") return cast();
    if (op == "Slice") return slice();
    if (op == "Transpose") return transpose();
    if (op == "Where") return where();
    if (op == "Range") return range();
    if (op == "ConstantOfShape") return constant_of_shape();
    if (op == "Expand") return expand();
    if (op == "Neg" || op == "Abs" || op == "Not") return unary();
    return elementwise();
  }

 private:
  // ---- helpers ----
  std::optional<Arr> in(size_t i, bool need_bytes = true) const {
    if (i >= inputs_.size() || !inputs_[i]) return std::nullopt;
    return to_arr(inputs_[i], need_bytes);
  }
  bool has_input(size_t i) const { return i < inputs_.size() && inputs_[i]; }
  std::optional<std::vector<int64_t>> ints_in(size_t i) const {
    if (!has_input(i)) return std::nullopt;
    return tensor_ints(*inputs_[i], 1 << 16);
  }
  std::optional<int64_t> attr_i(const char* name) const {
    const Attribute* a = n_.attribute(name);
    if (!a || !a->i) return std::nullopt;
    return *a->i;
  }
  std::optional<std::vector<int64_t>> attr_ints(const char* name) const {
    const Attribute* a = n_.attribute(name);
    if (!a || a->kind() != AttrType::kInts) return std::nullopt;
    return a->ints;
  }
  bool fits(int32_t dtype, const Dims& dims) const {
    auto n = checked_numel(dims);
    return n && limits_.allows(dtype_storage_bytes(dtype, *n), in_bytes_);
  }
  // A view (shared bytes) is free unless its source is used elsewhere too, when the file
  // would then hold both.
  bool view_fits(const Arr& a) const {
    Value* src = n_.inputs()[0];
    return src->uses().size() == 1 || a.tensor->nbytes() <= limits_.max_bytes;
  }
  static Result one(std::shared_ptr<Tensor> t) { return Tensors{std::move(t)}; }
  // Declines for lack of an implementation for these types (not for limits or bad values): the
  // ONNX Runtime fallback may evaluate the node.
  std::nullopt_t unsupported() {
    unsupported_ = true;
    return std::nullopt;
  }
  // Normalizes an axis of a rank-`rank` tensor; nullopt when out of range.
  static std::optional<int64_t> axis(int64_t a, int64_t rank) {
    if (a < -rank || a >= rank) return std::nullopt;
    return a < 0 ? a + rank : a;
  }

  // ---- shapes ----
  Result shape() {
    auto x = in(0, false);
    if (!x) return std::nullopt;
    const int64_t r = static_cast<int64_t>(x->dims.size());
    int64_t start = 0, end = r;
    if (opset_ >= 15) {
      start = attr_i("start").value_or(0);
      end = attr_i("end").value_or(r);
    }
    auto clampi = [r](int64_t v) { return std::clamp(v < 0 ? v + r : v, int64_t{0}, r); };
    start = clampi(start);
    end = clampi(end);
    std::vector<int64_t> d;
    for (int64_t i = start; i < end; ++i) d.push_back(x->dims[i]);
    return one(make_int64_tensor(d, {static_cast<int64_t>(d.size())}));
  }

  Result size() {
    auto x = in(0, false);
    if (!x) return std::nullopt;
    return one(make_int64_tensor({static_cast<int64_t>(x->numel)}, {}));
  }

  // ---- data movement ----
  Result gather() {
    auto data = in(0), idx = in(1);
    if (!data || !idx || (idx->dtype != kInt32 && idx->dtype != kInt64)) return std::nullopt;
    const int64_t r = static_cast<int64_t>(data->dims.size());
    auto ax = axis(attr_i("axis").value_or(0), r);
    if (!ax) return std::nullopt;
    Dims out(data->dims.begin(), data->dims.begin() + *ax);
    out.insert(out.end(), idx->dims.begin(), idx->dims.end());
    out.insert(out.end(), data->dims.begin() + *ax + 1, data->dims.end());
    if (!fits(data->dtype, out)) return std::nullopt;
    const int64_t dim = data->dims[*ax];
    const uint64_t outer = product(data->dims, 0, *ax);
    const uint64_t inner = product(data->dims, *ax + 1) * data->esize;
    std::string bytes;
    bytes.reserve(outer * idx->numel * inner);
    for (uint64_t o = 0; o < outer; ++o) {
      for (uint64_t k = 0; k < idx->numel; ++k) {
        int64_t i = idx->i64(k);
        if (i < -dim || i >= dim) return std::nullopt;
        if (i < 0) i += dim;
        const uint8_t* src = data->bytes.data() + (o * dim + i) * inner;
        bytes.append(reinterpret_cast<const char*>(src), inner);
      }
    }
    return one(owned(data->dtype, std::move(out), std::move(bytes)));
  }

  // GatherND with batch_dims 0: index tuples of the last axis of `indices` pick slices.
  Result gather_nd() {
    auto data = in(0), idx = in(1);
    if (!data || !idx || idx->dtype != kInt64 || attr_i("batch_dims").value_or(0) != 0) {
      return std::nullopt;
    }
    const size_t r = data->dims.size();
    if (idx->dims.empty()) return std::nullopt;
    const int64_t k = idx->dims.back();
    if (k < 1 || static_cast<size_t>(k) > r) return std::nullopt;
    Dims out(idx->dims.begin(), idx->dims.end() - 1);
    out.insert(out.end(), data->dims.begin() + k, data->dims.end());
    if (!fits(data->dtype, out)) return std::nullopt;
    const uint64_t inner = product(data->dims, k) * data->esize;
    const uint64_t tuples = idx->numel / static_cast<uint64_t>(k);
    std::string bytes;
    bytes.reserve(tuples * inner);
    for (uint64_t t = 0; t < tuples; ++t) {
      uint64_t offset = 0;
      for (int64_t a = 0; a < k; ++a) {
        const int64_t dim = data->dims[static_cast<size_t>(a)];
        int64_t i = idx->i64(t * static_cast<uint64_t>(k) + static_cast<uint64_t>(a));
        if (i < -dim || i >= dim) return std::nullopt;
        if (i < 0) i += dim;
        offset = offset * static_cast<uint64_t>(dim) + static_cast<uint64_t>(i);
      }
      bytes.append(reinterpret_cast<const char*>(data->bytes.data() + offset * inner), inner);
    }
    return one(owned(data->dtype, std::move(out), std::move(bytes)));
  }

  std::optional<std::vector<int64_t>> axes_operand() const {
    // Squeeze/Unsqueeze: an attribute before opset 13, an input from 13 on.
    if (opset_ >= 13) return has_input(1) ? ints_in(1) : std::nullopt;
    return attr_ints("axes");
  }

  Result unsqueeze() {
    auto x = in(0, false);
    auto axes = axes_operand();
    if (!x || !axes) return std::nullopt;
    const int64_t out_rank = static_cast<int64_t>(x->dims.size() + axes->size());
    std::vector<bool> inserted(out_rank, false);
    for (int64_t a : *axes) {
      auto ax = axis(a, out_rank);
      if (!ax || inserted[*ax]) return std::nullopt;
      inserted[*ax] = true;
    }
    Dims out;
    size_t next = 0;
    for (int64_t i = 0; i < out_rank; ++i) out.push_back(inserted[i] ? 1 : x->dims[next++]);
    if (!view_fits(*x)) return std::nullopt;
    return one(view(*x, std::move(out)));
  }

  Result squeeze() {
    auto x = in(0, false);
    if (!x) return std::nullopt;
    const int64_t r = static_cast<int64_t>(x->dims.size());
    std::vector<bool> drop(r, false);
    const bool has_axes = opset_ >= 13 ? has_input(1) : n_.attribute("axes") != nullptr;
    if (has_axes) {
      auto axes = axes_operand();
      if (!axes) return std::nullopt;
      for (int64_t a : *axes) {
        auto ax = axis(a, r);
        if (!ax || x->dims[*ax] != 1) return std::nullopt;
        drop[*ax] = true;
      }
    } else {
      for (int64_t i = 0; i < r; ++i) drop[i] = x->dims[i] == 1;
    }
    Dims out;
    for (int64_t i = 0; i < r; ++i) {
      if (!drop[i]) out.push_back(x->dims[i]);
    }
    if (!view_fits(*x)) return std::nullopt;
    return one(view(*x, std::move(out)));
  }

  Result flatten() {
    auto x = in(0, false);
    if (!x) return std::nullopt;
    const int64_t r = static_cast<int64_t>(x->dims.size());
    int64_t a = attr_i("axis").value_or(1);
    if (a < -r || a > r) return std::nullopt;
    if (a < 0) a += r;
    Dims out{static_cast<int64_t>(product(x->dims, 0, a)),
             static_cast<int64_t>(product(x->dims, a))};
    if (!view_fits(*x)) return std::nullopt;
    return one(view(*x, std::move(out)));
  }

  Result reshape() {
    auto x = in(0, false);
    auto shape = ints_in(1);
    if (!x || !shape) return std::nullopt;
    const bool allowzero = opset_ >= 14 && attr_i("allowzero").value_or(0) != 0;
    Dims out;
    int infer = -1;
    uint64_t known = 1;
    for (size_t i = 0; i < shape->size(); ++i) {
      int64_t s = (*shape)[i];
      if (s == 0 && !allowzero) {
        if (i >= x->dims.size()) return std::nullopt;
        s = x->dims[i];
      }
      if (s == -1) {
        if (infer >= 0) return std::nullopt;
        infer = static_cast<int>(i);
        out.push_back(-1);
        continue;
      }
      if (s < 0) return std::nullopt;
      out.push_back(s);
      known *= static_cast<uint64_t>(s);
    }
    if (infer >= 0) {
      if (known == 0 || x->numel % known != 0) return std::nullopt;
      out[infer] = static_cast<int64_t>(x->numel / known);
    }
    auto n = checked_numel(out);
    if (!n || *n != x->numel || !view_fits(*x)) return std::nullopt;
    return one(view(*x, std::move(out)));
  }

  Result concat() {
    std::vector<Arr> xs;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      auto a = in(i);
      if (!a) return std::nullopt;
      xs.push_back(std::move(*a));
    }
    if (xs.empty() || !attr_i("axis")) return std::nullopt;
    const Arr& first = xs[0];
    const int64_t r = static_cast<int64_t>(first.dims.size());
    auto ax = axis(*attr_i("axis"), r);
    if (!ax) return std::nullopt;
    Dims out = first.dims;
    out[*ax] = 0;
    for (const Arr& a : xs) {
      if (a.dtype != first.dtype || a.dims.size() != first.dims.size()) return std::nullopt;
      for (int64_t d = 0; d < r; ++d) {
        if (d != *ax && a.dims[d] != first.dims[d]) return std::nullopt;
      }
      out[*ax] += a.dims[*ax];
    }
    if (!fits(first.dtype, out)) return std::nullopt;
    const uint64_t outer = product(first.dims, 0, *ax);
    const uint64_t inner = product(first.dims, *ax + 1) * first.esize;
    std::string bytes;
    for (uint64_t o = 0; o < outer; ++o) {
      for (const Arr& a : xs) {
        const uint64_t chunk = static_cast<uint64_t>(a.dims[*ax]) * inner;
        bytes.append(reinterpret_cast<const char*>(a.bytes.data() + o * chunk), chunk);
      }
    }
    return one(owned(first.dtype, std::move(out), std::move(bytes)));
  }

  Result transpose() {
    auto x = in(0);
    if (!x) return std::nullopt;
    const size_t r = x->dims.size();
    std::vector<int64_t> perm;
    if (auto p = attr_ints("perm")) {
      perm = *p;
    } else {
      for (size_t i = r; i-- > 0;) perm.push_back(static_cast<int64_t>(i));
    }
    if (perm.size() != r) return std::nullopt;
    std::vector<bool> seen(r, false);
    for (int64_t p : perm) {
      if (p < 0 || p >= static_cast<int64_t>(r) || seen[p]) return std::nullopt;
      seen[p] = true;
    }
    Dims out;
    for (int64_t p : perm) out.push_back(x->dims[p]);
    if (!fits(x->dtype, out)) return std::nullopt;
    std::vector<uint64_t> own = strides_of(x->dims), s(r);
    for (size_t i = 0; i < r; ++i) s[i] = own[perm[i]];
    std::string bytes;
    bytes.reserve(x->numel * x->esize);
    for_each_broadcast(out, {s}, [&](const std::vector<uint64_t>& o) {
      bytes.append(reinterpret_cast<const char*>(x->at(o[0])), x->esize);
    });
    return one(owned(x->dtype, std::move(out), std::move(bytes)));
  }

  Result slice() {
    auto x = in(0);
    if (!x) return std::nullopt;
    std::optional<std::vector<int64_t>> starts, ends, axes, steps;
    if (opset_ < 10) {
      starts = attr_ints("starts");
      ends = attr_ints("ends");
      axes = attr_ints("axes");
    } else {
      starts = ints_in(1);
      ends = ints_in(2);
      if (has_input(3) && !(axes = ints_in(3))) return std::nullopt;
      if (has_input(4) && !(steps = ints_in(4))) return std::nullopt;
    }
    if (!starts || !ends || starts->size() != ends->size()) return std::nullopt;
    const size_t k = starts->size();
    const int64_t r = static_cast<int64_t>(x->dims.size());
    if (!axes) {
      axes.emplace();
      for (size_t i = 0; i < k; ++i) axes->push_back(static_cast<int64_t>(i));
    }
    if (!steps) steps = std::vector<int64_t>(k, 1);
    if (axes->size() != k || steps->size() != k) return std::nullopt;
    std::vector<int64_t> begin(r, 0), step(r, 1);
    Dims out = x->dims;
    std::vector<bool> seen(r, false);
    for (size_t i = 0; i < k; ++i) {
      auto ax = axis((*axes)[i], r);
      const int64_t st = (*steps)[i];
      if (!ax || seen[*ax] || st == 0 || st == std::numeric_limits<int64_t>::min()) {
        return std::nullopt;
      }
      seen[*ax] = true;
      const int64_t dim = x->dims[*ax];
      int64_t s = (*starts)[i], e = (*ends)[i];
      if (s < 0) s += dim;
      if (e < 0) e += dim;
      int64_t count = 0;
      if (st > 0) {
        s = std::clamp(s, int64_t{0}, dim);
        e = std::clamp(e, int64_t{0}, dim);
        if (e > s) count = (e - s - 1) / st + 1;
      } else if (dim > 0) {
        s = std::clamp(s, int64_t{0}, dim - 1);
        e = std::clamp(e, int64_t{-1}, dim - 1);
        if (s > e) count = (s - e - 1) / (-st) + 1;
      }
      begin[*ax] = s;
      step[*ax] = st;
      out[*ax] = count;
    }
    if (!fits(x->dtype, out)) return std::nullopt;
    std::vector<uint64_t> own = strides_of(x->dims), s(r);
    uint64_t base = 0;
    for (int64_t d = 0; d < r; ++d) {
      if (out[d] == 0) break;
      base += static_cast<uint64_t>(begin[d]) * own[d];
      s[d] = static_cast<uint64_t>(step[d]) * own[d];  // wraps for negative steps: offsets
    }                                                  // are computed modulo 2^64
    std::string bytes;
    for_each_broadcast(out, {s}, [&](const std::vector<uint64_t>& o) {
      bytes.append(reinterpret_cast<const char*>(x->at(base + o[0])), x->esize);
    });
    return one(owned(x->dtype, std::move(out), std::move(bytes)));
  }

  Result where() {
    auto c = in(0), a = in(1), b = in(2);
    if (!c || !a || !b || c->dtype != kBool || a->dtype != b->dtype || opset_ < 9) {
      return std::nullopt;
    }
    auto out = broadcast({&c->dims, &a->dims, &b->dims});
    if (!out || !fits(a->dtype, *out)) return std::nullopt;
    std::string bytes;
    for_each_broadcast(*out,
                       {broadcast_strides(c->dims, *out), broadcast_strides(a->dims, *out),
                        broadcast_strides(b->dims, *out)},
                       [&](const std::vector<uint64_t>& o) {
                         const uint8_t* src = *c->at(o[0]) ? a->at(o[1]) : b->at(o[2]);
                         bytes.append(reinterpret_cast<const char*>(src), a->esize);
                       });
    return one(owned(a->dtype, std::move(*out), std::move(bytes)));
  }

  Result expand() {
    auto x = in(0);
    auto shape = ints_in(1);
    if (!x || !shape || opset_ < 8) return std::nullopt;
    auto out = broadcast({&x->dims, &*shape});
    if (!out || !fits(x->dtype, *out)) return std::nullopt;
    std::string bytes;
    for_each_broadcast(*out, {broadcast_strides(x->dims, *out)},
                       [&](const std::vector<uint64_t>& o) {
                         bytes.append(reinterpret_cast<const char*>(x->at(o[0])), x->esize);
                       });
    return one(owned(x->dtype, std::move(*out), std::move(bytes)));
  }

  Result constant_of_shape() {
    auto shape = ints_in(0);
    if (!shape || opset_ < 9 || inputs_[0]->dims.size() != 1) return std::nullopt;
    int32_t dtype = kFloat;
    std::string value(4, '\0');
    if (const Attribute* a = n_.attribute("value")) {
      if (!a->t) return std::nullopt;
      auto v = to_arr(a->t, true);
      if (!v || v->numel != 1) return std::nullopt;
      dtype = v->dtype;
      value.assign(reinterpret_cast<const char*>(v->bytes.data()), v->esize);
    }
    Dims out = *shape;
    if (!fits(dtype, out)) return std::nullopt;
    const uint64_t n = *checked_numel(out);
    std::string bytes;
    bytes.reserve(n * value.size());
    for (uint64_t i = 0; i < n; ++i) bytes += value;
    return one(owned(dtype, std::move(out), std::move(bytes)));
  }

  Result range() {
    auto s = in(0), l = in(1), d = in(2);
    if (!s || !l || !d || opset_ < 11) return std::nullopt;
    const int32_t dt = s->dtype;
    if (l->dtype != dt || d->dtype != dt || s->numel != 1 || l->numel != 1 || d->numel != 1 ||
        !(is_float(dt) || is_int(dt))) {
      return std::nullopt;
    }
    const bool integral = dt == kInt16 || dt == kInt32 || dt == kInt64;
    const long double start_f = integral ? s->i64(0) : s->f(0),
                      limit_f = integral ? l->i64(0) : l->f(0),
                      delta_f = integral ? d->i64(0) : d->f(0);
    if (delta_f == 0 || !std::isfinite(start_f) || !std::isfinite(limit_f) ||
        !std::isfinite(delta_f)) {
      return std::nullopt;
    }
    const long double steps = std::ceil((limit_f - start_f) / delta_f);
    const int64_t count = steps > 0 ? static_cast<int64_t>(std::min<long double>(steps, 1e12)) : 0;
    Dims out{count};
    if (!fits(dt, out)) return std::nullopt;
    // Integer ranges only: ONNX Runtime accumulates float ranges in their own precision.
    if (!integral) return unsupported();
    const int64_t start = s->i64(0), delta = d->i64(0);
    std::string bytes;
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t v =
          static_cast<uint64_t>(start) + static_cast<uint64_t>(i) * static_cast<uint64_t>(delta);
      put_int(bytes, dt, static_cast<int64_t>(v));
    }
    return one(owned(dt, std::move(out), std::move(bytes)));
  }

  // ---- arithmetic ----
  Result cast() {
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
    const bool to_ok = to == kFloat || to == kDouble || is_int(to) || to == kUint64;
    if (!from_ok || !to_ok) return unsupported();
    std::string bytes;
    for (uint64_t i = 0; i < x->numel; ++i) {
      if (is_float(x->dtype)) {
        const double v = x->f(i);
        if (to == kFloat || to == kDouble) {
          put_float(bytes, to, v);
        } else if (to == kBool) {
          put_int(bytes, to, v != 0 || std::isnan(v));
        } else {
          // Out of range (or NaN) is undefined behaviour in the runtime's static_cast.
          if (!std::isfinite(v)) return std::nullopt;
          const double t = std::trunc(v);
          if (!in_range(t, to)) return std::nullopt;
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
        if (to == kFloat)
          put_float(bytes, to, static_cast<float>(v));  // one rounding, as the runtime does
        else if (to == kDouble)
          put_float(bytes, to, static_cast<double>(v));
        else
          put_int(bytes, to, v);  // wraps, as static_cast does
      }
    }
    return one(owned(to, x->dims, std::move(bytes)));
  }

  static bool in_range(double t, int32_t to) {
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

  Result unary() {
    auto x = in(0);
    if (!x) return std::nullopt;
    const std::string& op = n_.op_type;
    const int32_t dt = x->dtype;
    if (!fits(dt, x->dims)) return std::nullopt;
    const bool ok =
        op == "Not" ? dt == kBool : (dt == kFloat || dt == kDouble || (is_int(dt) && dt != kBool));
    if (!ok) return unsupported();
    std::string bytes;
    for (uint64_t i = 0; i < x->numel; ++i) {
      if (op == "Not") {
        put_int(bytes, dt, x->i64(i) == 0);
      } else if (dt == kFloat || dt == kDouble) {
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

  enum class Kind { kArith, kCompare, kLogic, kMinMax };

  Result elementwise() {
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
    switch (kind) {
      case Kind::kArith:
      case Kind::kMinMax:
        if (!fp && !integral) return unsupported();
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
          if (b == 0 || (acc == std::numeric_limits<int64_t>::min() && b == -1)) {
            failed = true;
            return;
          }
          acc = acc / b;  // truncates toward zero, as the runtime's integer division
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

  const Node& n_;
  int64_t opset_;
  const FoldLimits& limits_;
  const std::vector<std::shared_ptr<const Tensor>>* given_;  // inputs in place of constants
  std::vector<std::shared_ptr<const Tensor>> inputs_;
  uint64_t in_bytes_ = 0;
  bool unsupported_ = false;
};

// ---- the pass ----

bool all_inputs_constant(const Node& n) {
  bool any = false;
  for (Value* v : n.inputs()) {
    if (!v) continue;
    if (!constant_tensor(v)) return false;
    any = true;
  }
  return any;
}

bool used(const Value* v) {
  return v && (!v->uses().empty() || v->is_graph_output());
}

bool dead(const Node& n) {
  for (Value* v : n.outputs()) {
    if (used(v)) return false;
  }
  return true;
}

struct Folder {
  Model& model;
  PassContext& ctx;
  FoldLimits limits;
  std::vector<std::pair<Graph*, Value*>> created;  // new initializers

  int64_t run() {
    std::vector<Graph*> graphs;
    model.for_each_graph([&](Graph& g) { graphs.push_back(&g); });
    int64_t rewrites = 0;
    for (Graph* g : graphs) rewrites += fold_graph(*g);
    // Constants made here that later folds left unused.
    for (auto [g, v] : created) {
      if (v->initializer() && v->uses().empty() && !v->is_graph_output()) g->remove_initializer(v);
    }
    return rewrites;
  }

  int64_t fold_graph(Graph& g) {
    const int64_t opset = graph_opset(model, g);
    const bool initializers_allowed = !in_function(model, g) && model.ir_version.value_or(0) >= 4;
    int64_t rewrites = 0;
    for (Node *n = g.first(), *next; n; n = next) {
      next = n->next();
      if (!standard_domain(*n) || !n->subgraphs().empty()) continue;
      if (n->op_type == "Constant") {
        rewrites += initializers_allowed && lift(g, n);
        continue;
      }
      if (!all_inputs_constant(*n) || dead(*n)) continue;
      if (n->op_type == "Identity") {
        Value* x = n->inputs()[0];
        Value* y = n->outputs()[0];
        if (!y || !pattern::can_replace(g, y, x) || x->graph() != &g) continue;
        pattern::replace_value(g, y, x);
        g.remove_node(n);
        ++ctx.counters["folded_Identity"];
        ++rewrites;
        continue;
      }
      auto outs = evaluate_node(*n, opset, limits);
      if (!outs || outs->size() != n->outputs().size()) continue;
      for (size_t i = 0; i < outs->size(); ++i) {
        Value* v = n->outputs()[i];
        if (!used(v)) continue;
        Value* c = replace_with_constant(g, v, (*outs)[i]);
        if (c->initializer()) created.emplace_back(&g, c);
      }
      const std::vector<Value*> inputs = n->inputs();
      g.remove_node(n);
      // Constant nodes only this node read (function bodies keep Constant nodes).
      for (Value* v : inputs) {
        Node* p = v ? v->producer() : nullptr;
        if (p && p->alive() && p->graph() == &g && p->op_type == "Constant" && dead(*p)) {
          g.remove_node(p);
        }
      }
      ++ctx.counters["folded_" + n->op_type];
      ++rewrites;
    }
    return rewrites;
  }

  // Constant node -> initializer (the tensor is shared, not copied).
  bool lift(Graph& g, Node* n) {
    Value* v = n->outputs().empty() ? nullptr : n->outputs()[0];
    if (!v || v->is_graph_output() || v->uses().empty()) return false;
    auto t = constant_tensor(v);
    if (!t) return false;  // sparse or string-valued attributes
    auto copy = std::make_shared<Tensor>(*t);
    Value* c = g.add_initializer(v->name(), copy);
    pattern::replace_value(g, v, c);
    g.remove_node(n);
    created.emplace_back(&g, c);
    ++ctx.counters["lifted_Constant"];
    return true;
  }
};

int64_t option(const PassContext& ctx, const std::string& name, int64_t fallback) {
  auto it = ctx.options.find(name);
  return it == ctx.options.end() ? fallback : it->second;
}

int64_t fold_constants(Model& model, PassContext& ctx) {
  Folder f{model, ctx, {}, {}};
  f.limits.max_bytes = static_cast<uint64_t>(
      option(ctx, "fold_max_bytes", static_cast<int64_t>(f.limits.max_bytes)));
  f.limits.max_expand_bytes = static_cast<uint64_t>(
      option(ctx, "fold_max_expand_bytes", static_cast<int64_t>(f.limits.max_expand_bytes)));
  return f.run();
}

const PassRegistrar kRegister{{
    "fold_constants",
    "evaluate nodes whose inputs are all constants (size-capped); Constant nodes -> initializers",
    {"cleanup"},
    1,
    INT64_MAX,
    true,
    fold_constants,
}};

Graph* root_of(const Graph& g) {
  const Graph* r = &g;
  while (r->parent()) r = r->parent();
  return const_cast<Graph*>(r);
}

const Function* function_of(const Model& model, const Graph& g) {
  const Graph* root = root_of(g);
  for (const auto& f : model.functions) {
    if (f->body.get() == root) return f.get();
  }
  return nullptr;
}

}  // namespace

const std::vector<std::string>& native_fold_ops() {
  static const std::vector<std::string> ops = {"Abs",
                                               "Add",
                                               "And",
                                               "Cast",
                                               "CastLike",
                                               "Concat",
                                               "Constant",
                                               "ConstantOfShape",
                                               "Div",
                                               "Equal",
                                               "Expand",
                                               "Flatten",
                                               "Gather",
                                               "GatherND",
                                               "Greater",
                                               "GreaterOrEqual",
                                               "Identity",
                                               "Less",
                                               "LessOrEqual",
                                               "Max",
                                               "Min",
                                               "Mul",
                                               "Neg",
                                               "Not",
                                               "Or",
                                               "Range",
                                               "Reshape",
                                               "Shape",
                                               "Size",
                                               "Slice",
                                               "Squeeze",
                                               "Sub",
                                               "Transpose",
                                               "Unsqueeze",
                                               "Where",
                                               "Xor"};
  return ops;
}

std::optional<std::vector<std::shared_ptr<Tensor>>> evaluate_node(const Node& n, int64_t opset,
                                                                  const FoldLimits& limits,
                                                                  bool* unsupported) {
  if (unsupported) *unsupported = false;
  if (!standard_domain(n) || !n.subgraphs().empty() || n.outputs().size() != 1) {
    return std::nullopt;
  }
  // ORT refuses a node with a mistyped attribute: folding it would make the model valid.
  if (pattern::mistyped_attribute(n)) return std::nullopt;
  Evaluator e(n, opset, limits);
  try {
    auto r = e.run();
    if (unsupported) *unsupported = e.declined_for_types();
    return r;
  } catch (const ModelError&) {
    return std::nullopt;  // undecodable input bytes: leave the node alone
  }
}

std::optional<std::vector<std::shared_ptr<Tensor>>> evaluate_node_on(
    const Node& n, int64_t opset, const FoldLimits& limits,
    const std::vector<std::shared_ptr<const Tensor>>& inputs) {
  if (!standard_domain(n) || !n.subgraphs().empty() || n.outputs().size() != 1) {
    return std::nullopt;
  }
  Evaluator e(n, opset, limits, &inputs);
  try {
    auto r = e.run();
    if (e.declined_for_types()) return std::nullopt;
    return r;
  } catch (const ModelError&) {
    return std::nullopt;
  }
}

Value* replace_with_constant(Graph& g, Value* v, std::shared_ptr<Tensor> t) {
  Value* c;
  // Function bodies hold no initializers; before IR version 4 every initializer must also be a
  // graph input (which would make it overridable, not constant).
  if (in_function(*g.model(), g) || g.model()->ir_version.value_or(0) < 4 || v->is_graph_output()) {
    Node* before = v->producer() && v->producer()->graph() == &g ? v->producer() : g.first();
    Node* k = g.create_node("Constant", "", {}, {v->name()}, before);
    if (v->producer() && !v->producer()->name.value.empty()) k->name.set(v->producer()->name.value);
    k->attributes.push_back(pattern::attr_tensor("value", std::move(t)));
    c = k->outputs()[0];
  } else {
    c = g.add_initializer(v->name(), std::move(t));
  }
  pattern::replace_value(g, v, c);
  return c;
}

int64_t graph_opset(const Model& model, const Graph& g) {
  if (const Function* f = function_of(model, g)) {
    for (const auto& o : f->opset_import) {
      if (o.domain.value.empty() || o.domain.value == "ai.onnx") return o.version.value_or(0);
    }
  }
  return default_opset(model);
}

bool in_function(const Model& model, const Graph& g) {
  return function_of(model, g) != nullptr;
}

std::string constant_nodes_model(const Model& model, const std::vector<Node*>& nodes,
                                 const std::vector<Value*>& outputs) {
  Model m;
  m.ir_version = model.ir_version;
  m.opset_import = model.opset_import;
  m.graph = std::make_unique<Graph>(&m);
  Graph& g = *m.graph;
  g.name.set("constant_nodes");
  std::unordered_map<const Value*, Value*> map;
  for (Node* n : nodes) {
    if (!n->alive() || n->graph() != nodes[0]->graph()) {
      throw ModelError("constant_nodes_model: nodes must be live nodes of one graph");
    }
    std::vector<Value*> inputs;
    for (Value* v : n->inputs()) {
      if (!v) {
        inputs.push_back(nullptr);
        continue;
      }
      auto it = map.find(v);
      if (it == map.end()) {
        auto t = constant_tensor(v);
        if (!t) {
          throw ModelError("constant_nodes_model: input '" + v->name() + "' of node '" +
                           n->name.value + "' is neither a constant nor computed by the nodes");
        }
        Value* c = g.create_value(v->name());
        g.set_initializer(c, std::make_shared<Tensor>(*t));
        it = map.emplace(v, c).first;
      }
      inputs.push_back(it->second);
    }
    std::vector<std::string> names;
    for (Value* v : n->outputs()) names.push_back(v ? v->name() : "");
    Node* c = g.create_node(n->op_type, n->domain.value, inputs, names);
    c->name = n->name;
    for (const auto& a : n->attributes) c->attributes.push_back(pattern::copy_attribute(a));
    for (size_t i = 0; i < names.size(); ++i) {
      if (!n->outputs()[i]) continue;
      map[n->outputs()[i]] = c->outputs()[i];
      if (outputs.empty()) g.add_output(c->outputs()[i]);
    }
  }
  for (Value* v : outputs) {
    auto it = map.find(v);
    if (it == map.end() || !it->second->producer()) {
      throw ModelError("constant_nodes_model: output '" + v->name() +
                       "' is not computed by the nodes");
    }
    g.add_output(it->second);
  }
  return serialize_model(m);
}

}  // namespace fastopt::passes
