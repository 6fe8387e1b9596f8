// Proves what an attention's mask is by evaluating its subgraph on probe inputs (add_kv_cache
// replaces the mask only when this says it is the causal pattern it installs, with or without
// a sliding window). The walk, the evaluation and the reading of a mask are mask_walker.h's,
// shared with the seq2seq decoder's proof (kv_cache_cross_mask.cc); this file holds the probes
// and the pattern of a decoder-only model.
//
// The subgraph is the mask's ancestry back to graph inputs and constants. It is admitted only
// when it reads:
//   - attention_mask (values and shape),
//   - input_ids and, for a model with a cache, the past_* inputs, for their shapes only (every
//     path from them to the mask passes a Shape or Size; the values never matter),
//   - position_ids for its shape only, when each of its dims is fixed or input_ids' batch or
//     sequence symbol (dynamo exports may read S as Shape(position_ids)[1]: a shape read, not
//     the positions; its values stay refused),
//   - constants,
// through ai.onnx ops the native constant evaluator computes bit-exactly (fold_constants.h:
// index, compare and logic ops, Range, Where, Expand, GatherND, Trilu, ScatterND, ...). A Shape
// of an activation (TorchScript exports take S from the embeddings' shape, and transformers
// 4.49 slices the mask to Shape(keys)) is answered from its type when every dim it reads is
// fixed, a symbol of the inputs' dims (batch, sequence, total or past length) or a sum "a+b" of
// them, as the rest of the pipeline trusts shape inference; an untyped RotaryEmbedding output
// has its input's shape, an untyped Concat the sum on its axis. A dim of unknown size is
// allowed only where constant Gathers of the shape never read it. Anything else (position_ids'
// values, float arithmetic on activations, an op the evaluator lacks) is refused: the mask then is
// not known.
//
// Probes (P = past length, S = new tokens, T = P + S; P = 0 without a cache), each a batch of
// attention_mask rows:
//   - every T in 1..16, in one batch: the unpadded row, every left and every right padding,
//     every single hole and alternating holes (a standard cache's padding between a short
//     prompt and the tokens generated after the longest row); and a batch of one, unpadded;
//   - T = c-1 .. c+2 around every integer constant c of the subgraph (initializers and what its
//     input-free nodes compute) with 16 < c <= 2048, with
//     rows unpadded, padded by 1 and by T/2 on either side, and a hole; a constant of
//     2048 < |c| < 2^31 - 1 (a window this check would have to probe beyond) refuses the mask,
//     unless it is only an offset compared with positions (prove_far_offset: the subgraph is
//     proven with c replaced by two probed values instead);
//   - with a cache, S in {1, 2, T} for each T.
// The mask must agree on every probe, for every query that attention_mask keeps, at every key,
// with transformers' pattern: key t allowed iff attention_mask[b, t] != 0, t <= P + s, and
// (window w > 0) t > P + s - w (positions are indices: padding inside the window counts). Its
// window w is read off the longest unpadded probe.
//
// Why these probes suffice for the admitted subgraphs: their inputs are the lengths and the 0/1
// padding column; the ops compare Range-made index grids with each other, with the lengths and
// with constants, and combine the results elementwise. Such a mask changes with the lengths only
// where a length crosses a constant (or a small offset of one) of the subgraph, and each row's
// answer depends on its own padding column. The probes take every length up to 16, both sides of
// every constant up to 2048, and the paddings and holes a row can have, so a subgraph that
// agrees on all of them is the pattern. This is a check of the exporters' mask builders, not a
// decision procedure for arbitrary programs; what it admits is kept to the op set above for that
// reason.
// Pad queries' rows are not compared: a pad position's output reaches no kept position (no kept
// query may see a pad key, which the comparison checks), and its own output is don't-care.
#include "passes/kv_cache/mask_proof.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/cache_form.h"
#include "passes/kv_cache/mask_walker.h"

