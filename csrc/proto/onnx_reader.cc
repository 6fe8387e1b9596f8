// The reader's entry points (a file, a buffer, a skeleton) and the ModelProto level; the
// tensor and graph levels are onnx_reader_tensor.cc and onnx_reader_graph.cc.
#include "proto/onnx_reader.h"

#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include "ir/error.h"
#include "ir/wire.h"
#include "proto/onnx_fields.h"
#include "proto/onnx_reader_impl.h"
#include "proto/onnx_schema.h"

namespace fastopt {

namespace reader {

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

}  // namespace reader

OpsetId ModelReader::read_opset(uint64_t b, uint64_t e, int depth) {
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

bool ModelReader::read_entry(uint64_t b, uint64_t e, std::string* key, std::string* value,
                             int depth) {
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

std::unique_ptr<Model> ModelReader::read() {
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

std::unique_ptr<Model> read_model_from_buffer(std::shared_ptr<const Buffer> buffer,
                                              const std::string& base_dir) {
  ModelReader reader;
  reader.source = std::move(buffer);
  reader.base_dir = base_dir;
  if (!base_dir.empty()) {
    reader.base_dir_real = reader::real_path(base_dir);
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
    auto m = read_model_from_buffer(file, reader::dirname_of(absolute));
    m->path = path;
    return m;
  } catch (const ModelError& e) {
    throw ModelError(std::string(e.what()) + " (in '" + path + "')");
  }
}

}  // namespace fastopt
