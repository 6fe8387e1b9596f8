#include "proto/onnx_reader.h"

#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include "ir/constant.h"
#include "ir/error.h"
#include "proto/onnx_fields.h"
#include "proto/onnx_schema.h"
#include "proto/onnx_writer.h"
#include "proto/wire.h"

namespace fastopt {

namespace {

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  if (::realpath(p.c_str(), buf) == nullptr) return {};
  return buf;
}

std::string dirname_of(const std::string& p) {
  auto slash = p.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

bool path_inside(const std::string& child, const std::string& dir) {
  if (dir == "/") return true;
  return child.size() > dir.size() && child.compare(0, dir.size(), dir) == 0 &&
         child[dir.size()] == '/';
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

bool same_type(const TypeInfo& a, const TypeInfo& b) {
  if (a.known != b.known) return false;
  if (!a.known) return true;
  return a.encoded.size == b.encoded.size &&
         std::memcmp(a.encoded.data(), b.encoded.data(), a.encoded.size) == 0;
}

// Counts values in a typed-data field occurrence without decoding them.
uint64_t count_values(wire::Reader& r, wire::WireType type, const uint8_t* base, int fixed_size) {
  if (type != wire::kLen) {
    r.skip(type, 0);
    return 1;
  }
  auto [b, e] = r.len_payload();
  if (fixed_size > 0) {
    if ((e - b) % fixed_size) r.fail("packed field length is not a multiple of the value size");
    return (e - b) / fixed_size;
  }
  return wire::check_packed_varints(r, base, b, e);
}

// Protobuf `string` fields hold UTF-8; names with invalid bytes cannot be text in Python or
// in error messages, so they are refused at load.
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
    } else
      return false;
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      return false;
    }
    i += len;
  }
  return true;
}

}  // namespace

struct ModelReader {
  std::shared_ptr<const Buffer> source;
  const uint8_t* base = nullptr;
  std::string base_dir;       // as given
  std::string base_dir_real;  // resolved, for containment checks
  Model* model = nullptr;
  const Model* skeleton_of = nullptr;  // reading a skeleton of this model

  struct PendingGraph {
    Attribute* attr;
    int index;  // -1: attr.g, else attr.graphs[index]
    uint64_t begin, end;
    int depth;  // nesting level of the GraphProto
  };

  ByteRef span(uint64_t b, uint64_t e) const { return ByteRef{source, b, e - b}; }
  // A field the IR does not model, kept verbatim: it must parse as protobuf parses it.
  void keep(RawFields& extras, wire::Reader& r, wire::WireType type, uint32_t number,
            schema::Msg message) {
    uint64_t start = r.tag_start();
    schema::check_field(r, base, message, number, type);
    extras.push_back(span(start, r.pos()));
  }
  // A `string` field: must be UTF-8.
  std::string str(wire::Reader& r, wire::WireType type, const char* what) {
    r.expect(type, wire::kLen, what);
    std::string s = r.string();
    if (!valid_utf8(s)) r.fail(std::string("field '") + what + "' is not valid UTF-8");
    return s;
  }
  // A `string` field viewed in place (names only need looking up).
  std::string_view str_view(wire::Reader& r, wire::WireType type, const char* what) {
    r.expect(type, wire::kLen, what);
    auto [b, e] = r.len_payload();
    std::string_view s(reinterpret_cast<const char*>(base + b), e - b);
    bool ascii = true;
    for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
    if (!ascii && !valid_utf8(std::string(s))) {
      r.fail(std::string("field '") + what + "' is not valid UTF-8");
    }
    return s;
  }
  // A `bytes` field: anything goes.
  std::string bytes(wire::Reader& r, wire::WireType type, const char* what) {
    r.expect(type, wire::kLen, what);
    return r.string();
  }
  int64_t int64(wire::Reader& r, wire::WireType type, const char* what) {
    r.expect(type, wire::kVarint, what);
    return static_cast<int64_t>(r.varint());
  }
  std::pair<uint64_t, uint64_t> sub(wire::Reader& r, wire::WireType type, const char* what) {
    r.expect(type, wire::kLen, what);
    return r.len_payload();
  }

  // ---- small messages ----

  OpsetId read_opset(uint64_t b, uint64_t e, int depth) {
    OpsetId o;
    wire::Reader r(base, b, e, "OperatorSetIdProto", depth);
    uint32_t f;
    wire::WireType t;
    while (r.next(&f, &t)) {
      if (f == field::opset::kDomain)
        o.domain.set(str(r, t, "domain"));
      else if (f == field::opset::kVersion) {
        o.version = int64(r, t, "version");
        if (*o.version < 0) r.fail("negative opset version");
      } else
        keep(o.extras, r, t, f, schema::Msg::kOpset);
    }
    return o;
  }

  // Returns false if the entry has fields beyond key and value.
  bool read_entry(uint64_t b, uint64_t e, std::string* key, std::string* value, int depth) {
    wire::Reader r(base, b, e, "StringStringEntryProto", depth);
    uint32_t f;
    wire::WireType t;
    bool plain = true;
    while (r.next(&f, &t)) {
      if (f == field::entry::kKey)
        *key = str(r, t, "key");
      else if (f == field::entry::kValue)
        *value = str(r, t, "value");
      else {
        plain = false;
        r.skip(t, f);
      }
    }
    return plain;
  }

