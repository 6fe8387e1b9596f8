#include "quant/gptq.h"

#include <algorithm>

#include "ir/error.h"
#include "quant/vector_clones.h"

namespace fastopt::quant {
namespace {

// row -= a * e, across the tile's columns.
FASTOPT_VECTOR_CLONES void feed(float* __restrict row, float a, const float* __restrict e,
                                int64_t n) {
  for (int64_t c = 0; c < n; ++c) row[c] -= a * e[c];
}

// e = (row - deq) / d: the row's rounding error scaled for the feedback.
FASTOPT_VECTOR_CLONES void scaled_error(const float* __restrict row, const float* __restrict deq,
                                        float inv_d, int64_t n, float* __restrict e) {
  for (int64_t c = 0; c < n; ++c) e[c] = (row[c] - deq[c]) * inv_d;
}

// Codes positions [i0, i0 + n) of the coding order one at a time (position i is row row_of(i) of
// w, coded by code(i, row, deq)), each row's error fed into the later positions' rows; the scaled
// errors go to e [n, cols].
template <class RowOf, class Code>
void code_rows(float* w, int64_t K, int64_t cols, const float* u, int64_t i0, int64_t n,
               RowOf row_of, Code code, float* e, float* deq) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = i0 + j;
    float* row = w + row_of(i) * cols;
    code(i, row, deq);
    const float d = u[i * K + i];
    if (!(d > 0.0f)) {
      throw ModelError("gptq: the Hessian factor's diagonal must be positive (row " +
                       std::to_string(i) + ")");
    }
    float* ej = e + j * cols;
    scaled_error(row, deq, 1.0f / d, cols, ej);
    for (int64_t k = i + 1; k < i0 + n; ++k) feed(w + row_of(k) * cols, u[i * K + k], ej, cols);
  }
}

// Along K: rows [r0, r0 + rows), one block's quantizer.
void code_block(float* w, int64_t K, int64_t cols, const float* u, int64_t r0, int64_t rows,
                BlockQuantizer& bq, float* e, float* deq) {
  code_rows(
      w, K, cols, u, r0, rows, [](int64_t i) { return i; },
      [&](int64_t i, float* row, float* out) { bq.code_row(i - r0, row, out); }, e, deq);
}

// Act order: positions [i0, i0 + n) of the order (rows perm[i]), each with its block's parameters.
void code_batch(float* w, int64_t K, int64_t cols, const float* u, const int64_t* perm, int64_t bs,
                int64_t i0, int64_t n, std::vector<BlockQuantizer>& bqs, float* e, float* deq) {
  code_rows(
      w, K, cols, u, i0, n, [perm](int64_t i) { return perm[i]; },
      [&](int64_t i, float* row, float* out) {
        bqs[static_cast<size_t>(perm[i] / bs)].code_row(perm[i] % bs, row, out);
      },
      e, deq);
}

}  // namespace

void gptq_columns_act_order(float* w, int64_t K, int64_t cols, const float* u, const int64_t* perm,
                            const BlockwiseSpec& spec, const float* importance,
                            std::vector<BlockQuantizer>& bqs, std::vector<float>& errors,
                            const std::function<void(int64_t kb, int64_t rows)>& emit) {
  const int64_t bs = spec.block_size, blocks = (K + bs - 1) / bs;
  bqs.assign(static_cast<size_t>(blocks), BlockQuantizer(spec));
  for (int64_t kb = 0; kb < blocks; ++kb) {  // static groups: from the original rows
    const int64_t r0 = kb * bs;
    bqs[static_cast<size_t>(kb)].choose(w + r0 * cols, cols, std::min(bs, K - r0), cols,
                                        importance ? importance + r0 : nullptr);
  }
  errors.resize(static_cast<size_t>((bs + 1) * cols));
  float* e = errors.data();
  float* deq = e + bs * cols;
  for (int64_t i0 = 0; i0 < K; i0 += bs) {  // lazy batches of bs positions of the order
    const int64_t n = std::min(bs, K - i0);
    code_batch(w, K, cols, u, perm, bs, i0, n, bqs, e, deq);
    for (int64_t k = i0 + n; k < K; ++k) {
      float* row = w + perm[k] * cols;
      for (int64_t j = 0; j < n; ++j) feed(row, u[(i0 + j) * K + k], e + j * cols, cols);
    }
  }
  for (int64_t kb = 0; kb < blocks; ++kb) emit(kb, std::min(bs, K - kb * bs));
}

void gptq_columns(float* w, int64_t K, int64_t cols, const float* u, const BlockwiseSpec& spec,
                  const float* importance, BlockQuantizer& bq, std::vector<float>& errors,
                  const std::function<void(int64_t kb, int64_t rows)>& emit) {
  const int64_t bs = spec.block_size;
  errors.resize(static_cast<size_t>((bs + 1) * cols));
  float* e = errors.data();
  float* deq = e + bs * cols;
  for (int64_t r0 = 0, kb = 0; r0 < K; r0 += bs, ++kb) {
    const int64_t rows = std::min(bs, K - r0);
    bq.choose(w + r0 * cols, cols, rows, cols, importance ? importance + r0 : nullptr);
    code_block(w, K, cols, u, r0, rows, bq, e, deq);
    emit(kb, rows);
    // The block's errors into every later row (row k stays in L1 while the block's rows pass).
    for (int64_t k = r0 + rows; k < K; ++k) {
      float* row = w + k * cols;
      for (int64_t j = 0; j < rows; ++j) feed(row, u[(r0 + j) * K + k], e + j * cols, cols);
    }
  }
}

}  // namespace fastopt::quant
