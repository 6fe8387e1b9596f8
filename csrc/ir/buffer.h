// Immutable byte regions with shared ownership. Tensor bytes are views (ByteRef) into a Buffer,
// so loading a model never copies weights: the Buffer is an mmap of the model or data file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fastopt {

// A readable descriptor lent by Buffer::hold_fd: open while this object lives (get() < 0: none).
class HeldFd {
 public:
  HeldFd() = default;
  HeldFd(int fd, std::function<void()> release) : fd_(fd), release_(std::move(release)) {}
  HeldFd(HeldFd&& o) noexcept : fd_(o.fd_), release_(std::move(o.release_)) {
    o.fd_ = -1;
    o.release_ = nullptr;
  }
  HeldFd(const HeldFd&) = delete;
  HeldFd& operator=(const HeldFd&) = delete;
  HeldFd& operator=(HeldFd&&) = delete;
  ~HeldFd() {
    if (release_) release_();
  }
  int get() const { return fd_; }

 private:
  int fd_ = -1;
  std::function<void()> release_;
};

class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual const uint8_t* data() const = 0;
  virtual uint64_t size() const = 0;
  // A readable file descriptor whose byte 0 is data()[0], or -1, open as long as the buffer.
  // FileBuffer has none (see hold_fd).
  virtual int fd() const { return -1; }
  // A readable descriptor whose byte 0 is data()[0] (get() < 0: none), open while the result
  // lives. Lets the writer copy unchanged bytes file-to-file in the kernel (copy_file_range)
  // instead of through memory. FileBuffer opens its file on demand, as one of a bounded number.
  virtual HeldFd hold_fd() const { return HeldFd(fd(), nullptr); }
  // Whether data() is a read-only mapping of a file: its pages can be dropped and read again.
  virtual bool file_backed() const { return fd() >= 0; }
  virtual const std::string& path() const {
    static const std::string empty;
    return empty;
  }
  // Throws ModelError when bytes [0, end) can no longer be read as they were loaded (a file
  // truncated or rewritten since: touching its mapping past the new end would raise SIGBUS).
  virtual void check_unchanged(uint64_t end) const { (void)end; }
  // Hands bytes [offset, offset + n) to `sink` in order, piece by piece, without data(): for
  // buffers whose bytes are made when read (ColumnConcatBuffer), so that a save streams them
  // instead of holding them all. false when this buffer cannot (the caller reads data()).
  using Sink = std::function<void(const uint8_t* piece, uint64_t size)>;
  virtual bool stream(uint64_t offset, uint64_t n, const Sink& sink) const {
    (void)offset, (void)n, (void)sink;
    return false;
  }
};

// Bytes owned in memory (serialized models handed over from Python, tensors made by passes).
class OwnedBuffer final : public Buffer {
 public:
  explicit OwnedBuffer(std::string bytes) : bytes_(std::move(bytes)) {}
  const uint8_t* data() const override { return reinterpret_cast<const uint8_t*>(bytes_.data()); }
  uint64_t size() const override { return bytes_.size(); }

 private:
  std::string bytes_;
};

// A read-only regular file. The mapping is created on first access to data(), so external data
// files that no one reads are never mapped; size() and the modification time come from fstat
// at open, and check_unchanged() compares them with the file's current ones.
//
// Its descriptor is not kept for its lifetime: a model may have thousands of external data files
// (torch.onnx writes one per tensor above 2 GB) and the usual limit is 1,024 descriptors. Open
// descriptors are pooled, the least recently used closed beyond a bound (a quarter of
// RLIMIT_NOFILE, at most 256; none while held, see hold_fd); a mapping stays valid without one.
// A file opened again must be the one loaded (device and inode), else a ModelError.
class FileBuffer final : public Buffer {
 public:
  // Opens `path`; throws ModelError naming the file when it cannot be opened or is not a
  // regular file (checked before opening: opening a FIFO for reading blocks).
  static std::shared_ptr<FileBuffer> open(const std::string& path, bool map_now);
  ~FileBuffer() override;
  FileBuffer(const FileBuffer&) = delete;
  FileBuffer& operator=(const FileBuffer&) = delete;

  const uint8_t* data() const override;
  uint64_t size() const override { return size_; }
  HeldFd hold_fd() const override;
  bool file_backed() const override { return true; }
  const std::string& path() const override { return path_; }
  void check_unchanged(uint64_t end) const override;
  // Identity of the underlying file, to detect the same file reached by two names.
  uint64_t device() const { return dev_; }
  uint64_t inode() const { return ino_; }

 private:
  friend class FdPool;
  FileBuffer() = default;
  std::string path_;
  mutable int fd_ = -1;        // open or -1; guarded by the pool's mutex (file_buffer.cc)
  mutable int holds_ = 0;      // HeldFds lent; the pool never closes a held descriptor
  mutable uint64_t used_ = 0;  // the pool's clock at the last hold (least recent closes first)
  uint64_t size_ = 0;
  uint64_t dev_ = 0, ino_ = 0;
  int64_t mtime_sec_ = 0, mtime_nsec_ = 0;
  mutable std::once_flag mapped_once_;
  mutable const uint8_t* map_ = nullptr;
};

// A view of [offset, offset+size) in a Buffer that keeps the Buffer alive.
struct ByteRef {
  std::shared_ptr<const Buffer> buffer;
  uint64_t offset = 0;
  uint64_t size = 0;

  const uint8_t* data() const { return buffer ? buffer->data() + offset : nullptr; }
  bool empty() const { return size == 0; }
  static ByteRef owned(std::string bytes) {
    auto b = std::make_shared<OwnedBuffer>(std::move(bytes));
    uint64_t n = b->size();
    return ByteRef{std::move(b), 0, n};
  }
};

// Fields of a message that fastopt does not model, kept as their exact encoded bytes
// (tag included) so that a round trip writes them back unchanged.
using RawFields = std::vector<ByteRef>;

}  // namespace fastopt