  TypeInfo read_type(uint64_t b, uint64_t e, int depth) {
    TypeInfo ti;
    ti.known = true;
    ti.encoded = span(b, e);  // written back verbatim: all of it must parse
    schema::check_message(base, b, e, schema::Msg::kType, depth, "TypeProto");
    wire::Reader r(base, b, e, "TypeProto", depth);
    uint32_t f;
    wire::WireType t;
    while (r.next(&f, &t)) {
      if (f != field::type::kTensorType) {
        r.skip(t, f);
        continue;
      }
      ti.is_tensor = true;
      auto [tb, te] = sub(r, t, "tensor_type");
      wire::Reader tr(base, tb, te, "TypeProto.Tensor", depth + 1);
      while (tr.next(&f, &t)) {
        if (f == field::type::tensor::kElemType) {
          ti.elem_type = static_cast<int32_t>(int64(tr, t, "elem_type"));
        } else if (f == field::type::tensor::kShape) {
          ti.has_shape = true;
          auto [sb, se] = sub(tr, t, "shape");
          wire::Reader sr(base, sb, se, "TensorShapeProto", depth + 2);
          while (sr.next(&f, &t)) {
            if (f != field::type::shape::kDim) {
              sr.skip(t, f);
              continue;
            }
            auto [db, de] = sub(sr, t, "dim");
            wire::Reader dr(base, db, de, "TensorShapeProto.Dimension", depth + 3);
            Dim d;
            while (dr.next(&f, &t)) {
              if (f == field::type::dim::kValue) {
                d.value = int64(dr, t, "dim_value");
                if (*d.value < 0) dr.fail("negative dim_value " + std::to_string(*d.value));
              } else if (f == field::type::dim::kParam)
                d.param = str(dr, t, "dim_param");
              else
                dr.skip(t, f);
            }
            ti.dims.push_back(std::move(d));
          }
        } else {
          tr.skip(t, f);
        }
      }
    }
    return ti;
  }

  // ---- tensors ----

  std::shared_ptr<Tensor> read_tensor(uint64_t b, uint64_t e, int depth) {
    auto tp = std::make_shared<Tensor>();
    Tensor& ts = *tp;
    wire::Reader r(base, b, e, "TensorProto", depth);
    uint32_t f;
    wire::WireType t;
    std::vector<std::pair<std::string, std::string>> ext_entries;
    uint64_t typed_values = 0, string_values = 0;
    while (r.next(&f, &t)) {
      switch (f) {
        case field::tensor::kDims:
          wire::read_repeated_varint(
              r, t, base, [&](uint64_t v) { ts.dims.push_back(static_cast<int64_t>(v)); });
          break;
        case field::tensor::kDataType:
          ts.data_type = static_cast<int32_t>(int64(r, t, "data_type"));
          break;
        case field::tensor::kName: ts.name.set(str(r, t, "name")); break;
        case field::tensor::kRawData: {
          auto [rb, re] = sub(r, t, "raw_data");
          ts.raw = span(rb, re);
          ts.has_raw_field = true;
          break;
        }
        case field::tensor::kDataLocation:
          ts.data_location = static_cast<int32_t>(int64(r, t, "data_location"));
          break;
        case field::tensor::kExternalData: {
          auto [xb, xe] = sub(r, t, "external_data");
          std::string k, v;
          read_entry(xb, xe, &k, &v, depth + 1);
          ext_entries.emplace_back(std::move(k), std::move(v));
          break;
        }
        case field::tensor::kFloatData:
        case field::tensor::kInt32Data:
        case field::tensor::kInt64Data:
        case field::tensor::kDoubleData:
        case field::tensor::kUint64Data:
        case field::tensor::kStringData: {
          uint64_t start = r.tag_start();
          if (f == field::tensor::kStringData) {
            r.expect(t, wire::kLen, "string_data");
            r.len_payload();
            ++string_values;
          } else {
            int fixed = f == field::tensor::kFloatData    ? 4
                        : f == field::tensor::kDoubleData ? 8
                                                          : 0;
            if (t == wire::kLen || (fixed == 4 && t == wire::kFixed32) ||
                (fixed == 8 && t == wire::kFixed64) || (fixed == 0 && t == wire::kVarint)) {
              typed_values += count_values(r, t, base, fixed);
            } else {
              r.fail("typed data field " + std::to_string(f) + " has wire type " +
                     std::to_string(t));
            }
          }
          ts.typed.push_back(span(start, r.pos()));
          break;
        }
        default: keep(ts.extras, r, t, f, schema::Msg::kTensor);
      }
    }
    finish_tensor(ts, std::move(ext_entries), typed_values, string_values);
    return tp;
  }

