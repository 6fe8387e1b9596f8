// Where quantized weights live between the pass and the save: an unnamed file in the output's
// folder (O_TMPFILE; an unlinked temporary where the filesystem has none), written with pwrite
// by the quantizing threads. A save into that folder takes the file (proto/output_files.h
// AdoptableFile): as its data file with external data, as the model file itself when
// self-contained (the layout below), so the quantized bytes are written once, where they end
// up; any other save copies them. The IR's new tensors are views into it (a
// Buffer with a file descriptor), so the writer copies them into the output in the kernel
// (copy_file_range) and the quantized bytes never sit in the process's anonymous memory: a
// 7B model's 3.5 GB of int4 weights cost page cache, not RSS. Chosen over tensors produced
// lazily at save time because the IR stays plain (every pass, verify and numpy() read these
// tensors like any other) and the pass can report errors and statistics before anything is saved.
// The file is laid out as the start of a self-contained model file (AdoptableFile::slots): room
// for the graph's tag and length, then each tensor after room for its initializer's framing, so
// that a self-contained save can take it as the model file and write the quantized bytes once.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ir/buffer.h"
#include "proto/output_files.h"

namespace fastopt::quant {

class TempFile final : public AdoptableFile {
 public:
  // Creates an unnamed file in `dir` ("" = $TMPDIR or /tmp); ModelError when it cannot.
  static std::shared_ptr<TempFile> create(const std::string& dir);
  ~TempFile() override;
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  // Reserves `n` bytes after `framing` bytes of room (proto/onnx_writer.h
  // initializer_framing_bytes of the initializer that will hold them) and returns the offset of
  // the `n` bytes. Thread-safe.
  uint64_t reserve(uint64_t n, uint64_t framing);
  // Writes bytes at an offset reserved before; thread-safe; ModelError on a failed write.
  void write(uint64_t offset, const void* data, uint64_t n) const;

  // Maps the file on first use; no writes may follow (a save that took the file may append
  // after size(): the mapping covers this file's own bytes only).
  const uint8_t* data() const override;
  uint64_t size() const override { return size_.load(); }
  int fd() const override { return fd_; }
  const std::string& path() const override { return path_; }
  std::vector<Slot> slots() const override;

 private:
  TempFile() = default;
  std::string path_;  // where it was made (unlinked at once)
  int fd_ = -1;
  static constexpr uint64_t kWritebackChunk = 32ull << 20;
  std::atomic<uint64_t> size_{kModelHeadRoom};
  mutable std::atomic<uint64_t> written_{0};  // bytes written so far (write's writeback)
  mutable std::mutex reserve_mu_;
  std::vector<Slot> slots_;
  mutable std::once_flag mapped_once_;
  mutable const uint8_t* map_ = nullptr;
  mutable uint64_t mapped_size_ = 0;
};

}  // namespace fastopt::quant
