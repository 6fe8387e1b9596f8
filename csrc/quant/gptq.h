// GPTQ (Frantar et al., 2022): rounding with error feedback along K. For a weight W [K, N] read
// by X [tokens, K], the output error is sum over columns of e^T H e with H = X^T X (calibration,
// python/fastopt/quant/gptq.py); rounding row k alone leaves its error e_k, and the rows not yet
// rounded can absorb it: W[j] -= U[k, j] / U[k, k] * e_k for j > k, where U is the upper
// Cholesky factor of H^-1 (H^-1 = U^T U). Each column is independent, so a tile of columns is
// quantized whole along K, block by block:
//   - the block's scales (and zero points) are chosen when it starts, from its rows as earlier
//     blocks' errors left them (BlockQuantizer::choose: the search, weighted by the importance);
//   - its rows are coded one at a time, each row's error fed into the block's later rows;
//   - then the block's errors are fed into all later rows at once (GPTQ's lazy batch update),
//     a loop across the tile's columns.
// Identity H (U = I) is round to nearest with the block's parameters.
// Act order (gptq_columns_act_order): rows are coded in the order `perm` gives (the channels of
// largest H_kk first, so the rows that matter most are coded before the error piles up), with U
// the factor of the permuted H; MatMulNBits' blocks stay along K, so each block's parameters are
// chosen from the original rows before any is coded ("static groups"). Cost: K^2 / 2 multiply-adds
// per column (on top of the search); U is K x K floats, shared by the weights of one input.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "quant/blockwise.h"

namespace fastopt::quant {

// Quantizes w [K, cols] (row-major, rows `cols` floats apart) in place of its rounding: w's rows
// receive the earlier rows' errors as they are coded. `u`: the upper Cholesky factor of H^-1,
// row-major [K, K] (its lower triangle is not read); its diagonal must be > 0. After each block,
// calls emit(kb, rows) while `bq` holds that block's codes and parameters. `importance` (K
// floats or null) weights the search's parameter choice. `errors` is scratch.
void gptq_columns(float* w, int64_t K, int64_t cols, const float* u, const BlockwiseSpec& spec,
                  const float* importance, BlockQuantizer& bq, std::vector<float>& errors,
                  const std::function<void(int64_t kb, int64_t rows)>& emit);

// Act order: `perm` (K indices, a permutation) is the coding order and `u` the factor of
// H[perm][:, perm]. bqs (one per block, resized here) hold each block's codes and parameters;
// emit(kb, rows) is called for every block once all rows are coded.
void gptq_columns_act_order(float* w, int64_t K, int64_t cols, const float* u, const int64_t* perm,
                            const BlockwiseSpec& spec, const float* importance,
                            std::vector<BlockQuantizer>& bqs, std::vector<float>& errors,
                            const std::function<void(int64_t kb, int64_t rows)>& emit);

}  // namespace fastopt::quant
