// Int8 weight quantization for dynamic quantization (DynamicQuantizeMatMul, MatMulInteger,
// ConvInteger), computed exactly as onnxruntime.quantization.quantize_dynamic does it with
// weight_type QInt8 (quant_utils.py: compute_scale_zp, quantize_nparray), so that the bytes are
// the same:
//   range      rmin = min(min(x), 0), rmax = max(max(x), 0) (float32); symmetric: +-max(|rmin|,
//              |rmax|); qmin..qmax = -128..127, -127..127 symmetric, -64..64 reduce_range
//   scale      (double(rmax) - double(rmin)) / (qmax - qmin) in float64, stored as float32;
//              below FLT_MIN (float32 tiny): scale 1, zero point 0
//   zero point symmetric: round((qmin + qmax) / 2) (0); else round(qmin - rmin / scale) in
//              float64 with the unrounded float64 scale, round half to even
//   codes      q = clip(rint(float(x) / float(scale)) + zp, -128, 127): a float32 division and
//              round half to even (numpy's round), clipped to the full int8 range
// Per tensor, or per channel along the last axis (a MatMul weight's columns).
// Weights are read in place from the model's mapping (quant/weight_source.h), the codes written
// straight into a TempFile. A weight up to a share of a 128 MB budget per thread is read once:
// its range, then its codes over the same mapped pages, released as they are coded; a larger
// one (an lm_head) is read twice in 4 MB tiles (ranges, then codes, on all threads), since its
// per-tensor scale needs the whole range before the first code. Memory: the budget plus a few
// MB of staging, whatever the model weighs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "quant/blockwise.h"
#include "quant/quantize_job.h"
#include "quant/temp_file.h"

namespace fastopt::quant {

struct Int8Spec {
  bool symmetric = true;
  bool reduce_range = false;
  bool per_channel = false;  // one scale per column of the [rows, cols] view
};

struct Int8Params {
  float scale = 1;
  int8_t zero_point = 0;
};

// Scale and zero point of a range as quantize_dynamic computes them.
Int8Params int8_params(float rmin, float rmax, const Int8Spec& spec);

// One weight: a row-major float32 [rows, cols] view of its elements (a MatMul's [K, N]; a Gemm's
// B, transposed when transB; a Conv weight as [1, numel], always per tensor).
struct Int8Job {
  std::string name;
  WeightSource src;  // src.K = rows, src.N = cols as stored
  Int8Spec spec;
  // The weight to quantize is src transposed (a Gemm's transB = 1): rows() x cols() is
  // src.N x src.K, the codes are written in that layout (as quantize_dynamic's
  // "<name>_Transposed").
  bool transposed = false;

  int64_t rows() const { return transposed ? src.N : src.K; }
  int64_t cols() const { return transposed ? src.K : src.N; }
  int64_t channels() const { return spec.per_channel ? cols() : 1; }
  uint64_t data_bytes() const { return static_cast<uint64_t>(src.K * src.N); }
  // Rows [r0, r0 + n) of the weight to quantize, as floats into dst (n x cols()).
  void read_rows(int64_t r0, int64_t n, float* dst, std::vector<float>& tmp) const;

  // Filled by run_int8_jobs.
  uint64_t framing = 0;            // room for the codes' initializer framing (TempFile::reserve)
  uint64_t data_offset = 0;        // int8 codes [rows, cols] in the TempFile
  std::vector<Int8Params> params;  // per channel
  ErrorSums error;
  bool finite = true;  // false: the weight holds NaN or infinities (nothing written)
};

// Quantizes every job into `out` with `threads` threads (0 = all cores); calls `progress`
// (may be empty) from the calling thread. Rethrows a worker's error.
void run_int8_jobs(std::vector<Int8Job>& jobs, TempFile& out, int threads,
                   const JobProgress& progress);

}  // namespace fastopt::quant
