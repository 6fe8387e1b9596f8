// libFuzzer entry point for the C++ pass pipeline: read, run the passes, save, read back.
//
//   tests/fuzz/build.sh                       # clang, ASan + UBSan, -> build/fuzz-san/
//   python tests/fuzz/run_fuzz.py --libfuzzer build/fuzz-san/fuzz_pipeline --runs 100000
//
// An input that reads and verifies goes through the C++ passes of the "default" preset in its
// order (python/fastopt/registry.py; tests/test_fuzz.py checks that kDefaultPasses matches),
// add_kv_cache after fuse_attention, then one quantization pass; FASTOPT_FUZZ_PASSES (comma
// separated) replaces the list. The input's size picks the variant, so that mutations reach all
// of them: target ort or onnx, KV cache off / standard / in place, quantization none / int4 /
// int8 / int8-dynamic / fp16 / bf16.
//
// A pass may refuse the model with fastopt::ModelError (the pipeline stops there, as optimize()
// does); anything else thrown, a sanitizer report or a timeout is a finding, and so is a
// model the passes leave unverifiable, one whose serialization does not read back and verify,
// or one that does not survive a save to a file (external data) and a read back.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "passes/registry.h"
#include "proto/onnx_reader.h"
#include "proto/onnx_writer.h"

