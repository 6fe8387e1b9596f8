#include "proto/onnx_schema.h"

namespace fastopt::schema {

namespace {

enum class Kind : uint8_t {
  kOther,          // scalar, string or bytes: any well-formed value
  kMessage,        // a submessage of type `msg`
  kPackedVarint,   // repeated int32/int64/uint64/enum: may be packed
  kPackedFixed32,  // repeated float
  kPackedFixed64,  // repeated double
};

struct FieldKind {
  Kind kind = Kind::kOther;
  Msg msg = Msg::kUnknown;
};

constexpr FieldKind M(Msg m) {
  return {Kind::kMessage, m};
}
constexpr FieldKind kV{Kind::kPackedVarint, Msg::kUnknown};
constexpr FieldKind kF32{Kind::kPackedFixed32, Msg::kUnknown};
constexpr FieldKind kF64{Kind::kPackedFixed64, Msg::kUnknown};
constexpr FieldKind kAny{};

// Message-typed and repeated-scalar fields of onnx.proto (IR version 11); every other field
// (singular scalars, strings, bytes, unknown numbers) only needs to be well-formed.
FieldKind field_kind(Msg m, uint32_t f) {
  switch (m) {
    case Msg::kModel:
      switch (f) {
        case 7: return M(Msg::kGraph);
        case 8: return M(Msg::kOpset);
        case 14: return M(Msg::kEntry);
        case 20: return M(Msg::kTraining);
        case 25: return M(Msg::kFunction);
        case 26: return M(Msg::kDeviceConfiguration);
      }
      break;
    case Msg::kGraph:
      switch (f) {
        case 1: return M(Msg::kNode);
        case 5: return M(Msg::kTensor);
        case 15: return M(Msg::kSparseTensor);
        case 11:
        case 12:
        case 13: return M(Msg::kValueInfo);
        case 14: return M(Msg::kTensorAnnotation);
        case 16: return M(Msg::kEntry);
      }
      break;
    case Msg::kNode:
      switch (f) {
        case 5: return M(Msg::kAttribute);
        case 9: return M(Msg::kEntry);
        case 10: return M(Msg::kNodeDevice);
      }
      break;
    case Msg::kAttribute:
      switch (f) {
        case 5:
        case 10: return M(Msg::kTensor);
        case 6:
        case 11: return M(Msg::kGraph);
        case 22:
        case 23: return M(Msg::kSparseTensor);
        case 14:
        case 15: return M(Msg::kType);
        case 7: return kF32;
        case 8: return kV;
      }
      break;
    case Msg::kTensor:
      switch (f) {
        case 1:
        case 5:
        case 7:
        case 11: return kV;
        case 4: return kF32;
        case 10: return kF64;
        case 3: return M(Msg::kSegment);
        case 13:
        case 16: return M(Msg::kEntry);
      }
      break;
    case Msg::kSparseTensor:
      switch (f) {
        case 1:
        case 2: return M(Msg::kTensor);
        case 3: return kV;
      }
      break;
    case Msg::kType:
      switch (f) {
        case 1: return M(Msg::kTypeTensor);
        case 4: return M(Msg::kTypeSequence);
        case 5: return M(Msg::kTypeMap);
        case 9: return M(Msg::kTypeOptional);
        case 8: return M(Msg::kTypeSparse);
        case 7: return M(Msg::kTypeOpaque);
      }
      break;
    case Msg::kTypeTensor:
    case Msg::kTypeSparse:
      if (f == 2) return M(Msg::kShape);
      break;
    case Msg::kShape:
      if (f == 1) return M(Msg::kDim);
      break;
    case Msg::kTypeSequence:
    case Msg::kTypeOptional:
      if (f == 1) return M(Msg::kType);
      break;
    case Msg::kTypeMap:
      if (f == 2) return M(Msg::kType);
      break;
    case Msg::kNodeDevice:
      if (f == 2) return M(Msg::kShardingSpec);
      break;
    case Msg::kShardingSpec:
      switch (f) {
        case 2: return kV;
        case 3: return M(Msg::kIntIntList);
        case 4: return M(Msg::kShardedDim);
      }
      break;
    case Msg::kIntIntList:
      if (f == 2) return kV;
      break;
    case Msg::kShardedDim:
      if (f == 2) return M(Msg::kSimpleShardedDim);
      break;
    case Msg::kValueInfo:
      if (f == 2) return M(Msg::kType);
      if (f == 4) return M(Msg::kEntry);
      break;
    case Msg::kTensorAnnotation:
      if (f == 2) return M(Msg::kEntry);
      break;
    case Msg::kTraining:
      switch (f) {
        case 1:
        case 2: return M(Msg::kGraph);
        case 3:
        case 4: return M(Msg::kEntry);
      }
      break;
    case Msg::kFunction:
      switch (f) {
        case 11: return M(Msg::kAttribute);
        case 7: return M(Msg::kNode);
        case 9: return M(Msg::kOpset);
        case 12: return M(Msg::kValueInfo);
        case 14: return M(Msg::kEntry);
      }
      break;
    default: break;
  }
  return kAny;
}

}  // namespace

void check_field(wire::Reader& r, const uint8_t* base, Msg m, uint32_t field, wire::WireType type) {
  if (type != wire::kLen) {
    r.skip(type, field);  // a wire type other than the field's makes it unknown to protobuf
    return;
  }
  auto [b, e] = r.len_payload();
  const FieldKind k = field_kind(m, field);
  switch (k.kind) {
    case Kind::kMessage: check_message(base, b, e, k.msg, r.depth() + 1, r.what()); return;
    case Kind::kPackedVarint: wire::check_packed_varints(r, base, b, e); return;
    case Kind::kPackedFixed32:
      if ((e - b) % 4) r.fail("packed fixed32 field length is not a multiple of 4");
      return;
    case Kind::kPackedFixed64:
      if ((e - b) % 8) r.fail("packed fixed64 field length is not a multiple of 8");
      return;
    case Kind::kOther: return;
  }
}

void check_message(const uint8_t* base, uint64_t b, uint64_t e, Msg m, int depth,
                   const char* what) {
  wire::Reader r(base, b, e, what, depth);
  uint32_t f;
  wire::WireType t;
  while (r.next(&f, &t)) check_field(r, base, m, f, t);
}

}  // namespace fastopt::schema
