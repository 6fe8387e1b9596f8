// The quantization kernels on one array, without a model or a file: what a tensor would lose at
// a given precision (the error allocating bits per tensor reads, python/fastopt quant's
// precision choices), computed block by block as quantize_weights does.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/handles.h"
#include "ir/error.h"
#include "passes/quant/options.h"
#include "quant/blockwise.h"
#include "quant/gptq.h"
#include "quant/vector_clones.h"
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

// Per column n of a transposed source (stored [N, K]): sum_k imp[k] W[k, n]^2 into acc, and
// with row_max the largest |W[k, n]| of each row k.
void column_sums_transposed(const quant::WeightSource& src, const float* iw, double* acc,
                            double* row_max) {
  const int64_t K = src.K, N = src.N;
  std::vector<float> col(static_cast<size_t>(K));
  for (int64_t c = 0; c < N; ++c) {
    src.read_columns(c, 1, col.data());
    double s = 0.0;
    for (int64_t k = 0; k < K; ++k) s += (iw ? iw[k] : 1.0) * col[k] * col[k];
    acc[c] = s;
    if (row_max) {
      for (int64_t k = 0; k < K; ++k) row_max[k] = std::max<double>(row_max[k], std::fabs(col[k]));
    }
    src.release(c, 1, 0, K, c + 1 < N);
  }
}

// acc[c] += w * row[c]^2 over n columns (compiled for the wider vector units too).
FASTOPT_VECTOR_CLONES void add_row_squares(const float* __restrict row, int64_t n, double w,
                                           double* __restrict acc) {
  for (int64_t c = 0; c < n; ++c) acc[c] += w * row[c] * row[c];
}

// max |row[c]| over n columns. On the bits: for floats without their sign bit, unsigned order is
// the floats' order (a NaN, above infinity, wins), and an integer max reduction vectorizes where
// a float one does not without -ffast-math (that cost 1.4 s on the 7B shape's down weights).
FASTOPT_VECTOR_CLONES float row_abs_max(const float* __restrict row, int64_t n) {
  uint32_t m = 0;
  for (int64_t c = 0; c < n; ++c) {
    uint32_t bits;
    std::memcpy(&bits, row + c, sizeof bits);
    bits &= 0x7fffffffu;
    m = bits > m ? bits : m;
  }
  float out;
  std::memcpy(&out, &m, sizeof out);
  return out;
}

// The same over every `stride`-th row of a [K, N] source, times `stride` (an estimate when
// stride > 1: every row in chunks otherwise), and with row_max each row's largest |W[k, n]|.
// float32 rows are read in place (no copy).
void column_sums_rows(const quant::WeightSource& src, const float* iw, int64_t stride, double* acc,
                      double* row_max) {
  const int64_t K = src.K, N = src.N;
  const int64_t chunk =
      stride == 1
          ? std::max<int64_t>(
                1, std::min<int64_t>(kRowChunk, (int64_t{1} << 20) / std::max<int64_t>(N, 1)))
          : 1;
  const float* in_place = src.in_place();
  std::vector<float> rows(in_place ? 0 : static_cast<size_t>(chunk * N));
  for (int64_t r0 = 0; r0 < K; r0 += chunk == 1 ? stride : chunk) {
    const int64_t n = std::min(chunk, K - r0);
    const float* block = in_place ? in_place + r0 * N : rows.data();
    if (!in_place) src.read(r0, n, 0, N, rows.data());
    for (int64_t r = 0; r < n; ++r) {
      const double w = (iw ? iw[r0 + r] : 1.0) * static_cast<double>(stride);
      add_row_squares(block + r * N, N, w, acc);
      if (row_max) row_max[r0 + r] = row_abs_max(block + r * N, N);
    }
    src.release(r0, n, 0, N, r0 + n < K);
  }
}

// Per column n: sum_k imp[k] W[k, n]^2 (row_stride > 1: estimated from every row_stride-th row);
// `row_max` (a float64 [K] array, or None) gets each row's largest |W[k, n]| from the same read
// (0 for rows a stride skips).
py::array_t<double> weight_column_sums(const PyTensor& t, bool transposed, py::object importance,
                                       int64_t row_stride, py::object row_max) {
  const quant::WeightSource src = weight_source(t, transposed);
  if (row_stride < 1 || (transposed && row_stride != 1)) {
    throw ModelError("row_stride must be >= 1 (1 for a transposed weight)");
  }
  FloatArray imp;
  if (!importance.is_none()) {
    imp = importance.cast<FloatArray>();
    if (imp.ndim() != 1 || imp.shape(0) != src.K) {
      throw ModelError("importance must be 1-D of length K = " + std::to_string(src.K));
    }
  }
  double* maxima = nullptr;
  py::array_t<double> maxima_array;
  if (!row_max.is_none()) {
    if (!py::isinstance<py::array_t<double>>(row_max)) {
      throw ModelError("row_max must be a float64 array of length K");
    }
    maxima_array = row_max.cast<py::array_t<double>>();
    if (maxima_array.ndim() != 1 || maxima_array.shape(0) != src.K ||
        !(maxima_array.flags() & py::array::c_style) || !maxima_array.writeable()) {
      throw ModelError("row_max must be a writable float64 array of length K = " +
                       std::to_string(src.K));
    }
    maxima = maxima_array.mutable_data();
  }
  py::array_t<double> out(src.N);
  double* acc = out.mutable_data();
  const float* iw = importance.is_none() ? nullptr : imp.data();
  py::gil_scoped_release release;
  std::fill(acc, acc + src.N, 0.0);
  if (maxima) std::fill(maxima, maxima + src.K, 0.0);
  if (transposed) {
    column_sums_transposed(src, iw, acc, maxima);
  } else {
    column_sums_rows(src, iw, row_stride, acc, maxima);
  }
  return out;
}

