// Element access for the evaluator (see tensor_data.h).
#include "eval/tensor_data.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "eval/ort_semantics.h"

namespace fastopt::eval {

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

int64_t wrap(int32_t dt, int64_t v) {
  return ort::wrap_to(dt, v);
}

void put_float(std::string& out, int32_t dt, double v) {
  if (dt == kDouble) {
    out.append(reinterpret_cast<const char*>(&v), 8);
  } else if (dt == kFloat16) {
    const uint16_t h = float_to_half(static_cast<float>(v));
    out.append(reinterpret_cast<const char*>(&h), 2);
  } else {
    float f = static_cast<float>(v);
    out.append(reinterpret_cast<const char*>(&f), 4);
  }
}

uint64_t product(const Dims& d, int64_t from, int64_t to) {
  auto b = d.begin() + from, e = to < 0 ? d.end() : d.begin() + to;
  uint64_t n = 1;
  for (auto it = b; it < e; ++it) n *= static_cast<uint64_t>(*it);
  return n;
}

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

std::vector<uint64_t> strides_of(const Dims& d) {
  std::vector<uint64_t> s(d.size(), 1);
  for (size_t i = d.size(); i-- > 1;) s[i - 1] = s[i] * static_cast<uint64_t>(d[i]);
  return s;
}

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

std::vector<uint64_t> broadcast_strides(const Dims& in, const Dims& out) {
  std::vector<uint64_t> s(out.size(), 0);
  std::vector<uint64_t> own = strides_of(in);
  const size_t off = out.size() - in.size();
  for (size_t i = 0; i < in.size(); ++i) s[off + i] = in[i] == 1 ? 0 : own[i];
  return s;
}

std::shared_ptr<Tensor> owned(int32_t dtype, Dims dims, std::string bytes) {
  return make_tensor(dtype, std::move(dims), std::move(bytes));
}

std::shared_ptr<Tensor> view(const Arr& a, Dims dims) {
  auto t = std::make_shared<Tensor>(*a.tensor);
  t->name = OptString{};
  t->dims = std::move(dims);
  t->extras.clear();
  return t;
}

}  // namespace fastopt::eval
