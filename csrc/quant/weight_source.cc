#include "quant/weight_source.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "ir/column_concat.h"
#include "ir/constant.h"
#include "quant/blockwise.h"

namespace fastopt::quant {
namespace {

constexpr uint64_t kFaultAroundBytes = 64u << 10;

uint64_t page_size() {
  static const uint64_t size = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

// The bytes one page table maps (2 MB with 4 KB pages): a fault never maps a folio across it.
uint64_t page_table_span() {
  return page_size() * (page_size() / sizeof(uint64_t));
}

}  // namespace

void to_float(int32_t dtype, const uint8_t* p, size_t n, float* dst) {
  if (dtype == 1) {
    std::memcpy(dst, p, n * 4);
  } else if (dtype == 10) {
    halves_to_floats(p, n, dst);
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      dst[i] = bfloat16_to_float(b);
    }
  }
}

WeightSource::WeightSource(ByteRef bytes_in, int32_t dtype_in, int64_t K_in, int64_t N_in,
                           bool transposed_in)
    : bytes(std::move(bytes_in)), dtype(dtype_in), K(K_in), N(N_in), transposed(transposed_in) {
  const ColumnConcatBuffer* packed = transposed ? nullptr : whole_column_concat(bytes);
  if (!packed) return;
  const uint64_t es = element_bytes();
  std::vector<Block> blocks;
  int64_t column = 0;
  for (size_t i = 0; i < packed->sources().size(); ++i) {
    const uint64_t row_bytes = packed->row_bytes()[i];
    // Blocks that do not tile the rows as [K, N] elements are read through the made copy.
    if (row_bytes % es != 0 || packed->sources()[i].size != row_bytes * static_cast<uint64_t>(K))
      return;
    const auto cols = static_cast<int64_t>(row_bytes / es);
    blocks.push_back({WeightSource(packed->sources()[i], dtype, K, cols), column});
    column += cols;
  }
  if (column == N) blocks_ = std::move(blocks);
}

template <typename F>
void WeightSource::each_block(int64_t c0, int64_t cols, F f) const {
  for (const Block& b : blocks_) {
    const int64_t first = std::max(c0, b.column);
    const int64_t last = std::min(c0 + cols, b.column + b.source.N);
    if (first < last) f(b.source, first - b.column, last - first, first - c0);
  }
}

void WeightSource::check_readable() const {
  if (!blocks_.empty()) {
    for (const Block& b : blocks_) b.source.check_readable();
  } else if (bytes.buffer) {
    bytes.buffer->check_unchanged(bytes.offset + bytes.size);
  }
}

const float* WeightSource::in_place() const {
  if (dtype != 1 || !blocks_.empty()) return nullptr;
  const uint8_t* p = bytes.data();
  if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) return nullptr;
  return reinterpret_cast<const float*>(p);
}

void WeightSource::read(int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* dst,
                        int64_t ld) const {
  if (!blocks_.empty()) {
    each_block(c0, cols, [&](const WeightSource& b, int64_t bc0, int64_t n, int64_t at) {
      b.read(r0, rows, bc0, n, dst + at, ld);
    });
    return;
  }
  const uint64_t es = element_bytes();
  const uint8_t* base = bytes.data();
  if (cols == N && ld == N) {
    to_float(dtype, base + static_cast<uint64_t>(r0 * N) * es, static_cast<size_t>(rows * N), dst);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    to_float(dtype, base + static_cast<uint64_t>((r0 + r) * N + c0) * es, static_cast<size_t>(cols),
             dst + r * ld);
  }
}

void WeightSource::read_columns(int64_t c0, int64_t cols, float* dst) const {
  to_float(dtype, bytes.data() + static_cast<uint64_t>(c0 * K) * element_bytes(),
           static_cast<size_t>(cols * K), dst);
}

void WeightSource::release_bytes(uint64_t offset, uint64_t n, bool more_follow) const {
  // Only a file mapping gives its pages back unchanged: on anonymous memory (a tensor made by
  // an earlier pass, a model made in memory) MADV_DONTNEED would zero them. The buffers with a
  // file behind them are read-only mappings of it (file_backed: FileBuffer, TempFile); a new
  // Buffer with a descriptor and owned bytes would have to say so there
  // (tests/quant/test_quant_mapped_reads.py checks in-memory weights survive).
  if (!bytes.buffer || !bytes.buffer->file_backed() || n == 0) return;
  // A read fault maps more than the page read: the 64 KB-aligned fault-around window around
  // it (the kernel's default fault_around_bytes), and on recent Linux (6.18 here) the whole large
  // folio the page cache holds it in (ext4 and others cache files in folios up to 2 MB), as far as
  // it lies in the same page table. So a fault may map any page of the 2 MB-aligned region
  // around it, before the bytes read as well as after: releasing only the windows of the
  // bytes left a folio's earlier pages mapped once read (1.3 GB of a 13.5 GB fp16 model).
  // The release starts at its region's start (pages of earlier rows, already released unless
  // a fault mapped them again). While more rows follow it ends at the last whole page of the
  // bytes: the next release starts at or before the rest (contiguous rows), and releasing the
  // next rows' pages would only have their first read fault the whole folio in again. After
  // the last rows it ends at the region's end. A neighbour's page in it is faulted in again
  // from the page cache when next read (the mapping is read-only), which costs less than
  // keeping it.
  const uint64_t region = page_table_span();
  const auto map_start = reinterpret_cast<uintptr_t>(bytes.buffer->data());
  const uintptr_t map_end =
      (map_start + bytes.buffer->size() + page_size() - 1) / page_size() * page_size();
  const auto start = reinterpret_cast<uintptr_t>(bytes.data() + offset);
  const uintptr_t first = std::max<uintptr_t>(start / region * region, map_start);
  const uintptr_t end =
      std::min<uintptr_t>(more_follow ? (start + n) / page_size() * page_size()
                                      : (start + n + region - 1) / region * region,
                          map_end);
  if (end <= first) return;
  // Advice only: a failure leaves the pages mapped, which costs memory, not correctness.
  (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

void WeightSource::release(int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                           bool more_follow) const {
  if (!blocks_.empty()) {
    each_block(c0, cols, [&](const WeightSource& b, int64_t bc0, int64_t n, int64_t) {
      b.release(r0, rows, bc0, n, more_follow);
    });
    return;
  }
  const uint64_t es = element_bytes();
  const int64_t row_len = transposed ? K : N;
  if (c0 == 0 && cols == row_len) {
    release_bytes(static_cast<uint64_t>(r0 * row_len) * es,
                  static_cast<uint64_t>(rows * row_len) * es, more_follow);
    return;
  }
  // A column strip: only the windows of each row's part (a region-wide release per row would
  // unmap the strip's next rows, still to be read, again and again).
  if (!bytes.buffer || !bytes.buffer->file_backed() || cols == 0) return;
  const uint64_t window = std::max<uint64_t>(kFaultAroundBytes, page_size());
  const auto map_start = reinterpret_cast<uintptr_t>(bytes.buffer->data());
  const uintptr_t map_end =
      (map_start + bytes.buffer->size() + page_size() - 1) / page_size() * page_size();
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const auto start =
        reinterpret_cast<uintptr_t>(bytes.data() + static_cast<uint64_t>(r * row_len + c0) * es);
    const uintptr_t first = std::max<uintptr_t>(start / window * window, map_start);
    const uintptr_t end = std::min<uintptr_t>(
        (start + static_cast<uint64_t>(cols) * es + window - 1) / window * window, map_end);
    if (end > first) (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
  }
}

}  // namespace fastopt::quant
