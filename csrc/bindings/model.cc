// Bindings of Model (its properties, edits, save) and of reading and writing model files.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <map>
#include <memory>
#include <string>

#include "bindings/handles.h"
#include "ir/constant.h"
#include "ir/error.h"
#include "ir/graph.h"
#include "ir/types.h"
#include "proto/onnx_reader.h"
#include "proto/onnx_writer.h"
#include "proto/output_files.h"

namespace fastopt::bindings {
namespace {

// A path as the C++ side takes it: UTF-8 text. A file name that is not (bytes that do not decode,
// which Python hands over as lone surrogates) is refused with a ModelError: messages and
// Model.path are text, and pybind's own cast failed with a RuntimeError.
std::string fspath(const py::object& p) {
  py::module_ os = py::module_::import("os");
  py::object path = os.attr("fspath")(p);
  if (py::isinstance<py::str>(path)) {
    Py_ssize_t n = 0;
    if (const char* utf8 = PyUnicode_AsUTF8AndSize(path.ptr(), &n)) return std::string(utf8, n);
    PyErr_Clear();
  } else if (py::isinstance<py::bytes>(path)) {
    std::string bytes = path.cast<std::string>();
    py::object text = py::reinterpret_steal<py::object>(
        PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "strict"));
    if (text) return bytes;
    PyErr_Clear();
  } else {
    return path.cast<std::string>();  // os.fspath returned neither: pybind's TypeError
  }
  throw ModelError("path " + py::repr(os.attr("fsencode")(path)).cast<std::string>() +
                   " is not valid UTF-8; fastopt takes UTF-8 file names (rename the file or " +
                   "folder)");
}

}  // namespace

