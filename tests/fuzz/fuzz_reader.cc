// libFuzzer entry point for the model reader (csrc/proto/onnx_reader.h).
//
//   tests/fuzz/build.sh                       # clang, ASan + UBSan, -> build/fuzz-san/
//   python tests/fuzz/run_fuzz.py --libfuzzer build/fuzz-san/fuzz_reader --runs 1000000
//
// Every input must either read or throw fastopt::ModelError; any other exception, a sanitizer
// report, a timeout or an allocation over -malloc_limit_mb is a finding. A model that reads is
// then walked: every node, value, attribute and subgraph, every tensor's bytes (so that ASan sees
// an out-of-bounds view here), verify() and op_counts(); a model that verifies is serialized
// (its size must be what self_contained_size() promised) and read back, which must succeed
// (under 64 KiB inline; see kMaxRoundTripBytes).
//
// External data resolves against a private folder (fuzz_common.h make_base_dir).

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "fuzz_common.h"
#include "proto/onnx_reader.h"
#include "proto/onnx_writer.h"

namespace {
std::string g_base_dir;
constexpr uint64_t kMaxRoundTripBytes = 64 << 10;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  g_base_dir = fuzz::make_base_dir();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto buffer = std::make_shared<fastopt::OwnedBuffer>(
      std::string(reinterpret_cast<const char*>(data), size));
  std::unique_ptr<fastopt::Model> model;
  try {
    model = fastopt::read_model_from_buffer(buffer, g_base_dir);
  } catch (const fastopt::ModelError& e) {
    if (e.what()[0] == '\0') fuzz::finding("ModelError with an empty message");
    return 0;
  }
  // Anything else thrown above escapes and libFuzzer reports it (uncaught exception -> abort).
  fuzz::walk_model(*model);
  try {
    model->verify();
  } catch (const fastopt::ModelError&) {
    return 0;
  }
  // Round trips of models with megabytes of (export.bin) weights cost more than the rest of an
  // execution; fuzz_pipeline round-trips those.
  if (fastopt::self_contained_size(*model) > kMaxRoundTripBytes) return 0;
  std::string bytes;
  try {
    bytes = fastopt::serialize_model(*model);
  } catch (const fastopt::ModelError&) {
    return 0;  // e.g. external data that cannot be inlined
  }
  if (bytes.size() != fastopt::self_contained_size(*model)) {
    fuzz::finding("serialize_model wrote " + std::to_string(bytes.size()) +
                  " bytes, self_contained_size() said " +
                  std::to_string(fastopt::self_contained_size(*model)));
  }
  try {
    auto again = fastopt::read_model_from_buffer(
        std::make_shared<fastopt::OwnedBuffer>(std::move(bytes)), g_base_dir);
    if (again->op_counts() != model->op_counts())
      fuzz::finding("op counts changed in the round trip");
  } catch (const fastopt::ModelError& e) {
    fuzz::finding(std::string("a verified model, serialized, does not read back: ") + e.what());
  }
  return 0;
}
