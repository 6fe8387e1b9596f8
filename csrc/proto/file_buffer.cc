#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ir/buffer.h"
#include "ir/error.h"

namespace fastopt {

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
  struct stat st {};
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
  buf->fd_ = fd;
  buf->size_ = static_cast<uint64_t>(st.st_size);
  buf->dev_ = static_cast<uint64_t>(st.st_dev);
  buf->ino_ = static_cast<uint64_t>(st.st_ino);
  buf->mtime_sec_ = static_cast<int64_t>(st.st_mtim.tv_sec);
  buf->mtime_nsec_ = static_cast<int64_t>(st.st_mtim.tv_nsec);
  if (map_now) buf->data();
  return buf;
}

void FileBuffer::check_unchanged(uint64_t end) const {
  struct stat st{};
  if (::fstat(fd_, &st) != 0) {
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
  if (fd_ >= 0) ::close(fd_);
}

const uint8_t* FileBuffer::data() const {
  std::call_once(mapped_once_, [this] {
    if (size_ == 0) {
      static const uint8_t kEmpty = 0;
      map_ = &kEmpty;
      return;
    }
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (p == MAP_FAILED) {
      throw ModelError("cannot map '" + path_ + "': " + std::strerror(errno));
    }
    map_ = static_cast<const uint8_t*>(p);
  });
  if (map_ == nullptr) throw ModelError("cannot map '" + path_ + "'");
  return map_;
}

}  // namespace fastopt
