// Method::kSearch: per column of a block, the scale (and, asymmetric, the zero point) that
// minimises the weighted squared error of the dequantized block, element weights
// imp[k] * (av + |x|) (av: the block column's weighted rms), searched as llama.cpp's k-quants do
// (make_qx_quants / make_qkx2_quants, whose data-free weights are av + |x| too: plain squared
// error let the search trade the large weights' error for the small ones', and on SmolLM2 the
// KL rose although the squared error fell):
//   1. candidate scales around the range-based one (its divisor times kDivisors), each refitted
//      by least squares given the codes it makes (s = sum w x L / sum w L^2, L = q - zero);
//   2. from the best, rounds of: scale rounded to its storage type -> nearest codes -> refit
//      (asymmetric: scale and offset jointly, the offset rounded to an integer zero point);
//   3. the best stored (scale, zero point) replaces nearest rounding's only where its error,
//      computed exactly as the codes will be written, is smaller: never worse than RTN in
//      that weighted error.
// Columns are searched independently, in spans whose rows stay in L1 over the passes; each pass
// over the rows sums groups of 16 columns in vector registers; the per-column steps between
// passes are vectorized loops too (search_steps.h). Every float operation is the one the plain
// per-column loops did, in the same order: the same bytes (tests/quant/test_search_speed.py).
// Measured in bench/results/quantize_accuracy.md ("Cost").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "quant/blockwise.h"
#include "quant/search_steps.h"
#include "quant/vector_clones.h"

namespace fastopt::quant {
namespace {

// Candidates: the range-based scale's divisor (2^(bits-1) symmetric, 2^bits - 1 asymmetric)
// times these: steps of 0.2 of a code at 4 bits (llama.cpp's are 0.1), and wider ones that clip
// a heavy tail's outliers. On SmolLM2-135M's weights these 9 and 2 rounds come within 1 % of the
// relative MSE of 16 candidates and 3 rounds at int4, in two thirds of the time.
constexpr float kDivisors[] = {0.95f, 0.975f, 1.0f, 1.025f, 1.05f, 1.075f, 1.15f, 1.3f, 1.5f};
constexpr int kRounds = 2;  // codes-then-refit rounds from the best candidate

// Columns summed together: a group's accumulators stay in registers over the block's rows.
// (Loops across all of a chunk's columns kept them in memory, a load and a store per sum, row
// and column: on the 0.5B that was most of the search's time.) Each column's sums still add its
// rows in order, so the results are the same floats.
constexpr int64_t kGroup = 16;
// A full group's width as a compile-time constant (the compiler then keeps its sums in vector
// registers); the last group of a block's columns has a runtime one.
using FullGroup = std::integral_constant<int64_t, kGroup>;
// Floats of a span's rows (search below): with its element weights, 32 KB.
constexpr int64_t kSpanFloats = 4096;

// nearest_code(v, recip, zero, kmax) (blockwise.h) as a float, in fewer instructions: for x in
// [0, kmax] (kmax <= 255) the integer part of x + 0.49999997f is roundf(x), for every float
// (checked exhaustively over [0, 255]; x + 0.5f alone fails at x = 0.49999997f, whose sum rounds
// up to 1). Two instructions (add, truncate) where nearest_code's rounding takes seven.
// The clamp is written as min (one instruction); x > 0 differs from nearest_code's x >= 0 only at
// -0, which codes as +0 does.
FASTOPT_INLINE float nearest_code_value(float v, float recip, float zero, float kmax) {
  float x = v * recip + zero;
  x = x > 0.0f ? x : 0.0f;
  x = x < kmax ? x : kmax;
  return std::trunc(x + 0.49999997f);
}

// The weighted sums of one group's columns under the codes (recip, zero) make, L = q - zero with
// q = nearest_code(x, recip, zero, kmax) (blockwise.h), as quantize_row rounds, the element
// weights ew [rows, ldw] (see data_sums): slx = sum ew L x, sll = sum ew L^2, and with kOffset
// (the asymmetric joint fit) sl = sum ew L.
template <bool kOffset, typename Width>
FASTOPT_INLINE void code_sums_group(const float* __restrict src, int64_t ld, int64_t rows,
                                    const float* __restrict ew, int64_t ldw,
                                    const float* __restrict rs, const float* __restrict zf,
                                    float kmax, Width width, float* __restrict slx,
                                    float* __restrict sll, float* __restrict sl) {
  const int64_t w = width;
  float a[kGroup] = {}, b[kGroup] = {}, t[kGroup] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    const float* e = ew + r * ldw;
    for (int64_t c = 0; c < w; ++c) {
      const float v = row[c];
      const float l = nearest_code_value(v, rs[c], zf[c], kmax) - zf[c];
      const float wl = e[c] * l;
      a[c] += wl * v;
      b[c] += wl * l;
      if (kOffset) t[c] += wl;
    }
  }
  for (int64_t c = 0; c < w; ++c) {
    slx[c] = a[c];
    sll[c] = b[c];
    sl[c] = t[c];
  }
}

template <bool kOffset>
FASTOPT_VECTOR_CLONES void code_sums(const float* src, int64_t ld, int64_t rows, int64_t n,
                                     const float* ew, const float* rs, const float* zf, float kmax,
                                     float* slx, float* sll, float* sl) {
  int64_t c0 = 0;
  for (; c0 + kGroup <= n; c0 += kGroup)
    code_sums_group<kOffset>(src + c0, ld, rows, ew + c0, n, rs + c0, zf + c0, kmax, FullGroup(),
                             slx + c0, sll + c0, sl + c0);
  if (c0 < n)
    code_sums_group<kOffset>(src + c0, ld, rows, ew + c0, n, rs + c0, zf + c0, kmax, n - c0,
                             slx + c0, sll + c0, sl + c0);
}

// Per column: av = sqrt(sum w x^2 / sum w) (w: the rows' weights, `total` their sum), the scale
// of the element weights w (av + |x|). (In groups, GCC vectorizes this one across rows.)
FASTOPT_VECTOR_CLONES void column_rms(const float* __restrict src, int64_t ld, int64_t rows,
                                      int64_t n, const float* __restrict w, float total,
                                      float* __restrict av) {
  for (int64_t c = 0; c < n; ++c) av[c] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    for (int64_t c = 0; c < n; ++c) av[c] += w[r] * row[c] * row[c];
  }
  for (int64_t c = 0; c < n; ++c) av[c] = total > 0.0f ? std::sqrt(av[c] / total) : 0.0f;
}

