// The model reader's parts (internal to csrc/proto): ModelReader walks a ModelProto's wire
// bytes into the IR. onnx_reader.cc holds the entry points and the ModelProto level,
// onnx_reader_tensor.cc tensors, external data and sparse tensors, onnx_reader_graph.cc types,
// attributes, nodes, graphs and functions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ir/graph.h"
#include "ir/wire.h"
#include "proto/onnx_schema.h"

namespace fastopt {

namespace reader {

std::string real_path(const std::string& p);
std::string dirname_of(const std::string& p);
// True when `child` (a resolved path) lies inside the folder `dir`.
bool path_inside(const std::string& child, const std::string& dir);
std::string shape_text(const std::vector<int64_t>& dims);
// Protobuf `string` fields hold UTF-8; names with invalid bytes cannot be text in Python or
// in error messages, so they are refused at load.
bool valid_utf8(const std::string& s);

}  // namespace reader

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
    if (!reader::valid_utf8(s)) r.fail(std::string("field '") + what + "' is not valid UTF-8");
    return s;
  }
  // A `string` field viewed in place (names only need looking up).
  std::string_view str_view(wire::Reader& r, wire::WireType type, const char* what) {
    r.expect(type, wire::kLen, what);
    auto [b, e] = r.len_payload();
    std::string_view s(reinterpret_cast<const char*>(base + b), e - b);
    bool ascii = true;
    for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
    if (!ascii && !reader::valid_utf8(std::string(s))) {
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

  struct PendingNode {
    Node* node;
    std::vector<std::string_view> inputs;                 // views into the source buffer
    std::vector<std::pair<size_t, PendingGraph>> graphs;  // attribute index, graph
  };

  // ---- small messages (onnx_reader.cc) ----

  OpsetId read_opset(uint64_t b, uint64_t e, int depth);
  // Returns false if the entry has fields beyond key and value.
  bool read_entry(uint64_t b, uint64_t e, std::string* key, std::string* value, int depth);

  // ---- tensors (onnx_reader_tensor.cc) ----

  std::shared_ptr<Tensor> read_tensor(uint64_t b, uint64_t e, int depth);
  void finish_tensor(Tensor& ts, std::vector<std::pair<std::string, std::string>> ext_entries,
                     uint64_t typed_values, uint64_t string_values);
  // A skeleton placeholder takes the payload (storage fields) of the original model's tensor:
  // views, never copies. Its name, shape and type are the skeleton's and must still fit.
  void bind_placeholder(Tensor& ts,
                        const std::vector<std::pair<std::string, std::string>>& entries);
  ExternalLocation resolve_external(const Tensor& ts,
                                    std::vector<std::pair<std::string, std::string>> entries,
                                    uint64_t expected, bool sized);
  std::shared_ptr<SparseTensor> read_sparse(uint64_t b, uint64_t e, int depth);
  // Values [NNZ], indices [NNZ] (linear) or [NNZ, rank], every index inside the dense shape:
  // anything that densifies the tensor can then trust them.
  static void validate_sparse(const SparseTensor& sp);

  // ---- types, attributes, nodes, graphs, functions (onnx_reader_graph.cc) ----

  TypeInfo read_type(uint64_t b, uint64_t e, int depth);
  Attribute read_attribute(uint64_t b, uint64_t e, std::vector<PendingGraph>* pending_raw,
                           int depth);
  PendingNode read_node(Graph& g, uint64_t b, uint64_t e, int depth);
  ValueInfoEntry read_value_info(uint64_t b, uint64_t e, std::string* name, TypeInfo* type,
                                 int depth);
  // Attaches `type` to the entry: the value takes it if it has none yet; otherwise the entry
  // keeps its own copy when it differs.
  static void attach_type(ValueInfoEntry& entry, Value* v, TypeInfo type, bool first);
  void resolve_inputs(Graph& g, PendingNode& pn);
  void read_subgraphs(Graph& g, std::vector<PendingNode>& pending);
  // `spans` are the occurrences of one GraphProto field: protobuf merges them in order.
  void read_graph_body(Graph& g, const std::vector<std::pair<uint64_t, uint64_t>>& spans,
                       int depth);
  std::unique_ptr<Function> read_function(uint64_t b, uint64_t e);

  // The ModelProto (onnx_reader.cc).

  std::unique_ptr<Model> read();
};

}  // namespace fastopt
