#include "quant/blockwise.h"

#include <cfloat>
#include <cmath>
#include <cstring>

#include "ir/constant.h"
#include "quant/vector_clones.h"

namespace fastopt::quant {

void ErrorSums::merge(const ErrorSums& o) {
  abs_err += o.abs_err;
  abs += o.abs;
  max_err = o.max_err > max_err || std::isnan(o.max_err) ? o.max_err : max_err;
  max_abs = o.max_abs > max_abs ? o.max_abs : max_abs;
  sq_err += o.sq_err;
  sq += o.sq;
  count += o.count;
}

bool ErrorSums::finite() const {
  return std::isfinite(abs_err) && std::isfinite(abs) && std::isfinite(max_err);
}

uint16_t float_to_bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float bfloat16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace {

// Per column, the min and max over `rows` rows `ld` floats apart.
FASTOPT_VECTOR_CLONES void column_range(const float* __restrict src, int64_t ld, int64_t rows,
                                        int64_t n, float* __restrict mn, float* __restrict mx) {
  for (int64_t c = 0; c < n; ++c) {
    mn[c] = FLT_MAX;
    mx[c] = -FLT_MAX;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    for (int64_t c = 0; c < n; ++c) {
      const float v = row[c];
      mn[c] = v < mn[c] ? v : mn[c];
      mx[c] = v > mx[c] ? v : mx[c];
    }
  }
}

// One row of codes and its error terms; a plain function of restrict pointers so that the
// compiler vectorizes it across columns.
FASTOPT_VECTOR_CLONES void quantize_row(const float* __restrict row, const float* __restrict rs,
                                        const float* __restrict zf, const float* __restrict ds,
                                        float kmax, float weight, int64_t n, uint8_t* __restrict q,
                                        float* __restrict ce, float* __restrict ca,
                                        float* __restrict cme, float* __restrict cma,
                                        float* __restrict cse, float* __restrict csq) {
  for (int64_t c = 0; c < n; ++c) {
    const float v = row[c];
    const int32_t qi = nearest_code(v, rs[c], zf[c], kmax);
    q[c] = static_cast<uint8_t>(qi);
    const float d = v - (static_cast<float>(qi) - zf[c]) * ds[c];
    const float e = std::fabs(d);
    const float a = std::fabs(v);
    ce[c] += e;
    ca[c] += a;
    cse[c] += weight * d * d;
    csq[c] += weight * v * v;
    cme[c] = e > cme[c] ? e : cme[c];
    cma[c] = a > cma[c] ? a : cma[c];
  }
}

// One row's codes and dequantized values from the chosen parameters (GPTQ's step).
FASTOPT_VECTOR_CLONES void code_and_dequantize(const float* __restrict row,
                                               const float* __restrict rs,
                                               const float* __restrict zf,
                                               const float* __restrict ds, float kmax, int64_t n,
                                               uint8_t* __restrict q, float* __restrict deq) {
  for (int64_t c = 0; c < n; ++c) {
    const int32_t qi = nearest_code(row[c], rs[c], zf[c], kmax);
    q[c] = static_cast<uint8_t>(qi);
    deq[c] = (static_cast<float>(qi) - zf[c]) * ds[c];
  }
}

}  // namespace

float BlockQuantizer::store(size_t c, float scale) {
  if (spec_.scale_dtype == 10) {
    const uint16_t h = float_to_half(scale);
    stored_[c] = h;
    return half_to_float(h);
  }
  if (spec_.scale_dtype == 16) {
    const uint16_t b = float_to_bfloat16(scale);
    stored_[c] = b;
    return bfloat16_to_float(b);
  }
  std::memcpy(&stored_[c], &scale, 4);
  return scale;
}

void BlockQuantizer::choose(const float* src, int64_t ld, int64_t rows, int64_t cols,
                            const float* importance) {
  const size_t n = static_cast<size_t>(cols);
  cols_ = cols;
  min_.resize(n);
  max_.resize(n);
  recip_.resize(n);
  zero_.resize(n);
  dequant_scale_.resize(n);
  stored_.resize(n);
  zp_.resize(n);
  codes_.resize(n * static_cast<size_t>(rows));
  float* mn = min_.data();
  float* mx = max_.data();
  column_range(src, ld, rows, static_cast<int64_t>(n), mn, mx);

  const float kmax = static_cast<float>(spec_.max_code());
  const float half = static_cast<float>(spec_.mid_code());
  for (size_t c = 0; c < n; ++c) {
    float scale;
    uint8_t zp;
    if (spec_.symmetric) {
      const float m = std::fabs(mx[c]) > std::fabs(mn[c]) ? mx[c] : mn[c];
      scale = -m / half;
      zp = static_cast<uint8_t>(spec_.mid_code());
    } else {
      const float lo = std::min(mn[c], 0.0f), hi = std::max(mx[c], 0.0f);
      scale = (hi - lo) / kmax;
      float zp_f = lo;
      if (scale != 0.0f) zp_f = 0.0f - lo / scale;
      if (zp_f < 0.0f) {
        zp = 0;
      } else if (zp_f > kmax) {
        zp = static_cast<uint8_t>(spec_.max_code());
      } else {
        zp = static_cast<uint8_t>(std::roundf(zp_f));
      }
    }
    // The scale the codes use, and the one stored: onnxruntime quantizes bfloat16 weights with
    // the float scale and casts it afterwards.
    const float dequant = store(c, scale);
    const float used = spec_.scale_dtype == 16 ? scale : dequant;
    recip_[c] = used != 0.0f ? 1.0f / used : 0.0f;
    zero_[c] = static_cast<float>(zp);
    dequant_scale_[c] = dequant;
    zp_[c] = zp;
  }
  if (spec_.method != Method::kRtn) search(src, ld, rows, static_cast<int64_t>(n), importance);
}

void BlockQuantizer::code_row(int64_t r, const float* row, float* deq) {
  code_and_dequantize(row, recip_.data(), zero_.data(), dequant_scale_.data(),
                      static_cast<float>(spec_.max_code()), cols_,
                      codes_.data() + static_cast<size_t>(r * cols_), deq);
}

void BlockQuantizer::add_error(const float* src, int64_t ld, int64_t rows, ErrorSums& err,
                               const float* importance) const {
  ErrorSums e;
  for (int64_t r = 0; r < rows; ++r) {
    const float w = importance ? importance[r] : 1.0f;
    const uint8_t* q = codes_.data() + static_cast<size_t>(r * cols_);
    for (int64_t c = 0; c < cols_; ++c) {
      const float v = src[r * ld + c];
      const float d = v - (static_cast<float>(q[c]) - zero_[c]) * dequant_scale_[c];
      e.abs_err += std::fabs(d);
      e.abs += std::fabs(v);
      e.sq_err += static_cast<double>(w * d * d);
      e.sq += static_cast<double>(w * v * v);
      e.max_err = std::max(e.max_err, std::fabs(d));
      e.max_abs = std::max(e.max_abs, std::fabs(v));
    }
  }
  e.count = static_cast<uint64_t>(rows * cols_);
  err.merge(e);
}

void BlockQuantizer::run(const float* src, int64_t ld, int64_t rows, int64_t cols, ErrorSums& err,
                         const float* importance) {
  choose(src, ld, rows, cols, importance);
  const size_t n = static_cast<size_t>(cols);
  const float kmax = static_cast<float>(spec_.max_code());
  const float* __restrict rs = recip_.data();
  const float* __restrict zf = zero_.data();
  const float* __restrict ds = dequant_scale_.data();
  // Per-column accumulators: the loops below stay elementwise across columns (no reductions
  // inside them), which is what lets the compiler vectorize them.
  col_err_.assign(n, 0.0f);
  col_abs_.assign(n, 0.0f);
  col_max_err_.assign(n, 0.0f);
  col_max_abs_.assign(n, 0.0f);
  col_sq_err_.assign(n, 0.0f);
  col_sq_.assign(n, 0.0f);
  float* __restrict cse = col_sq_err_.data();
  float* __restrict csq = col_sq_.data();
  float* __restrict ce = col_err_.data();
  float* __restrict ca = col_abs_.data();
  float* __restrict cme = col_max_err_.data();
  float* __restrict cma = col_max_abs_.data();
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(src + r * ld, rs, zf, ds, kmax, importance ? importance[r] : 1.0f,
                 static_cast<int64_t>(n), codes_.data() + static_cast<size_t>(r) * n, ce, ca, cme,
                 cma, cse, csq);
  }
  double abs_err = 0, abs_sum = 0, sq_err = 0, sq = 0;
  float max_err = err.max_err, max_abs = err.max_abs;
  for (size_t c = 0; c < n; ++c) {
    abs_err += static_cast<double>(ce[c]);  // a NaN shows in the sums
    abs_sum += static_cast<double>(ca[c]);
    sq_err += static_cast<double>(cse[c]);
    sq += static_cast<double>(csq[c]);
    max_err = cme[c] > max_err ? cme[c] : max_err;
    max_abs = cma[c] > max_abs ? cma[c] : max_abs;
  }
  err.abs_err += abs_err;
  err.abs += abs_sum;
  err.sq_err += sq_err;
  err.sq += sq;
  err.max_err = max_err;
  err.max_abs = max_abs;
  err.count += static_cast<uint64_t>(rows) * n;
}

void BlockQuantizer::store_scale(int64_t c, uint8_t* dst) const {
  std::memcpy(dst, &stored_[static_cast<size_t>(c)], static_cast<size_t>(spec_.scale_bytes()));
}

}  // namespace fastopt::quant
