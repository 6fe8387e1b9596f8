// Row-major [rows, n_i] tensors side by side along their last axis, [rows, sum n_i], whose bytes
// are made when read: pack_matmuls' packed Q/K/V weights. A save streams them from the sources
// (read through their files, not their mappings) in blocks of a few MB, so neither the packed
// copy nor the sources' pages are held (the TorchScript Qwen2-0.5B export's optimize + save:
// peak RSS 228 -> 44 MB). The quantizers read the sources where they lie
// (quant/weight_source.h); whoever reads data() (a fold) gets them made once.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ir/buffer.h"
#include "ir/uninit_buffer.h"

namespace fastopt {

class ColumnConcatBuffer final : public Buffer {
 public:
  // `sources[i]` holds `rows` rows of `row_bytes[i]` bytes each.
  ColumnConcatBuffer(std::vector<ByteRef> sources, std::vector<uint64_t> row_bytes, uint64_t rows);

  const uint8_t* data() const override;
  const std::vector<ByteRef>& sources() const { return sources_; }
  const std::vector<uint64_t>& row_bytes() const { return row_bytes_; }
  uint64_t size() const override { return size_; }
  // The whole buffer only (what a save writes); other ranges read data().
  bool stream(uint64_t offset, uint64_t n, const Sink& sink) const override;

 private:
  // Rows [row0, row0 + count) into `dst`, the sources read through their files where they have
  // one (a source file changed since the load: ModelError, never SIGBUS).
  void fill(uint8_t* dst, uint64_t row0, uint64_t count, std::vector<uint8_t>& scratch) const;

  std::vector<ByteRef> sources_;
  std::vector<uint64_t> row_bytes_;
  uint64_t rows_ = 0, row_total_ = 0, size_ = 0;
  mutable std::once_flag made_once_;
  mutable std::unique_ptr<UninitBuffer> made_;
};

// The sources of `ref` and their row bytes when it is a whole ColumnConcatBuffer (a reader that
// can take the blocks side by side, such as the quantizers, reads them where they lie instead of
// through data()'s made copy); null otherwise.
const ColumnConcatBuffer* whole_column_concat(const ByteRef& ref);

}  // namespace fastopt
