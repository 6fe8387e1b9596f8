// Blockwise round-to-nearest quantization of one block of rows, computed exactly as ONNX
// Runtime's MLAS BlockwiseQuantizer (onnxruntime/core/mlas/lib/q4_dq.cpp, reached through
// quantize_matmul_4bits / 8bits and MatMulNBitsQuantizer's default RTN), so that fastopt's bytes
// are the same as onnxruntime's:
//   per column, over the block's rows (min and max as float):
//     symmetric:  m = |max| > |min| ? max : min (signed);  scale = -m / 2^(bits-1);  zp =
//     2^(bits-1) asymmetric: min = min(min, 0), max = max(max, 0);  scale = (max - min) / (2^bits -
//     1);
//                 zp = clamp(roundf(-min / scale), 0, 2^bits - 1)   (0 when scale is 0)
//   the scale is rounded to its storage type (the weight's: fp32 / fp16) and read back, then
//     q = clamp(roundf(v * (scale ? 1 / scale : 0) + zp), 0, 2^bits - 1)
// (bf16 weights: onnxruntime quantizes them as fp32 and casts the scales to bf16 afterwards.)
// The loops run across columns of a row-major block, so the compiler vectorizes them; the file
// is built with -ffp-contract=off (no fused multiply-adds: the rounding must match).
// Method::kSearch replaces nearest rounding's scale (and zero point) per block and column with
// the one that minimises the importance-weighted squared error (quant/search.cc). Method::kGptq
// chooses each block's parameters as the search does, from weights that earlier rows' rounding
// errors were fed into (quant/gptq.h, with calibration's Hessian).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastopt::quant {

// How a block's scale and zero point are chosen: onnxruntime's round-to-nearest from the block's
// range (its bytes), or searched for the least weighted squared error (quant/search.cc).
// GPTQ: the search's parameters, codes made row by row with error feedback (quant/gptq.h).
enum class Method { kRtn = 0, kSearch = 1, kGptq = 2 };

struct BlockwiseSpec {
  Method method = Method::kRtn;
  int bits = 4;  // 4 or 8
  int64_t block_size = 32;
  bool symmetric = true;
  int32_t scale_dtype = 1;  // ONNX code of the scales' type: 1 float, 10 float16, 16 bfloat16
  int max_code() const { return (1 << bits) - 1; }
  int mid_code() const { return 1 << (bits - 1); }
  int scale_bytes() const { return scale_dtype == 1 ? 4 : 2; }
};

// Reconstruction error sums of the dequantized values against the originals.
struct ErrorSums {
  double abs_err = 0, abs = 0;  // sums of |w - w'| and |w|
  float max_err = 0, max_abs = 0;
  // Importance-weighted sums of (w - w')^2 and w^2 (weights 1 without an importance vector).
  double sq_err = 0, sq = 0;
  uint64_t count = 0;
  void merge(const ErrorSums& o);
  bool finite() const;  // false when the weight held NaN or infinities
  // sq_err / sq: the relative weighted mean squared error (0 for an all-zero weight).
  double rel_mse() const { return sq > 0 ? sq_err / sq : 0.0; }
};

class BlockQuantizer {
 public:
  explicit BlockQuantizer(const BlockwiseSpec& spec) : spec_(spec) {}

  // Quantizes `rows` (1..block_size) rows x `cols` columns of a row-major float block whose rows
  // are `ld` floats apart. Results: codes()[r * cols + c], and per column the stored scale,
  // the scale the codes were computed with, and the zero point. `importance` (null: uniform)
  // weights row r's squared errors by importance[r] (>= 0) in the search and in err.sq_err.
  void run(const float* src, int64_t ld, int64_t rows, int64_t cols, ErrorSums& err,
           const float* importance = nullptr);

  // GPTQ (quant/gptq.h): chooses the block's parameters as run() does, without coding it; then
  // code_row codes row r (< rows) into codes() and writes its dequantized values into deq, and
  // add_error sums the error of the block's codes against the original rows `src`.
  void choose(const float* src, int64_t ld, int64_t rows, int64_t cols, const float* importance);
  void code_row(int64_t r, const float* row, float* deq);
  void add_error(const float* src, int64_t ld, int64_t rows, ErrorSums& err,
                 const float* importance) const;

  const uint8_t* codes() const { return codes_.data(); }
  uint8_t zero_point(int64_t c) const { return zp_[c]; }
  // Writes column c's scale as stored (little-endian, spec.scale_bytes() bytes).
  void store_scale(int64_t c, uint8_t* dst) const;

 private:
  // Method::kSearch (search.cc): replaces the nearest-rounding parameters of each column where
  // a searched scale (and zero point) gives a smaller weighted squared error.
  void search(const float* src, int64_t ld, int64_t rows, int64_t n, const float* importance);
  // The search of columns [c0, c0 + n), src pointing at column c0.
  void search_span(const float* src, int64_t ld, int64_t rows, int64_t n, const float* importance,
                   int64_t c0);
  // The stored form of scale s in column c, and the value dequantization reads back.
  float store(size_t c, float s);

  BlockwiseSpec spec_;
  std::vector<float> min_, max_, recip_, zero_, dequant_scale_;
  std::vector<float> col_err_, col_abs_, col_max_err_, col_max_abs_, col_sq_err_, col_sq_;
  std::vector<float> s_sums_;     // search's per-column sums (search.cc)
  std::vector<float> s_weights_;  // and its element weights
  std::vector<float> s_rows_;     // and row weights
  std::vector<double> s_err_;
  std::vector<uint16_t> s_halves_;
  std::vector<uint32_t> stored_;  // bits of the stored scale
  std::vector<uint8_t> zp_, codes_;
  int64_t cols_ = 0;  // of the block choose() chose for
};

// bfloat16 <-> float (round to nearest even, as ml_dtypes / numpy casts do).
uint16_t float_to_bfloat16(float f);
float bfloat16_to_float(uint16_t b);

// q = clamp(roundf(v * recip + zero), 0, kmax), the code of one value. clamp(roundf(x)) ==
// roundf(clamp(x)) since kmax is whole; for x >= 0, roundf (halves away from zero) is
// t + (x - t >= 0.5) with t = trunc(x): exact, and branch-free so that callers vectorize.
inline int32_t nearest_code(float v, float recip, float zero, float kmax) {
  float x = v * recip + zero;
  x = x >= 0.0f ? x : 0.0f;
  x = x <= kmax ? x : kmax;
  const int32_t t = static_cast<int32_t>(x);
  return t + ((x - static_cast<float>(t)) >= 0.5f ? 1 : 0);
}

}  // namespace fastopt::quant
