// float32 -> float16 / bfloat16 conversion of whole tensors, streamed: each tensor is read in
// tiles from the model's mapping (quant/weight_source.h), converted and written into a TempFile,
// so a model's fp32 weights never sit in memory as a copy.
//   float16:  round to nearest even, exactly numpy's astype(float16) (ir/constant.h
//             float_to_half); finite values beyond +-65504 are clamped to +-65504 and counted
//   bfloat16: round to nearest even, exactly ml_dtypes' astype(bfloat16); finite values that
//             would round to infinity are clamped to +-3.3895e38 (0x7f7f) and counted
// NaN and infinities are kept (as numpy and ml_dtypes convert them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "quant/blockwise.h"
#include "quant/quantize_job.h"
#include "quant/temp_file.h"

namespace fastopt::quant {

// One element: the 16-bit pattern, `clamped` set when the value was out of range.
uint16_t convert_float(float f, int32_t to, bool& clamped);

struct ConvertJob {
  std::string name;
  ByteRef src;  // float32 elements
  uint64_t numel = 0;
  // Read as [numel / row_elems, row_elems] in whole rows: a packed weight's last dim, so that
  // its column blocks are read from their sources (quant/weight_source.h); 1 = flat.
  uint64_t row_elems = 1;
  int32_t to = 10;  // 10 float16, 16 bfloat16

  uint64_t data_bytes() const { return numel * 2; }
  uint64_t framing = 0;  // room for the initializer's framing (TempFile::reserve)
  // Filled by run_convert_jobs.
  uint64_t offset = 0;
  uint64_t clamped = 0;
  ErrorSums error;  // of the converted values against the originals
};

void run_convert_jobs(std::vector<ConvertJob>& jobs, TempFile& out, int threads,
                      const JobProgress& progress);

}  // namespace fastopt::quant