namespace {

// The C++ passes of PRESETS["default"], in order (its Python passes left out: infer_shapes,
// fold_constants_ort, which evaluates nodes in ONNX Runtime, and target_opset).
const char* const kDefaultPasses[] = {
    "fold_shapes",
    "fold_constants",
    "eliminate_identity",
    "eliminate_cast",
    "eliminate_noop",
    "fold_transposes",
    "fold_reshapes",
    "eliminate_noop",
    "eliminate_neutral_arithmetic",
    "eliminate_common_subexpressions",
    "eliminate_unused_function_inputs",
    "eliminate_dead_nodes",
    "fuse_conv_bn",
    "fuse_conv_activation",
    "fuse_matmul_add",
    "eliminate_dead_nodes",
    "fuse_layer_norm",
    "fuse_rms_norm",
    "fuse_norm_casts",
    "fuse_gelu",
    "fuse_bias_gelu",
    "fuse_silu",
    "fuse_rotary",
    "eliminate_dead_nodes",
    "fuse_attention",
    "lower_attention",
    "fuse_skip_norm",
    "fold_transposes",
    "fold_reshapes",
    "eliminate_noop",
    "eliminate_dead_nodes",
    "pack_matmuls",
    "eliminate_common_subexpressions",
    "eliminate_dead_nodes",
};

const char* const kQuantModes[] = {"", "int4", "int8", "int8-dynamic", "fp16", "bf16"};

std::string g_base_dir;
std::string g_out_dir;
std::vector<std::string> g_passes;

std::vector<std::string> pass_list() {
  std::vector<std::string> names;
  if (const char* env = std::getenv("FASTOPT_FUZZ_PASSES"); env != nullptr && *env != '\0') {
    std::stringstream ss(env);
    for (std::string name; std::getline(ss, name, ',');) {
      if (!name.empty()) names.push_back(name);
    }
  } else {
    for (const char* name : kDefaultPasses) {
      names.emplace_back(name);
      if (names.back() == "fuse_attention") names.emplace_back("add_kv_cache");
    }
  }
  for (const auto& name : names) {
    if (fastopt::passes::find_pass(name) == nullptr) fuzz::finding("no C++ pass named " + name);
  }
  return names;
}

struct Variant {
  std::string target;
  int64_t kv_cache;  // 0: none
  std::string quant_mode;
  bool save_to_file;
};

Variant variant_for(size_t size) {
  Variant v;
  v.target = size % 2 == 0 ? "ort" : "onnx";
  v.kv_cache = static_cast<int64_t>((size / 2) % 3);
  v.quant_mode = kQuantModes[(size / 6) % 6];
  v.save_to_file = (size / 36) % 4 == 0;  // a quarter of the inputs: file I/O costs
  return v;
}

fastopt::passes::PassContext context_for(const Variant& v) {
  fastopt::passes::PassContext ctx;
  ctx.target = fastopt::passes::parse_target(v.target);
  if (v.kv_cache != 0) ctx.options["kv_cache"] = v.kv_cache;
  ctx.options["quant_threads"] = 1;
  if (!v.quant_mode.empty()) {
    ctx.text_options["quant_mode"] = v.quant_mode;
    if (v.quant_mode == "int4" || v.quant_mode == "int8") {
      ctx.options["quant_bits"] = v.quant_mode == "int4" ? 4 : 8;
    }
  }
  ctx.text_options["quant_tmpdir"] = g_out_dir;
  return ctx;
}

const char* quant_pass(const std::string& mode) {
  if (mode == "int4" || mode == "int8") return "quantize_weights";
  if (mode == "int8-dynamic") return "quantize_dynamic";
  return "convert_precision";
}

// Runs the pipeline; false when a pass refused the model.
bool run_passes(fastopt::Model& model, const Variant& v) {
  fastopt::passes::PassContext ctx = context_for(v);
  std::vector<std::string> names = g_passes;
  if (!v.quant_mode.empty()) names.emplace_back(quant_pass(v.quant_mode));
  for (const auto& name : names) {
    if (name == "add_kv_cache" && v.kv_cache == 0) continue;
    ctx.counters.clear();
    ctx.explain_lines.clear();
    try {
      fastopt::passes::find_pass(name)->run(model, ctx);
    } catch (const fastopt::ModelError& e) {
      if (e.what()[0] == '\0') fuzz::finding(name + " threw a ModelError with an empty message");
      return false;
    }
  }
  return true;
}

void check_reads_back(std::shared_ptr<const fastopt::Buffer> bytes, const fastopt::Model& model,
                      const char* how) {
  std::unique_ptr<fastopt::Model> again;
  try {
    again = fastopt::read_model_from_buffer(std::move(bytes), g_base_dir);
    again->verify();
  } catch (const fastopt::ModelError& e) {
    fuzz::finding(std::string("the optimized model, ") + how + ", does not read back: " + e.what());
  }
  if (again->op_counts() != model.op_counts()) {
    fuzz::finding(std::string("op counts changed in the round trip (") + how + ")");
  }
  fuzz::walk_model(*again);
}

void check_file_round_trip(const fastopt::Model& model) {
  const std::string path = g_out_dir + "/model.onnx";
  fastopt::SaveOptions options;
  options.external = fastopt::SaveOptions::External::kAlways;
  options.size_threshold = 16;
  try {
    fastopt::write_model_file(model, path, options);
  } catch (const fastopt::ModelError& e) {
    fuzz::finding(std::string("a verified model does not save: ") + e.what());
  }
  try {
    auto again = fastopt::read_model_file(path);
    again->verify();
    if (again->op_counts() != model.op_counts()) fuzz::finding("op counts changed in the save");
    fuzz::walk_model(*again);
  } catch (const fastopt::ModelError& e) {
    fuzz::finding(std::string("a saved model does not read back: ") + e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  g_base_dir = fuzz::make_base_dir();
  g_out_dir = fuzz::make_base_dir();
  g_passes = pass_list();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto buffer = std::make_shared<fastopt::OwnedBuffer>(
      std::string(reinterpret_cast<const char*>(data), size));
  std::unique_ptr<fastopt::Model> model;
  try {
    model = fastopt::read_model_from_buffer(buffer, g_base_dir);
    model->verify();
  } catch (const fastopt::ModelError&) {
    return 0;  // the reader fuzzer's business
  }
  const Variant v = variant_for(size);
  if (!run_passes(*model, v)) return 0;
  try {
    model->verify();
  } catch (const fastopt::ModelError& e) {
    fuzz::finding(std::string("the passes left a model that does not verify: ") + e.what());
  }
  fuzz::walk_model(*model);
  std::string bytes;
  try {
    bytes = fastopt::serialize_model(*model);
  } catch (const fastopt::ModelError& e) {
    fuzz::finding(std::string("the optimized model does not serialize: ") + e.what());
  }
  check_reads_back(std::make_shared<fastopt::OwnedBuffer>(std::move(bytes)), *model, "serialized");
  if (v.save_to_file) check_file_round_trip(*model);
  return 0;
}
