// IR -> ModelProto file, streamed: unchanged tensor bytes go from their source file to the
// output in the kernel (copy_file_range) or from the mapping, never through Python.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ir/graph.h"

namespace fastopt {

struct SaveOptions {
  enum class External { kAuto, kAlways, kNever };
  External external = External::kAuto;  // kAuto: self-contained when under 2 GB
  std::string location;            // data file name in the output folder; "" = <model name>.data
  uint64_t size_threshold = 1024;  // tensors smaller than this stay inline (but those in a
                                   // data file the save takes: AdoptableFile)
  uint64_t align = 0;              // align each tensor's offset in the data file (0 = no padding)
  uint64_t max_file_bytes = 0;     // > 0: start a new data file before exceeding this size
  // Small files written beside the model (name in the output folder, bytes), committed with
  // the data files: e.g. genai_config.json, which must never describe another model file.
  std::vector<std::pair<std::string, std::string>> side_files;
  // false: no writeback, no fsync (as cp writes): the files are still complete or absent for
  // every reader and after a crash of this process, but a power loss may leave them partial.
  bool durable = true;
  // Called when every file is written (and fsynced) but none named (commit_outputs): an
  // exception from it leaves nothing. The run check waits for its forked child here.
  std::function<void()> before_commit;
};

// Writes the model file, its data files and side files: complete or absent at every instant
// (commit_outputs), never over the loaded model's own files or over anything not a regular
// file; missing folders are created. A self-contained model whose quantized tensors fill an
// AdoptableFile in the output's folder is written into that file (graph field first; see
// AdoptableFile), the same model as the canonical order in other bytes.
void write_model_file(const Model& model, const std::string& path, const SaveOptions& options);

// Bytes of an initializer's framing in a self-contained model file: the initializer field's tag
// and length and the tensor's fields before its raw_data payload, as the writer writes them. The
// quantization passes reserve this room before each tensor they write (AdoptableFile::Slot).
uint64_t initializer_framing_bytes(const std::string& name, const std::vector<int64_t>& dims,
                                   int32_t dtype, uint64_t nbytes);

// Serializes a self-contained model in memory (external data inlined); ModelError over 2 GB.
std::string serialize_model(const Model& model);

// Bytes a self-contained serialization would take.
uint64_t self_contained_size(const Model& model);

// The external-data location of skeleton placeholders. A skeleton's only external data are
// placeholders, so the marker cannot clash with a real file.
inline constexpr const char* kSkeletonLocation = "*fastopt-skeleton*";

// Serializes the model with every tensor payload of at least `threshold` bytes replaced by a
// placeholder: data_location EXTERNAL, location kSkeletonLocation, offset = index into
// model.skeleton_tensors (recorded here), length = the payload's size. The result is the
// model's structure, small whatever its weights weigh, for tools that edit ModelProtos (onnx
// shape inference, version conversion); read_skeleton binds the placeholders back.
std::string serialize_skeleton(Model& model, uint64_t threshold);

// The model as a file ONNX Runtime loads with every tensor payload of at least `threshold`
// bytes read as external data from the file `location` (a plain name beside it), each at its
// own page-aligned offset; *zeros_bytes receives that file's length. A sparse file of zeros of
// that length lets ORT load and run the graph without the weights (the run check).
std::string serialize_zeros_skeleton(const Model& model, uint64_t threshold,
                                     const std::string& location, uint64_t* zeros_bytes);

}  // namespace fastopt
