#include "proto/onnx_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "ir/error.h"
#include "ir/wire.h"
#include "proto/onnx_fields.h"
#include "proto/output_files.h"

namespace fastopt {

namespace {

constexpr uint64_t kProtobufLimit = (1ull << 31) - 1;  // protobuf refuses messages of 2 GB+

void write_pieces(OutputFile& out, const wire::Writer& w) {
  for (const auto& piece : w.pieces()) {
    if (piece.ref.buffer)
      out.copy(piece.ref);
    else
      out.write(piece.bytes.data(), piece.bytes.size());
  }
}

// A tensor's fields before its payload, in the order tensor() writes them.
void tensor_head(wire::Writer& w, const Tensor& t) {
  namespace ft = field::tensor;
  w.packed_ints(ft::kDims, t.dims);
  if (t.data_type) w.int_field(ft::kDataType, *t.data_type);
  if (t.name.written()) w.string_field(ft::kName, t.name.value);
}

uint64_t varint_bytes(uint64_t v) {
  uint64_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

// initializer_framing_bytes of `t`, a raw tensor of `nbytes` bytes.
uint64_t framing_of(const Tensor& t, uint64_t nbytes) {
  wire::Writer head;
  tensor_head(head, t);
  head.tag(field::tensor::kRawData, wire::kLen);
  head.varint(nbytes);
  return 1 + varint_bytes(head.size() + nbytes) + head.size();  // initializer tag: 1 byte
}

// The file of bytes written before the save (quantized weights: AdoptableFile) to take as the
// first data file, or null: the one holding the most bytes of tensors bound for the data files,
// when this save can take it and nearly all of it is such bytes (bytes no tensor reads would stay
// in the output, dead). The tensors in it are then not copied: they stay where they are.
const AdoptableFile* file_to_adopt(const Model& model, const std::string& folder,
                                   const SaveOptions& opt) {
  std::map<const AdoptableFile*, std::set<std::pair<uint64_t, uint64_t>>> ranges;
  model.for_each_graph([&](Graph& g) {
    for (Value* v : g.initializer_order) {
      const Tensor& t = *v->initializer();
      if (t.storage != Tensor::Storage::kRaw) continue;
      const auto* f = dynamic_cast<const AdoptableFile*>(t.raw.buffer.get());
      // Only bytes at offsets the save's alignment accepts can stay where they are.
      if (f && (opt.align <= 1 || t.raw.offset % opt.align == 0)) {
        ranges[f].insert({t.raw.offset, t.raw.size});
      }
    }
  });
  const AdoptableFile* best = nullptr;
  uint64_t best_live = 0;
  for (const auto& [file, used] : ranges) {
    uint64_t live = 0;
    for (const auto& r : used) live += r.second;  // distinct tensors never overlap
    if (live > best_live) best = file, best_live = live;
  }
  if (!best || !best->adoptable_in(folder)) return nullptr;
  // The room left for framing (AdoptableFile::Slot) is not counted as dead: it is a few bytes
  // a tensor, there by design.
  uint64_t rooms = 0;
  for (const AdoptableFile::Slot& s : best->slots()) rooms += s.data - s.frame;
  if (rooms > 0) rooms += AdoptableFile::kModelHeadRoom;
  const uint64_t size = best->size() - std::min(best->size(), rooms);
  if (size - std::min(size, best_live) > size / 100) return nullptr;  // over 1 % dead
  if (opt.max_file_bytes > 0 && size > opt.max_file_bytes) return nullptr;
  return best;
}

// External data files being written: tensors are appended as the model is serialized; those
// already in the adopted file (file_to_adopt) are placed where they are.
class DataFiles {
 public:
  DataFiles(std::string folder, std::string location, const SaveOptions& opt,
            const InputFiles& inputs, std::string model_name, const AdoptableFile* adopt)
      : folder_(std::move(folder)),
        location_(std::move(location)),
        opt_(opt),
        inputs_(inputs),
        model_name_(std::move(model_name)),
        adopt_(adopt) {}

  struct Placement {
    std::string location;
    uint64_t offset;
  };

  // Whether `bytes` are in the adopted file where this save may leave them (any size: they
  // are in the data file already, so inlining a small one would only copy it).
  bool in_place(const ByteRef& bytes) const {
    return adopt_ && bytes.buffer.get() == adopt_ &&
           (opt_.align <= 1 || bytes.offset % opt_.align == 0);
  }

  Placement add(const ByteRef& bytes) {
    if (files_.empty()) open_file();
    if (in_place(bytes)) return {files_.front().name, bytes.offset};
    if (opt_.max_file_bytes > 0 && files_.back().file->size() > 0 &&
        padded(files_.back().file->size()) + bytes.size > opt_.max_file_bytes) {
      open_file();
    }
    OutputFile& f = *files_.back().file;
    f.zeros(padded(f.size()) - f.size());
    uint64_t offset = f.size();
    f.copy(bytes);
    return {files_.back().name, offset};
  }

  std::vector<OutputFile*> files() const {
    std::vector<OutputFile*> out;
    for (const auto& f : files_) out.push_back(f.file.get());
    return out;
  }

 private:
  void open_file() {
    std::string name = files_.empty() ? location_ : location_ + "." + std::to_string(files_.size());
    if (name == model_name_) {
      throw ModelError("external data file '" + name + "' would be the model file itself");
    }
    const std::string path = folder_ + "/" + name;
    inputs_.check_output(path, "external data file");
    files_.push_back({name, files_.empty() && adopt_ ? std::make_unique<OutputFile>(path, *adopt_)
                                                     : std::make_unique<OutputFile>(path)});
    files_.back().file->set_durable(opt_.durable);
  }
  uint64_t padded(uint64_t n) const {
    return opt_.align > 1 ? (n + opt_.align - 1) / opt_.align * opt_.align : n;
  }
  struct Entry {
    std::string name;
    std::unique_ptr<OutputFile> file;
  };
  std::string folder_, location_;
  const SaveOptions& opt_;
  const InputFiles& inputs_;
  std::string model_name_;
  const AdoptableFile* adopt_;
  std::vector<Entry> files_;
};

// A self-contained save into an adopted file (write_in_place): the main graph's initializers
// whose bytes fill the file's slots, in file order.
struct InPlace {
  const AdoptableFile* file = nullptr;
  std::vector<Value*> order;
  std::set<const Tensor*> tensors;
  bool stray = false;  // set by the writer: another tensor reads bytes of the file
};

class ModelWriter {
 public:
  ModelWriter(const Model& m, DataFiles* data, uint64_t threshold)
      : model_(m), data_(data), threshold_(threshold) {}
  // Skeleton mode: payloads of `threshold` bytes or more become placeholders recorded in the
  // table of `table_owner` (the model being written).
  ModelWriter(Model& table_owner, uint64_t threshold)
      : model_(table_owner), skeleton_(&table_owner), threshold_(threshold) {}
  // Zeros mode: payloads of `threshold` bytes or more point into the file `zeros_location`,
  // each at its own page-aligned offset (zeros_bytes(): the file's length).
  ModelWriter(const Model& m, uint64_t threshold, std::string zeros_location)
      : model_(m), threshold_(threshold), zeros_location_(std::move(zeros_location)) {}

  uint64_t zeros_bytes() const { return zeros_end_; }

  wire::Writer model() {
    wire::Writer w;
    fields(w, /*graph=*/true);
    return w;
  }

  // The model with the graph field first and its length in 5 bytes, so that what follows it
  // starts at AdoptableFile::kModelHeadRoom, where the adopted file's first slot is.
  wire::Writer model_graph_first(InPlace& in_place) {
    in_place_ = &in_place;
    wire::Writer g = graph(*model_.graph);
    wire::Writer w;
    w.tag(field::model::kGraph, wire::kLen);
    w.varint_padded(g.size(), static_cast<int>(AdoptableFile::kModelHeadRoom) - 1);
    w.append(std::move(g));
    fields(w, /*graph=*/false);
    in_place_ = nullptr;
    return w;
  }

 private:
  void fields(wire::Writer& w, bool with_graph) {
    namespace f = field::model;
    const Model& m = model_;
    if (m.ir_version) w.int_field(f::kIrVersion, *m.ir_version);
    if (m.producer_name.written()) w.string_field(f::kProducerName, m.producer_name.value);
    if (m.producer_version.written()) {
      w.string_field(f::kProducerVersion, m.producer_version.value);
    }
    if (m.domain.written()) w.string_field(f::kDomain, m.domain.value);
    if (m.model_version) w.int_field(f::kModelVersion, *m.model_version);
    if (m.doc_string.written()) w.string_field(f::kDocString, m.doc_string.value);
    if (m.graph && with_graph) w.message(f::kGraph, graph(*m.graph));
    for (const auto& o : m.opset_import) w.message(f::kOpsetImport, opset(o));
    for (const auto& kv : m.metadata_props)
      w.message(f::kMetadataProps, entry(kv.first, kv.second));
    w.raw_fields(m.metadata_extras);
    for (const auto& fn : m.functions) w.message(f::kFunctions, function(*fn));
    w.raw_fields(m.extras);
  }

  static wire::Writer entry(const std::string& k, const std::string& v) {
    wire::Writer w;
    w.string_field(field::entry::kKey, k);
    w.string_field(field::entry::kValue, v);
    return w;
  }

  static wire::Writer opset(const OpsetId& o) {
    wire::Writer w;
    if (o.domain.written()) w.string_field(field::opset::kDomain, o.domain.value);
    if (o.version) w.int_field(field::opset::kVersion, *o.version);
    w.raw_fields(o.extras);
    return w;
  }

  static wire::Writer type(const TypeInfo& t) {
    wire::Writer w;
    if (!t.encoded.empty() || !t.is_tensor) {
      w.append_ref(t.encoded);
      return w;
    }
    namespace ft = field::type;
    wire::Writer tensor;
    if (t.elem_type) tensor.int_field(ft::tensor::kElemType, t.elem_type);
    if (t.has_shape) {
      wire::Writer shape;
      for (const Dim& d : t.dims) {
        wire::Writer dim;
        if (d.value)
          dim.int_field(ft::dim::kValue, *d.value);
        else if (d.param)
          dim.string_field(ft::dim::kParam, *d.param);
        shape.message(ft::shape::kDim, std::move(dim));
      }
      tensor.message(ft::tensor::kShape, std::move(shape));
    }
    w.message(ft::kTensorType, std::move(tensor));
    return w;
  }

  static wire::Writer value_info(const ValueInfoEntry& e) {
    wire::Writer w;
    const std::string& name = e.value ? e.value->name() : e.orphan_name;
    w.string_field(field::value_info::kName, name);
    const TypeInfo& t = e.own_type ? *e.own_type : e.value->type;
    if (t.known) w.message(field::value_info::kType, type(t));
    w.raw_fields(e.extras);
    return w;
  }

  // Skeleton and zeros modes: a payload of `threshold_` bytes or more becomes external data (a
  // skeleton table slot, or its range of the zeros file). False: the payload is written as usual.
  bool placeholder(wire::Writer& w, const std::shared_ptr<Tensor>& tp) {
    namespace ft = field::tensor;
    const Tensor& t = *tp;
    if ((!skeleton_ && zeros_location_.empty()) || t.dtype() == kString ||
        t.nbytes() < threshold_ || t.storage == Tensor::Storage::kNone) {
      return false;
    }
    const bool zeros = !zeros_location_.empty();
    w.message(ft::kExternalData, entry("location", zeros ? zeros_location_ : kSkeletonLocation));
    const uint64_t offset = zeros ? zeros_offset(t) : skeleton_slot(tp);
    w.message(ft::kExternalData, entry("offset", std::to_string(offset)));
    w.message(ft::kExternalData, entry("length", std::to_string(t.nbytes())));
    w.int_field(ft::kDataLocation, ft::kLocationExternal);
    w.raw_fields(t.extras);
    return true;
  }

  // Where `t` reads its zeros (a tensor shared by two places reads the same bytes).
  uint64_t zeros_offset(const Tensor& t) {
    constexpr uint64_t kPage = 4096;  // ORT maps external data at page-aligned offsets
    auto [it, added] = zeros_at_.emplace(&t, zeros_end_);
    if (added) zeros_end_ += (t.nbytes() + kPage - 1) / kPage * kPage;
    return it->second;
  }

  // Index of `t` in the skeleton table (added on first use).
  uint64_t skeleton_slot(const std::shared_ptr<Tensor>& t) {
    auto [it, added] =
        skeleton_->skeleton_index.emplace(t.get(), skeleton_->skeleton_tensors.size());
    if (added) skeleton_->skeleton_tensors.push_back(t);
    return it->second;
  }

  wire::Writer tensor(const std::shared_ptr<Tensor>& tp) {
    namespace ft = field::tensor;
    const Tensor& t = *tp;
    wire::Writer w;
    tensor_head(w, t);
    if (in_place_ && t.storage == Tensor::Storage::kRaw && t.raw.buffer.get() == in_place_->file) {
      if (!in_place_->tensors.count(&t)) {
        in_place_->stray = true;  // bytes of the file not in a slot: write_in_place gives up
      } else {
        w.tag(ft::kRawData, wire::kLen);
        w.varint(t.raw.size);
        w.in_place_ref(t.raw);
        return w;  // (plan_in_place checked: no data_location, no extras)
      }
    }
    if (placeholder(w, tp)) return w;
    std::optional<int32_t> location = t.data_location;
    const bool has_bytes =
        t.storage == Tensor::Storage::kRaw || t.storage == Tensor::Storage::kExternal;
    // Typed fields (float_data, ...) holding a big fixed-size tensor go to the data file too,
    // decoded to raw little-endian bytes; otherwise a model over 2 GB could not be written.
    const bool typed_to_external = data_ && t.storage == Tensor::Storage::kTyped &&
                                   dtype_bits(t.dtype()) > 0 && t.expected_bytes() >= threshold_;
    if (has_bytes || typed_to_external) {
      ByteRef bytes = t.storage == Tensor::Storage::kRaw ? t.raw
                      : t.storage == Tensor::Storage::kExternal
                          ? ByteRef{t.external->file, t.external->offset, t.external->length}
                          : t.bytes();
      if (data_ && (bytes.size >= threshold_ || data_->in_place(bytes))) {
        auto placed = data_->add(bytes);
        w.message(ft::kExternalData, entry("location", placed.location));
        w.message(ft::kExternalData, entry("offset", std::to_string(placed.offset)));
        w.message(ft::kExternalData, entry("length", std::to_string(bytes.size)));
        location = ft::kLocationExternal;
      } else {
        w.bytes_field(ft::kRawData, bytes);
        // Inlined external data reads back as DEFAULT, exactly as onnx.load leaves it.
        if (t.storage == Tensor::Storage::kExternal) location = ft::kLocationDefault;
      }
    } else {
      w.raw_fields(t.typed);
      if (t.external) {  // inert entries of a non-external tensor
        for (const auto& kv : t.external->entries) {
          w.message(ft::kExternalData, entry(kv.first, kv.second));
        }
      }
    }
    if (location) w.int_field(ft::kDataLocation, *location);
    w.raw_fields(t.extras);
    return w;
  }

  wire::Writer sparse(const SparseTensor& s) {
    wire::Writer w;
    if (s.values) w.message(field::sparse::kValues, tensor(s.values));
    if (s.indices) w.message(field::sparse::kIndices, tensor(s.indices));
    w.packed_ints(field::sparse::kDims, s.dims);
    w.raw_fields(s.extras);
    return w;
  }

  wire::Writer attribute(const Attribute& a) {
    namespace fa = field::attr;
    wire::Writer w;
    w.string_field(fa::kName, a.name);
    if (a.f) w.float_field(fa::kF, *a.f);
    if (a.i) w.int_field(fa::kI, *a.i);
    if (a.s) w.string_field(fa::kS, *a.s);
    if (a.t) w.message(fa::kT, tensor(a.t));
    if (a.g) w.message(fa::kG, graph(*a.g));
    w.packed_floats(fa::kFloats, a.floats);
    w.packed_ints(fa::kInts, a.ints);
    for (const auto& s : a.strings) w.string_field(fa::kStrings, s);
    for (const auto& t : a.tensors) w.message(fa::kTensors, tensor(t));
    for (const auto& g : a.graphs) w.message(fa::kGraphs, graph(*g));
    if (a.type) w.int_field(fa::kType, *a.type);
    if (a.ref_attr_name.written()) w.string_field(fa::kRefAttrName, a.ref_attr_name.value);
    w.raw_fields(a.extras);
    return w;
  }

  wire::Writer node(const Node& n) {
    namespace fn = field::node;
    wire::Writer w;
    static const std::string kEmpty;
    for (Value* v : n.inputs()) w.string_field(fn::kInput, v ? v->name() : kEmpty);
    for (Value* v : n.outputs()) w.string_field(fn::kOutput, v ? v->name() : kEmpty);
    if (n.name.written()) w.string_field(fn::kName, n.name.value);
    if (n.has_op_type || !n.op_type.empty()) w.string_field(fn::kOpType, n.op_type);
    for (const auto& a : n.attributes) w.message(fn::kAttribute, attribute(a));
    if (n.domain.written()) w.string_field(fn::kDomain, n.domain.value);
    if (n.overload.written()) w.string_field(fn::kOverload, n.overload.value);
    w.raw_fields(n.extras);
    return w;
  }

  // Entries naming values that no longer exist in the graph (removed by a pass) are dropped.
  static bool live(const Graph& g, const ValueInfoEntry& e) {
    return !e.value || g.lookup(e.value->name()) == e.value;
  }

  wire::Writer graph(const Graph& g) {
    namespace fg = field::graph;
    wire::Writer w;
    const bool main_in_place = in_place_ && &g == model_.graph.get();
    if (main_in_place) {  // first, in file order: the bytes after the head are theirs
      for (Value* v : in_place_->order) w.message(fg::kInitializer, tensor(v->initializer()));
    }
    for (Node* n = g.first(); n; n = n->next()) w.message(fg::kNode, node(*n));
    if (g.name.written()) w.string_field(fg::kName, g.name.value);
    for (Value* v : g.initializer_order) {
      if (main_in_place && in_place_->tensors.count(v->initializer().get())) continue;
      w.message(fg::kInitializer, tensor(v->initializer()));
    }
    w.raw_fields(g.extras);
    for (const auto& e : g.input_entries) w.message(fg::kInput, value_info(e));
    for (const auto& e : g.output_entries) w.message(fg::kOutput, value_info(e));
    for (const auto& e : g.value_info_entries) {
      if (live(g, e)) w.message(fg::kValueInfo, value_info(e));
    }
    for (Value* v : g.sparse_initializer_order) {
      w.message(fg::kSparseInitializer, sparse(*v->sparse_initializer()));
    }
    return w;
  }

  wire::Writer function(const Function& f) {
    namespace ff = field::function;
    wire::Writer w;
    const Graph& g = *f.body;
    if (f.name.written()) w.string_field(ff::kName, f.name.value);
    for (const auto& e : g.input_entries) w.string_field(ff::kInput, e.value->name());
    for (const auto& e : g.output_entries) w.string_field(ff::kOutput, e.value->name());
    for (const auto& a : f.attribute_names) w.string_field(ff::kAttribute, a);
    for (Node* n = g.first(); n; n = n->next()) w.message(ff::kNode, node(*n));
    for (const auto& o : f.opset_import) w.message(ff::kOpsetImport, opset(o));
    if (f.domain.written()) w.string_field(ff::kDomain, f.domain.value);
    for (const auto& a : f.attribute_defaults) w.message(ff::kAttributeProto, attribute(a));
    for (const auto& e : g.value_info_entries) {
      if (live(g, e)) w.message(ff::kValueInfo, value_info(e));
    }
    if (f.overload.written()) w.string_field(ff::kOverload, f.overload.value);
    w.raw_fields(f.extras);
    return w;
  }

  const Model& model_;
  DataFiles* data_ = nullptr;
  Model* skeleton_ = nullptr;
  InPlace* in_place_ = nullptr;
  uint64_t threshold_;
  std::string zeros_location_;
  std::map<const Tensor*, uint64_t> zeros_at_;
  uint64_t zeros_end_ = 0;
};

std::string too_big(uint64_t size) {
  return "a self-contained model would be " + std::to_string(size) +
         " bytes, over protobuf's 2 GB limit; save it with external data";
}

}  // namespace

uint64_t initializer_framing_bytes(const std::string& name, const std::vector<int64_t>& dims,
                                   int32_t dtype, uint64_t nbytes) {
  Tensor t;
  t.name.set(name);
  t.dims = dims;
  t.data_type = dtype;
  return framing_of(t, nbytes);
}

namespace {

// The adoptable file whose slots the main graph's initializers fill exactly, each slot one raw
// tensor with the framing its room was made for, or false: then the save copies (a tensor
// renamed or dropped after the pass, the file in another folder or taken by an earlier save).
bool plan_in_place(const Model& model, const std::string& folder, InPlace& plan) {
  // The file an external-data save would take (no alignment, no size cap): the slots below
  // then say whether the self-contained layout fits it.
  const AdoptableFile* file = file_to_adopt(model, folder, SaveOptions{});
  if (!file) return false;
  const std::vector<AdoptableFile::Slot> slots = file->slots();
  if (slots.empty()) return false;
  std::map<uint64_t, size_t> slot_at;  // data offset -> slot
  uint64_t end = AdoptableFile::kModelHeadRoom;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].frame != end) return false;
    slot_at[slots[i].data] = i;
    end = slots[i].data + slots[i].size;
  }
  if (end != file->size()) return false;
  std::vector<Value*> filled(slots.size(), nullptr);
  for (Value* v : model.graph->initializer_order) {
    const Tensor& t = *v->initializer();
    if (t.storage != Tensor::Storage::kRaw || t.raw.buffer.get() != file) continue;
    auto it = slot_at.find(t.raw.offset);
    if (it == slot_at.end() || filled[it->second]) return false;
    const AdoptableFile::Slot& slot = slots[it->second];
    if (t.raw.size != slot.size || t.data_location || !t.extras.empty() ||
        framing_of(t, t.raw.size) != slot.data - slot.frame) {
      return false;
    }
    filled[it->second] = v;
  }
  for (Value* v : filled) {
    if (!v) return false;  // a slot no initializer holds: its bytes would sit inside the graph
    plan.order.push_back(v);
    plan.tensors.insert(v->initializer().get());
  }
  plan.file = file;
  return true;
}

