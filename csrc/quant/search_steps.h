// The per-column steps of Method::kSearch (quant/search.cc) between its passes over a block's
// rows: each candidate's scale and zero point, the choice among them, the stored scales and the
// refit. Loops across a span's columns, branch-free so that they vectorize (search_steps.cc is
// built with -fno-trapping-math: both sides of each choice are computed, then one is selected;
// no value changes). Each computes exactly what the scalar code before it did.
#pragma once

#include <cstdint>
#include <vector>

#include "quant/blockwise.h"

namespace fastopt::quant {

// Per column, the weighted sums of the codes a pass made (search.cc's code_sums) and of the
// data (data_sums).
struct SearchSums {
  const float *slx, *sll, *sl, *sw, *sx, *sxx;
};

// Step 1's candidates: per column the range-based scale (from the column's max mx and min mn)
// with its divisor times `divisor`, as its reciprocal rs (0 where not finite), and (asymmetric)
// the zero point zf it implies, as blockwise.cc computes nearest rounding's.
void range_candidates(bool symmetric, const float* mx, const float* mn, int64_t n, float kmax,
                      float half, float divisor, float* rs, float* zf);

// Step 1's choice: per column where the candidate (rs, zf) made codes, its refitted scale
// slx / sll replaces the fit when its error from the sums, sxx - slx^2 / sll, is smaller.
void keep_better_fit(const SearchSums& k, const float* rs, const float* zf, int64_t n,
                     double* fit_e, float* fit_s, float* fit_z);

// The scales as the file will store them (float16 / bfloat16 scales round), in place.
void stored_scales(const BlockwiseSpec& spec, float* s, int64_t n, std::vector<uint16_t>& halves);

// Step 2's codes: each column's stored scale fit_s as the reciprocal its codes use, and the
// fit's zero point.
void round_codes(const float* fit_s, const float* fit_z, int64_t n, float* rs, float* zf);

// Step 2's evaluation and refit: per column that has codes, the stored fit (fit_s, zf) replaces
// the best where its error from the sums is smaller; then the next fit from these codes (the
// asymmetric one fits scale and offset jointly, the offset rounded to an integer zero point).
void evaluate_and_refit(bool symmetric, const SearchSums& k, const float* rs, const float* zf,
                        int64_t n, float kmax, double* best_e, float* best_s, float* best_z,
                        float* fit_s, float* fit_z);

// rs[c] = 1 / s[c], or 0 where s[c] is 0 or the reciprocal is not finite.
void finite_recips(const float* s, int64_t n, float* rs);

}  // namespace fastopt::quant