// Rows [r0, r0 + rows) x `columns` (all when empty) of B [K, N] as float32 [rows, n].
FloatArray weight_rows(const PyTensor& t, bool transposed, int64_t r0, int64_t rows,
                       std::vector<int64_t> columns) {
  const quant::WeightSource src = weight_source(t, transposed);
  const int64_t K = src.K, N = src.N;
  if (r0 < 0 || rows < 0 || r0 + rows > K) throw ModelError("rows out of range");
  if (columns.empty()) {
    columns.resize(static_cast<size_t>(N));
    for (int64_t c = 0; c < N; ++c) columns[static_cast<size_t>(c)] = c;
  }
  for (int64_t c : columns) {
    if (c < 0 || c >= N) throw ModelError("column " + std::to_string(c) + " out of range");
  }
  const int64_t n = static_cast<int64_t>(columns.size());
  FloatArray out({rows, n});
  float* dst = out.mutable_data();
  py::gil_scoped_release release;
  if (transposed) {  // stored rows are B's columns
    std::vector<float> col(static_cast<size_t>(K));
    for (int64_t j = 0; j < n; ++j) {
      src.read_columns(columns[j], 1, col.data());
      for (int64_t r = 0; r < rows; ++r) dst[r * n + j] = col[r0 + r];
      src.release(columns[j], 1, 0, K);
    }
    return out;
  }
  // (a wide weight, an lm_head [K, vocab], in fewer rows at a time: at most ~4 MB of floats)
  const int64_t chunk = std::max<int64_t>(
      1, std::min<int64_t>(kRowChunk, (int64_t{1} << 20) / std::max<int64_t>(N, 1)));
  std::vector<float> buf(static_cast<size_t>(chunk * N));
  for (int64_t done = 0; done < rows; done += chunk) {
    const int64_t m = std::min(chunk, rows - done);
    src.read(r0 + done, m, 0, N, buf.data());
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < n; ++j) dst[(done + r) * n + j] = buf[r * N + columns[j]];
    }
    src.release(r0 + done, m, 0, N);
  }
  return out;
}

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// `order` as a permutation of 0..K-1 (empty for None); ModelError otherwise.
Int64Array checked_order(const py::object& order, int64_t K) {
  if (order.is_none()) return Int64Array();
  Int64Array perm = order.cast<Int64Array>();
  bool ok = perm.ndim() == 1 && perm.shape(0) == K;
  std::vector<bool> seen(static_cast<size_t>(K), false);
  for (int64_t i = 0; ok && i < K; ++i) {
    const int64_t v = perm.data()[i];
    ok = v >= 0 && v < K && !seen[static_cast<size_t>(v)];
    if (ok) seen[static_cast<size_t>(v)] = true;
  }
  if (!ok) throw ModelError("order must be a permutation of 0..K-1");
  return perm;
}

// `importance` as K floats (empty for None); ModelError otherwise.
FloatArray checked_importance(const py::object& importance, int64_t K) {
  if (importance.is_none()) return FloatArray();
  FloatArray imp = importance.cast<FloatArray>();
  if (imp.ndim() != 1 || imp.shape(0) != K) {
    throw ModelError("importance must be 1-D of length K = " + std::to_string(K));
  }
  return imp;
}

// Block kb's rows as MatMulNBits reads them, (q - zero point) * stored scale, into dst [K, N].
void dequantize_block(const quant::BlockQuantizer& b, int64_t kb, int64_t rows, int64_t N,
                      int64_t block_size, float* dst) {
  const uint8_t* q = b.codes();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < N; ++c) {
      float scale;
      b.store_scale(c, reinterpret_cast<uint8_t*>(&scale));
      dst[(kb * block_size + r) * N + c] =
          (static_cast<float>(q[r * N + c]) - b.zero_point(c)) * scale;
    }
  }
}

