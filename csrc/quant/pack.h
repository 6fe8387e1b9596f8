// Codes of a block, computed row by row across columns (blockwise.h), into MatMulNBits' layout:
// each column's codes contiguous along K (two 4-bit codes a byte, low nibble first). The step is
// a byte transpose; done 16 x 16 bytes at a time with SSE2 where the block is whole.
#pragma once

#include <cstdint>
#include <vector>

namespace fastopt::quant {

// q[r * w + c] (r < rows, c < w): codes of `rows` rows (a whole block: rows even for 4 bits)
// and `w` columns. Writes column c's rows * bits / 8 bytes at dst + c * stride; `tmp` is staging.
void pack_columns(const uint8_t* q, int64_t rows, int64_t w, int bits, uint8_t* dst, int64_t stride,
                  std::vector<uint8_t>& tmp);

}  // namespace fastopt::quant
