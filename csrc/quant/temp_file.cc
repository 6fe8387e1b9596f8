#include "quant/temp_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ir/error.h"

namespace fastopt::quant {

std::shared_ptr<TempFile> TempFile::create(const std::string& dir) {
  std::string base = dir;
  if (base.empty()) {
    const char* env = std::getenv("TMPDIR");
    base = env && *env ? env : "/tmp";
  }
  std::shared_ptr<TempFile> f(new TempFile());
  int fd = -1;
  if (f->open_unnamed(base, &fd)) {
    f->path_ = base + "/(unnamed quantized weights)";
    f->fd_ = fd;
    return f;
  }
  std::string pattern = base + "/fastopt-quant-XXXXXX";
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) {
    throw ModelError("cannot create a temporary file in '" + base + "': " + std::strerror(errno));
  }
  ::unlink(name.data());  // gone when the last view of it goes
  f->path_ = name.data();
  f->fd_ = fd;
  return f;
}

TempFile::~TempFile() {
  if (map_ != nullptr && mapped_size_ > 0) ::munmap(const_cast<uint8_t*>(map_), mapped_size_);
  if (fd_ >= 0) ::close(fd_);
}

uint64_t TempFile::reserve(uint64_t n, uint64_t framing) {
  std::lock_guard<std::mutex> lock(reserve_mu_);
  const uint64_t frame = size_.load();
  // The file is as long as its reservations at once (tails never written read as zeros), so
  // data() never resizes it: a forked run check maps it while the save appends to it.
  if (::ftruncate(fd_, static_cast<off_t>(frame + framing + n)) != 0) {
    throw ModelError("cannot size a temporary file in '" + path_ + "': " + std::strerror(errno));
  }
  slots_.push_back(Slot{frame, frame + framing, n});
  size_.store(frame + framing + n);
  return frame + framing;
}

std::vector<AdoptableFile::Slot> TempFile::slots() const {
  std::lock_guard<std::mutex> lock(reserve_mu_);
  return slots_;
}

void TempFile::write(uint64_t offset, const void* data, uint64_t n) const {
  const auto* p = static_cast<const uint8_t*>(data);
  const uint64_t total = n;
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      throw ModelError("cannot write quantized weights to a temporary file in '" + path_ +
                       "': " + std::strerror(errno));
    }
    p += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<uint64_t>(w);
  }
  // Every kWritebackChunk written, start the disk on the file: a durable save of it (its usual
  // end: it becomes the model or data file) then finds little left for its fsync (the 0.5B
  // int4 output's 270 MB of codes waited for the commit's fsync). Advice only.
  const uint64_t before = written_.fetch_add(total);
  if (before / kWritebackChunk != (before + total) / kWritebackChunk) {
    (void)::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
  }
}

const uint8_t* TempFile::data() const {
  std::call_once(mapped_once_, [this] {
    mapped_size_ = size_.load();
    if (mapped_size_ == 0) {
      static const uint8_t kEmpty = 0;
      map_ = &kEmpty;
      return;
    }
    // reserve() makes the file as long as its reservations, so this only sizes a file with
    // none (never shorter: a save that took the file may have appended to it).
    struct stat st{};
    if (::fstat(fd_, &st) != 0 || (static_cast<uint64_t>(st.st_size) < mapped_size_ &&
                                   ::ftruncate(fd_, static_cast<off_t>(mapped_size_)) != 0)) {
      throw ModelError("cannot size a temporary file: " + std::string(std::strerror(errno)));
    }
    void* p = ::mmap(nullptr, mapped_size_, PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      throw ModelError("cannot map a temporary file: " + std::string(std::strerror(errno)));
    }
    map_ = static_cast<const uint8_t*>(p);
  });
  if (map_ == nullptr) throw ModelError("cannot map a temporary file");
  return map_;
}

}  // namespace fastopt::quant
