// A float weight as the quantizers read it: straight from the model's mapping (the loaded
// file's mmap, or memory for tensors made by earlier passes), without a pread copy. float32
// rows are read in place; float16 / bfloat16 are converted into the caller's block. Once a part
// was read for the last time, release() drops its pages from the process's page tables
// (MADV_DONTNEED on the file mapping: the page cache keeps them), so that a 13 GB model read
// end to end costs a few MB of resident memory per thread, not its size.
// Measured on the 2.4 GB export (page cache warm): pread into a 4 MB buffer 0.61 s of system
// time, the mapping read in place with faults and releases 0.32 s.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ir/buffer.h"

namespace fastopt::quant {

// A row-major [K, N] float weight (float32, float16 or bfloat16 elements), or with `transposed`
// one stored as [N, K] (an embedding table [vocab, hidden], quantized along hidden like the
// lm_head that reads its transpose). A weight made of column blocks side by side (pack_matmuls'
// packed Q/K/V, ir/column_concat.h) is read block by block from its sources, so that quantizing
// it never makes the packed copy (on the 0.5B export, int4's peak RSS 234 -> 134 MB).
struct WeightSource {
  ByteRef bytes;
  int32_t dtype = 1;
  int64_t K = 0, N = 0;
  bool transposed = false;

  WeightSource() = default;
  WeightSource(ByteRef bytes, int32_t dtype, int64_t K, int64_t N, bool transposed = false);

  // ModelError when the file behind the bytes shrank or changed since the load (touching its
  // mapping would raise SIGBUS or show other bytes). Call once before reading.
  void check_readable() const;
  // The float32 elements in place (element i of the stored layout at [i]), or null when they
  // cannot be read in place (float16 / bfloat16, not 4-byte aligned in the file, or column
  // blocks).
  const float* in_place() const;
  // Rows [r0, r0 + rows) x columns [c0, c0 + cols) as floats into dst (row stride cols).
  // Not for transposed sources.
  void read(int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* dst) const {
    read(r0, rows, c0, cols, dst, cols);
  }
  // Transposed sources: columns [c0, c0 + cols), all of K, as floats into dst ([cols, K]).
  void read_columns(int64_t c0, int64_t cols, float* dst) const;
  // Rows [r0, r0 + rows) x columns [c0, c0 + cols) of the stored layout were read for the last
  // time: the pages they lie on leave the process's mapping (file mappings only; a neighbour
  // that reads a page again faults it back in from the page cache). Whole rows release the
  // 2 MB page-table region's pages before them too (a fault maps a whole large folio, pages
  // already read included), and with `more_follow` false (the caller's last rows) the rest of
  // the region after them; a column strip releases the fault-around windows of each row's part.
  void release(int64_t r0, int64_t rows, int64_t c0, int64_t cols, bool more_follow = false) const;
  // The same for bytes [offset, offset + n) of the stored layout (not for column blocks).
  void release_bytes(uint64_t offset, uint64_t n, bool more_follow = false) const;

  uint64_t element_bytes() const { return dtype == 1 ? 4 : 2; }

 private:
  void read(int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* dst, int64_t ld) const;
  // Calls f(block, c0 within the block, cols, column of the first one within [c0, c0 + cols))
  // for each column block [c0, c0 + cols) overlaps.
  template <typename F>
  void each_block(int64_t c0, int64_t cols, F f) const;

  // Column blocks, each [K, its N] with its first column at `column`; empty for one block.
  struct Block;
  std::vector<Block> blocks_;
};

struct WeightSource::Block {
  WeightSource source;
  int64_t column = 0;
};

// n elements of `dtype` (1 float32, 10 float16, 16 bfloat16) at p as floats.
void to_float(int32_t dtype, const uint8_t* p, size_t n, float* dst);

}  // namespace fastopt::quant
