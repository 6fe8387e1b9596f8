// Rows whose every key is masked (pad queries): the internal op gives 0 there, or with
// masked_value the export's own softmax over all keys (internal_op.h). The ops the lowerings
// build give something else there: MultiHeadAttention / GroupQueryAttention over a bias, a
// finite average of the keys their kernels did not exclude; Attention-23 with a bool mask, 0.
// Where the two differ the lowering keeps the op's rows that see a key and gives the others
// what the internal op gives:
//
//   Where(rows_with_keys(mask), Y, 0 | the mean over T of V)
//
// rows_with_keys = ReduceSum(Cast(mask, float), last axis) > 0, built once per mask. A masking
// value that does not absorb the scores (masked_value) only a lowering adding that value to
// every key itself reproduces (fp32 MultiHeadAttention's bias, Attention-23's float mask).
#pragma once

#include <cstdint>
#include <string>

#include "ir/graph.h"
#include "pattern/rewrite.h"

namespace fastopt::passes {

// What a node's all-masked rows must give.
enum class MaskedRows {
  kZero,    // 0 (the export masked with -inf)
  kMean,    // the mean of V over all keys (masked_rows_mean: a value absorbing the scores)
  kScores,  // softmax(scores + masked_value) over all keys (a value that does not)
  kUnread,  // anything: add_kv_cache's own mask, whose all-masked rows nothing reads
};
MaskedRows masked_rows(const Node* attention);
// masked_value, or 0 without one.
double masked_value(const Node* attention);

// True when v added in `dtype` rounds every score to v, so that softmax(scores + v) is the plain
// mean: fp32 / bf16 for |score| < 2^103 when v <= -2^104 (a score that large overflows exp()
// anyway). fp16 at its lowest, -65504, rounds only |score| < 16 to v: beyond, the export's row
// is fp16's rounding of the sum to multiples of 32, which no kernel adding in fp32 reproduces
// and no runtime promises; it is taken as the mean it approximates (the one rule here that is
// not exact: tests/attention/test_masked_rows.py checks real positions only for fp16).
bool absorbs_scores(double v, int32_t dtype);

// A finite masking value that absorbs the scores in `dtype` (masked_rows_mean's rows), short of
// the dtype's lowest, which ORT 1.32's Attention-23 reads as -inf: -2^127 (exact in fp32 and
// bf16), fp16's -61440 (absorbing as much as its lowest, -65504).
double absorbing_mask_value(int32_t dtype);

// Why rows_with_keys cannot be built for `mask` broadcasting to (B, S, Hq*Dv) outputs (empty
// when it can): a 4-D mask's dim 1 (a 3-D mask's dim 0) must be 1.
std::string rows_with_keys_refusal(const Value* mask);

// The rows that see at least one key (bool): (.., S|1, 1), broadcastable to (B, Hq, S, T) with
// `bnsh` (the bias), else to (B, S, Hq*Dv) (the 3-D ops' Q and Y).
Value* rows_with_keys(pattern::Rewriter& rw, Value* mask, bool bnsh);

// y (B, S, Hq*Dv) with the rows that see no key replaced by what `rule` gives: 0 (kZero) or the
// mean over the keys of V (kMean), each query head h reading kv head h / (hq / hkv), from `v4`
// (B, Hkv, T, Dv) or, when null, `v3` (B, T, Hkv*Dv).
Value* fix_masked_rows(pattern::Rewriter& rw, Value* y, Value* mask, MaskedRows rule, Value* v4,
                       Value* v3, int64_t hq, int64_t hkv, int32_t dtype);

}  // namespace fastopt::passes
