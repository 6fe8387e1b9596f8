// Tensors: TensorProto fields, their checks (sizes, payload kinds), external data and
// skeleton placeholders; sparse tensors.

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ir/constant.h"
#include "ir/error.h"
#include "proto/onnx_fields.h"
#include "proto/onnx_reader_impl.h"
#include "proto/onnx_writer.h"

namespace fastopt {

namespace {

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

}  // namespace

std::shared_ptr<Tensor> ModelReader::read_tensor(uint64_t b, uint64_t e, int depth) {
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
        wire::read_repeated_varint(r, t, base,
                                   [&](uint64_t v) { ts.dims.push_back(static_cast<int64_t>(v)); });
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
          int fixed = f == field::tensor::kFloatData ? 4 : f == field::tensor::kDoubleData ? 8 : 0;
          if (t == wire::kLen || (fixed == 4 && t == wire::kFixed32) ||
              (fixed == 8 && t == wire::kFixed64) || (fixed == 0 && t == wire::kVarint)) {
            typed_values += count_values(r, t, base, fixed);
          } else {
            r.fail("typed data field " + std::to_string(f) + " has wire type " + std::to_string(t));
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

void ModelReader::finish_tensor(Tensor& ts,
                                std::vector<std::pair<std::string, std::string>> ext_entries,
                                uint64_t typed_values, uint64_t string_values) {
  const std::string who = "tensor '" + ts.name.value + "'";
  for (int64_t d : ts.dims) {
    if (d < 0)
      throw ModelError(who + " has a negative dimension in shape " + reader::shape_text(ts.dims));
  }
  uint64_t numel;
  try {
    numel = ts.numel();
  } catch (const ModelError&) {
    throw ModelError(who + " has absurd dimensions " + reader::shape_text(ts.dims) +
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
    throw ModelError(who + " has absurd dimensions " + reader::shape_text(ts.dims) + " of " +
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
                       " bytes does not match its shape " + reader::shape_text(ts.dims) + " of " +
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
                         reader::shape_text(ts.dims));
      }
    }
    return;
  }
  if (numel > 0 && (bits > 0 || dt == kString)) {
    throw ModelError(who + " has shape " + reader::shape_text(ts.dims) + " but no data");
  }
}

void ModelReader::bind_placeholder(
    Tensor& ts, const std::vector<std::pair<std::string, std::string>>& entries) {
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
    throw ModelError(who + " is " + dtype_name(ts.dtype()) + reader::shape_text(ts.dims) +
                     " but the original tensor '" + original.name.value + "' is " +
                     dtype_name(original.dtype()) + reader::shape_text(original.dims));
  }
  ts.storage = original.storage;
  ts.raw = original.raw;
  ts.has_raw_field = original.has_raw_field;
  ts.external = original.external;
  ts.data_location = original.data_location;
  ts.typed = original.typed;
}

ExternalLocation ModelReader::resolve_external(
    const Tensor& ts, std::vector<std::pair<std::string, std::string>> entries, uint64_t expected,
    bool sized) {
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
  std::string resolved = reader::real_path(joined);
  if (resolved.empty()) {
    throw ModelError(who + " external data file '" + location + "' not found in '" + base_dir +
                     "': " + std::strerror(errno));
  }
  if (!reader::path_inside(resolved, base_dir_real)) {
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
    throw ModelError(who + " external data range [offset " + std::to_string(offset) + ", length " +
                     std::to_string(length) + "] runs past the end of '" + location + "' (" +
                     std::to_string(file->size()) + " bytes)");
  }
  if (sized && length != expected) {
    throw ModelError(who + " external data length " + std::to_string(length) +
                     " bytes does not match its shape " + reader::shape_text(ts.dims) + " of " +
                     dtype_name(ts.dtype()) + " (expected " + std::to_string(expected) + " bytes)");
  }
  return ExternalLocation{std::move(file), offset, length, std::move(entries)};
}

std::shared_ptr<SparseTensor> ModelReader::read_sparse(uint64_t b, uint64_t e, int depth) {
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
      wire::read_repeated_varint(r, t, base,
                                 [&](uint64_t v) { sp->dims.push_back(static_cast<int64_t>(v)); });
    } else {
      keep(sp->extras, r, t, f, schema::Msg::kSparseTensor);
    }
  }
  validate_sparse(*sp);
  return sp;
}

void ModelReader::validate_sparse(const SparseTensor& sp) {
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

}  // namespace fastopt
