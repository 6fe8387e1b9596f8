#include "quant/search_steps.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "ir/constant.h"
#include "quant/vector_clones.h"

namespace fastopt::quant {
namespace {

FASTOPT_INLINE float clamp_code(float z, float kmax) {
  return z < 0.0f ? 0.0f : z > kmax ? kmax : z;
}

// std::roundf (halves away from zero; NaN, infinities and the sign of zero kept), branch-free so
// that its loops vectorize (roundf is a library call): x - trunc(x) is exact for every float.
FASTOPT_INLINE float round_half_away(float x) {
  const float t = std::trunc(x);
  return std::fabs(x - t) >= 0.5f ? t + std::copysign(1.0f, x) : t;
}

// 1 / s, or 0 where s is 0 or the reciprocal is not finite.
FASTOPT_INLINE float finite_recip(float s) {
  const float q = 1.0f / s;
  const float r = s != 0.0f ? q : 0.0f;
  return std::fabs(r) <= FLT_MAX ? r : 0.0f;
}

template <bool kSymmetric>
FASTOPT_VECTOR_CLONES void candidates(const float* __restrict mx, const float* __restrict mn,
                                      int64_t n, float kmax, float half, float divisor,
                                      float* __restrict rs, float* __restrict zf) {
  const float range_divisor = (kSymmetric ? half : kmax) * divisor;
  for (int64_t c = 0; c < n; ++c) {
    float s, z = half;
    if (kSymmetric) {
      const float peak = std::fabs(mx[c]) > std::fabs(mn[c]) ? mx[c] : mn[c];
      s = -peak / range_divisor;
    } else {
      const float lo = std::min(mn[c], 0.0f), hi = std::max(mx[c], 0.0f);
      s = (hi - lo) / range_divisor;
      const float zs = clamp_code(round_half_away(-lo / s), kmax);
      z = s != 0.0f ? zs : 0.0f;
    }
    rs[c] = finite_recip(s);
    zf[c] = z;
  }
}

FASTOPT_VECTOR_CLONES void better_fit(const float* __restrict slx, const float* __restrict sll,
                                      const float* __restrict sxx, const float* __restrict rs,
                                      const float* __restrict zf, int64_t n,
                                      double* __restrict fit_e, float* __restrict fit_s,
                                      float* __restrict fit_z) {
  for (int64_t c = 0; c < n; ++c) {
    const double e = static_cast<double>(sxx[c]) - static_cast<double>(slx[c]) * slx[c] / sll[c];
    const float s = slx[c] / sll[c];
    const bool take = (sll[c] > 0.0f) & (rs[c] != 0.0f) & (e < fit_e[c]);
    fit_e[c] = take ? e : fit_e[c];
    fit_s[c] = take ? s : fit_s[c];
    fit_z[c] = take ? zf[c] : fit_z[c];
  }
}

FASTOPT_VECTOR_CLONES void codes_of(const float* __restrict fit_s, const float* __restrict fit_z,
                                    int64_t n, float* __restrict rs, float* __restrict zf) {
  for (int64_t c = 0; c < n; ++c) {
    rs[c] = std::fabs(fit_s[c]) <= FLT_MAX ? finite_recip(fit_s[c]) : 0.0f;
    zf[c] = fit_z[c];
  }
}

// The weighted sums of one column under its current codes (see code_sums and data_sums).
struct ColumnSums {
  double slx, sll, sl, sw, sx;
};

// Asymmetric refit of a column: x ~ s * L + b jointly, then the offset as an integer zero point
// and s refitted for it. Falls back to the scale-only fit where the joint one is degenerate.
// Branch-free (the fallbacks chosen after computing everything), so that its loop vectorizes.
FASTOPT_INLINE void refit_offset(const ColumnSums& k, float zero, float kmax, float* fit_s,
                                 float* fit_z) {
  const float scale_only = static_cast<float>(k.slx) / static_cast<float>(k.sll);
  const double d = k.sw * k.sll - k.sl * k.sl;
  const double js = (k.sw * k.slx - k.sl * k.sx) / d;
  const double jb = (k.sll * k.sx - k.sl * k.slx) / d;
  const float z = clamp_code(round_half_away(static_cast<float>(zero - jb / js)), kmax);
  const double dz = static_cast<double>(zero) - z;  // L' = L + dz
  const double lx = k.slx + dz * k.sx;
  const double ll = k.sll + 2.0 * dz * k.sl + dz * dz * k.sw;
  const bool joint = (d > 0.0) & (js > 0.0) & (ll > 0.0);
  *fit_s = joint ? static_cast<float>(lx / ll) : scale_only;
  *fit_z = joint ? z : *fit_z;
}

template <bool kSymmetric>
FASTOPT_VECTOR_CLONES void evaluate(const float* __restrict slx, const float* __restrict sll,
                                    const float* __restrict sl, const float* __restrict sw,
                                    const float* __restrict sx, const float* __restrict sxx,
                                    const float* __restrict rs, const float* __restrict zf,
                                    int64_t n, float kmax, double* __restrict best_e,
                                    float* __restrict best_s, float* __restrict best_z,
                                    float* __restrict fit_s, float* __restrict fit_z) {
  for (int64_t c = 0; c < n; ++c) {
    const double s = fit_s[c];
    const double e = static_cast<double>(sxx[c]) - 2.0 * s * slx[c] + s * s * sll[c];
    const bool coded = rs[c] != 0.0f;
    const bool take = coded & (e < best_e[c]);
    best_e[c] = take ? e : best_e[c];
    best_s[c] = take ? fit_s[c] : best_s[c];
    best_z[c] = take ? zf[c] : best_z[c];
    float ns, nz = fit_z[c];
    if (kSymmetric) {
      ns = slx[c] / sll[c];
    } else {
      refit_offset({slx[c], sll[c], sl[c], sw[c], sx[c]}, zf[c], kmax, &ns, &nz);
    }
    const bool refit = coded & (sll[c] > 0.0f);
    fit_s[c] = refit ? ns : fit_s[c];
    fit_z[c] = refit ? nz : fit_z[c];
  }
}

FASTOPT_VECTOR_CLONES void recips(const float* __restrict s, int64_t n, float* __restrict rs) {
  for (int64_t c = 0; c < n; ++c) rs[c] = finite_recip(s[c]);
}

}  // namespace

void range_candidates(bool symmetric, const float* mx, const float* mn, int64_t n, float kmax,
                      float half, float divisor, float* rs, float* zf) {
  (symmetric ? candidates<true> : candidates<false>)(mx, mn, n, kmax, half, divisor, rs, zf);
}

void keep_better_fit(const SearchSums& k, const float* rs, const float* zf, int64_t n,
                     double* fit_e, float* fit_s, float* fit_z) {
  better_fit(k.slx, k.sll, k.sxx, rs, zf, n, fit_e, fit_s, fit_z);
}

void stored_scales(const BlockwiseSpec& spec, float* s, int64_t n, std::vector<uint16_t>& halves) {
  const size_t m = static_cast<size_t>(n);
  if (spec.scale_dtype == 10) {  // float_to_half / half_to_float, 8 at a time (ir/constant.h)
    halves.resize(m);
    floats_to_halves(s, m, halves.data());
    halves_to_floats(reinterpret_cast<const uint8_t*>(halves.data()), m, s);
  }
  if (spec.scale_dtype == 16) {
    for (size_t c = 0; c < m; ++c) s[c] = bfloat16_to_float(float_to_bfloat16(s[c]));
  }
}

void round_codes(const float* fit_s, const float* fit_z, int64_t n, float* rs, float* zf) {
  codes_of(fit_s, fit_z, n, rs, zf);
}

void evaluate_and_refit(bool symmetric, const SearchSums& k, const float* rs, const float* zf,
                        int64_t n, float kmax, double* best_e, float* best_s, float* best_z,
                        float* fit_s, float* fit_z) {
  (symmetric ? evaluate<true> : evaluate<false>)(k.slx, k.sll, k.sl, k.sw, k.sx, k.sxx, rs, zf, n,
                                                 kmax, best_e, best_s, best_z, fit_s, fit_z);
}

void finite_recips(const float* s, int64_t n, float* rs) {
  recips(s, n, rs);
}

}  // namespace fastopt::quant
