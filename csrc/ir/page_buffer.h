// Large tensors that passes build (packed weights: megabytes each, written once): bytes in
// anonymous pages the pass writes directly, never zero-filled by us first (the kernel hands out
// zeroed pages anyway), in 2 MB pages where the kernel offers them, so that filling 100 MB takes
// a few dozen page faults instead of 25,000.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ir/buffer.h"
#include "ir/tensor.h"

namespace fastopt {

class PageBuffer final : public Buffer {
 public:
  // `size` writable bytes (contents unspecified until written); std::bad_alloc when the
  // memory cannot be had.
  explicit PageBuffer(uint64_t size);
  ~PageBuffer() override;
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  const uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  uint8_t* mutable_data() { return data_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t mapped_ = 0;  // 0: data_ came from operator new
};

// A raw tensor over all of `buffer`, which the caller has filled; ModelError when its size is
// not the shape's.
std::shared_ptr<Tensor> make_tensor(int32_t dtype, std::vector<int64_t> dims,
                                    std::shared_ptr<PageBuffer> buffer);

}  // namespace fastopt
