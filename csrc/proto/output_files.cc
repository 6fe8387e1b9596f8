#include "proto/output_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ir/error.h"
#include "ir/graph.h"

namespace fastopt {

std::string basename_of(const std::string& p) {
  auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string dirname_of(const std::string& p) {
  auto slash = p.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

namespace {

std::string errno_text() {
  return std::strerror(errno);
}

bool file_id(const std::string& path, FileId* id) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return false;
  *id = FileId{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  return true;
}

}  // namespace

// ---- the input's files ----

InputFiles::InputFiles(const Model& model) {
  auto add = [this](const Buffer* b) {
    const auto* f = dynamic_cast<const FileBuffer*>(b);
    if (!f) return;
    f->check_unchanged(f->size());
    files_.push_back({FileId{f->device(), f->inode()}, f->path()});
  };
  add(model.source.get());
  for (const auto& kv : model.external_files) add(kv.second.get());
  // The file now at the model's path too (a skeleton-derived model maps no file of its own).
  FileId id;
  if (!model.path.empty() && file_id(model.path, &id)) files_.push_back({id, model.path});
}

void InputFiles::check_output(const std::string& path, const char* what) const {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;  // nothing there yet (or a dangling symlink, replaced)
    throw ModelError("cannot write " + std::string(what) + " '" + path + "': " + errno_text());
  }
  if (S_ISDIR(st.st_mode)) {
    throw ModelError(std::string(what) + " '" + path + "' is a directory");
  }
  if (!S_ISREG(st.st_mode)) {
    throw ModelError(std::string(what) + " '" + path +
                     "' is a FIFO, socket or device, not a regular file; it is never replaced");
  }
  const FileId id{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  for (const auto& f : files_) {
    if (f.id == id) {
      throw ModelError(std::string(what) + " '" + path + "' is the loaded model's own file '" +
                       f.path + "' (the input is never modified); choose another output path");
    }
  }
}

// ---- folders ----

CreatedFolders::CreatedFolders(const std::string& folder) {
  std::vector<std::string> missing;
  for (std::string d = folder;; d = dirname_of(d)) {
    struct stat st{};
    if (::stat(d.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) {
        throw ModelError("output folder '" + d + "' exists and is not a folder");
      }
      break;
    }
    if (errno != ENOENT) throw ModelError("cannot use output folder '" + d + "': " + errno_text());
    missing.push_back(d);
    if (d == "." || d == "/") break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0777) != 0 && errno != EEXIST) {
      std::string err = errno_text();
      throw ModelError("cannot create output folder '" + *it + "': " + err);
    }
    created_.push_back(*it);
  }
}

CreatedFolders::~CreatedFolders() {
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) ::rmdir(it->c_str());
}

// ---- the lock on an output ----

namespace {
// FNV-1a: a hash that every build and process computes alike (std::hash need not).
uint64_t stable_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}
}  // namespace

OutputLock::OutputLock(const std::string& path) {
  struct stat folder{};
  if (::stat(dirname_of(path).c_str(), &folder) != 0) return;  // the save reports it next
  // The folder by identity (any spelling of it) and the file name in it.
  char name[96];
  const int len = std::snprintf(name, sizeof(name), "fastopt-save/%llx/%llx/%016llx",
                                static_cast<unsigned long long>(folder.st_dev),
                                static_cast<unsigned long long>(folder.st_ino),
                                static_cast<unsigned long long>(stable_hash(basename_of(path))));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name, static_cast<size_t>(len));  // sun_path[0] = 0: abstract
  fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return;  // no sockets here (a sandbox): unguarded, as before
  const auto size = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + len);
  if (::bind(fd_, reinterpret_cast<const sockaddr*>(&addr), size) == 0) return;
  const int err = errno;
  ::close(fd_);
  fd_ = -1;
  if (err == EADDRINUSE) {
    throw ModelError("output '" + path + "' is being written by another save; nothing was " +
                     "written: wait for that save to finish or choose another output path");
  }
}