namespace fastopt::passes {
namespace {
using kv_cache::kAttentionMask;
using kv_cache::kExportedPastPrefix;
using kv_cache::kInputIds;
using kv_cache::kPositionIds;
using mask_walk::MaskInput;
using mask_walk::MaskWalker;
using mask_walk::Probe;
using mask_walk::TensorPtr;

constexpr int64_t kShortLengths = 16;  // every length up to this, with every padding

// Probe length slots: 0 batch, then S (new tokens), T (attention_mask's width), P (past), and
// the rows a sliding layer's past holds, min(P, rows).
enum Slot : size_t { kBatch = 0, kSeq = 1, kTotal = 2, kPast = 3, kRowsHeld = 4 };

class MaskProof {
 public:
  MaskProof(const Model& m, const Graph& g, const Node* att, bool with_past,
            const SlidingRows* sliding, bool reads_rows)
      : att_(att),
        with_past_(with_past),
        rows_(sliding ? sliding->rows : 0),
        reads_rows_(sliding && reads_rows),
        right_padded_only_(sliding && sliding->right_padded_only),
        walker_(m, g, inputs(g, with_past, sliding)) {}

  std::optional<MaskKind> run(std::string* why) {
    const std::vector<Value*>& in = att_->inputs();
    Value* mask = in.size() > 3 ? in[3] : nullptr;
    causal_ = int_attr_or(att_, "is_causal", 0) != 0;
    hq_ = int_attr_or(att_, "q_num_heads", 0);
    if (!mask) {
      return fail(why, causal_ ? "it has no mask (causal only): it ignores attention_mask, and the "
                                 "cached form applies it"
                               : "it has neither a mask nor is_causal");
    }
    if (hq_ <= 0) return fail(why, "no q_num_heads");
    std::string err;
    if (!walker_.admit(mask, &err)) return fail(why, err);
    const std::optional<int64_t> far = far_offset();
    if (!far) return prove(why);
    return prove_far_offset(*far, why);
  }

 private:
  // A constant beyond the probes (transformers 4.49's Qwen2 window of 4096 when the config
  // keeps one: Sub(cache_position, 4096) compared with the key positions), when there is one.
  std::optional<int64_t> far_offset() {
    std::vector<int64_t> constants = walker_.constants();
    std::string err;
    walker_.evaluate(make_probe(1, 1, {full_row(1)}, "length 1"), &err, &constants);
    for (int64_t c : constants) {
      const int64_t a = c < 0 ? -c : c;
      if (a > mask_walk::kMaxProbeLength && a < std::numeric_limits<int32_t>::max()) return c;
    }
    return std::nullopt;
  }

  // The mask with a constant c beyond the probes. When c is an offset compared with something
  // and nothing else (every use Add(x, c) or Sub(x, c), read only by Less/LessOrEqual/Greater/
  // GreaterOrEqual: MaskWalker::compared_offsets), the mask depends on c only through where a
  // length crosses c (or a small offset of it), the breakpoints the probes are placed around
  // (this file's header). The same subgraph with c replaced by a probed c' > 16, clear of the
  // other constants, crosses the same breakpoints in the same order, so it is proven the way
  // any mask is; done for two such c', the window must follow c' (then it is c: the window
  // comes from c) or stay the same (then c never changes the mask). No probe of c's length is
  // run (a 4096-row probe took over 13 minutes).
  std::optional<MaskKind> prove_far_offset(int64_t c, std::string* why) {
    const std::vector<const Value*> leaves = walker_.compared_offsets(c);
    if (leaves.empty()) return prove(why);  // refused: beyond the probes, used otherwise
    std::vector<int64_t> others;
    for (int64_t x : walker_.constants()) {
      if (x != c) others.push_back(x < 0 ? -x : x);
    }
    auto clear = [&](int64_t from) {
      int64_t v = from;
      while (std::any_of(others.begin(), others.end(),
                         [&](int64_t a) { return a >= v - 4 && a <= v + 4; })) {
        ++v;
      }
      return v;
    };
    const int64_t c1 = clear(kShortLengths + 8), c2 = clear(c1 + 9);
    std::optional<MaskKind> kinds[2];
    const int64_t tried[2] = {c1, c2};
    for (int i = 0; i < 2; ++i) {
      for (const Value* leaf : leaves) walker_.substitute(leaf, c < 0 ? -tried[i] : tried[i]);
      std::string err;
      kinds[i] = prove(&err);
      if (!kinds[i]) {
        return fail(why, "its subgraph holds the constant " + std::to_string(c) +
                             " (beyond the lengths the check probes), an offset compared with "
                             "positions; with it replaced by " +
                             std::to_string(tried[i]) + ", " + err);
      }
    }
    const int64_t abs_c = c < 0 ? -c : c;
    if (kinds[0]->window == c1 && kinds[1]->window == c2) return MaskKind{abs_c};
    if (kinds[0]->window == kinds[1]->window) return kinds[0];
    return fail(why, "its subgraph holds the constant " + std::to_string(c) +
                         ", an offset compared with positions, whose window neither follows it "
                         "nor stays (replaced by " +
                         std::to_string(c1) + " and " + std::to_string(c2) + ": windows " +
                         std::to_string(kinds[0]->window) + " and " +
                         std::to_string(kinds[1]->window) + ")");
  }