  void finish_tensor(Tensor& ts, std::vector<std::pair<std::string, std::string>> ext_entries,
                     uint64_t typed_values, uint64_t string_values) {
    const std::string who = "tensor '" + ts.name.value + "'";
    for (int64_t d : ts.dims) {
      if (d < 0)
        throw ModelError(who + " has a negative dimension in shape " + shape_text(ts.dims));
    }
    uint64_t numel;
    try {
      numel = ts.numel();
    } catch (const ModelError&) {
      throw ModelError(who + " has absurd dimensions " + shape_text(ts.dims) +
                       " (element count overflows)");
    }
    const int32_t dt = ts.dtype();
    const int bits = dtype_bits(dt);
    // numpy and onnx size an array as the product of its non-zero dims times the item size,
    // even when a zero dim makes it empty: that product must fit in int64 too.
    uint64_t nonzero = 1;  // numel() proved this product fits in int64
    for (int64_t d : ts.dims) nonzero *= d > 0 ? static_cast<uint64_t>(d) : 1;
    const uint64_t item = bits >= 8 ? static_cast<uint64_t>(bits) / 8 : dt == kString ? 8 : 1;
    if (nonzero > static_cast<uint64_t>(INT64_MAX) / item) {
      throw ModelError(who + " has absurd dimensions " + shape_text(ts.dims) + " of " +
                       dtype_name(dt) + " (size in bytes overflows)");
    }
    const uint64_t expected = bits > 0 ? dtype_storage_bytes(dt, numel) : 0;
    const bool external = ts.data_location.value_or(0) == field::tensor::kLocationExternal;
    const bool has_payload = external || ts.has_raw_field || !ts.typed.empty();
    if (has_payload && bits == 0 && dt != kString) {
      throw ModelError(who + " has data but an unsupported data type " + std::to_string(dt));
    }

    if (external && skeleton_of) {
      bind_placeholder(ts, ext_entries);
      return;
    }
    if (external) {
      if (ts.has_raw_field) throw ModelError(who + " has both raw_data and external data");
      if (dt == kString) throw ModelError(who + " is a string tensor with external data");
      ts.storage = Tensor::Storage::kExternal;
      ts.external = resolve_external(ts, std::move(ext_entries), expected, bits > 0);
      return;
    }
    if (!ext_entries.empty()) {
      // Not external (data_location is DEFAULT): the entries are inert metadata. Keep them.
      ts.external = ExternalLocation{nullptr, 0, 0, std::move(ext_entries)};
    }
    if (ts.has_raw_field) {
      if (!ts.typed.empty()) throw ModelError(who + " has both raw_data and typed data fields");
      if (dt == kString) throw ModelError(who + " is a string tensor with raw_data");
      if (bits > 0 && ts.raw.size != expected) {
        throw ModelError(who + " raw_data size " + std::to_string(ts.raw.size) +
                         " bytes does not match its shape " + shape_text(ts.dims) + " of " +
                         dtype_name(dt) + " (expected " + std::to_string(expected) + " bytes)");
      }
      ts.storage = Tensor::Storage::kRaw;
      return;
    }
    if (!ts.typed.empty()) {
      ts.storage = Tensor::Storage::kTyped;
      uint64_t want = dt == kString                             ? numel
                      : (dt == kComplex64 || dt == kComplex128) ? numel * 2
                      : bits > 0 && bits < 8                    ? expected
                                                                : numel;
      uint64_t got = dt == kString ? string_values : typed_values;
      if (bits > 0 || dt == kString) {
        if (got != want) {
          throw ModelError(who + " has " + std::to_string(got) + " values in its typed data, " +
                           "expected " + std::to_string(want) + " for shape " +
                           shape_text(ts.dims));
        }
      }
      return;
    }
    if (numel > 0 && (bits > 0 || dt == kString)) {
      throw ModelError(who + " has shape " + shape_text(ts.dims) + " but no data");
    }
  }

  // A skeleton placeholder takes the payload (storage fields) of the original model's tensor:
  // views, never copies. Its name, shape and type are the skeleton's and must still fit.
  void bind_placeholder(Tensor& ts,
                        const std::vector<std::pair<std::string, std::string>>& entries) {
    const std::string who = "skeleton tensor '" + ts.name.value + "'";
    std::string location, offset;
    for (const auto& kv : entries) {
      if (kv.first == "location") location = kv.second;
      if (kv.first == "offset") offset = kv.second;
    }
    if (location != kSkeletonLocation) {
      throw ModelError(who + " references external data '" + location +
                       "'; a skeleton holds only placeholders");
    }
    const auto& table = skeleton_of->skeleton_tensors;
    uint64_t index = UINT64_MAX;
    if (!offset.empty() && offset.size() < 20 &&
        offset.find_first_not_of("0123456789") == std::string::npos) {
      index = std::stoull(offset);
    }
    if (index >= table.size()) {
      throw ModelError(who + " has placeholder index '" + offset + "', not one of the " +
                       std::to_string(table.size()) + " tensors of the original model's skeletons");
    }
    const Tensor& original = *table[index];
    if (original.dims != ts.dims || original.dtype() != ts.dtype()) {
      throw ModelError(who + " is " + dtype_name(ts.dtype()) + shape_text(ts.dims) +
                       " but the original tensor '" + original.name.value + "' is " +
                       dtype_name(original.dtype()) + shape_text(original.dims));
    }
    ts.storage = original.storage;
    ts.raw = original.raw;
    ts.has_raw_field = original.has_raw_field;
    ts.external = original.external;
    ts.data_location = original.data_location;
    ts.typed = original.typed;
  }

