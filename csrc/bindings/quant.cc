// The quantization kernels on one array, without a model or a file: what a tensor would lose at
// a given precision (the error allocating bits per tensor reads, python/fastopt quant's
// precision choices), computed block by block as quantize_weights does.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bindings/handles.h"
#include "ir/error.h"
#include "passes/quant/options.h"
#include "quant/blockwise.h"
#include "quant/weight_source.h"

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

// A 2-D float initializer read as MatMul's B [K, N] (`transposed`: stored [N, K], the tied
// lm_head), straight from the model's mapping like the pass reads it.
quant::WeightSource weight_source(const PyTensor& t, bool transposed) {
  const Tensor& x = *t.tensor;
  const int32_t dt = x.dtype();
  if (x.dims.size() != 2 || (dt != 1 && dt != 10 && dt != 16)) {
    throw ModelError("weight must be a 2-D float32/float16/bfloat16 tensor");
  }
  const int64_t K = transposed ? x.dims[1] : x.dims[0], N = transposed ? x.dims[0] : x.dims[1];
  quant::WeightSource src{x.bytes(), dt, K, N, transposed};
  src.check_readable();
  return src;
}

// Rows of K read at a time (and released once read: the pages leave the process).
constexpr int64_t kRowChunk = 64;

// Per column n: sum_k imp[k] W[k, n]^2.
py::array_t<double> weight_column_sums(const PyTensor& t, bool transposed, py::object importance) {
  const quant::WeightSource src = weight_source(t, transposed);
  const int64_t K = src.K, N = src.N;
  FloatArray imp;
  if (!importance.is_none()) {
    imp = importance.cast<FloatArray>();
    if (imp.ndim() != 1 || imp.shape(0) != K) {
      throw ModelError("importance must be 1-D of length K = " + std::to_string(K));
    }
  }
  py::array_t<double> out(N);
  double* acc = out.mutable_data();
  const float* iw = importance.is_none() ? nullptr : imp.data();
  {
    py::gil_scoped_release release;
    std::fill(acc, acc + N, 0.0);
    if (transposed) {  // stored rows are B's columns
      std::vector<float> col(static_cast<size_t>(K));
      for (int64_t c = 0; c < N; ++c) {
        src.read_columns(c, 1, col.data());
        double s = 0.0;
        for (int64_t k = 0; k < K; ++k)
          s += static_cast<double>(iw ? iw[k] : 1.0f) * col[k] * col[k];
        acc[c] = s;
        src.release(c, 1, 0, K, c + 1 < N);
      }
    } else {
      std::vector<float> rows(static_cast<size_t>(kRowChunk * N));
      for (int64_t r0 = 0; r0 < K; r0 += kRowChunk) {
        const int64_t n = std::min(kRowChunk, K - r0);
        src.read(r0, n, 0, N, rows.data());
        for (int64_t r = 0; r < n; ++r) {
          const double w = iw ? iw[r0 + r] : 1.0;
          const float* row = rows.data() + r * N;
          for (int64_t c = 0; c < N; ++c) acc[c] += w * row[c] * row[c];
        }
        src.release(r0, n, 0, N, r0 + n < K);
      }
    }
  }
  return out;
}

// Columns `columns` of B [K, N] as float32 [K, len(columns)].
FloatArray weight_columns(const PyTensor& t, bool transposed, const std::vector<int64_t>& columns) {
  const quant::WeightSource src = weight_source(t, transposed);
  const int64_t K = src.K, N = src.N, n = static_cast<int64_t>(columns.size());
  for (int64_t c : columns) {
    if (c < 0 || c >= N) throw ModelError("column " + std::to_string(c) + " out of range");
  }
  FloatArray out({K, n});
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    if (transposed) {
      std::vector<float> col(static_cast<size_t>(K));
      for (int64_t j = 0; j < n; ++j) {
        src.read_columns(columns[j], 1, col.data());
        for (int64_t k = 0; k < K; ++k) dst[k * n + j] = col[k];
        src.release(columns[j], 1, 0, K);
      }
    } else {
      std::vector<float> rows(static_cast<size_t>(kRowChunk * N));
      for (int64_t r0 = 0; r0 < K; r0 += kRowChunk) {
        const int64_t m = std::min(kRowChunk, K - r0);
        src.read(r0, m, 0, N, rows.data());
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t j = 0; j < n; ++j) dst[(r0 + r) * n + j] = rows[r * N + columns[j]];
        }
        src.release(r0, m, 0, N, r0 + m < K);
      }
    }
  }
  return out;
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def("weight_column_sums", &weight_column_sums, py::arg("weight"), py::arg("transposed") = false,
        py::arg("importance") = py::none(),
        "Per column n of a float initializer read as MatMul's B [K, N] (transposed: stored "
        "[N, K]): sum_k importance[k] W[k, n]^2, float64 [N]. Read from the model's mapping in "
        "row chunks whose pages are released once read, as quantize_weights reads.");
  m.def("weight_columns", &weight_columns, py::arg("weight"), py::arg("transposed"),
        py::arg("columns"),
        "Columns of a float initializer read as MatMul's B [K, N] (transposed: stored [N, K]) "
        "as float32 [K, len(columns)], read like weight_column_sums (pages released).");
  m.def("quantization_error", &quantization_error, py::arg("weight"), py::arg("bits") = 4,
        py::arg("block_size") = 32, py::arg("symmetric") = true, py::arg("method") = "search",
        py::arg("importance") = py::none(),
        "What quantize_weights would lose on a float weight [K, N] (MatMul's B; float16 is "
        "read as float32) without writing anything: {'rel_mse': sum imp[k] (w - w')^2 / "
        "sum imp[k] w^2, 'max_rel_error', 'mean_rel_error', 'sq_err'}. `importance`: float32 "
        "[K] weights per input channel (None: uniform). Scales as float32 weights store them.");
}

}  // namespace fastopt::bindings