  // The proof on the probes, for the admitted subgraph as the walker evaluates it.
  std::optional<MaskKind> prove(std::string* why) {
    std::string err;
    // Constants the subgraph computes (Mul(256, 2) is a window of 512 too): the values of its
    // input-free nodes, from one evaluation.
    std::vector<int64_t> constants = walker_.constants();
    if (!walker_.evaluate(make_probe(1, 1, {full_row(1)}, "length 1"), &err, &constants)) {
      return fail(why, err);
    }
    auto lengths = mask_walk::probe_lengths(constants, kShortLengths, &err);
    if (!lengths) return fail(why, err);

    // The window, from the longest unpadded probe: the keys its last query sees.
    const int64_t longest = lengths->back();
    Probe full = make_probe(longest, longest, {full_row(longest)}, "unpadded");
    auto got = walker_.evaluate(full, &err);
    if (!got) return fail(why, err);
    if (!mask_walk::readable(**got)) {
      return fail(why, "the mask is not a tensor of rank <= 4 the check can read");
    }
    const ByteRef bytes = (*got)->bytes();
    int64_t visible = 0;
    for (int64_t t = 0; t < longest; ++t) {
      const int a = allowed(**got, bytes.data(), full, 0, 0, longest - 1, t);
      if (a < 0) return fail(why, "the mask is neither boolean nor 0 / a masking value");
      visible += a;
    }
    MaskKind kind;
    kind.window = visible < longest ? visible : 0;
    if (visible == 0) return fail(why, "the last query of an unpadded row sees no key");

    for (int64_t t : *lengths) {
      std::vector<int64_t> seqs = {t};
      if (with_past_) seqs = {1, 2, t};
      for (int64_t s : seqs) {
        if (s > t || (s == 2 && t < 3)) continue;
        for (const Probe& p : probes_of(t, s)) {
          auto r = walker_.evaluate(p, &err);
          if (!r) return fail(why, err);
          if (!matches(*r, p, kind.window, &err)) return fail(why, err);
        }
      }
    }
    return kind;
  }

  // attention_mask's values; the shapes of input_ids, of position_ids where it is tied to
  // input_ids' (positions_shape) and, with a cache, of the past_* inputs.
  static std::vector<MaskInput> inputs(const Graph& g, bool with_past, const SlidingRows* sliding) {
    std::vector<MaskInput> in = {{kAttentionMask, false, true, {{0, kBatch}, {1, kTotal}}},
                                 {kInputIds, false, false, {{0, kBatch}, {1, kSeq}}}};
    if (std::optional<MaskInput> pos = positions_shape(g)) in.push_back(std::move(*pos));
    for (size_t i = 0; with_past && sliding && i < sliding->pasts.size(); ++i) {
      in.push_back({sliding->pasts[i], false, false, {{0, kBatch}, {2, kRowsHeld}}});
    }
    if (with_past) in.push_back({kExportedPastPrefix, true, false, {{0, kBatch}, {2, kPast}}});
    return in;
  }

