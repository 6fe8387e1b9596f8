// The quantization kernels on one array, without a model or a file: what a tensor would lose at
// a given precision (the error allocating bits per tensor reads, python/fastopt quant's
// precision choices), computed block by block as quantize_weights does.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "bindings/handles.h"
#include "ir/error.h"
#include "passes/quant/options.h"
#include "quant/blockwise.h"

namespace fastopt::bindings {
namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

py::dict quantization_error(const FloatArray& weight, int bits, int64_t block_size, bool symmetric,
                            const std::string& method, py::object importance) {
  if (weight.ndim() != 2) throw ModelError("weight must be 2-D [K, N]");
  if (bits != 4 && bits != 8) throw ModelError("bits must be 4 or 8");
  if (std::string problem = quant::block_size_problem(block_size); !problem.empty()) {
    throw ModelError(problem);
  }
  if (method != "rtn" && method != "search") throw ModelError("method must be rtn or search");
  const int64_t K = weight.shape(0), N = weight.shape(1);
  FloatArray imp;
  if (!importance.is_none()) {
    imp = importance.cast<FloatArray>();
    if (imp.ndim() != 1 || imp.shape(0) != K) {
      throw ModelError("importance must be 1-D of length K = " + std::to_string(K));
    }
  }
  quant::BlockwiseSpec spec;
  spec.bits = bits;
  spec.block_size = block_size;
  spec.symmetric = symmetric;
  spec.method = method == "rtn" ? quant::Method::kRtn : quant::Method::kSearch;
  quant::ErrorSums err;
  const float* w = weight.data();
  const float* iw = importance.is_none() ? nullptr : imp.data();
  {
    py::gil_scoped_release release;
    quant::BlockQuantizer bq(spec);
    constexpr int64_t kChunk = 256;  // as quantize_job.cc: a block's rows stay in L1
    for (int64_t r0 = 0; r0 < K; r0 += block_size) {
      const int64_t rows = std::min(block_size, K - r0);
      for (int64_t c0 = 0; c0 < N; c0 += kChunk) {
        bq.run(w + r0 * N + c0, N, rows, std::min(kChunk, N - c0), err, iw ? iw + r0 : nullptr);
      }
    }
  }
  py::dict d;
  d["rel_mse"] = err.rel_mse();
  d["max_rel_error"] = err.max_abs > 0 ? static_cast<double>(err.max_err) / err.max_abs : 0.0;
  d["mean_rel_error"] = err.abs > 0 ? err.abs_err / err.abs : 0.0;
  d["sq_err"] = err.sq_err;
  return d;
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def("quantization_error", &quantization_error, py::arg("weight"), py::arg("bits") = 4,
        py::arg("block_size") = 32, py::arg("symmetric") = true, py::arg("method") = "search",
        py::arg("importance") = py::none(),
        "What quantize_weights would lose on a float weight [K, N] (MatMul's B; float16 is "
        "read as float32) without writing anything: {'rel_mse': sum imp[k] (w - w')^2 / "
        "sum imp[k] w^2, 'max_rel_error', 'mean_rel_error', 'sq_err'}. `importance`: float32 "
        "[K] weights per input channel (None: uniform). Scales as float32 weights store them.");
}

}  // namespace fastopt::bindings
