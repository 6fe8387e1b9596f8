#include "ir/column_concat.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "ir/error.h"

namespace fastopt {

ColumnConcatBuffer::ColumnConcatBuffer(std::vector<ByteRef> sources,
                                       std::vector<uint64_t> row_bytes, uint64_t rows)
    : sources_(std::move(sources)), row_bytes_(std::move(row_bytes)), rows_(rows) {
  for (size_t i = 0; i < sources_.size(); ++i) {
    if (sources_[i].size != row_bytes_[i] * rows_) {
      throw ModelError("a packed tensor's source has " + std::to_string(sources_[i].size) +
                       " bytes, not " + std::to_string(rows_) + " rows of " +
                       std::to_string(row_bytes_[i]));
    }
    row_total_ += row_bytes_[i];
  }
  size_ = row_total_ * rows_;
}

void ColumnConcatBuffer::fill(uint8_t* dst, uint64_t row0, uint64_t count,
                              std::vector<uint8_t>& scratch) const {
  for (size_t i = 0; i < sources_.size(); ++i) {
    const ByteRef& s = sources_[i];
    const uint64_t rb = row_bytes_[i], begin = s.offset + row0 * rb, n = count * rb;
    const uint8_t* rows = nullptr;
    const HeldFd held = s.buffer->hold_fd();
    if (const int fd = held.get(); fd >= 0) {
      scratch.resize(n);
      for (uint64_t got = 0; got < n;) {
        const ssize_t r =
            ::pread(fd, scratch.data() + got, n - got, static_cast<off_t>(begin + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          throw ModelError("cannot read '" + s.buffer->path() + "' for a packed weight: " +
                           (r < 0 ? std::string(std::strerror(errno)) : "it shrank"));
        }
        got += static_cast<uint64_t>(r);
      }
      rows = scratch.data();
    } else {
      rows = s.buffer->data() + begin;
    }
    for (uint64_t r = 0; r < count; ++r) {
      std::memcpy(dst + r * row_total_, rows + r * rb, rb);
    }
    dst += rb;  // the next source's columns
  }
}

const uint8_t* ColumnConcatBuffer::data() const {
  std::call_once(made_once_, [this] {
    for (const ByteRef& s : sources_) s.buffer->check_unchanged(s.offset + s.size);
    auto made = std::make_unique<UninitBuffer>(size_);
    std::vector<uint8_t> scratch;
    fill(made->mutable_data(), 0, rows_, scratch);
    made_ = std::move(made);
  });
  return made_->data();
}

bool ColumnConcatBuffer::stream(uint64_t offset, uint64_t n, const Sink& sink) const {
  if (offset != 0 || n != size_) return false;
  for (const ByteRef& s : sources_) s.buffer->check_unchanged(s.offset + s.size);
  constexpr uint64_t kBlockBytes = 4u << 20;
  const uint64_t block_rows = row_total_ ? std::max<uint64_t>(1, kBlockBytes / row_total_) : 1;
  std::vector<uint8_t> block, scratch;
  for (uint64_t r = 0; r < rows_; r += block_rows) {
    const uint64_t count = std::min(block_rows, rows_ - r);
    block.resize(count * row_total_);
    fill(block.data(), r, count, scratch);
    sink(block.data(), block.size());
  }
  return true;
}

const ColumnConcatBuffer* whole_column_concat(const ByteRef& ref) {
  const auto* packed = dynamic_cast<const ColumnConcatBuffer*>(ref.buffer.get());
  return packed && ref.offset == 0 && ref.size == packed->size() ? packed : nullptr;
}

}  // namespace fastopt
