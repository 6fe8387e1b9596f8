#include "quant/weight_source.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ir/constant.h"
#include "quant/blockwise.h"

namespace fastopt::quant {
namespace {

constexpr uint64_t kFaultAroundBytes = 64u << 10;

uint64_t page_size() {
  static const uint64_t size = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return size;
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

void WeightSource::check_readable() const {
  if (bytes.buffer) bytes.buffer->check_unchanged(bytes.offset + bytes.size);
}

const float* WeightSource::in_place() const {
  if (dtype != 1) return nullptr;
  const uint8_t* p = bytes.data();
  if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) return nullptr;
  return reinterpret_cast<const float*>(p);
}

void WeightSource::read(int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* dst) const {
  const uint64_t es = element_bytes();
  const uint8_t* base = bytes.data();
  if (cols == N) {
    to_float(dtype, base + static_cast<uint64_t>(r0 * N) * es, static_cast<size_t>(rows * N), dst);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    to_float(dtype, base + static_cast<uint64_t>((r0 + r) * N + c0) * es, static_cast<size_t>(cols),
             dst + r * cols);
  }
}

void WeightSource::read_columns(int64_t c0, int64_t cols, float* dst) const {
  to_float(dtype, bytes.data() + static_cast<uint64_t>(c0 * K) * element_bytes(),
           static_cast<size_t>(cols * K), dst);
}

void WeightSource::release_bytes(uint64_t offset, uint64_t n) const {
  // Only a file mapping gives its pages back unchanged: on anonymous memory (a tensor made by
  // an earlier pass, a model made in memory) MADV_DONTNEED would zero them. The buffers with a
  // file descriptor are read-only mappings of it (FileBuffer, TempFile); a new Buffer with a
  // descriptor and owned bytes would have to say so here
  // (tests/test_quant_mapped_reads.py checks in-memory weights survive).
  if (!bytes.buffer || bytes.buffer->fd() < 0 || n == 0) return;
  // Whole fault-around windows around the bytes: a page fault maps the 64 KB-aligned window
  // around it (the kernel's default fault_around_bytes), so pages of rows released before would
  // stay mapped after the next row's first fault unless the release covers the whole window.
  // A neighbour's page in it is faulted in again from the page cache when next read (the
  // mapping is read-only), which costs less than keeping it.
  const uint64_t window = std::max<uint64_t>(kFaultAroundBytes, page_size());
  const auto map_start = reinterpret_cast<uintptr_t>(bytes.buffer->data());
  const uintptr_t map_end =
      (map_start + bytes.buffer->size() + page_size() - 1) / page_size() * page_size();
  const auto start = reinterpret_cast<uintptr_t>(bytes.data() + offset);
  const uintptr_t first = std::max<uintptr_t>(start / window * window, map_start);
  const uintptr_t end = std::min<uintptr_t>((start + n + window - 1) / window * window, map_end);
  if (end <= first) return;
  // Advice only: a failure leaves the pages mapped, which costs memory, not correctness.
  (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

void WeightSource::release(int64_t r0, int64_t rows, int64_t c0, int64_t cols) const {
  const uint64_t es = element_bytes();
  const int64_t row_len = transposed ? K : N;
  if (c0 == 0 && cols == row_len) {
    release_bytes(static_cast<uint64_t>(r0 * row_len) * es,
                  static_cast<uint64_t>(rows * row_len) * es);
    return;
  }
  for (int64_t r = r0; r < r0 + rows; ++r) {
    release_bytes(static_cast<uint64_t>(r * row_len + c0) * es, static_cast<uint64_t>(cols) * es);
  }
}

}  // namespace fastopt::quant