OutputLock::~OutputLock() {
  if (fd_ >= 0) ::close(fd_);  // frees the name
}

// ---- files written before the save ----

bool AdoptableFile::open_unnamed(const std::string& folder, int* fd) {
  static const bool named_only = std::getenv("FASTOPT_TEST_NAMED_TEMPS") != nullptr;
  if (named_only) return false;
  FileId id;
  if (!file_id(folder, &id)) return false;
  const int f = ::open(folder.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0666);
  if (f < 0) return false;
  *fd = f;
  folder_ = id;
  linkable_ = true;
  return true;
}

bool AdoptableFile::adoptable_in(const std::string& folder) const {
  // Any folder of the filesystem the file was made on: an unnamed file links into any of them
  // (quantize makes it in the output folder's nearest existing parent when the save is to
  // create the folder; a link that still fails, a bind mount's EXDEV, falls back to a copy).
  FileId id;
  return linkable_ && !taken_ && fd() >= 0 && file_id(folder, &id) && id.dev == folder_.dev;
}

// ---- output files ----

OutputFile::OutputFile(std::string final_path, bool unnamed) : final_(std::move(final_path)) {
  const std::string folder = dirname_of(final_);
  // O_RDWR: the fallback in name() reads the file back. The mode is filtered by the umask.
  // FASTOPT_TEST_NAMED_TEMPS=1 (tests only) takes the fallback below, as on filesystems
  // without O_TMPFILE.
  static const bool named_only = std::getenv("FASTOPT_TEST_NAMED_TEMPS") != nullptr;
  if (unnamed && !named_only) fd_ = ::open(folder.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0666);
  if (fd_ >= 0) return;
  // No unnamed files here (EOPNOTSUPP, EISDIR on old kernels): a hidden named temporary.
  std::string pattern = folder + "/." + basename_of(final_) + ".tmp-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  fd_ = ::mkstemp(buf.data());
  if (fd_ < 0) {
    throw ModelError("cannot create a file in '" + folder + "': " + errno_text());
  }
  temp_.assign(buf.data());
  mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd_, 0666 & ~mask);  // mkstemp makes 0600; outputs get the usual permissions
}

OutputFile::OutputFile(std::string final_path, const AdoptableFile& file)
    : final_(std::move(final_path)), adopted_(&file), adopted_size_(file.size()) {
  fd_ = ::fcntl(file.fd(), F_DUPFD_CLOEXEC, 0);
  if (fd_ < 0) throw ModelError("cannot write '" + final_ + "': " + errno_text());
  // Reserved tails that were never written read as zeros; appends start after them. The file
  // offset is shared with the taker's descriptor, which only uses pread/pwrite.
  struct stat st{};
  if (::fstat(fd_, &st) != 0 ||
      (static_cast<uint64_t>(st.st_size) < adopted_size_ &&
       ::ftruncate(fd_, static_cast<off_t>(adopted_size_)) != 0) ||
      ::lseek(fd_, static_cast<off_t>(adopted_size_), SEEK_SET) < 0) {
    const std::string err = errno_text();
    ::close(fd_);
    throw ModelError("cannot write '" + final_ + "': " + err);
  }
  size_ = adopted_size_;
  file.taken_ = true;
}

OutputFile::~OutputFile() {
  if (adopted_ && !committed_) {
    // Not saved: what this save appended goes, the file's own bytes stay for another save.
    if (::ftruncate(fd_, static_cast<off_t>(adopted_size_)) == 0) adopted_->taken_ = false;
  }
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void OutputFile::write(const void* p, uint64_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd_, c, n > kWritebackChunk ? kWritebackChunk : n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw ModelError("cannot write '" + final_ + "': " + errno_text());
    }
    c += w;
    n -= static_cast<uint64_t>(w);
    appended(static_cast<uint64_t>(w));
  }
}

void OutputFile::write_at(uint64_t offset, const void* p, uint64_t n) {
  if (!adopted_ || offset + n > adopted_size_) {
    throw ModelError("cannot write '" + final_ + "': a write before its end");
  }
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, c, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw ModelError("cannot write '" + final_ + "': " + errno_text());
    c += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<uint64_t>(w);
  }
}