  ExternalLocation resolve_external(const Tensor& ts,
                                    std::vector<std::pair<std::string, std::string>> entries,
                                    uint64_t expected, bool sized) {
    const std::string who = "tensor '" + ts.name.value + "'";
    std::string location;
    bool has_length = false;
    uint64_t offset = 0, length = 0;
    auto parse_u64 = [&](const std::string& key, const std::string& v) -> uint64_t {
      if (v.empty() || v.size() > 20 || v.find_first_not_of("0123456789") != std::string::npos) {
        throw ModelError(who + " has an invalid external data " + key + " '" + v + "'");
      }
      errno = 0;
      unsigned long long x = std::strtoull(v.c_str(), nullptr, 10);
      if (errno == ERANGE) throw ModelError(who + " external data " + key + " is out of range");
      return static_cast<uint64_t>(x);
    };
    for (const auto& kv : entries) {
      if (kv.first == "location")
        location = kv.second;
      else if (kv.first == "offset") {
        offset = parse_u64("offset", kv.second);
      } else if (kv.first == "length") {
        length = parse_u64("length", kv.second);
        has_length = true;
      }
    }
    if (location.empty()) throw ModelError(who + " is external but has no location");
    if (location.find('\0') != std::string::npos) {
      throw ModelError(who + " external data location contains a NUL byte");
    }
    if (location[0] == '/') {
      throw ModelError(who + " external data location '" + location +
                       "' is an absolute path; it must be relative to the model's folder");
    }
    if (base_dir.empty()) {
      throw ModelError(who + " references external data '" + location +
                       "' but the model was not loaded from a folder (pass base_dir)");
    }
    std::string joined = base_dir + "/" + location;
    std::string resolved = real_path(joined);
    if (resolved.empty()) {
      throw ModelError(who + " external data file '" + location + "' not found in '" + base_dir +
                       "': " + std::strerror(errno));
    }
    if (!path_inside(resolved, base_dir_real)) {
      throw ModelError(who + " external data location '" + location +
                       "' escapes the model's folder '" + base_dir + "'");
    }
    std::shared_ptr<const FileBuffer> file;
    auto it = model->external_files.find(resolved);
    if (it != model->external_files.end()) {
      file = it->second;
    } else {
      file = FileBuffer::open(resolved, /*map_now=*/false);
      model->external_files.emplace(resolved, file);
    }
    if (!has_length) {
      if (!sized) throw ModelError(who + " is external with no length and no fixed-size type");
      length = expected;
    }
    if (offset > file->size() || length > file->size() - offset) {
      throw ModelError(who + " external data range [offset " + std::to_string(offset) +
                       ", length " + std::to_string(length) + "] runs past the end of '" +
                       location + "' (" + std::to_string(file->size()) + " bytes)");
    }
    if (sized && length != expected) {
      throw ModelError(who + " external data length " + std::to_string(length) +
                       " bytes does not match its shape " + shape_text(ts.dims) + " of " +
                       dtype_name(ts.dtype()) + " (expected " + std::to_string(expected) +
                       " bytes)");
    }
    return ExternalLocation{std::move(file), offset, length, std::move(entries)};
  }

  std::shared_ptr<SparseTensor> read_sparse(uint64_t b, uint64_t e, int depth) {
    auto sp = std::make_shared<SparseTensor>();
    wire::Reader r(base, b, e, "SparseTensorProto", depth);
    uint32_t f;
    wire::WireType t;
    while (r.next(&f, &t)) {
      if (f == field::sparse::kValues) {
        auto [vb, ve] = sub(r, t, "values");
        sp->values = read_tensor(vb, ve, depth + 1);
      } else if (f == field::sparse::kIndices) {
        auto [ib, ie] = sub(r, t, "indices");
        sp->indices = read_tensor(ib, ie, depth + 1);
      } else if (f == field::sparse::kDims) {
        wire::read_repeated_varint(
            r, t, base, [&](uint64_t v) { sp->dims.push_back(static_cast<int64_t>(v)); });
      } else {
        keep(sp->extras, r, t, f, schema::Msg::kSparseTensor);
      }
    }
    validate_sparse(*sp);
    return sp;
  }

  // Values [NNZ], indices [NNZ] (linear) or [NNZ, rank], every index inside the dense shape:
  // anything that densifies the tensor can then trust them.
  static void validate_sparse(const SparseTensor& sp) {
    if (!sp.values) throw ModelError("sparse tensor has no values");
    const std::string who = "sparse tensor '" + sp.values->name.value + "'";
    uint64_t dense = 1;
    for (int64_t d : sp.dims) {
      if (d < 0) throw ModelError(who + " has a negative dense dimension");
      if (d != 0 && dense > static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(d)) {
        throw ModelError(who + " has dense dimensions whose element count overflows");
      }
      dense *= static_cast<uint64_t>(d);
    }
    if (sp.values->dims.size() != 1) throw ModelError(who + " values must be 1-D");
    const uint64_t nnz = static_cast<uint64_t>(sp.values->dims[0]);
    if (!sp.indices) {
      if (nnz != 0) throw ModelError(who + " has values but no indices");
      return;
    }
    const Tensor& ix = *sp.indices;
    if (ix.dtype() != kInt64) throw ModelError(who + " indices must be int64");
    const bool linear = ix.dims.size() == 1;
    if (!(linear || (ix.dims.size() == 2 && static_cast<uint64_t>(ix.dims[1]) == sp.dims.size())) ||
        static_cast<uint64_t>(ix.dims[0]) != nnz) {
      throw ModelError(who + " indices shape does not match its values and dense shape");
    }
    auto idx = tensor_ints(ix, UINT64_MAX);
    if (!idx) throw ModelError(who + " indices cannot be read");
    for (size_t k = 0; k < idx->size(); ++k) {
      int64_t i = (*idx)[k];
      uint64_t bound = linear ? dense : static_cast<uint64_t>(sp.dims[k % sp.dims.size()]);
      if (i < 0 || static_cast<uint64_t>(i) >= bound) {
        throw ModelError(who + " index " + std::to_string(i) + " is outside the dense shape");
      }
    }
  }