// One group of data_sums.
template <typename Width>
FASTOPT_INLINE void data_sums_group(const float* __restrict src, int64_t ld, int64_t rows,
                                    const float* __restrict w, const float* __restrict av,
                                    Width width, float* __restrict ew, int64_t ldw,
                                    float* __restrict sw, float* __restrict sx,
                                    float* __restrict sxx) {
  const int64_t n = width;
  float a[kGroup] = {}, b[kGroup] = {}, t[kGroup] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    float* e = ew + r * ldw;
    for (int64_t c = 0; c < n; ++c) {
      const float x = w[r] * (av[c] + std::fabs(row[c]));
      e[c] = x;
      a[c] += x;
      b[c] += x * row[c];
      t[c] += x * row[c] * row[c];
    }
  }
  for (int64_t c = 0; c < n; ++c) {
    sw[c] = a[c];
    sx[c] = b[c];
    sxx[c] = t[c];
  }
}

// Per element, its weight in the errors, ew = w * (av + |x|) (kept: every later sum reads it),
// and per column their sums: sum ew, sum ew x and sum ew x^2.
FASTOPT_VECTOR_CLONES void data_sums(const float* src, int64_t ld, int64_t rows, int64_t n,
                                     const float* w, const float* av, float* ew, float* sw,
                                     float* sx, float* sxx) {
  int64_t c0 = 0;
  for (; c0 + kGroup <= n; c0 += kGroup)
    data_sums_group(src + c0, ld, rows, w, av + c0, FullGroup(), ew + c0, n, sw + c0, sx + c0,
                    sxx + c0);
  if (c0 < n)
    data_sums_group(src + c0, ld, rows, w, av + c0, n - c0, ew + c0, n, sw + c0, sx + c0, sxx + c0);
}

// One group of exact_error.
template <typename Width>
FASTOPT_INLINE void exact_error_group(const float* __restrict src, int64_t ld, int64_t rows,
                                      const float* __restrict ew, int64_t ldw,
                                      const float* __restrict rs, const float* __restrict zf,
                                      const float* __restrict ds, float kmax, Width width,
                                      double* __restrict e) {
  const int64_t w = width;
  double a[kGroup] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    const float* x = ew + r * ldw;
    for (int64_t c = 0; c < w; ++c) {
      const float v = row[c];
      const float d = v - (nearest_code_value(v, rs[c], zf[c], kmax) - zf[c]) * ds[c];
      a[c] += static_cast<double>(x[c] * d * d);
    }
  }
  for (int64_t c = 0; c < w; ++c) e[c] = a[c];
}

// Per column: the weighted squared error, in double, of the codes (recip, zero) make
// dequantized with `ds`, each term as quantize_row computes it.
FASTOPT_VECTOR_CLONES void exact_error(const float* src, int64_t ld, int64_t rows, int64_t n,
                                       const float* ew, const float* rs, const float* zf,
                                       const float* ds, float kmax, double* e) {
  int64_t c0 = 0;
  for (; c0 + kGroup <= n; c0 += kGroup)
    exact_error_group(src + c0, ld, rows, ew + c0, n, rs + c0, zf + c0, ds + c0, kmax, FullGroup(),
                      e + c0);
  if (c0 < n)
    exact_error_group(src + c0, ld, rows, ew + c0, n, rs + c0, zf + c0, ds + c0, kmax, n - c0,
                      e + c0);
}

}  // namespace

