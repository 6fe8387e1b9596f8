// The message structure of onnx.proto, for checking bytes the reader keeps without decoding
// them (unknown and skipped fields, non-tensor TypeProtos): they are written back verbatim, so
// they must parse as protobuf parses them, or onnx could not read what fastopt saves.
#pragma once

#include <cstdint>

#include "ir/wire.h"

namespace fastopt::schema {

enum class Msg : uint8_t {
  kUnknown,  // not a message fastopt knows: its fields are opaque
  kModel,
  kOpset,
  kGraph,
  kNode,
  kAttribute,
  kTensor,
  kSegment,
  kEntry,
  kSparseTensor,
  kType,
  kTypeTensor,
  kShape,
  kDim,
  kTypeSequence,
  kTypeMap,
  kTypeOptional,
  kTypeSparse,
  kTypeOpaque,
  kNodeDevice,
  kShardingSpec,
  kIntIntList,
  kShardedDim,
  kSimpleShardedDim,
  kValueInfo,
  kTensorAnnotation,
  kTraining,
  kFunction,
  kDeviceConfiguration,
};

// Checks one field occurrence of message `m` whose tag `r` has just read (wire type `type`,
// number `field`), consuming its value: a length-delimited value of a known message field is
// checked recursively (depth included), a packed repeated scalar's payload is checked, groups
// are balanced. Throws ModelError where protobuf would refuse to parse.
void check_field(wire::Reader& r, const uint8_t* base, Msg m, uint32_t field, wire::WireType type);

// Checks a whole message payload [b, e) of type `m` at nesting level `depth`.
void check_message(const uint8_t* base, uint64_t b, uint64_t e, Msg m, int depth, const char* what);

}  // namespace fastopt::schema