void OutputFile::zeros(uint64_t n) {
  static const char kZeros[4096] = {};
  while (n > 0) {
    uint64_t k = n < sizeof(kZeros) ? n : sizeof(kZeros);
    write(kZeros, k);
    n -= k;
  }
}

void OutputFile::read_from(int src, uint64_t offset, uint64_t n, const std::string& src_path) {
  std::vector<char> buf(n < (8u << 20) ? n : (8u << 20));
  while (n > 0) {
    size_t want = n < buf.size() ? n : buf.size();
    ssize_t r = ::pread(src, buf.data(), want, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw ModelError("cannot read '" + src_path + "': " + errno_text());
    if (r == 0) {
      throw ModelError("'" + src_path + "' shrank while the model was being saved (another " +
                       "program rewrote it); nothing was written");
    }
    write(buf.data(), static_cast<uint64_t>(r));
    offset += static_cast<uint64_t>(r);
    n -= static_cast<uint64_t>(r);
  }
}

void OutputFile::copy(const ByteRef& ref) {
  if (ref.size == 0) return;
  const HeldFd held = ref.buffer->hold_fd();
  const int src = held.get();
  if (src < 0) {  // bytes in memory, or made as they are read
    if (!ref.buffer->stream(ref.offset, ref.size,
                            [this](const uint8_t* p, uint64_t n) { write(p, n); })) {
      write(ref.data(), ref.size);
    }
    return;
  }
  ref.buffer->check_unchanged(ref.offset + ref.size);
  uint64_t left = ref.size;
  if (can_copy_range_) {
    loff_t in_off = static_cast<loff_t>(ref.offset);
    while (left > 0) {
      // At most a chunk per call, so that a large tensor's writeback starts while it is copied.
      const uint64_t want = left < kWritebackChunk ? left : kWritebackChunk;
      ssize_t n = ::copy_file_range(src, &in_off, fd_, nullptr, want, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) can_copy_range_ = false;  // not supported between these files
      if (n <= 0) break;                   // (or the end of the source: read_from says so)
      left -= static_cast<uint64_t>(n);
      appended(static_cast<uint64_t>(n));
    }
  }
  if (left > 0) read_from(src, ref.offset + (ref.size - left), left, ref.buffer->path());
}

// Streaming writeback: each kWritebackChunk appended starts its own writeback and waits for the
// chunk before it. The disk then works while the rest is still being copied, so the fsync at
// commit finds little left to write (it was most of a save's time beyond cp's), and the dirty
// pages a save leaves stay bounded instead of throttling every writer on the machine.
void OutputFile::appended(uint64_t n) {
  size_ += n;
  if (!durable_) return;
  while (size_ - flushed_ >= kWritebackChunk) {
    const auto at = static_cast<off64_t>(flushed_);
    const auto len = static_cast<off64_t>(kWritebackChunk);
    // Best effort, as is the kernel's own writeback: the fsync at commit is what guarantees.
    ::sync_file_range(fd_, at, len, SYNC_FILE_RANGE_WRITE);
    if (flushed_ >= kWritebackChunk) {
      ::sync_file_range(
          fd_, at - len, len,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    }
    flushed_ += kWritebackChunk;
  }
}

void OutputFile::sync() {
  if (!durable_) return;
  if (::fsync(fd_) != 0) throw ModelError("cannot write '" + final_ + "': " + errno_text());
}

void OutputFile::name() {
  if (temp_.empty()) {
    if (::linkat(fd_, "", AT_FDCWD, final_.c_str(), AT_EMPTY_PATH) == 0) return;
    const std::string proc = "/proc/self/fd/" + std::to_string(fd_);
    if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, final_.c_str(), AT_SYMLINK_FOLLOW) == 0) return;
    if (errno == EEXIST) {
      throw ModelError("cannot write '" + final_ + "': another program created it meanwhile");
    }
    // The unnamed file cannot be linked here (no capability, no /proc): copy it to a named
    // temporary, then rename. Only this rare path can leave a temporary if killed.
    OutputFile named(final_, /*unnamed=*/false);
    named.durable_ = durable_;
    named.read_from(fd_, 0, size_, final_);
    named.sync();
    named.name();
    named.committed_ = true;
    return;
  }
  if (::rename(temp_.c_str(), final_.c_str()) != 0) {
    throw ModelError("cannot move the written file to '" + final_ + "': " + errno_text());
  }
}

