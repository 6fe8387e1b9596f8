#include "ir/tensor.h"

#include <cstring>

#include "ir/error.h"
#include "ir/wire.h"

namespace fastopt {

uint64_t Tensor::numel() const {
  // The product of the non-zero dims must fit in int64 even when a zero dim makes the tensor
  // empty: such a shape is still absurd, and numpy refuses it.
  uint64_t n = 1;
  bool empty = false;
  for (int64_t d : dims) {
    if (d < 0) throw ModelError("tensor '" + name.value + "' has a negative dimension");
    if (d == 0) {
      empty = true;
      continue;
    }
    if (n > static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(d)) {
      throw ModelError("tensor '" + name.value + "' has an element count that overflows");
    }
    n *= static_cast<uint64_t>(d);
  }
  return empty ? 0 : n;
}

uint64_t Tensor::nbytes() const {
  switch (storage) {
    case Storage::kRaw: return raw.size;
    case Storage::kExternal: return external->length;
    default: return expected_bytes();
  }
}

namespace {

// Field numbers of TensorProto's typed data.
constexpr uint32_t kFloatData = 4, kInt32Data = 5, kStringData = 6, kInt64Data = 7,
                   kDoubleData = 10, kUint64Data = 11;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

ByteRef Tensor::bytes() const {
  if (storage == Storage::kRaw) return raw;
  if (storage == Storage::kExternal) {
    const auto& ext = *external;
    ext.file->data();  // map now: errors surface here with the file's name
    return ByteRef{ext.file, ext.offset, ext.length};
  }
  const int32_t t = dtype();
  if (t == kString) throw ModelError("tensor '" + name.value + "' holds strings, not bytes");
  const int bits = dtype_bits(t);
  if (bits == 0) {
    throw ModelError("tensor '" + name.value + "' has unsupported type " + dtype_name(t));
  }
  std::string out;
  uint64_t count = 0;  // values decoded (not bytes)
  for (const ByteRef& field : typed) {
    wire::Reader r(field.data(), 0, field.size, "tensor data");
    uint32_t number;
    wire::WireType type;
    while (r.next(&number, &type)) {
      const uint8_t* base = field.data();
      switch (number) {
        case kFloatData:
          wire::read_repeated_fixed32(r, type, base, [&](uint32_t v) {
            put(out, v);
            ++count;
          });
          break;
        case kDoubleData:
          if (type == wire::kLen) {
            auto [b, e] = r.len_payload();
            if ((e - b) % 8) r.fail("packed double field length is not a multiple of 8");
            out.append(reinterpret_cast<const char*>(base + b), e - b);
            count += (e - b) / 8;
          } else {
            r.expect(type, wire::kFixed64, "double_data");
            put(out, r.fixed64());
            ++count;
          }
          break;
        case kInt64Data:
          wire::read_repeated_varint(r, type, base, [&](uint64_t v) {
            put(out, v);
            ++count;
          });
          break;
        case kUint64Data:
          wire::read_repeated_varint(r, type, base, [&](uint64_t v) {
            if (t == kUint32)
              put(out, static_cast<uint32_t>(v));
            else
              put(out, v);
            ++count;
          });
          break;
        case kInt32Data:
          wire::read_repeated_varint(r, type, base, [&](uint64_t v) {
            // int32_data carries every type narrower than 32 bits (and sub-byte types two or
            // four per entry, already packed into one byte).
            if (bits >= 32)
              put(out, static_cast<uint32_t>(v));
            else if (bits == 16)
              put(out, static_cast<uint16_t>(v));
            else
              put(out, static_cast<uint8_t>(v));
            ++count;
          });
          break;
        default: r.skip(type, number);
      }
    }
  }
  // Complex values come as pairs; sub-byte values come packed, one byte per entry.
  const uint64_t expected = expected_bytes();
  if (out.size() != expected) {
    throw ModelError("tensor '" + name.value + "' has " + std::to_string(out.size()) +
                     " bytes of typed data (" + std::to_string(count) + " values), expected " +
                     std::to_string(expected) + " for its shape");
  }
  return ByteRef::owned(std::move(out));
}

std::vector<std::string> Tensor::strings() const {
  std::vector<std::string> out;
  for (const ByteRef& field : typed) {
    wire::Reader r(field.data(), 0, field.size, "tensor data");
    uint32_t number;
    wire::WireType type;
    while (r.next(&number, &type)) {
      if (number == kStringData && type == wire::kLen)
        out.push_back(r.string());
      else
        r.skip(type, number);
    }
  }
  return out;
}

}  // namespace fastopt
