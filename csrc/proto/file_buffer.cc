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
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
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
  if (map_now) buf->data();
  return buf;
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