namespace {

// Removes `path` if it exists (the old output taking the name).
void remove_old(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    throw ModelError("cannot replace '" + path + "': " + errno_text());
  }
}

// The new names are in place when this runs: a failure here leaves the new output readable,
// but whether its names survive a crash or power loss is unknown, which a save must not hide.
void sync_folder(const std::string& folder) {
  int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // durability is best effort where the folder cannot be opened
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // EINVAL: a filesystem that cannot sync folders (some FUSE ones), where there is nothing to wait
  // for.
  if (rc != 0 && err != EINVAL && err != ENOTSUP) {
    throw ModelError("cannot sync the output folder '" + folder + "': " + std::strerror(err) +
                     "; the new files are in place but may not survive a crash or power loss " +
                     "(the save is uncertain): check the disk and save again");
  }
}

// Test hook: FASTOPT_TEST_KILL_AT_STEP=k kills the process right after step k of a commit.
class KillSwitch {
 public:
  KillSwitch() {
    const char* v = std::getenv("FASTOPT_TEST_KILL_AT_STEP");
    if (v && *v) kill_at_ = std::atoi(v);
  }
  void step() {
    if (++done_ == kill_at_) ::kill(::getpid(), SIGKILL);
  }

 private:
  int kill_at_ = -1;
  int done_ = 0;
};

}  // namespace

// Commit order. Killed at any step, or looked at by a reader at any instant, the folder holds
// the old output, the new one, or no model file; never the old model file beside new data
// (which would load without error, with wrong weights), never a partial or temporary file:
//   1. every new file is complete and fsynced while it is still unnamed (O_TMPFILE; a save with
//      SaveOptions::durable false skips the fsyncs, so only steps 2-4 hold after a power loss),
//      then `before_naming` may still refuse them all;
//   2. the old model file is removed: from here on no model file names old data;
//   3. each data file: the old one is removed and the new one linked under its name;
//   4. the new model file is linked under its name, last: it appears only with all its data;
//   5. the folder is fsynced, so that the new names survive a power loss.
// Old data files that the new model does not use are left alone: they are nobody's temporary.
void commit_outputs(OutputFile* model, const std::vector<OutputFile*>& data,
                    const std::function<void()>& before_naming) {
  KillSwitch kill;
  for (OutputFile* f : data) f->sync();
  if (model) model->sync();
  if (before_naming) before_naming();  // may throw: nothing is named yet
  kill.step();                         // 1: everything written, nothing named
  if (model) {
    remove_old(model->final_);
    kill.step();  // 2
  }
  for (OutputFile* f : data) {
    remove_old(f->final_);
    kill.step();  // 3a
    f->name();
    f->committed_ = true;
    kill.step();  // 3b
  }
  if (model) {
    model->name();
    model->committed_ = true;
    kill.step();  // 4
  }
  const OutputFile* named_last = model ? model : data.front();
  if (named_last->durable_) sync_folder(dirname_of(named_last->final_));
  kill.step();  // 5
}

void write_output_file(const std::string& path, const std::string& bytes) {
  if (path.empty()) throw ModelError("output path is empty");
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    throw ModelError(
        "output '" + path + "' is " +
        (S_ISDIR(st.st_mode) ? "a directory" : "a FIFO, socket or device; it is never replaced"));
  }
  CreatedFolders folders(dirname_of(path));
  OutputLock lock(path);
  OutputFile out(path);
  out.write(bytes.data(), bytes.size());
  commit_outputs(&out, {});
  folders.keep();
}

}  // namespace fastopt