  // position_ids as a shape-only input: each of its dims fixed or one of input_ids' symbols
  // (batch: axis 0, new tokens: axis 1), which then has that probe length; nullopt otherwise
  // (a dim of its own would have no probe length: the walker refuses the read).
  static std::optional<MaskInput> positions_shape(const Graph& g) {
    const Value* ids = nullptr;
    const Value* pos = nullptr;
    for (const Value* v : g.inputs()) {
      if (v && v->name() == kInputIds) ids = v;
      if (v && v->name() == kPositionIds) pos = v;
    }
    auto symbol = [](const Value* v, size_t axis) -> const std::string* {
      if (!v || !v->type.known || !v->type.has_shape || axis >= v->type.dims.size()) {
        return nullptr;
      }
      const Dim& d = v->type.dims[axis];
      return d.param && !d.param->empty() ? &*d.param : nullptr;
    };
    if (!pos || !pos->type.known || !pos->type.has_shape || !symbol(ids, 0) || !symbol(ids, 1) ||
        *symbol(ids, 0) == *symbol(ids, 1)) {
      return std::nullopt;
    }
    MaskInput in{kPositionIds, false, false, {}};
    for (size_t axis = 0; axis < pos->type.dims.size(); ++axis) {
      if (pos->type.dims[axis].value) continue;  // fixed: read from the type
      const std::string* s = symbol(pos, axis);
      if (!s) return std::nullopt;
      if (*s == *symbol(ids, 0)) {
        in.lengths.emplace_back(axis, kBatch);
      } else if (*s == *symbol(ids, 1)) {
        in.lengths.emplace_back(axis, kSeq);
      } else {
        return std::nullopt;
      }
    }
    return in;
  }

  std::optional<MaskKind> fail(std::string* why, const std::string& what) {
    if (why) *why = what;
    return std::nullopt;
  }

  static std::vector<uint8_t> full_row(int64_t t) { return std::vector<uint8_t>(t, 1); }

  Probe make_probe(int64_t total, int64_t seq, std::vector<std::vector<uint8_t>> rows,
                   std::string what) const {
    Probe p;
    p.lengths = {static_cast<int64_t>(rows.size()), seq, total, total - seq,
                 std::min(total - seq, rows_)};
    p.rows = std::move(rows);
    p.what = std::move(what);
    return p;
  }
  std::vector<Probe> probes_of(int64_t total, int64_t seq) const {
    std::vector<std::vector<uint8_t>> rows = {full_row(total)};
    auto padded = [&](int64_t k, bool right) {
      std::vector<uint8_t> r(total, 1);
      for (int64_t i = 0; i < k; ++i) r[right ? total - 1 - i : i] = 0;
      rows.push_back(std::move(r));
    };
    auto holed = [&](int64_t at) {
      std::vector<uint8_t> r(total, 1);
      r[at] = 0;
      rows.push_back(std::move(r));
    };
    if (right_padded_only_) {
      for (int64_t k = 1; k < total; ++k) padded(k, true);
    } else if (total <= kShortLengths) {
      for (int64_t k = 1; k < total; ++k) padded(k, true);
      for (int64_t k = 1; k < total; ++k) padded(k, false);
      for (int64_t k = 1; k + 1 < total; ++k) holed(k);
      for (int64_t phase = 0; phase < 2 && total > 2; ++phase) {
        std::vector<uint8_t> r(total, 1);
        for (int64_t t = phase; t < total - 1; t += 2) r[t] = 0;
        rows.push_back(std::move(r));
      }
    } else {
      for (int64_t k : {int64_t{1}, total / 2}) {
        padded(k, true);
        padded(k, false);
      }
      holed(total / 2);
    }
    const std::string at = "length " + std::to_string(total) +
                           (with_past_ ? " (past " + std::to_string(total - seq) + ")" : "");
    return {make_probe(total, seq, {full_row(total)}, at + ", batch 1"),
            make_probe(total, seq, std::move(rows), at + ", padded rows and rows with holes")};
  }