  // ---- attributes and nodes ----

  Attribute read_attribute(uint64_t b, uint64_t e, std::vector<PendingGraph>* pending_raw,
                           int depth) {
    Attribute a;
    wire::Reader r(base, b, e, "AttributeProto", depth);
    uint32_t f;
    wire::WireType t;
    std::vector<std::pair<uint64_t, uint64_t>> graphs;
    std::pair<uint64_t, uint64_t> g{0, 0};
    bool has_g = false;
    while (r.next(&f, &t)) {
      switch (f) {
        case field::attr::kName: a.name = str(r, t, "name"); break;
        case field::attr::kType: a.type = static_cast<int32_t>(int64(r, t, "type")); break;
        case field::attr::kF: {
          r.expect(t, wire::kFixed32, "f");
          uint32_t bits = r.fixed32();
          float v;
          std::memcpy(&v, &bits, 4);
          a.f = v;
          break;
        }
        case field::attr::kI: a.i = int64(r, t, "i"); break;
        case field::attr::kS: a.s = bytes(r, t, "s"); break;
        case field::attr::kT: {
          auto [tb, te] = sub(r, t, "t");
          a.t = read_tensor(tb, te, depth + 1);
          break;
        }
        case field::attr::kG:
          g = sub(r, t, "g");
          has_g = true;
          break;
        case field::attr::kFloats:
          wire::read_repeated_fixed32(r, t, base, [&](uint32_t bits) {
            float v;
            std::memcpy(&v, &bits, 4);
            a.floats.push_back(v);
          });
          break;
        case field::attr::kInts:
          wire::read_repeated_varint(
              r, t, base, [&](uint64_t v) { a.ints.push_back(static_cast<int64_t>(v)); });
          break;
        case field::attr::kStrings: a.strings.push_back(bytes(r, t, "strings")); break;
        case field::attr::kTensors: {
          auto [tb, te] = sub(r, t, "tensors");
          a.tensors.push_back(read_tensor(tb, te, depth + 1));
          break;
        }
        case field::attr::kGraphs: graphs.push_back(sub(r, t, "graphs")); break;
        case field::attr::kRefAttrName: a.ref_attr_name.set(str(r, t, "ref_attr_name")); break;
        default: keep(a.extras, r, t, f, schema::Msg::kAttribute);
      }
    }
    if (a.name.empty()) r.fail("attribute has no name");
    if (a.type && (*a.type < 0 || *a.type > static_cast<int32_t>(AttrType::kTypeProtos))) {
      r.fail("attribute '" + a.name + "' has unknown type " + std::to_string(*a.type));
    }
    // Subgraphs are parsed after the enclosing graph has defined all its names.
    if (has_g) pending_raw->push_back({nullptr, -1, g.first, g.second, depth + 1});
    for (size_t i = 0; i < graphs.size(); ++i) {
      pending_raw->push_back(
          {nullptr, static_cast<int>(i), graphs[i].first, graphs[i].second, depth + 1});
    }
    a.graphs.resize(graphs.size());
    return a;
  }

  struct PendingNode {
    Node* node;
    std::vector<std::string_view> inputs;                 // views into the source buffer
    std::vector<std::pair<size_t, PendingGraph>> graphs;  // attribute index, graph
  };

