// Quantizing whole weights: each weight is cut into tiles that threads take from a shared list;
// a tile is read from the model's mapping in place (quant/weight_source.h: float32 straight into
// the block quantizer, float16 / bfloat16 converted block by block), quantized block by block
// (blockwise.h) and its packed bytes are written straight into the TempFile. Memory: a few MB of
// staging per thread (GPTQ's tiles, whole along K: 2 x 4 MB), whatever the model weighs; the source
// pages a block read leave the process's mapping once it is done, so they do not add up in its RSS
// either.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ir/buffer.h"
#include "quant/blockwise.h"
#include "quant/parallel.h"
#include "quant/temp_file.h"
#include "quant/weight_source.h"

namespace fastopt::quant {

enum class Layout {
  kNBits,    // com.microsoft MatMulNBits: B uint8 [N, k_blocks, blob], scales [N, k_blocks],
             // zero points uint8 [N, ceil(k_blocks * bits / 8)] (asymmetric only)
  kQdq,      // DequantizeLinear(axis 0, block_size): data [K, N] int4/uint4/int8/uint8,
             // scales [k_blocks, N], zero points [k_blocks, N] (asymmetric only)
  kQdqRows,  // DequantizeLinear(axis 1, block_size) of the transpose: data [N, K], scales and
             // zero points [N, k_blocks]; MatMulNBits' bytes unpadded, signed when symmetric
             // (needs K * bits to be whole bytes)
};

struct WeightJob {
  std::string name;
  WeightSource src;
  BlockwiseSpec spec;
  Layout layout = Layout::kNBits;
  // Per input channel (K floats, >= 0): weights of the squared errors the search minimises and
  // error.sq_err sums; null for uniform. Owned by the caller, alive until run_jobs returns.
  const float* importance = nullptr;
  // GPTQ (quant/gptq.h; MatMulNBits layout): the upper Cholesky factor of H^-1, [K, K] floats
  // row-major, owned by the caller like `importance`; null: the spec's method alone.
  const float* gptq_factor = nullptr;
  // With it, act order: the order rows are coded in (K indices), the factor being that of the
  // permuted H; null: along K.
  const int64_t* gptq_order = nullptr;

  int64_t k_blocks() const { return (src.K + spec.block_size - 1) / spec.block_size; }
  int64_t blob() const { return spec.block_size * spec.bits / 8; }
  uint64_t data_bytes() const;   // quantized weights
  uint64_t scale_bytes() const;  // scales
  uint64_t zp_bytes() const;     // zero points (0 when symmetric)

  // Room for the framing of each part's initializer (TempFile::reserve), set by the pass that
  // names them; 0 where the part has none.
  uint64_t data_framing = 0, scale_framing = 0, zp_framing = 0;
  // Filled by run_jobs: offsets of the three parts in the TempFile, and the error sums.
  uint64_t data_offset = 0, scale_offset = 0, zp_offset = 0;
  ErrorSums error;

  // Internal to run_jobs.
  std::unique_ptr<std::mutex> mu = std::make_unique<std::mutex>();
  std::vector<uint8_t> qdq_zero_points;  // unpacked (QDQ layouts, asymmetric)
};

// Quantizes every job into `out` with `threads` threads (0 = all cores). Calls `progress` from
// the calling thread about ten times a second (may be empty). Rethrows a worker's error.
void run_jobs(std::vector<WeightJob>& jobs, TempFile& out, int threads,
              const JobProgress& progress);

}  // namespace fastopt::quant
