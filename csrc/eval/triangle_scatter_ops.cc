// Trilu and ScatterND for the evaluator (evaluator_class.h): the ops transformers 4.49's causal
// mask builder exports (a triu of a full masking matrix; the padding merged by a slice
// assignment, which TorchScript exports as ScatterND). Semantics as ONNX Runtime's CPU kernels.
#include "eval/evaluator_class.h"

namespace fastopt::eval {

// Trilu (opset 14): keeps the upper (upper=1: j - i >= k) or lower (j - i <= k) triangle of the
// last two axes and zeroes the rest (all-zero bytes: +0.0 for floats, false, 0).
Result Evaluator::trilu() {
  auto x = in(0);
  if (!x || opset_ < 14 || !is_bytewise(x->dtype) || x->dims.size() < 2) return std::nullopt;
  int64_t k = 0;
  if (has_input(1)) {
    auto ks = ints_in(1);
    if (!ks || ks->size() != 1 || inputs_[1]->dtype() != kInt64) return std::nullopt;
    k = (*ks)[0];
  }
  const int64_t upper = attr_i("upper").value_or(1);
  if (upper != 0 && upper != 1) return std::nullopt;
  if (!fits(x->dtype, x->dims)) return std::nullopt;
  const int64_t rows = x->dims[x->dims.size() - 2], cols = x->dims.back();
  std::string bytes(reinterpret_cast<const char*>(x->bytes.data()), x->numel * x->esize);
  const uint64_t mats = product(x->dims, 0, static_cast<int64_t>(x->dims.size()) - 2);
  for (uint64_t m = 0; m < mats; ++m) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const bool keep = upper ? j - i >= k : j - i <= k;
        if (keep) continue;
        const uint64_t e = (m * static_cast<uint64_t>(rows) + static_cast<uint64_t>(i)) *
                               static_cast<uint64_t>(cols) +
                           static_cast<uint64_t>(j);
        std::memset(&bytes[e * x->esize], 0, x->esize);
      }
    }
  }
  return one(owned(x->dtype, x->dims, std::move(bytes)));
}

// ScatterND (opset 11; reduction "none" only): a copy of data with the slices the int64 index
// tuples name replaced by updates. Declined where ONNX leaves the result undefined (two tuples
// naming one slice) and for an index out of [0, dim) (ONNX Runtime rejects out-of-range ones;
// negative ones are left to it).
Result Evaluator::scatter_nd() {
  auto data = in(0), idx = in(1), upd = in(2);
  if (!data || !idx || !upd || opset_ < 11 || idx->dtype != kInt64 || upd->dtype != data->dtype ||
      !is_bytewise(data->dtype)) {
    return std::nullopt;
  }
  if (const Attribute* a = n_.attribute("reduction"); a && a->s && *a->s != "none") {
    return std::nullopt;
  }
  if (idx->dims.empty()) return std::nullopt;
  const int64_t k = idx->dims.back();
  const size_t r = data->dims.size();
  if (k < 1 || static_cast<size_t>(k) > r) return std::nullopt;
  // updates' shape: indices.shape[:-1] + data.shape[k:].
  Dims want(idx->dims.begin(), idx->dims.end() - 1);
  want.insert(want.end(), data->dims.begin() + k, data->dims.end());
  if (want != upd->dims || !fits(data->dtype, data->dims)) return std::nullopt;
  const uint64_t inner = product(data->dims, k) * data->esize;
  const uint64_t tuples = idx->numel / static_cast<uint64_t>(k);
  std::string bytes(reinterpret_cast<const char*>(data->bytes.data()), data->numel * data->esize);
  std::vector<bool> written(data->numel / std::max<uint64_t>(product(data->dims, k), 1), false);
  for (uint64_t t = 0; t < tuples; ++t) {
    uint64_t offset = 0;
    for (int64_t a = 0; a < k; ++a) {
      const int64_t dim = data->dims[static_cast<size_t>(a)];
      const int64_t i = idx->i64(t * static_cast<uint64_t>(k) + static_cast<uint64_t>(a));
      if (i < 0 || i >= dim) return std::nullopt;
      offset = offset * static_cast<uint64_t>(dim) + static_cast<uint64_t>(i);
    }
    if (written[offset]) return std::nullopt;  // duplicate: undefined in ONNX
    written[offset] = true;
    if (inner) std::memcpy(&bytes[offset * inner], upd->bytes.data() + t * inner, inner);
  }
  return one(owned(data->dtype, data->dims, std::move(bytes)));
}

}  // namespace fastopt::eval