  PendingNode read_node(Graph& g, uint64_t b, uint64_t e, int depth) {
    Node& n = *g.new_node();
    PendingNode pn{nullptr, {}, {}};
    std::vector<std::string> outputs;
    wire::Reader r(base, b, e, "NodeProto", depth);
    uint32_t f;
    wire::WireType t;
    while (r.next(&f, &t)) {
      switch (f) {
        case field::node::kInput: pn.inputs.push_back(str_view(r, t, "input")); break;
        case field::node::kOutput: outputs.push_back(str(r, t, "output")); break;
        case field::node::kName: n.name.set(str(r, t, "name")); break;
        case field::node::kOpType:
          n.op_type = str(r, t, "op_type");
          n.has_op_type = true;
          break;
        case field::node::kDomain: n.domain.set(str(r, t, "domain")); break;
        case field::node::kOverload: n.overload.set(str(r, t, "overload")); break;
        case field::node::kAttribute: {
          auto [ab, ae] = sub(r, t, "attribute");
          std::vector<PendingGraph> raw;
          n.attributes.push_back(read_attribute(ab, ae, &raw, depth + 1));
          for (auto& pg : raw) pn.graphs.emplace_back(n.attributes.size() - 1, pg);
          break;
        }
        default: keep(n.extras, r, t, f, schema::Msg::kNode);
      }
    }
    if (!n.has_op_type || n.op_type.empty()) r.fail("node '" + n.name.value + "' has no op_type");
    for (size_t i = 0; i < n.attributes.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (n.attributes[i].name == n.attributes[j].name) {
          r.fail("node '" + n.name.value + "' has attribute '" + n.attributes[i].name + "' twice");
        }
      }
    }
    Node* node = g.append_node(&n);
    pn.node = node;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].empty()) {
        node->outputs_.push_back(nullptr);
        continue;
      }
      Value* v = g.create_value(outputs[i]);
      v->producer_ = node;
      v->producer_output_ = static_cast<int>(i);
      node->outputs_.push_back(v);
    }
    return pn;
  }

  ValueInfoEntry read_value_info(uint64_t b, uint64_t e, std::string* name, TypeInfo* type,
                                 int depth) {
    ValueInfoEntry entry;
    wire::Reader r(base, b, e, "ValueInfoProto", depth);
    uint32_t f;
    wire::WireType t;
    while (r.next(&f, &t)) {
      if (f == field::value_info::kName) {
        *name = str(r, t, "name");
      } else if (f == field::value_info::kType) {
        auto [tb, te] = sub(r, t, "type");
        *type = read_type(tb, te, depth + 1);
      } else {
        keep(entry.extras, r, t, f, schema::Msg::kValueInfo);
      }
    }
    return entry;
  }

  // Attaches `type` to the entry: the value takes it if it has none yet; otherwise the entry
  // keeps its own copy when it differs.
  static void attach_type(ValueInfoEntry& entry, Value* v, TypeInfo type, bool first) {
    if (first) {
      v->type = std::move(type);
    } else if (!same_type(v->type, type)) {
      entry.own_type = std::move(type);
    }
  }

  void resolve_inputs(Graph& g, PendingNode& pn) {
    Node* node = pn.node;
    for (size_t i = 0; i < pn.inputs.size(); ++i) {
      std::string_view name = pn.inputs[i];
      if (name.empty()) {
        node->append_input(nullptr);
        continue;
      }
      Value* v = g.lookup(name);
      if (!v) {
        throw ModelError("node '" + node->name.value + "' (" + node->op_type + ") input '" +
                         std::string(name) + "' is not defined (dangling input) in graph '" +
                         g.name.value + "'");
      }
      node->append_input(v);
      for (Graph* s = &g; s && s != v->graph(); s = s->parent()) s->add_outer_reference(v);
    }
  }

  void read_subgraphs(Graph& g, std::vector<PendingNode>& pending) {
    for (auto& pn : pending) {
      for (auto& [attr_index, pg] : pn.graphs) {
        Attribute& a = pn.node->attributes[attr_index];
        auto sub = std::make_unique<Graph>(model, &g);
        sub->set_owner_node(pn.node);
        read_graph_body(*sub, {{pg.begin, pg.end}}, pg.depth);
        if (pg.index < 0)
          a.g = std::move(sub);
        else
          a.graphs[pg.index] = std::move(sub);
      }
    }
  }

  // `spans` are the occurrences of one GraphProto field: protobuf merges them in order.
  void read_graph_body(Graph& g, const std::vector<std::pair<uint64_t, uint64_t>>& spans,
                       int depth) {
    if (depth > wire::kMaxNesting) wire::nesting_error();
    std::vector<std::pair<uint64_t, uint64_t>> nodes, inputs, outputs, inits, sparse, infos;
    for (auto [b, e] : spans) {
      wire::Reader r(base, b, e, "GraphProto", depth);
      uint32_t f;
      wire::WireType t;
      while (r.next(&f, &t)) {
        switch (f) {
          case field::graph::kNode: nodes.push_back(sub(r, t, "node")); break;
          case field::graph::kName: g.name.set(str(r, t, "name")); break;
          case field::graph::kInitializer: inits.push_back(sub(r, t, "initializer")); break;
          case field::graph::kSparseInitializer:
            sparse.push_back(sub(r, t, "sparse_initializer"));
            break;
          case field::graph::kInput: inputs.push_back(sub(r, t, "input")); break;
          case field::graph::kOutput: outputs.push_back(sub(r, t, "output")); break;
          case field::graph::kValueInfo: infos.push_back(sub(r, t, "value_info")); break;
          default: keep(g.extras, r, t, f, schema::Msg::kGraph);
        }
      }
    }
    const std::string gname = "graph '" + g.name.value + "'";
    g.reserve_scope(inputs.size() + inits.size() + sparse.size() + 2 * nodes.size());
    for (auto [ib, ie] : inputs) {
      std::string name;
      TypeInfo type;
      ValueInfoEntry entry = read_value_info(ib, ie, &name, &type, depth + 1);
      if (name.empty()) throw ModelError(gname + " has an input with an empty name");
      Value* v = g.create_value(name);
      v->is_graph_input_ = true;
      entry.value = v;
      attach_type(entry, v, std::move(type), true);
      g.input_entries.push_back(std::move(entry));
    }
    // The value an initializer defines: a graph input of that name, or a new value.
    auto initializer_value = [&](const std::string& name) {
      if (name.empty()) throw ModelError(gname + " has an initializer with an empty name");
      auto it = g.scope().find(name);
      Value* v = it != g.scope().end() ? it->second : g.create_value(name);
      if (v->initializer_ || v->sparse_) {
        throw ModelError(gname + " has two initializers named '" + name + "'");
      }
      return v;
    };
    for (auto [tb, te] : inits) {
      auto tensor = read_tensor(tb, te, depth + 1);
      Value* v = initializer_value(tensor->name.value);
      v->initializer_ = std::move(tensor);
      g.initializer_order.push_back(v);
    }
    for (auto [sb, se] : sparse) {
      auto sp = read_sparse(sb, se, depth + 1);
      Value* v = initializer_value(sp->values->name.value);
      v->sparse_ = std::move(sp);
      g.sparse_initializer_order.push_back(v);
    }
    std::vector<PendingNode> pending;
    pending.reserve(nodes.size());
    for (auto [nb, ne] : nodes) pending.push_back(read_node(g, nb, ne, depth + 1));
    for (auto& pn : pending) resolve_inputs(g, pn);
    for (auto [ib, ie] : infos) {
      std::string name;
      TypeInfo type;
      ValueInfoEntry entry = read_value_info(ib, ie, &name, &type, depth + 1);
      auto it = g.scope().find(name);
      if (it == g.scope().end()) {
        entry.orphan_name = name;  // describes nothing in this graph; kept as written
        entry.own_type = std::move(type);
      } else {
        Value* v = it->second;
        entry.value = v;
        attach_type(entry, v, std::move(type), !v->type.known);
      }
      g.value_info_entries.push_back(std::move(entry));
    }
    for (auto [ob, oe] : outputs) {
      std::string name;
      TypeInfo type;
      ValueInfoEntry entry = read_value_info(ob, oe, &name, &type, depth + 1);
      Value* v = g.lookup(name);
      if (!v) {
        throw ModelError(gname + " output '" + name + "' is not defined (dangling output)");
      }
      if (v->graph() != &g) {
        for (Graph* s = &g; s && s != v->graph(); s = s->parent()) s->add_outer_reference(v);
      }
      entry.value = v;
      attach_type(entry, v, std::move(type), !v->type.known);
      ++v->graph_output_count_;
      g.output_entries.push_back(std::move(entry));
    }
    read_subgraphs(g, pending);
    if (Node* bad = g.find_cycle()) {
      throw ModelError(gname + " has a cycle through node '" + bad->name.value + "' (" +
                       bad->op_type + ")");
    }
  }

  std::unique_ptr<Function> read_function(uint64_t b, uint64_t e) {
    const int depth = 1;  // FunctionProto is a field of ModelProto
    auto fn = std::make_unique<Function>();
    fn->body = std::make_unique<Graph>(model, nullptr);
    Graph& g = *fn->body;
    wire::Reader r(base, b, e, "FunctionProto", depth);
    uint32_t f;
    wire::WireType t;
    std::vector<std::string> inputs, outputs;
    std::vector<std::pair<uint64_t, uint64_t>> nodes, infos;
    while (r.next(&f, &t)) {
      switch (f) {
        case field::function::kName: fn->name.set(str(r, t, "name")); break;
        case field::function::kDomain: fn->domain.set(str(r, t, "domain")); break;
        case field::function::kOverload: fn->overload.set(str(r, t, "overload")); break;
        case field::function::kInput: inputs.push_back(str(r, t, "input")); break;
        case field::function::kOutput: outputs.push_back(str(r, t, "output")); break;
        case field::function::kAttribute:
          fn->attribute_names.push_back(str(r, t, "attribute"));
          break;
        case field::function::kAttributeProto: {
          auto [ab, ae] = sub(r, t, "attribute_proto");
          std::vector<PendingGraph> raw;
          fn->attribute_defaults.push_back(read_attribute(ab, ae, &raw, depth + 1));
          if (!raw.empty()) {
            throw ModelError("function '" + fn->name.value +
                             "' has a graph-valued attribute default (unsupported)");
          }
          break;
        }
        case field::function::kNode: nodes.push_back(sub(r, t, "node")); break;
        case field::function::kOpsetImport: {
          auto [ob, oe] = sub(r, t, "opset_import");
          fn->opset_import.push_back(read_opset(ob, oe, depth + 1));
          break;
        }
        case field::function::kValueInfo: infos.push_back(sub(r, t, "value_info")); break;
        default: keep(fn->extras, r, t, f, schema::Msg::kFunction);
      }
    }
    g.name.value = fn->name.value;  // for error messages only; not written
    for (const auto& name : inputs) {
      Value* v = g.create_value(name);
      v->is_graph_input_ = true;
      ValueInfoEntry entry;
      entry.value = v;
      g.input_entries.push_back(std::move(entry));
    }
    std::vector<PendingNode> pending;
    for (auto [nb, ne] : nodes) pending.push_back(read_node(g, nb, ne, depth + 1));
    for (auto& pn : pending) resolve_inputs(g, pn);
    for (const auto& name : outputs) {
      Value* v = g.lookup(name);
      if (!v) {
        throw ModelError("function '" + fn->name.value + "' output '" + name + "' is not defined");
      }
      ValueInfoEntry entry;
      entry.value = v;
      ++v->graph_output_count_;
      g.output_entries.push_back(std::move(entry));
    }
    for (auto [ib, ie] : infos) {
      std::string name;
      TypeInfo type;
      ValueInfoEntry entry = read_value_info(ib, ie, &name, &type, depth + 1);
      auto it = g.scope().find(name);
      if (it == g.scope().end()) {
        entry.orphan_name = name;
        entry.own_type = std::move(type);
      } else {
        entry.value = it->second;
        attach_type(entry, it->second, std::move(type), !it->second->type.known);
      }
      g.value_info_entries.push_back(std::move(entry));
    }
    read_subgraphs(g, pending);
    if (Node* bad = g.find_cycle()) {
      throw ModelError("function '" + fn->name.value + "' has a cycle through node '" +
                       bad->name.value + "' (" + bad->op_type + ")");
    }
    return fn;
  }

  std::unique_ptr<Model> read() {
    auto m = std::make_unique<Model>();
    model = m.get();
    m->source = source;
    m->base_dir = base_dir;
    base = source->data();
    wire::Reader r(base, 0, source->size(), "ModelProto");
    uint32_t f;
    wire::WireType t;
    std::vector<std::pair<uint64_t, uint64_t>> graph;
    std::vector<std::pair<uint64_t, uint64_t>> functions;
    while (r.next(&f, &t)) {
      switch (f) {
        case field::model::kIrVersion: m->ir_version = int64(r, t, "ir_version"); break;
        case field::model::kProducerName: m->producer_name.set(str(r, t, "producer_name")); break;
        case field::model::kProducerVersion:
          m->producer_version.set(str(r, t, "producer_version"));
          break;
        case field::model::kDomain: m->domain.set(str(r, t, "domain")); break;
        case field::model::kModelVersion: m->model_version = int64(r, t, "model_version"); break;
        case field::model::kDocString: m->doc_string.set(str(r, t, "doc_string")); break;
        case field::model::kGraph: graph.push_back(sub(r, t, "graph")); break;
        case field::model::kOpsetImport: {
          auto [ob, oe] = sub(r, t, "opset_import");
          m->opset_import.push_back(read_opset(ob, oe, 1));
          break;
        }
        case field::model::kMetadataProps: {
          uint64_t start = r.tag_start();
          auto [mb, me] = sub(r, t, "metadata_props");
          std::string k, v;
          if (read_entry(mb, me, &k, &v, 1)) {
            m->metadata_props.emplace_back(k, v);
          } else {  // kept verbatim
            schema::check_message(base, mb, me, schema::Msg::kEntry, 1, "StringStringEntryProto");
            m->metadata_extras.push_back(span(start, r.pos()));
          }
          break;
        }
        case field::model::kFunctions: functions.push_back(sub(r, t, "functions")); break;
        default: keep(m->extras, r, t, f, schema::Msg::kModel);
      }
    }
    if (graph.empty())
      throw ModelError("not an ONNX model: no graph (is the file empty or not ONNX?)");
    if (!m->ir_version) throw ModelError("not an ONNX model: no ir_version");
    if (*m->ir_version < 1) {
      throw ModelError("invalid ir_version " + std::to_string(*m->ir_version));
    }
    for (auto [fb, fe] : functions) m->functions.push_back(read_function(fb, fe));
    m->graph = std::make_unique<Graph>(model, nullptr);
    read_graph_body(*m->graph, graph, 1);
    return m;
  }
};