// The self-contained save that takes the adopted file as the model file: the framing goes into
// the room around the tensors' bytes, which stay where the pass wrote them, and the rest of the
// model is appended. False (nothing written) when the model does not fit the file's layout.
bool write_in_place(const Model& model, const std::string& path, const std::string& folder,
                    bool durable, const std::function<void(OutputFile&)>& commit) {
  InPlace plan;
  if (!plan_in_place(model, folder, plan)) return false;
  wire::Writer w = ModelWriter(model, nullptr, 0).model_graph_first(plan);
  if (plan.stray || w.size() > kProtobufLimit) return false;
  // Every in-place piece must fall where its bytes are, the rest after the file's own bytes.
  const uint64_t own = plan.file->size();
  uint64_t pos = 0;
  for (const auto& piece : w.pieces()) {
    const uint64_t n = piece.ref.buffer ? piece.ref.size : piece.bytes.size();
    const bool in_place = piece.ref.buffer.get() == plan.file && piece.ref.offset == pos;
    if (pos < own && (piece.ref.buffer ? !in_place : pos + n > own)) return false;
    pos += n;
  }
  if (pos < own) return false;
  OutputFile out(path, *plan.file);
  out.set_durable(durable);
  pos = 0;
  for (const auto& piece : w.pieces()) {
    if (pos >= own) {
      if (piece.ref.buffer)
        out.copy(piece.ref);
      else
        out.write(piece.bytes.data(), piece.bytes.size());
    } else if (!piece.ref.buffer) {
      out.write_at(pos, piece.bytes.data(), piece.bytes.size());
    }
    pos += piece.ref.buffer ? piece.ref.size : piece.bytes.size();
  }
  commit(out);
  return true;
}

}  // namespace

