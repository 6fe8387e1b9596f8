#include "ir/uninit_buffer.h"

#include <new>

#include "ir/error.h"

namespace fastopt {

UninitBuffer::UninitBuffer(uint64_t size)
    : data_(static_cast<uint8_t*>(::operator new(size ? size : 1))), size_(size) {}

UninitBuffer::~UninitBuffer() {
  ::operator delete(data_);
}

std::shared_ptr<Tensor> make_tensor(int32_t dtype, std::vector<int64_t> dims,
                                    std::shared_ptr<const Buffer> buffer) {
  auto t = std::make_shared<Tensor>();
  t->data_type = dtype;
  t->dims = std::move(dims);
  const uint64_t size = buffer->size();
  t->raw = ByteRef{std::move(buffer), 0, size};
  t->has_raw_field = true;
  t->storage = Tensor::Storage::kRaw;
  if (t->expected_bytes() != t->raw.size) throw ModelError("tensor bytes do not match its shape");
  return t;
}

}  // namespace fastopt
