// Shared by the libFuzzer harnesses (fuzz_reader.cc, fuzz_pipeline.cc): the private folder
// external data resolves against, and a walk that touches everything a loaded model exposes.
//
// The folder holds `weights.bin` (4096 bytes; make_seeds.py weights_bin(), which the synthetic
// seeds point into) and `export.bin` (make_seeds.py export_bin(): the bytes every weight of the
// real-export seeds reads, all from offset 0, so that a seed keeps its export's graph but not
// its megabytes).
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ir/buffer.h"
#include "ir/error.h"
#include "ir/graph.h"
#include "ir/tensor.h"

namespace fuzz {

inline volatile uint64_t g_sink = 0;  // keeps the byte reads from being optimised away

// Same bytes as make_seeds.py: weights_bin() (4096 bytes) and export_bin() (1 MiB).
inline uint8_t weights_byte(uint64_t i) {
  return static_cast<uint8_t>((i * 7 + 3) & 0xff);
}
inline uint8_t export_byte(uint64_t i) {
  return static_cast<uint8_t>((i * 13 + 5) % 61 + 60);
}
inline constexpr uint64_t kWeightsSize = 4096;
inline constexpr uint64_t kExportSize = 1 << 20;

inline void write_pattern(const std::string& path, uint64_t size, uint8_t (*byte)(uint64_t)) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::perror(path.c_str());
    std::abort();
  }
  for (uint64_t i = 0; i < size; ++i) std::fputc(byte(i), f);
  std::fclose(f);
}

// A fresh folder under $TMPDIR (or /tmp) holding weights.bin and export.bin.
inline std::string make_base_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fastopt-fuzz-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::perror("mkdtemp");
    std::abort();
  }
  write_pattern(tmpl + "/weights.bin", kWeightsSize, weights_byte);
  write_pattern(tmpl + "/export.bin", kExportSize, export_byte);
  return tmpl;
}

// Reads the first and last byte of a view and one per page between: ASan reports a view that
// runs past its buffer or mapping, and megabytes of weights cost a few hundred reads, not a
// million (the export seeds' tensors would otherwise dominate each execution).
inline void touch_bytes(const fastopt::ByteRef& ref) {
  if (ref.size == 0) return;
  const uint8_t* p = ref.data();
  uint64_t acc = p[ref.size - 1];
  for (uint64_t i = 0; i < ref.size; i += 4096) acc += p[i];
  g_sink = g_sink + acc;
}

inline void touch_tensor(const fastopt::Tensor& t) {
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

inline void walk(const fastopt::Graph& g);

inline void touch_value(const fastopt::Value* v) {
  if (v == nullptr) return;
  g_sink = g_sink + v->name().size() + v->uses().size();
  if (v->producer() != nullptr) g_sink = g_sink + v->producer()->op_type.size();
  if (v->initializer()) touch_tensor(*v->initializer());
  if (const auto& sp = v->sparse_initializer()) {
    if (sp->values) touch_tensor(*sp->values);
    if (sp->indices) touch_tensor(*sp->indices);
  }
}

inline void touch_attribute(const fastopt::Attribute& a) {
  g_sink =
      g_sink + static_cast<uint64_t>(a.kind()) + a.floats.size() + a.ints.size() + a.strings.size();
  if (a.t) touch_tensor(*a.t);
  for (const auto& t : a.tensors) {
    if (t) touch_tensor(*t);
  }
  if (a.g) walk(*a.g);
  for (const auto& sg : a.graphs) {
    if (sg) walk(*sg);
  }
}

inline void walk(const fastopt::Graph& g) {
  for (const fastopt::Value* v : g.inputs()) touch_value(v);
  for (const fastopt::Value* v : g.outputs()) touch_value(v);
  for (const fastopt::Value* v : g.outer_references()) touch_value(v);
  for (const fastopt::Node* n : g.nodes()) {
    for (const fastopt::Value* v : n->inputs()) touch_value(v);
    for (const fastopt::Value* v : n->outputs()) touch_value(v);
    for (const auto& a : n->attributes) touch_attribute(a);
  }
}

// Every graph of the model (main and function bodies).
inline void walk_model(const fastopt::Model& m) {
  if (m.graph) walk(*m.graph);
  for (const auto& f : m.functions) {
    if (f && f->body) walk(*f->body);
  }
  g_sink = g_sink + m.op_counts().size();
}

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "FINDING: %s\n", what.c_str());
  std::abort();
}

}  // namespace fuzz