uint64_t self_contained_size(const Model& model) {
  return ModelWriter(model, nullptr, 0).model().size();
}

namespace {
std::string flatten(const wire::Writer& w) {
  std::string out;
  out.reserve(w.size());
  for (const auto& piece : w.pieces()) {
    if (piece.ref.buffer)
      out.append(reinterpret_cast<const char*>(piece.ref.data()), piece.ref.size);
    else
      out.append(piece.bytes);
  }
  return out;
}
}  // namespace

std::string serialize_model(const Model& model) {
  wire::Writer w = ModelWriter(model, nullptr, 0).model();
  if (w.size() > kProtobufLimit) throw ModelError(too_big(w.size()));
  return flatten(w);
}

std::string serialize_skeleton(Model& model, uint64_t threshold) {
  wire::Writer w = ModelWriter(model, threshold).model();
  if (w.size() > kProtobufLimit) {
    throw ModelError("the model's skeleton is " + std::to_string(w.size()) +
                     " bytes, over protobuf's 2 GB limit; use a lower threshold");
  }
  return flatten(w);
}

std::string serialize_zeros_skeleton(const Model& model, uint64_t threshold,
                                     const std::string& location, uint64_t* zeros_bytes) {
  ModelWriter writer(model, threshold, location);
  wire::Writer w = writer.model();
  if (w.size() > kProtobufLimit) {
    throw ModelError("the model's skeleton is " + std::to_string(w.size()) +
                     " bytes, over protobuf's 2 GB limit; use a lower threshold");
  }
  *zeros_bytes = writer.zeros_bytes();
  return flatten(w);
}

