// Protocol-buffers wire format over a byte span: a bounds-checked reader and a writer that
// assembles messages as pieces, so that large payloads stay references until the final write.
// Offsets are 64-bit: a single-file model over 2 GB reads like any other.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ir/buffer.h"
#include "ir/error.h"

namespace fastopt::wire {

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLen = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5
};

// Protobuf's default recursion limit: messages (and groups) nested deeper than this below the
// top-level message make protobuf (onnx.load, ONNX Runtime) refuse the whole file.
inline constexpr int kMaxNesting = 100;

[[noreturn]] inline void nesting_error() {
  throw ModelError("nesting deeper than " + std::to_string(kMaxNesting) +
                   " levels (protobuf's limit; onnx and ONNX Runtime cannot read such a file)");
}

// Parse position in one message. `what` names the message for error text; `depth` is the
// message's nesting level (0 = the top-level message), which bounds groups inside it.
class Reader {
 public:
  Reader(const uint8_t* base, uint64_t begin, uint64_t end, const char* what, int depth = 0)
      : base_(base), pos_(begin), end_(end), what_(what), depth_(depth) {
    if (depth > kMaxNesting) nesting_error();
  }

  bool done() const { return pos_ >= end_; }
  uint64_t pos() const { return pos_; }
  const char* what() const { return what_; }
  int depth() const { return depth_; }

  // At most 10 bytes, the 10th holding only bit 63: anything longer is not an int64.
  uint64_t varint() {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= end_) fail("truncated varint (input ends inside it)");
      uint8_t b = base_[pos_++];
      if (shift == 63 && b > 1)
        fail("varint overflows 64 bits (10th byte " + std::to_string(b) + ")");
      result |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return result;
    }
    fail("varint does not terminate within 10 bytes");
  }

  // Reads a tag; returns false at the end of the message.
  bool next(uint32_t* field, WireType* type) {
    if (done()) return false;
    tag_start_ = pos_;
    uint64_t tag = varint();
    uint64_t number = tag >> 3;
    if (number == 0 || number > 0x1fffffff) fail("invalid field number " + std::to_string(number));
    *field = static_cast<uint32_t>(number);
    *type = static_cast<WireType>(tag & 7);
    if (*type == 6 || *type == 7)
      fail("invalid wire type " + std::to_string(*type) + " for field " + std::to_string(number));
    return true;
  }

  // Returns [begin, end) of a length-delimited payload.
  std::pair<uint64_t, uint64_t> len_payload() {
    uint64_t n = varint();
    if (n > end_ - pos_) {
      fail("length " + std::to_string(n) + " runs past the end of the data (" +
           std::to_string(end_ - pos_) + " bytes left)");
    }
    uint64_t b = pos_;
    pos_ += n;
    return {b, pos_};
  }

  std::string string() {
    auto [b, e] = len_payload();
    return std::string(reinterpret_cast<const char*>(base_ + b), e - b);
  }

  uint32_t fixed32() {
    if (end_ - pos_ < 4) fail("truncated fixed32 value");
    uint32_t v;
    std::memcpy(&v, base_ + pos_, 4);
    pos_ += 4;
    return v;
  }
  uint64_t fixed64() {
    if (end_ - pos_ < 8) fail("truncated fixed64 value");
    uint64_t v;
    std::memcpy(&v, base_ + pos_, 8);
    pos_ += 8;
    return v;
  }

  // Skips the value of the field whose tag was just read. A group is a nested message to
  // protobuf: it counts toward the nesting limit.
  void skip(WireType type, uint32_t field, int depth = -1) {
    if (depth < 0) depth = depth_ + 1;
    switch (type) {
      case kVarint: varint(); return;
      case kFixed64: fixed64(); return;
      case kFixed32: fixed32(); return;
      case kLen: len_payload(); return;
      case kStartGroup: {
        if (depth > kMaxNesting) nesting_error();
        uint32_t f;
        WireType t;
        while (next(&f, &t)) {
          if (t == kEndGroup) {
            if (f != field) fail("mismatched end-group tag");
            return;
          }
          skip(t, f, depth + 1);
        }
        fail("unterminated group for field " + std::to_string(field));
      }
      case kEndGroup: fail("unexpected end-group tag for field " + std::to_string(field));
    }
    fail("invalid wire type");
  }

  // Start offset of the tag most recently read by next(): with pos() after skip(), the exact
  // encoded bytes of the field.
  uint64_t tag_start() const { return tag_start_; }

  void expect(WireType got, WireType want, const char* field) {
    if (got != want) {
      fail(std::string("field '") + field + "' has wire type " + std::to_string(got) +
           ", expected " + std::to_string(want));
    }
  }

  [[noreturn]] void fail(const std::string& msg) const {
    throw ModelError(std::string("corrupt ") + what_ + " at byte " + std::to_string(pos_) + ": " +
                     msg);
  }

 private:
  const uint8_t* base_;
  uint64_t pos_;
  uint64_t end_;
  uint64_t tag_start_ = 0;
  const char* what_;
  int depth_ = 0;
};

// Checks a packed repeated varint payload [b, e) as protobuf parses it; returns the count.
inline uint64_t check_packed_varints(Reader& r, const uint8_t* base, uint64_t b, uint64_t e) {
  uint64_t n = 0;  // one value ends at each byte without the continuation bit
  int run = 0;     // bytes in the current varint
  for (uint64_t p = b; p < e; ++p) {
    if (++run > 10) r.fail("varint in packed field does not terminate within 10 bytes");
    if (run == 10 && base[p] > 1) r.fail("varint in packed field overflows 64 bits");
    if ((base[p] & 0x80) == 0) {
      ++n;
      run = 0;
    }
  }
  if (e > b && (base[e - 1] & 0x80)) r.fail("packed varint field ends inside a value");
  return n;
}