void bind_model(py::module_& m, py::class_<Model, ModelPtr>& model_cls) {
  model_cls
      .def_property_readonly("ir_version",
                             [](const Model& mm) { return mm.ir_version.value_or(0); })
      .def_property_readonly("producer_name",
                             [](const Model& mm) { return mm.producer_name.value; })
      .def_property_readonly("producer_version",
                             [](const Model& mm) { return mm.producer_version.value; })
      .def_property_readonly("domain", [](const Model& mm) { return mm.domain.value; })
      .def_property_readonly("model_version",
                             [](const Model& mm) { return mm.model_version.value_or(0); })
      .def_property_readonly("doc_string", [](const Model& mm) { return mm.doc_string.value; })
      .def_property_readonly("opset_imports",
                             [](const Model& mm) {
                               py::typing::Dict<py::str, int> d;
                               for (const auto& o : mm.opset_import)
                                 d[py::str(o.domain.value)] = o.version.value_or(0);
                               return d;
                             })
      .def_property_readonly("metadata_props",
                             [](const Model& mm) {
                               py::typing::Dict<py::str, py::str> d;
                               for (const auto& kv : mm.metadata_props)
                                 d[py::str(kv.first)] = kv.second;
                               return d;
                             })
      .def_property_readonly("graph",
                             [](const ModelPtr& mm) { return PyGraph{mm, mm->graph.get()}; })
      .def_property_readonly("functions",
                             [](const ModelPtr& mm) {
                               py::typing::List<PyFunction> l;
                               for (const auto& f : mm->functions)
                                 l.append(PyFunction{mm, f.get()});
                               return l;
                             })
      .def(
          "graphs",
          [](const ModelPtr& mm) {
            py::typing::List<PyGraph> l;
            mm->for_each_graph([&](Graph& g) { l.append(PyGraph{mm, &g}); });
            return l;
          },
          "Every graph: the main graph, function bodies and nested subgraphs")
      .def_property_readonly("path",
                             [](const Model& mm) -> py::typing::Optional<py::str> {
                               if (mm.path.empty()) return py::none();
                               return py::str(mm.path);
                             })
      .def_property_readonly("base_dir", [](const Model& mm) { return mm.base_dir; })
      .def("op_counts", &Model::op_counts, py::call_guard<py::gil_scoped_release>(),
           "Operator histogram over all graphs: 'Op' for ai.onnx, 'domain::Op' otherwise")
      .def(
          "node_count",
          [](const Model& mm) {
            int64_t n = 0;
            mm.for_each_graph([&](Graph& g) { n += static_cast<int64_t>(g.node_count()); });
            return n;
          },
          "The number of nodes over all graphs (the sum of op_counts(), without building it)")
      .def("note_edit", &Model::note_edit,
           "Marks the model edited: memoized analyses (the shape facts) recompute")
      .def("verify", &Model::verify, py::call_guard<py::gil_scoped_release>(),
           "Checks the IR's invariants; raises ModelError naming the first broken one")
      .def(
          "external_checksums",
          [](const Model& mm) {
            py::typing::List<py::typing::Tuple<py::str, py::str, py::str>> out;
            mm.for_each_graph([&](Graph& g) {
              for (Value* v : g.initializer_order) {
                const Tensor& t = *v->initializer();
                if (!t.is_external()) continue;
                for (const auto& kv : t.external->entries) {
                  if (kv.first == "checksum") {
                    out.append(py::make_tuple(t.name.value, t.external->file->path(), kv.second));
                  }
                }
              }
            });
            return out;
          },
          "(tensor, data file, checksum) of each external tensor with a 'checksum' key "
          "(fastopt.verify_checksums checks them)")
      .def(
          "num_parameters",
          [](const Model& mm) {
            uint64_t n = 0;
            mm.for_each_graph([&](Graph& g) {
              for (Value* v : g.initializer_order) n += v->initializer()->numel();
            });
            return n;
          },
          "Elements in all initializers (subgraphs included)")
      .def(
          "parameter_bytes",
          [](const Model& mm) {
            uint64_t n = 0;
            mm.for_each_graph([&](Graph& g) {
              for (Value* v : g.initializer_order) n += v->initializer()->nbytes();
            });
            return n;
          },
          "Bytes of all initializers (subgraphs included)")
      .def("external_data_files",
           [](const Model& mm) {
             std::vector<std::string> out;
             for (const auto& kv : mm.external_files) out.push_back(kv.first);
             return out;
           })
      .def("self_contained_size", &self_contained_size, py::call_guard<py::gil_scoped_release>(),
           "Bytes of the model serialized with all data inline")
      .def(
          "skeleton",
          [](Model& mm, uint64_t threshold_bytes) {
            std::string s;
            {
              py::gil_scoped_release release;
              s = serialize_skeleton(mm, threshold_bytes);
            }
            return py::bytes(s);
          },
          py::arg("threshold_bytes") = 1024,
          R"doc(The model as ModelProto bytes with every tensor payload of at least threshold_bytes
replaced by an external-data placeholder (location '*fastopt-skeleton*', offset = an index into
a table this Model keeps). Small whatever the weights weigh: hand it to tools that edit
ModelProtos (onnx shape inference, version conversion), then bind the result back with
fastopt._C.load_skeleton(bytes, model) or apply its types with Model.apply_types.)doc")
      .def(
          "zeros_skeleton",
          [](const Model& mm, uint64_t threshold_bytes, const std::string& location) {
            std::string s;
            uint64_t zeros = 0;
            {
              py::gil_scoped_release release;
              s = serialize_zeros_skeleton(mm, threshold_bytes, location, &zeros);
            }
            return py::make_tuple(py::bytes(s), zeros);
          },
          py::arg("threshold_bytes"), py::arg("location"),
          R"doc(The model as ModelProto bytes whose tensor payloads of at least threshold_bytes are
external data in the file `location` (beside the model file), each at its own page-aligned
offset, and that file's length: a sparse file of zeros that long lets ONNX Runtime load and run
the graph without reading or copying the weights (fastopt.verify.run_check).)doc")
      .def(
          "apply_types",
          [](ModelPtr& mm, py::bytes data) {
            std::string s = data;
            py::gil_scoped_release release;
            auto inferred = read_skeleton(std::make_shared<OwnedBuffer>(std::move(s)), *mm);
            return apply_types(*mm, *inferred);
          },
          py::arg("skeleton_bytes"),
          "Applies the value types of an edited skeleton of this model (e.g. after onnx shape "
          "inference): values are matched by name per graph; a type is set where missing and "
          "refined where the other is more specific; graph inputs keep theirs. Values whose type "
          "changed get value_info entries. Returns how many changed.")
      .def(
          "serialize",
          [](const Model& mm) {
            std::string s;
            {
              py::gil_scoped_release release;
              s = serialize_model(mm);
            }
            return py::bytes(s);
          },
          "The model as ModelProto bytes, all data inline (under 2 GB only)")
      .def(
          "to_onnx",
          [](const Model& mm) {
            std::string s;
            {
              py::gil_scoped_release release;
              s = serialize_model(mm);
            }
            py::object parse = py::module_::import("onnx").attr("ModelProto").attr("FromString");
            try {
              return parse(py::bytes(s));
            } catch (py::error_already_set& e) {
              // Protobuf refuses some models fastopt reads (nesting past its depth limit of 100):
              // a ModelError, with protobuf's exception as __cause__.
              if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_MemoryError)) throw;
              const std::string text =
                  "to_onnx: protobuf cannot parse this model (" + std::string(e.what()) + ")";
              const py::object model_error = py::module_::import("fastopt._C").attr("ModelError");
              py::raise_from(e, model_error.ptr(), text.c_str());
              throw py::error_already_set();
            }
          },
          "The model as an onnx.ModelProto, all data inline (for models under 2 GB)")
      .def(
          "save",
          [](const Model& mm, const py::object& path, const py::object& external_data,
             const std::string& location, uint64_t size_threshold, uint64_t align,
             uint64_t max_file_bytes, const std::map<std::string, py::bytes>& side_files,
             bool fsync, const py::object& before_commit) {
            SaveOptions o;
            o.durable = fsync;
            if (!before_commit.is_none()) {
              // (a borrowed handle: before_commit outlives the save; called with the GIL)
              o.before_commit = [fn = py::handle(before_commit)] {
                py::gil_scoped_acquire gil;
                fn();
              };
            }
            for (const auto& [name, bytes] : side_files) o.side_files.emplace_back(name, bytes);
            o.location = location;
            if (external_data.is_none()) {
              o.external = SaveOptions::External::kAuto;
            } else if (py::isinstance<py::str>(external_data)) {
              o.external = SaveOptions::External::kAlways;
              o.location = external_data.cast<std::string>();
            } else if (py::isinstance<py::bool_>(external_data)) {
              o.external = external_data.cast<bool>() ? SaveOptions::External::kAlways
                                                      : SaveOptions::External::kNever;
            } else {
              throw ModelError("external_data must be None, a bool, or a file name");
            }
            o.size_threshold = size_threshold;
            o.align = align;
            o.max_file_bytes = max_file_bytes;
            std::string p = fspath(path);
            py::gil_scoped_release release;
            write_model_file(mm, p, o);
          },
          py::arg("path"), py::arg("external_data") = py::none(), py::kw_only(),
          py::arg("location") = "", py::arg("size_threshold") = 1024, py::arg("align") = 0,
          py::arg("max_file_bytes") = 0, py::arg("side_files") = std::map<std::string, py::bytes>{},
          py::arg("fsync") = true, py::arg("before_commit") = py::none(),
          R"doc(Writes the model: complete or absent at every instant, never over the loaded model's files.

Files are written unnamed and named at the end, data files before the model file (the old
model file is removed first, so it never sits beside new data); missing folders are created.

Parameters
----------
path : str or os.PathLike
    The model file to write.
external_data : None, bool or str, default None
    None: a self-contained file when it fits protobuf's 2 GB limit, external data otherwise;
    True: tensors of at least `size_threshold` bytes always go to `location`; False: never
    (ModelError over 2 GB); a string: True with that location.
location : str, default '<file name>.data'
    The data file, beside the model.
size_threshold : int, default 1024
    Smallest tensor (bytes) moved to external data.
align : int, default 0
    Pad each tensor's offset in the data file to a multiple of it (4096 lets runtimes mmap).
max_file_bytes : int, default 0
    Above 0, split the data into several files.
side_files : dict of str to bytes, default {}
    Small files written beside the model and committed with it (genai_config.json).
fsync : bool, default True
    False writes as cp does: no writeback while writing and no fsync, so the save returns
    before the bytes reach the disk; the files are still complete or absent for every reader
    and if this process dies, but a power loss may leave them partial.
before_commit : callable, optional
    Called with no arguments once every file is written (and fsynced) but none named: an
    exception from it is raised here and leaves nothing written (optimize's run check, running
    beside the save, refuses its output so).

Raises
------
ModelError
    A path that is the loaded model's own file or one of its external data files (by identity:
    links and symlinks included), a directory, FIFO, socket or device; a save after one of the
    loaded files shrank or changed; a second save to the same output at the same time.)doc");

  m.def(
      "write_file",
      [](const py::object& path, py::bytes data) {
        std::string p = fspath(path);
        std::string s = data;
        py::gil_scoped_release release;
        write_output_file(p, s);
      },
      py::arg("path"), py::arg("data"),
      "Writes a small output file (e.g. genai_config.json) as Model.save writes a model file");
  m.def(
      "load",
      [](const py::object& path) {
        std::string p = fspath(path);
        py::gil_scoped_release release;
        return std::shared_ptr<Model>(read_model_file(p));
      },
      py::arg("path"), "Reads an ONNX model file (memory-mapped; weights are not copied)");
  m.def(
      "load_bytes",
      [](py::bytes data, const std::string& base_dir) {
        std::string s = data;
        py::gil_scoped_release release;
        return std::shared_ptr<Model>(
            read_model_from_buffer(std::make_shared<OwnedBuffer>(std::move(s)), base_dir));
      },
      py::arg("data"), py::arg("base_dir") = "", "Reads a serialized ModelProto held in memory");
  m.def(
      "load_skeleton",
      [](py::bytes data, const ModelPtr& original) {
        std::string s = data;
        py::gil_scoped_release release;
        return std::shared_ptr<Model>(
            read_skeleton(std::make_shared<OwnedBuffer>(std::move(s)), *original));
      },
      py::arg("data"), py::arg("original"),
      "Reads a skeleton of `original` (Model.skeleton bytes, possibly edited by onnx tools): "
      "placeholders take the original's tensor bytes as views (no copy); the new Model keeps "
      "the original's buffers alive");
  m.def("dtype_name", &dtype_name);
  m.def(
      "make_tensor",
      [](int32_t dtype, std::vector<int64_t> dims, py::bytes data) {
        return PyTensor{nullptr, make_tensor(dtype, std::move(dims), std::string(data))};
      },
      py::arg("dtype"), py::arg("dims"), py::arg("data"), "A new tensor owning a copy of `data`");
}

}  // namespace fastopt::bindings
