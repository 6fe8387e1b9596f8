#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "ir/buffer.h"
#include "ir/error.h"

namespace fastopt {

// The open descriptors of every FileBuffer (see buffer.h). One mutex guards each buffer's fd_,
// holds_ and used_; opening a file under it is rare (a few per save beyond the bound).
class FdPool {
 public:
  static FdPool& get() {
    static FdPool* pool = new FdPool();  // never destroyed: buffers may outlive static destructors
    return *pool;
  }

  // Adds a descriptor that `b` opened itself (the first open, in FileBuffer::open).
  void adopt(const FileBuffer* b, int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    make_room();
    b->fd_ = fd;
    b->used_ = ++clock_;
    open_.push_back(b);
  }

  HeldFd hold(const FileBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (b->fd_ < 0) {
      make_room();
      b->fd_ = reopen(*b);
      open_.push_back(b);
    }
    b->used_ = ++clock_;
    ++b->holds_;
    return HeldFd(b->fd_, [this, b] {
      std::lock_guard<std::mutex> release(mu_);
      --b->holds_;
    });
  }

  void forget(const FileBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (b->fd_ < 0) return;
    close_entry(std::find(open_.begin(), open_.end(), b));
  }

 private:
  // A quarter of the process's descriptors, at least 8, at most 256: the rest stay for
  // everything else (ONNX Runtime, output files, Python).
  static size_t bound() {
    struct rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 256;
    return std::clamp<size_t>(static_cast<size_t>(r.rlim_cur / 4), 8, 256);
  }

  // Closes the least recently used unheld descriptors until one more fits. All held: no room
  // is made (holds are short; the bound is then exceeded by at most the holders' count).
  void make_room() {
    const size_t limit = bound();
    while (open_.size() >= limit) {
      auto victim = open_.end();
      for (auto it = open_.begin(); it != open_.end(); ++it) {
        if ((*it)->holds_ == 0 && (victim == open_.end() || (*it)->used_ < (*victim)->used_)) {
          victim = it;
        }
      }
      if (victim == open_.end()) return;
      close_entry(victim);
    }
  }

  void close_entry(std::vector<const FileBuffer*>::iterator it) {
    ::close((*it)->fd_);
    (*it)->fd_ = -1;
    *it = open_.back();
    open_.pop_back();
  }

  // Opens the file again by its path; it must still be the file loaded.
  static int reopen(const FileBuffer& b) {
    const int fd = ::open(b.path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      throw ModelError("cannot open '" + b.path_ + "' again: " + std::strerror(errno) +
                       " (it was removed or renamed after the model was loaded)");
    }
    struct stat st{};
    if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_dev) != b.dev_ ||
        static_cast<uint64_t>(st.st_ino) != b.ino_) {
      ::close(fd);
      throw ModelError("'" + b.path_ +
                       "' is another file than the one loaded (another program replaced it); "
                       "its weights can no longer be read: load the model again");
    }
    return fd;
  }

  std::mutex mu_;
  std::vector<const FileBuffer*> open_;
  uint64_t clock_ = 0;
};

std::shared_ptr<FileBuffer> FileBuffer::open(const std::string& path, bool map_now) {
  // stat before open: opening a FIFO for reading would block until a writer appears.
  struct stat before{};
  if (::stat(path.c_str(), &before) != 0) {
    throw ModelError("cannot open '" + path + "': " + std::strerror(errno));
  }
  if (S_ISDIR(before.st_mode)) throw ModelError("'" + path + "' is a directory, not a file");
  if (!S_ISREG(before.st_mode)) {
    throw ModelError("'" + path + "' is not a regular file (a FIFO, socket or device)");
  }
  // O_NONBLOCK: should the name be swapped for a FIFO after the stat, open still returns.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    throw ModelError("cannot open '" + path + "': " + std::strerror(errno));
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw ModelError("cannot stat '" + path + "': " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw ModelError("'" + path + "' is not a regular file");
  }
  std::shared_ptr<FileBuffer> buf(new FileBuffer());
  buf->path_ = path;
  buf->size_ = static_cast<uint64_t>(st.st_size);
  buf->dev_ = static_cast<uint64_t>(st.st_dev);
  buf->ino_ = static_cast<uint64_t>(st.st_ino);
  buf->mtime_sec_ = static_cast<int64_t>(st.st_mtim.tv_sec);
  buf->mtime_nsec_ = static_cast<int64_t>(st.st_mtim.tv_nsec);
  FdPool::get().adopt(buf.get(), fd);
  if (map_now) buf->data();
  return buf;
}

HeldFd FileBuffer::hold_fd() const {
  return FdPool::get().hold(this);
}

void FileBuffer::check_unchanged(uint64_t end) const {
  const HeldFd fd = hold_fd();
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) {
    throw ModelError("cannot stat '" + path_ + "': " + std::strerror(errno));
  }
  const uint64_t now = static_cast<uint64_t>(st.st_size);
  if (now < end || now < size_) {
    throw ModelError("'" + path_ + "' shrank from " + std::to_string(size_) + " to " +
                     std::to_string(now) +
                     " bytes after the model was loaded (another program rewrote it); its "
                     "weights can no longer be read: load the model again");
  }
  if (st.st_mtim.tv_sec != mtime_sec_ || st.st_mtim.tv_nsec != mtime_nsec_) {
    throw ModelError("'" + path_ +
                     "' was modified after the model was loaded (another program wrote to it); "
                     "its weights may have changed: load the model again");
  }
}

FileBuffer::~FileBuffer() {
  if (map_ != nullptr && size_ > 0) ::munmap(const_cast<uint8_t*>(map_), size_);
  FdPool::get().forget(this);
}

const uint8_t* FileBuffer::data() const {
  std::call_once(mapped_once_, [this] {
    if (size_ == 0) {
      static const uint8_t kEmpty = 0;
      map_ = &kEmpty;
      return;
    }
    const HeldFd fd = hold_fd();  // the mapping stays valid once the descriptor is closed
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) {
      throw ModelError("cannot map '" + path_ + "': " + std::strerror(errno));
    }
    map_ = static_cast<const uint8_t*>(p);
  });
  if (map_ == nullptr) throw ModelError("cannot map '" + path_ + "'");
  return map_;
}

}  // namespace fastopt
