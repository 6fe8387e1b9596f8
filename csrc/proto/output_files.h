// The files a save writes, and the order in which they take their names (see commit_outputs):
// complete or absent at every instant, never over the loaded model's own files.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ir/buffer.h"

namespace fastopt {

struct Model;

// Identity of a file (device, inode): the same file however it is named (links, symlinks).
struct FileId {
  uint64_t dev = 0, ino = 0;
  bool operator==(const FileId& o) const { return dev == o.dev && ino == o.ino; }
};

// The files a loaded model reads from (its model file and every external data file it maps),
// which no save may replace. Construction also checks that none has changed since the load,
// so a save never touches a mapping past a file's new end.
class InputFiles {
 public:
  explicit InputFiles(const Model& model);
  // Throws ModelError when `path` names one of the input files, or exists and is not a regular
  // file (a directory, FIFO, socket or device is never replaced). `what` says which output.
  void check_output(const std::string& path, const char* what) const;

 private:
  struct Entry {
    FileId id;
    std::string path;
  };
  std::vector<Entry> files_;
};

// Creates the missing folders of `folder` (parents too); removes them again unless keep() is
// called, so a failed save leaves the disk as it found it.
class CreatedFolders {
 public:
  explicit CreatedFolders(const std::string& folder);
  ~CreatedFolders();
  CreatedFolders(const CreatedFolders&) = delete;
  CreatedFolders& operator=(const CreatedFolders&) = delete;
  void keep() { created_.clear(); }

 private:
  std::vector<std::string> created_;  // outermost first
};

// An exclusive lock on the output `path` for the length of a save, so that two saves to one
// output never interleave their commits (one's model file beside the other's data, which loads
// without error with wrong weights). It is an abstract unix socket bound to a name made of the
// output folder's identity (device, inode) and the file name: binding is exclusive, nothing is
// written to the disk, and the kernel frees the name when the process ends, however it ends
// (a lock file would outlive a killed save). A save that finds the name taken fails at once,
// before it writes anything: a ModelError naming the output. Saves in other network namespaces
// (containers sharing a volume) do not see each other's locks.
class OutputLock {
 public:
  explicit OutputLock(const std::string& path);
  ~OutputLock();
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

 private:
  int fd_ = -1;  // the bound socket
};

// Bytes written for a save before the save, in an unnamed file (O_TMPFILE) in the folder the
// output will be written to: the quantization passes put their quantized weights there. A save
// with external data into that folder can take the file as its first data file (write_model_file:
// tensors already in it stay where they are, the others are appended after them, then it is
// linked under the data file's name) instead of copying its bytes into a new file. Taken at most
// once: after that save the file is that output's data file, which no other save may change.
//
// The same file can also become the model file of a self-contained save (onnx_writer.cc,
// write_in_place): its first kModelHeadRoom bytes are left for the graph field's tag and length,
// and each tensor's bytes follow the room for its initializer's framing (slots()), so the
// writer can put the framing around bytes already in place and append the rest of the model.
class AdoptableFile : public Buffer {
 public:
  // Room at the file's start: the GraphProto field's tag (1 byte) and its length as a 5-byte
  // varint (a self-contained model is under 2 GB).
  static constexpr uint64_t kModelHeadRoom = 6;
  // A tensor's bytes [data, data + size), after `data - frame` bytes of room for the framing
  // of the initializer that holds them (tag, length, dims, type, name, raw_data tag and length).
  struct Slot {
    uint64_t frame, data, size;
  };
  // The slots in file order, back to back from kModelHeadRoom to size(); empty when the file
  // was not laid out so.
  virtual std::vector<Slot> slots() const = 0;

  // Whether a save writing into `folder` can take this file: it is unnamed (linkable), on
  // that folder's filesystem, and no save has taken it.
  bool adoptable_in(const std::string& folder) const;

 protected:
  // Opens an unnamed file in `folder` for reading and writing; false (nothing opened) where the
  // filesystem has none. `fd` receives the descriptor.
  bool open_unnamed(const std::string& folder, int* fd);

 private:
  friend class OutputFile;
  FileId folder_{};
  bool linkable_ = false;
  mutable bool taken_ = false;
};

// A file being written for `final_path`: an unnamed file in its folder (O_TMPFILE) until
// commit_outputs names it, or, where the filesystem has no unnamed files, a hidden temporary
// in the folder. Destroyed uncommitted, it leaves nothing.
class OutputFile {
 public:
  explicit OutputFile(std::string final_path, bool unnamed = true);
  // Takes `file` (adoptable_in this folder) as the file for `final_path`: its bytes stay, writes
  // append after its size(). Uncommitted, the file is cut back to that size and can be taken again.
  OutputFile(std::string final_path, const AdoptableFile& file);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  const std::string& path() const { return final_; }
  uint64_t size() const { return size_; }
  void write(const void* p, uint64_t n);
  // Writes into the adopted file's own bytes (the room it left for framing); ModelError past them.
  void write_at(uint64_t offset, const void* p, uint64_t n);
  void zeros(uint64_t n);
  // Appends the bytes of `ref`. A file-backed source is read through its descriptor (in the
  // kernel where it can), never through its mapping: a source that shrank since the load is a
  // ModelError, not a SIGBUS.
  void copy(const ByteRef& ref);
  // false (before any write): no writeback while writing and no fsync at commit (SaveOptions).
  void set_durable(bool durable) { durable_ = durable; }

 private:
  friend void commit_outputs(OutputFile* model, const std::vector<OutputFile*>& data,
                             const std::function<void()>& before_naming);
  static constexpr uint64_t kWritebackChunk = 32ull << 20;  // see appended()
  void appended(uint64_t n);  // size_ += n; starts the writeback of what is complete
  void sync();
  void name();  // links the file under final_ (which must not exist)
  void read_from(int src, uint64_t offset, uint64_t n, const std::string& src_path);

  std::string final_, temp_;  // temp_: the named temporary of the fallback, else empty
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t flushed_ = 0;  // bytes [0, flushed_) handed to writeback (appended)
  bool committed_ = false;
  bool durable_ = true;
  bool can_copy_range_ = true;
  const AdoptableFile* adopted_ = nullptr;  // the file taken, if any
  uint64_t adopted_size_ = 0;               // its own bytes
};

// Gives `data` files and then the `model` file their names, in the order described in
// output_files.cc. `before_naming`, when set, is called once every file is complete (and
// fsynced) but none is named: an exception from it leaves nothing (the run check that ran
// beside the save refuses its output there). FASTOPT_TEST_KILL_AT_STEP=k (tests only) kills the
// process with SIGKILL right after step k, to prove that every intermediate state is safe.
void commit_outputs(OutputFile* model, const std::vector<OutputFile*>& data,
                    const std::function<void()>& before_naming = nullptr);

// Writes `bytes` to `path` as a save writes a model file (folders created, never over a
// directory or special file, complete or absent).
void write_output_file(const std::string& path, const std::string& bytes);

std::string dirname_of(const std::string& path);
std::string basename_of(const std::string& path);

}  // namespace fastopt
