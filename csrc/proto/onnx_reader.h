// ModelProto -> IR, straight from the protobuf wire format (no libprotobuf, no 2 GB limit).
#pragma once

#include <memory>
#include <string>

#include "ir/graph.h"

namespace fastopt {

// Reads a model file. The file is memory-mapped and tensor bytes stay views into it; external
// data is resolved against the file's folder and must stay inside it.
std::unique_ptr<Model> read_model_file(const std::string& path);

// Reads a serialized model held in `buffer`. External data, if any, is resolved against
// `base_dir`; with an empty base_dir a model that references external data is refused.
std::unique_ptr<Model> read_model_from_buffer(std::shared_ptr<const Buffer> buffer,
                                              const std::string& base_dir);

// Reads a skeleton of `original` (serialize_skeleton's bytes, possibly edited by another tool
// since): every placeholder takes the payload of the original's tensor it stands for, as views
// of the same bytes (no copy), so the new model keeps the original's buffers alive. The new
// model has the original's path, folder and external data files.
std::unique_ptr<Model> read_skeleton(std::shared_ptr<const Buffer> buffer, const Model& original);

}  // namespace fastopt