// Reads a repeated scalar field that may be packed (kLen) or not.
template <typename F>
void read_repeated_varint(Reader& r, WireType type, const uint8_t* base, F&& add) {
  if (type == kLen) {
    auto [b, e] = r.len_payload();
    Reader sub(base, b, e, r.what(), r.depth());
    while (!sub.done()) add(sub.varint());
  } else if (type == kVarint) {
    add(r.varint());
  } else {
    r.fail("repeated integer field has wire type " + std::to_string(type));
  }
}

template <typename F>
void read_repeated_fixed32(Reader& r, WireType type, const uint8_t* base, F&& add) {
  if (type == kLen) {
    auto [b, e] = r.len_payload();
    if ((e - b) % 4 != 0) r.fail("packed fixed32 field length is not a multiple of 4");
    for (uint64_t p = b; p < e; p += 4) {
      uint32_t v;
      std::memcpy(&v, base + p, 4);
      add(v);
    }
  } else if (type == kFixed32) {
    add(r.fixed32());
  } else {
    r.fail("repeated float field has wire type " + std::to_string(type));
  }
}

// ---------------------------------------------------------------------------------------------
// Writer: a message is a list of pieces; small bytes accumulate in strings, large payloads are
// ByteRefs written straight from their source (mmap or file descriptor) at the end.

class Writer {
 public:
  struct Piece {
    std::string bytes;  // used when ref.buffer is null
    ByteRef ref;
  };
  static constexpr uint64_t kRefThreshold = 4096;

  uint64_t size() const { return size_; }
  const std::vector<Piece>& pieces() const { return pieces_; }

  void raw(const void* p, size_t n) {
    tail().append(static_cast<const char*>(p), n);
    size_ += n;
  }
  void varint(uint64_t v) {
    uint8_t buf[10];
    int n = 0;
    while (v >= 0x80) {
      buf[n++] = static_cast<uint8_t>(v | 0x80);
      v >>= 7;
    }
    buf[n++] = static_cast<uint8_t>(v);
    raw(buf, n);
  }
  // `v` in exactly `width` bytes (continuation bits on the leading ones): a length written before
  // its value is known, in room reserved for it. Parsers accept such non-minimal varints.
  void varint_padded(uint64_t v, int width) {
    uint8_t buf[10];
    for (int i = 0; i < width; ++i) {
      buf[i] = static_cast<uint8_t>((v & 0x7f) | (i + 1 < width ? 0x80 : 0));
      v >>= 7;
    }
    raw(buf, static_cast<size_t>(width));
  }
  void tag(uint32_t field, WireType type) { varint((static_cast<uint64_t>(field) << 3) | type); }

  void int_field(uint32_t field, int64_t v) {
    tag(field, kVarint);
    varint(static_cast<uint64_t>(v));
  }
  void float_field(uint32_t field, float v) {
    tag(field, kFixed32);
    raw(&v, 4);
  }
  void string_field(uint32_t field, const std::string& s) {
    tag(field, kLen);
    varint(s.size());
    raw(s.data(), s.size());
  }
  void bytes_field(uint32_t field, const ByteRef& ref) {
    tag(field, kLen);
    varint(ref.size);
    append_ref(ref);
  }
  void packed_ints(uint32_t field, const std::vector<int64_t>& v) {
    if (v.empty()) return;
    Writer sub;
    for (int64_t x : v) sub.varint(static_cast<uint64_t>(x));
    message(field, std::move(sub));
  }
  void packed_floats(uint32_t field, const std::vector<float>& v) {
    if (v.empty()) return;
    tag(field, kLen);
    varint(v.size() * 4);
    raw(v.data(), v.size() * 4);
  }
  // Bytes copied verbatim (a preserved field, already tagged).
  void append_ref(const ByteRef& ref) {
    if (ref.size >= kRefThreshold) {
      pieces_.push_back(Piece{{}, ref});
      size_ += ref.size;
    } else if (ref.size > 0) {
      raw(ref.data(), ref.size);
    }
  }
  // Bytes the output already holds where this piece falls (AdoptableFile): always a piece of
  // its own, however small, so the writer can leave it where it is.
  void in_place_ref(const ByteRef& ref) {
    pieces_.push_back(Piece{{}, ref});
    size_ += ref.size;
  }
  void raw_fields(const RawFields& fields) {
    for (const auto& f : fields) append_ref(f);
  }
  void message(uint32_t field, Writer&& sub) {
    tag(field, kLen);
    varint(sub.size_);
    append(std::move(sub));
  }
  void append(Writer&& other) {
    for (auto& p : other.pieces_) {
      if (p.ref.buffer) {
        pieces_.push_back(std::move(p));
      } else {
        tail().append(p.bytes);
      }
    }
    size_ += other.size_;
    other.pieces_.clear();
    other.size_ = 0;
  }

 private:
  std::string& tail() {
    if (pieces_.empty() || pieces_.back().ref.buffer) pieces_.emplace_back();
    return pieces_.back().bytes;
  }
  std::vector<Piece> pieces_;
  uint64_t size_ = 0;
};

}  // namespace fastopt::wire
