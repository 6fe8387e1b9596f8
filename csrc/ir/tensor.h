// Tensors (TensorProto) whose bytes are views: raw_data into the model file, external data into
// a lazily mapped data file. Typed fields (float_data, int64_data, ...) are kept encoded as read.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ir/buffer.h"
#include "ir/dtype.h"

namespace fastopt {

// A proto2 string/bytes field with presence: written when present, even if empty.
struct OptString {
  std::string value;
  bool present = false;
  void set(std::string v) {
    value = std::move(v);
    present = true;
  }
  bool written() const { return present || !value.empty(); }
};

struct ExternalLocation {
  std::shared_ptr<const FileBuffer> file;  // opened at load (size known), mapped on first read
  uint64_t offset = 0;
  uint64_t length = 0;
  // The original key/value entries, in order, so that an unchanged tensor can be written back
  // exactly when it stays where it is (not used when the writer re-lays out external data).
  std::vector<std::pair<std::string, std::string>> entries;
};

struct Tensor {
  enum class Storage { kNone, kRaw, kExternal, kTyped };

  OptString name;
  std::vector<int64_t> dims;
  std::optional<int32_t> data_type;
  Storage storage = Storage::kNone;
  ByteRef raw;                               // kRaw: the raw_data payload
  bool has_raw_field = false;                // raw_data present (possibly empty)
  std::optional<ExternalLocation> external;  // kExternal
  std::optional<int32_t> data_location;
  RawFields typed;   // typed data fields exactly as encoded (kTyped)
  RawFields extras;  // doc_string, segment, metadata_props, unknown fields

  int32_t dtype() const { return data_type.value_or(0); }
  // Element count; ModelError on overflow (never from load: dims are validated there).
  uint64_t numel() const;
  // Bytes the payload must have for the shape and type (0 when the type has no fixed size).
  uint64_t expected_bytes() const { return dtype_storage_bytes(dtype(), numel()); }
  // Bytes actually stored (raw or external payload), or expected_bytes() for typed fields.
  uint64_t nbytes() const;
  bool is_external() const { return storage == Storage::kExternal; }

  // Little-endian element bytes: a view for raw and external tensors; decoded (one copy) from
  // typed fields. ModelError for string tensors and mismatched typed-field counts.
  ByteRef bytes() const;
  // For STRING tensors: the strings.
  std::vector<std::string> strings() const;
};

// SparseTensorProto: values + indices + dense dims.
struct SparseTensor {
  std::shared_ptr<Tensor> values;
  std::shared_ptr<Tensor> indices;
  std::vector<int64_t> dims;
  RawFields extras;
};

}  // namespace fastopt
