// ONNX element types (TensorProto.DataType) and their storage sizes.
#pragma once

#include <cstdint>
#include <string>

namespace fastopt {

enum DType : int32_t {
  kUndefined = 0,
  kFloat = 1,
  kUint8 = 2,
  kInt8 = 3,
  kUint16 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kString = 8,
  kBool = 9,
  kFloat16 = 10,
  kDouble = 11,
  kUint32 = 12,
  kUint64 = 13,
  kComplex64 = 14,
  kComplex128 = 15,
  kBFloat16 = 16,
  kFloat8E4M3FN = 17,
  kFloat8E4M3FNUZ = 18,
  kFloat8E5M2 = 19,
  kFloat8E5M2FNUZ = 20,
  kUint4 = 21,
  kInt4 = 22,
  kFloat4E2M1 = 23,
  kFloat8E8M0 = 24,
  kUint2 = 25,
  kInt2 = 26,
};

// Bits per element for types with a fixed size; 0 for strings and unknown types.
inline int dtype_bits(int32_t t) {
  switch (t) {
    case kFloat:
    case kInt32:
    case kUint32: return 32;
    case kUint8:
    case kInt8:
    case kBool:
    case kFloat8E4M3FN:
    case kFloat8E4M3FNUZ:
    case kFloat8E5M2:
    case kFloat8E5M2FNUZ:
    case kFloat8E8M0: return 8;
    case kUint16:
    case kInt16:
    case kFloat16:
    case kBFloat16: return 16;
    case kInt64:
    case kDouble:
    case kUint64:
    case kComplex64: return 64;
    case kComplex128: return 128;
    case kUint4:
    case kInt4:
    case kFloat4E2M1: return 4;
    case kUint2:
    case kInt2: return 2;
    default: return 0;
  }
}

// Storage bytes of `numel` elements (sub-byte types are packed, rounded up to whole bytes).
inline uint64_t dtype_storage_bytes(int32_t t, uint64_t numel) {
  uint64_t bits = static_cast<uint64_t>(dtype_bits(t));
  return (numel * bits + 7) / 8;
}

std::string dtype_name(int32_t t);

}  // namespace fastopt