void BlockQuantizer::search(const float* src, int64_t ld, int64_t rows, int64_t n,
                            const float* imp) {
  // Spans of columns whose rows (and their element weights) fit in L1 together: every pass of
  // the search reads them again. Columns are searched independently, so any span gives the same
  // results.
  const int64_t span =
      std::max<int64_t>(kGroup, kSpanFloats / std::max<int64_t>(rows, 1) / kGroup * kGroup);
  for (int64_t c0 = 0; c0 < n; c0 += span)
    search_span(src + c0, ld, rows, std::min(span, n - c0), imp, c0);
}

void BlockQuantizer::search_span(const float* src, int64_t ld, int64_t rows, int64_t n,
                                 const float* imp, int64_t c0) {
  const size_t m = static_cast<size_t>(n);
  const float* mx = max_.data() + c0;
  const float* mn = min_.data() + c0;
  s_sums_.resize(m * 13);
  float* slx = s_sums_.data();
  float* sll = slx + m;
  float* sl = sll + m;
  float* sx = sl + m;
  float* sxx = sx + m;
  float* rs = sxx + m;        // candidate reciprocal
  float* zf = rs + m;         // candidate zero point
  float* fit_s = zf + m;      // the refitted (unrounded) scale to try next, and its zero point
  float* fit_z = fit_s + m;   //
  float* best_s = fit_z + m;  // the best stored scale evaluated, and its zero point
  float* best_z = best_s + m;
  float* av = best_z + m;  // element weights: imp[r] * (av + |x|)
  float* sw = av + m;      // their sums
  s_err_.resize(m * 3);
  double* best_e = s_err_.data();  // error of (best_s, best_z) from the sums; then exact
  double* rtn_e = best_e + m;
  double* fit_e = rtn_e + m;  // error of (fit_s, fit_z) from the sums, unrounded

  const float kmax = static_cast<float>(spec_.max_code());
  const float half = static_cast<float>(spec_.mid_code());
  const bool sym = spec_.symmetric;
  const auto sums = sym ? code_sums<false> : code_sums<true>;
  s_weights_.resize(m * static_cast<size_t>(rows));
  float* ew = s_weights_.data();
  // The rows' weights (1 without importance) and their sum, added in row order.
  s_rows_.assign(static_cast<size_t>(rows), 1.0f);
  if (imp) std::copy(imp, imp + rows, s_rows_.begin());
  float total = 0.0f;
  for (const float w : s_rows_) total += w;
  column_rms(src, ld, rows, n, s_rows_.data(), total, av);
  data_sums(src, ld, rows, n, s_rows_.data(), av, ew, sw, sx, sxx);
  for (size_t c = 0; c < m; ++c) {
    fit_e[c] = best_e[c] = INFINITY;
    fit_s[c] = best_s[c] = 0.0f;
    fit_z[c] = best_z[c] = half;
  }

  // 1. Candidates around the range-based scale, each refitted given its codes.
  for (const float divisor : kDivisors) {
    // At 8 bits a clipped outlier costs more than the finer grid gains: the verify gate's max
    // error on logits rose past 5 % on the llama fixture with them (int8 asymmetric, block 128).
    if (spec_.bits == 8 && divisor > 1.1f) continue;
    range_candidates(sym, mx, mn, n, kmax, half, divisor, rs, zf);
    sums(src, ld, rows, n, ew, rs, zf, kmax, slx, sll, sl);
    keep_better_fit({slx, sll, sl, sw, sx, sxx}, rs, zf, n, fit_e, fit_s, fit_z);
  }

  // 2. Rounds: the scale as stored -> its nearest codes -> evaluate -> refit.
  for (int round = 0; round <= kRounds; ++round) {
    stored_scales(spec_, fit_s, n, s_halves_);  // stored form, evaluated below
    round_codes(fit_s, fit_z, n, rs, zf);
    sums(src, ld, rows, n, ew, rs, zf, kmax, slx, sll, sl);
    evaluate_and_refit(sym, {slx, sll, sl, sw, sx, sxx}, rs, zf, n, kmax, best_e, best_s, best_z,
                       fit_s, fit_z);
  }

  // 3. The search's best against nearest rounding, both computed as the codes will be.
  exact_error(src, ld, rows, n, ew, recip_.data() + c0, zero_.data() + c0,
              dequant_scale_.data() + c0, kmax, rtn_e);
  finite_recips(best_s, n, rs);
  exact_error(src, ld, rows, n, ew, rs, best_z, best_s, kmax, best_e);
  for (size_t c = 0; c < m; ++c) {
    if (rs[c] == 0.0f || !(best_e[c] < rtn_e[c])) continue;
    const size_t k = static_cast<size_t>(c0) + c;
    store(k, best_s[c]);  // exact: best_s is already in its stored form
    recip_[k] = rs[c];
    dequant_scale_[k] = best_s[c];
    zero_[k] = best_z[c];
    zp_[k] = static_cast<uint8_t>(best_z[c]);
  }
}

}  // namespace fastopt::quant