std::unique_ptr<Model> read_model_from_buffer(std::shared_ptr<const Buffer> buffer,
                                              const std::string& base_dir) {
  ModelReader reader;
  reader.source = std::move(buffer);
  reader.base_dir = base_dir;
  if (!base_dir.empty()) {
    reader.base_dir_real = real_path(base_dir);
    if (reader.base_dir_real.empty()) {
      throw ModelError("model folder '" + base_dir + "' does not exist");
    }
  }
  return reader.read();
}

std::unique_ptr<Model> read_skeleton(std::shared_ptr<const Buffer> buffer, const Model& original) {
  ModelReader reader;
  reader.source = std::move(buffer);
  reader.skeleton_of = &original;
  auto m = reader.read();
  m->path = original.path;
  m->base_dir = original.base_dir;
  m->external_files = original.external_files;
  return m;
}

std::unique_ptr<Model> read_model_file(const std::string& path) {
  auto file = FileBuffer::open(path, /*map_now=*/true);
  // External data is relative to the folder of the path as given (a symlinked model reads the
  // data beside the link), as onnx.load and ONNX Runtime resolve it.
  std::string absolute = path;
  if (path.empty() || path[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) absolute = std::string(cwd) + "/" + path;
  }
  try {
    auto m = read_model_from_buffer(file, dirname_of(absolute));
    m->path = path;
    return m;
  } catch (const ModelError& e) {
    throw ModelError(std::string(e.what()) + " (in '" + path + "')");
  }
}

}  // namespace fastopt
