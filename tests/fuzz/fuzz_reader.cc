// libFuzzer entry point for the model reader (csrc/proto/onnx_reader.h).
//
//   cmake -S . -B /tmp/fuzzbuild -DFASTOPT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++
//   cmake --build /tmp/fuzzbuild --target fuzz_reader -j
//   mkdir -p /tmp/fuzzcorpus && cp tests/fuzz/corpus/* /tmp/fuzzcorpus/
//   /tmp/fuzzbuild/fuzz_reader -max_total_time=600 -timeout=10 -rss_limit_mb=2048 \
//       -malloc_limit_mb=512 /tmp/fuzzcorpus
//
// Every input must either read or throw fastopt::ModelError; any other exception, a sanitizer
// report, a timeout or an allocation over -malloc_limit_mb is a finding. A model that reads is
// then walked: every node, value, attribute and subgraph, every tensor's bytes (so that ASan sees
// an out-of-bounds view here), verify() and op_counts(); a model that verifies is serialized
// (its size must be what self_contained_size() promised) and read back, which must succeed.
//
// External data resolves against a private folder holding `weights.bin`: 4096 bytes, the same
// as tests/fuzz/make_seeds.py weights_bin(), which the seed corpus points into.

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "ir/buffer.h"
#include "ir/error.h"
#include "ir/graph.h"
#include "ir/tensor.h"
#include "proto/onnx_reader.h"
#include "proto/onnx_writer.h"

namespace {

std::string g_base_dir;
volatile uint64_t g_sink = 0;  // keeps the byte reads from being optimised away

void make_base_dir() {
  char tmpl[] = "/tmp/fastopt-fuzz-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (dir == nullptr) {
    std::perror("mkdtemp");
    std::abort();
  }
  g_base_dir = dir;
  std::string path = g_base_dir + "/weights.bin";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::perror("fopen weights.bin");
    std::abort();
  }
  for (int i = 0; i < 4096; ++i) std::fputc((i * 7 + 3) & 0xff, f);
  std::fclose(f);
}

void touch_bytes(const fastopt::ByteRef& ref) {
  const uint8_t* p = ref.data();
  uint64_t acc = 0;
  for (uint64_t i = 0; i < ref.size; ++i) acc += p[i];
  g_sink = g_sink + acc;
}

void touch_tensor(const fastopt::Tensor& t) {
  try {
    g_sink = g_sink + t.nbytes();
    if (t.dtype() == 8 /* STRING */) {
      for (const auto& s : t.strings()) g_sink = g_sink + s.size();
    } else {
      touch_bytes(t.bytes());
    }
  } catch (const fastopt::ModelError&) {
    // bytes() refuses some tensors (e.g. typed fields that verify() would reject)
  }
}

void walk(const fastopt::Graph& g);

void touch_value(const fastopt::Value* v) {
  if (v == nullptr) return;
  g_sink = g_sink + v->name().size() + v->uses().size();
  if (v->producer() != nullptr) g_sink = g_sink + v->producer()->op_type.size();
  if (v->initializer()) touch_tensor(*v->initializer());
  if (const auto& sp = v->sparse_initializer()) {
    if (sp->values) touch_tensor(*sp->values);
    if (sp->indices) touch_tensor(*sp->indices);
  }
}

void touch_attribute(const fastopt::Attribute& a) {
  g_sink = g_sink + static_cast<uint64_t>(a.kind()) + a.floats.size() + a.ints.size() +
           a.strings.size();
  if (a.t) touch_tensor(*a.t);
  for (const auto& t : a.tensors) {
    if (t) touch_tensor(*t);
  }
  if (a.g) walk(*a.g);
  for (const auto& sg : a.graphs) {
    if (sg) walk(*sg);
  }
}

void walk(const fastopt::Graph& g) {
  for (const fastopt::Value* v : g.inputs()) touch_value(v);
  for (const fastopt::Value* v : g.outputs()) touch_value(v);
  for (const fastopt::Value* v : g.outer_references()) touch_value(v);
  for (const fastopt::Node* n : g.nodes()) {
    for (const fastopt::Value* v : n->inputs()) touch_value(v);
    for (const fastopt::Value* v : n->outputs()) touch_value(v);
    for (const auto& a : n->attributes) touch_attribute(a);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  make_base_dir();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto buffer = std::make_shared<fastopt::OwnedBuffer>(
      std::string(reinterpret_cast<const char*>(data), size));
  std::unique_ptr<fastopt::Model> model;
  try {
    model = fastopt::read_model_from_buffer(buffer, g_base_dir);
  } catch (const fastopt::ModelError& e) {
    if (e.what()[0] == '\0') {
      std::fprintf(stderr, "ModelError with an empty message\n");
      std::abort();
    }
    return 0;
  }
  // Anything else thrown above escapes and libFuzzer reports it (uncaught exception -> abort).
  if (model->graph) walk(*model->graph);
  for (const auto& f : model->functions) {
    if (f && f->body) walk(*f->body);
  }
  g_sink = g_sink + model->op_counts().size();
  try {
    model->verify();
  } catch (const fastopt::ModelError&) {
    return 0;
  }
  std::string bytes;
  try {
    bytes = fastopt::serialize_model(*model);
  } catch (const fastopt::ModelError&) {
    return 0;  // e.g. external data that cannot be inlined
  }
  if (bytes.size() != fastopt::self_contained_size(*model)) {
    std::fprintf(stderr, "serialize_model wrote %zu bytes, self_contained_size() said %llu\n",
                 bytes.size(), static_cast<unsigned long long>(fastopt::self_contained_size(*model)));
    std::abort();
  }
  try {
    auto again = fastopt::read_model_from_buffer(
        std::make_shared<fastopt::OwnedBuffer>(std::move(bytes)), g_base_dir);
    if (again->op_counts() != model->op_counts()) {
      std::fprintf(stderr, "op counts changed in the round trip\n");
      std::abort();
    }
  } catch (const fastopt::ModelError& e) {
    std::fprintf(stderr, "a verified model, serialized, does not read back: %s\n", e.what());
    std::abort();
  }
  return 0;
}
