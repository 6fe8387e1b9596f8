// IR -> ModelProto file, streamed: unchanged tensor bytes go from their source file to the
// output in the kernel (copy_file_range) or from the mapping, never through Python.
#pragma once

#include <cstdint>
#include <string>

#include "ir/graph.h"

namespace fastopt {

struct SaveOptions {
  enum class External { kAuto, kAlways, kNever };
  External external = External::kAuto;  // kAuto: self-contained when under 2 GB
  std::string location;            // data file name in the output folder; "" = <model name>.data
  uint64_t size_threshold = 1024;  // tensors smaller than this stay inline
  uint64_t align = 0;              // align each tensor's offset in the data file (0 = no padding)
  uint64_t max_file_bytes = 0;     // > 0: start a new data file before exceeding this size
};

// Writes atomically: everything goes to temporary files in the output folder, renamed into
// place only when complete. The source model's files are never written.
void write_model_file(const Model& model, const std::string& path, const SaveOptions& options);

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

}  // namespace fastopt
