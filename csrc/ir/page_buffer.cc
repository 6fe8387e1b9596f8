#include "ir/page_buffer.h"

#include <sys/mman.h>

#include <new>

#include "ir/error.h"

namespace fastopt {
namespace {
constexpr uint64_t kHugePage = 2u << 20;
}  // namespace

PageBuffer::PageBuffer(uint64_t size) : size_(size) {
  if (size < kHugePage) {  // small: the heap's pages are as good
    data_ = static_cast<uint8_t*>(::operator new(size ? size : 1));
    return;
  }
  // Rounded up to whole huge pages so the kernel can back all of it with them.
  mapped_ = (size + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  ::madvise(p, mapped_, MADV_HUGEPAGE);  // advice only: small pages where refused
#endif
  data_ = static_cast<uint8_t*>(p);
}

PageBuffer::~PageBuffer() {
  if (mapped_) {
    ::munmap(data_, mapped_);
  } else {
    ::operator delete(data_);
  }
}

std::shared_ptr<Tensor> make_tensor(int32_t dtype, std::vector<int64_t> dims,
                                    std::shared_ptr<PageBuffer> buffer) {
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
