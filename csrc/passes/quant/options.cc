#include "passes/quant/options.h"

#include <fnmatch.h>

#include <algorithm>

#include "ir/error.h"

namespace fastopt::quant {
namespace {

std::string text(const passes::PassContext& ctx, const std::string& key,
                 const std::string& fallback) {
  auto it = ctx.text_options.find(key);
  return it == ctx.text_options.end() ? fallback : it->second;
}

// The non-empty comma-separated parts of `text`.
std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string part = text.substr(start, comma - start);
    if (!part.empty()) parts.push_back(part);
    start = comma + 1;
  }
  return parts;
}

}  // namespace

bool QuantOptions::forced_int8(const std::string& name) const {
  return std::find(int8_weights.begin(), int8_weights.end(), name) != int8_weights.end();
}

std::string QuantOptions::excluded(const std::string& name) const {
  for (const std::string& g : exclude) {
    if (!name.empty() && ::fnmatch(g.c_str(), name.c_str(), 0) == 0) return g;
  }
  return "";
}

std::string block_size_problem(int64_t block_size) {
  if (block_size >= kMinBlockSize && block_size <= kMaxBlockSize &&
      (block_size & (block_size - 1)) == 0) {
    return "";
  }
  return "block size must be a power of two in " + std::to_string(kMinBlockSize) + ".." +
         std::to_string(kMaxBlockSize) + " (what onnxruntime's MatMulNBits kernels run), not " +
         std::to_string(block_size);
}

QuantOptions read_options(const passes::PassContext& ctx) {
  QuantOptions o;
  o.mode = text(ctx, "quant_mode", "");
  const int64_t bits = option(ctx, "quant_bits", o.mode == "int8" ? 8 : 4);
  if (bits != 4 && bits != 8) {
    throw ModelError("quant_bits must be 4 or 8, not " + std::to_string(bits));
  }
  o.bits = static_cast<int>(bits);
  o.block_size = option(ctx, "quant_block_size", 32);
  if (std::string problem = block_size_problem(o.block_size); !problem.empty()) {
    throw ModelError(problem);
  }
  o.symmetric = option(ctx, "quant_symmetric", 1) != 0;
  o.accuracy_level = option(ctx, "quant_accuracy_level", -1);
  if (o.accuracy_level < -1 || o.accuracy_level > 4) {
    throw ModelError(
        "accuracy level must be 0 (unset), 1 (fp32), 2 (fp16), 3 (bf16) or 4 "
        "(int8), not " +
        std::to_string(o.accuracy_level));
  }
  o.exclude = split_commas(text(ctx, "quant_exclude", ""));
  o.int8_weights = split_commas(text(ctx, "quant_int8_weights", ""));
  o.lm_head = text(ctx, "quant_lm_head", "");
  if (!o.lm_head.empty() && o.lm_head != "keep" && o.lm_head != "int4" && o.lm_head != "int8") {
    throw ModelError("lm_head must be keep, int4 or int8, not '" + o.lm_head + "'");
  }
  o.embeddings = text(ctx, "quant_embeddings", "keep");
  if (o.embeddings != "keep" && o.embeddings != "int4" && o.embeddings != "int8") {
    throw ModelError("embeddings must be keep, int4 or int8, not '" + o.embeddings + "'");
  }
  o.per_channel = option(ctx, "quant_per_channel", 0) != 0;
  o.keep_io_types = option(ctx, "quant_keep_io_types", 0) != 0;
  const int64_t threads = option(ctx, "quant_threads", 0);
  if (threads < 0 || threads > 4096) {
    throw ModelError("threads must be 0 (all cores) or a positive count, not " +
                     std::to_string(threads));
  }
  o.threads = static_cast<int>(threads);
  o.tmpdir = text(ctx, "quant_tmpdir", "");
  o.cuda = option(ctx, "cuda", 0) != 0;
  const int64_t method = option(ctx, "quant_method", kDefaultMethod);
  if (method < static_cast<int64_t>(Method::kRtn) || method > static_cast<int64_t>(Method::kGptq)) {
    throw ModelError("quant_method must be 0 (rtn), 1 (search) or 2 (gptq), not " +
                     std::to_string(method));
  }
  o.method = static_cast<Method>(method);
  o.importance = text(ctx, "quant_importance", "");
  o.hessian = text(ctx, "quant_hessian", "");
  if (o.method == Method::kGptq && o.hessian.empty()) {
    throw ModelError(
        "quant_method gptq needs quant_hessian: the Hessian factors calibration writes "
        "(fastopt quantize --method gptq --calibration FILE|builtin)");
  }
  return o;
}

int64_t QuantOptions::accuracy_for(int32_t dtype) const {
  if (accuracy_level >= 0) return accuracy_level;
  return cuda || dtype != 1 ? 0 : 4;
}

}  // namespace fastopt::quant