// GPTQ on one array (quant/gptq.h), as quantize_weights rounds a weight with a Hessian factor:
// returns the dequantized weight [K, N] (float32 scales).
py::array_t<float> gptq_dequantize(const FloatArray& weight, const FloatArray& factor, int bits,
                                   int64_t block_size, bool symmetric, const std::string& params,
                                   py::object importance, py::object order) {
  if (weight.ndim() != 2) throw ModelError("weight must be 2-D [K, N]");
  const int64_t K = weight.shape(0), N = weight.shape(1);
  if (factor.ndim() != 2 || factor.shape(0) != K || factor.shape(1) != K) {
    throw ModelError("factor must be [K, K] with K = " + std::to_string(K));
  }
  if (bits != 4 && bits != 8) throw ModelError("bits must be 4 or 8");
  if (std::string problem = quant::block_size_problem(block_size); !problem.empty()) {
    throw ModelError(problem);
  }
  if (params != "rtn" && params != "search") throw ModelError("params must be rtn or search");
  const FloatArray imp = checked_importance(importance, K);
  const Int64Array perm = checked_order(order, K);
  const bool act_order = !order.is_none();
  quant::BlockwiseSpec spec;
  spec.bits = bits;
  spec.block_size = block_size;
  spec.symmetric = symmetric;
  spec.method = params == "rtn" ? quant::Method::kRtn : quant::Method::kGptq;
  std::vector<float> w(weight.data(), weight.data() + K * N);
  py::array_t<float> out({K, N});
  float* dst = out.mutable_data();
  const float* iw = importance.is_none() ? nullptr : imp.data();
  {
    py::gil_scoped_release release;
    quant::BlockQuantizer bq(spec);
    std::vector<quant::BlockQuantizer> bqs;
    std::vector<float> errors;
    auto emit = [&](int64_t kb, int64_t rows) {
      dequantize_block(act_order ? bqs[static_cast<size_t>(kb)] : bq, kb, rows, N, block_size, dst);
    };
    if (act_order) {
      gptq_columns_act_order(w.data(), K, N, factor.data(), perm.data(), spec, iw, bqs, errors,
                             emit);
    } else {
      gptq_columns(w.data(), K, N, factor.data(), spec, iw, bq, errors, emit);
    }
  }
  return out;
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def("weight_column_sums", &weight_column_sums, py::arg("weight"), py::arg("transposed") = false,
        py::arg("importance") = py::none(), py::arg("row_stride") = 1,
        py::arg("row_max") = py::none(),
        "Per column n of a float initializer read as MatMul's B [K, N] (transposed: stored "
        "[N, K]): sum_k importance[k] W[k, n]^2, float64 [N] (row_stride > 1: from every "
        "row_stride-th row, times row_stride). Read from the model's mapping in "
        "row chunks whose pages are released once read, as quantize_weights reads. "
        "row_max, a writable float64 [K] array, gets each row's largest |W[k, n]| from the "
        "same read (0 for rows a stride skips).");
  m.def("weight_rows", &weight_rows, py::arg("weight"), py::arg("transposed"), py::arg("start"),
        py::arg("rows"), py::arg("columns") = std::vector<int64_t>{},
        "Rows [start, start + rows) and `columns` (all when empty) of a float initializer read "
        "as MatMul's B [K, N] (transposed: stored [N, K]) as float32 [rows, len(columns)], read "
        "like weight_column_sums (pages released).");
  m.def("quantization_error", &quantization_error, py::arg("weight"), py::arg("bits") = 4,
        py::arg("block_size") = 32, py::arg("symmetric") = true, py::arg("method") = "search",
        py::arg("importance") = py::none(),
        "What quantize_weights would lose on a float weight [K, N] (MatMul's B; float16 is "
        "read as float32) without writing anything: {'rel_mse': sum imp[k] (w - w')^2 / "
        "sum imp[k] w^2, 'max_rel_error', 'mean_rel_error', 'sq_err'}. `importance`: float32 "
        "[K] weights per input channel (None: uniform). Scales as float32 weights store them.");
  m.def("gptq_dequantize", &gptq_dequantize, py::arg("weight"), py::arg("factor"),
        py::arg("bits") = 4, py::arg("block_size") = 32, py::arg("symmetric") = true,
        py::arg("params") = "search", py::arg("importance") = py::none(),
        py::arg("order") = py::none(),
        "GPTQ-rounded float weight [K, N] (quantize_weights' quant_method gptq, float32 scales), "
        "dequantized: `factor` is the upper Cholesky factor of H^-1 [K, K]; `params` chooses "
        "each block's scale and zero point by round to nearest or by the search. `order` (int64 "
        "[K]): act order, rows coded in that order with `factor` the permuted H's, each "
        "block's parameters chosen before any row is coded.");
}

}  // namespace fastopt::bindings
