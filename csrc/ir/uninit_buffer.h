// Large tensors that passes build and write once (packed weights, megabytes each): heap bytes
// the pass fills directly, never zero-filled first (std::string(n, 0) wrote 100 MB of zeros on
// a 0.5B export before the copy overwrote them). Not anonymous 2 MB pages (MADV_HUGEPAGE): with
// THP defrag "madvise" their faults cost 0.2-0.3 s of CPU in some runs (compaction).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ir/buffer.h"
#include "ir/tensor.h"

namespace fastopt {

class UninitBuffer final : public Buffer {
 public:
  // `size` writable bytes (contents unspecified until written); std::bad_alloc when the
  // memory cannot be had.
  explicit UninitBuffer(uint64_t size);
  ~UninitBuffer() override;
  UninitBuffer(const UninitBuffer&) = delete;
  UninitBuffer& operator=(const UninitBuffer&) = delete;

  const uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  uint8_t* mutable_data() { return data_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// A raw tensor over all of `buffer`, which the caller has filled; ModelError when its size is
// not the shape's.
std::shared_ptr<Tensor> make_tensor(int32_t dtype, std::vector<int64_t> dims,
                                    std::shared_ptr<const Buffer> buffer);

}  // namespace fastopt