void write_model_file(const Model& model, const std::string& path, const SaveOptions& options) {
  if (path.empty()) throw ModelError("output path is empty");
  if (path.back() == '/') throw ModelError("output path '" + path + "' names a folder");
  const std::string folder = dirname_of(path);
  const InputFiles inputs(model);  // also: none of them changed since the load
  inputs.check_output(path, "output");

  std::string location = options.location.empty() ? basename_of(path) + ".data" : options.location;
  if (options.external != SaveOptions::External::kNever &&
      (location.find('/') != std::string::npos || location == "." || location == "..")) {
    throw ModelError("external data location '" + location +
                     "' must be a plain file name in the output folder");
  }
  for (const auto& [name, bytes] : options.side_files) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
        name == basename_of(path) || name == location) {
      throw ModelError("side file name '" + name + "' must be a plain file name in the output " +
                       "folder, other than the model's and its data's");
    }
    inputs.check_output(folder + "/" + name, "output");
  }
  CreatedFolders folders(folder);  // -o new/dir/model.onnx creates new/dir
  OutputLock lock(path);           // another save to this output fails here, before any write
  std::vector<std::unique_ptr<OutputFile>> side;
  for (const auto& [name, bytes] : options.side_files) {
    side.push_back(std::make_unique<OutputFile>(folder + "/" + name));
    side.back()->set_durable(options.durable);
    side.back()->write(bytes.data(), bytes.size());
  }
  auto commit = [&](OutputFile& out, std::vector<OutputFile*> files) {
    for (auto& f : side) files.push_back(f.get());
    commit_outputs(&out, files, options.before_commit);  // the model file takes its name last
    folders.keep();
  };

  if (options.external != SaveOptions::External::kAlways) {
    // Quantized weights written before the save are already in place in a file laid out as a
    // model file: written once (one fsync), not copied. (It checks the 2 GB limit itself.)
    if (write_in_place(model, path, folder, options.durable,
                       [&](OutputFile& out) { commit(out, {}); })) {
      return;
    }
    wire::Writer w = ModelWriter(model, nullptr, 0).model();
    if (w.size() <= kProtobufLimit) {
      OutputFile out(path);
      out.set_durable(options.durable);
      write_pieces(out, w);
      commit(out, {});
      return;
    }
    if (options.external == SaveOptions::External::kNever) throw ModelError(too_big(w.size()));
  }

  DataFiles data(folder, location, options, inputs, basename_of(path),
                 file_to_adopt(model, folder, options));
  wire::Writer w = ModelWriter(model, &data, options.size_threshold).model();
  if (w.size() > kProtobufLimit) {
    throw ModelError("the model's graph alone is " + std::to_string(w.size()) +
                     " bytes, over protobuf's 2 GB limit, even with external data");
  }
  OutputFile out(path);
  out.set_durable(options.durable);
  write_pieces(out, w);
  commit(out, data.files());
}

}  // namespace fastopt