  // 1 when the evaluated mask lets query s of row b see key t (any head: all must agree, which
  // matches() checks), 0 when it removes it, -1 for a value that is neither, -2 when it does not
  // broadcast.
  // Key t is the position: a sliding layer's attention holds positions P - min(P, rows) on
  // (the earlier ones are not among its keys: it cannot see them).
  int allowed(const Tensor& mask, const uint8_t* base, const Probe& p, int64_t b, int64_t h,
              int64_t s, int64_t t) const {
    const int64_t past = p.lengths[kPast], seq = p.lengths[kSeq];
    const int64_t held = reads_rows_ ? p.lengths[kRowsHeld] : past;  // past rows among the keys
    const int64_t j = t - (past - held);
    if (j < 0) return 0;
    const int64_t full[4] = {static_cast<int64_t>(p.rows.size()), hq_, seq, held + seq};
    const int64_t at[4] = {b, h, s, j};
    int v = mask_walk::read_mask(mask, base, full, at);
    if (v == 1 && causal_ && j > held + s) v = 0;  // is_causal, bottom-right aligned
    return v;
  }

  // Where a sliding layer's keys start, for a mismatch's message.
  std::string held_note(const Probe& p) const {
    const int64_t from = p.lengths[kPast] - p.lengths[kRowsHeld];
    if (!reads_rows_ || from == 0) return "";
    return " (its keys are the sliding cache's rows, positions " + std::to_string(from) +
           " on: a mask that reads their padding from attention_mask's first columns reads "
           "other positions' padding)";
  }

  bool matches(const TensorPtr& mask, const Probe& p, int64_t window, std::string* err) const {
    if (!mask_walk::readable(*mask)) {
      *err = "the mask is not a tensor of rank <= 4 the check can read";
      return false;
    }
    const ByteRef bytes = mask->bytes();
    const int64_t past = p.lengths[kPast], seq = p.lengths[kSeq];
    const int64_t total = past + seq;
    for (size_t b = 0; b < p.rows.size(); ++b) {
      const std::vector<uint8_t>& row = p.rows[b];
      for (int64_t s = 0; s < seq; ++s) {
        const int64_t q = past + s;
        if (!row[q]) continue;  // a pad query: don't-care
        for (int64_t h = 0; h < hq_; ++h) {
          for (int64_t t = 0; t < total; ++t) {
            const bool in_window = window == 0 || t > q - window;
            const int want = row[t] && t <= q && in_window;
            const int got = allowed(*mask, bytes.data(), p, static_cast<int64_t>(b), h, s, t);
            if (got == -2) {
              *err = "the mask's shape does not broadcast to (B, Hq, S, T) on a probe (" + p.what +
                     ")";
              return false;
            }
            if (got == -1) {
              *err =
                  "the mask holds values other than 0 and a masking value (a bias, not a "
                  "mask)";
              return false;
            }
            if (got != want) {
              *err = "on a probe (" + p.what + ", row " + std::to_string(b) + ") query " +
                     std::to_string(s) + " " + (got ? "sees" : "does not see") + " key " +
                     std::to_string(t) + ", unlike a causal mask with padding" +
                     (window ? " and a window of " + std::to_string(window) + " keys" : "") +
                     held_note(p);
              return false;
            }
          }
        }
      }
    }
    return true;
  }

  const Node* att_;
  bool with_past_;
  int64_t rows_;     // the rows a sliding layer's past holds at most (0: no sliding cache)
  bool reads_rows_;  // this attention's keys are a sliding layer's rows and the new ones
  bool right_padded_only_;
  MaskWalker walker_;
  bool causal_ = false;
  int64_t hq_ = 0;
};

}  // namespace

std::optional<MaskKind> classify_attention_mask(const Model& m, const Graph& g, const Node* att,
                                                bool with_past, std::string* why,
                                                const SlidingRows* sliding, bool reads_rows) {
  return MaskProof(m, g, att, with_past, sliding, reads_rows).run(why);
}

}  // namespace fastopt::passes
