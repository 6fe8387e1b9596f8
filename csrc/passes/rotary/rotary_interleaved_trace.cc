// trace_interleaved (rotary_interleaved.h): where the cos or sin of an interleaved rotation comes
// from, as a walk of named steps, each failing with the reason the rotation is not fused.
#include <algorithm>
#include <utility>
#include <vector>

#include "ir/constant.h"
#include "passes/rotary/rotary_interleaved.h"

namespace fastopt::passes::rotary {
namespace {

class InterleavedTrace {
 public:
  // Half-width values (no repeated pairs) are read as if the repeat were already passed.
  InterleavedTrace(const std::string& fn, std::string* why, bool repeated_pairs)
      : fn_(fn), why_(why), repeated_(!repeated_pairs) {}

  std::optional<InterleavedSource> run(Value* v) {
    CosSinSource& s = out_.source;
    s.dtype = value_dtype(v);
    cur_ = v;
    for (int hops = 0; hops < 16; ++hops) {
      const Hop h = hop();
      if (h == Hop::kFailed) return std::nullopt;
      if (h == Hop::kEnd) break;
    }
    if (!unsqueezed_) return failed(not_repeated());
    if (!take_cache_casts(casts_, fn_, &out_.source, why_)) return std::nullopt;
    // gptj: columns of a gathered table (Split, a Slice, or the [..., :w] taken above).
    Node* split = made_by(cur_, "Split");
    Node* cols = split ? nullptr : made_by(cur_, "Slice");
    const Value* peeled = cur_;
    while (Node* c = made_by(peeled, "Cast")) peeled = c->inputs()[0];
    const bool leading = !split && !cols && first_cols_ &&
                         (made_by(peeled, "Gather") || made_by(peeled, "GatherND"));
    const bool ok = split || cols || leading ? trace_table(split, cols, leading) : trace_trig();
    return ok ? std::optional<InterleavedSource>(out_) : std::nullopt;
  }

 private:
  enum class Hop { kNext, kEnd, kFailed };

  bool fail(std::string why) {
    *why_ = std::move(why);
    return false;
  }
  std::nullopt_t failed(std::string why) {
    fail(std::move(why));
    return std::nullopt;
  }
  Hop hop_failed(std::string why) {
    fail(std::move(why));
    return Hop::kFailed;
  }

  std::string not_repeated() const {
    return "the " + fn_ + " operand is not repeat_interleave(2) of a " + "(B, S, D/2) " + fn_ +
           " unsqueezed for the heads";
  }

  // One op between the multiplied operand and its source: Cast, the repeat, the heads'
  // Unsqueeze, a leading-columns Slice; kEnd at anything else.
  Hop hop() {
    Node* n = cur_->producer();
    if (!n) return Hop::kEnd;
    if (made_by(cur_, "Cast")) {
      casts_.push_back(static_cast<int32_t>(int_attr(n, "to").value_or(0)));
      cur_ = n->inputs()[0];
      return Hop::kNext;
    }
    if (Repeated r = !repeated_ ? repeated_twice(cur_) : Repeated{}; r.y) return take_repeat(r);
    if (!unsqueezed_ && made_by(cur_, "Unsqueeze")) return take_unsqueeze(n);
    if (Node* sl = !first_cols_ ? made_by(cur_, "Slice") : nullptr) return take_first_cols(sl);
    return Hop::kEnd;
  }

  Hop take_repeat(const Repeated& r) {
    repeated_ = true;
    cur_ = r.y;
    if (!r.head_axis) return Hop::kNext;
    // The heads' Unsqueeze merged into the repeat's.
    if (unsqueezed_ || (*r.head_axis != 1 && *r.head_axis != 2)) {
      return hop_failed("the " + fn_ + " is not unsqueezed once at axis 1 or 2 for the heads");
    }
    unsqueezed_ = true;
    out_.seq_axis = *r.head_axis == 1 ? 2 : 1;
    return Hop::kNext;
  }

  Hop take_unsqueeze(Node* n) {
    auto axes = unsqueeze_axes(n);
    const int in_rank = value_rank(n->inputs()[0]);
    if (!axes || axes->size() != 1 || ((*axes)[0] != 1 && (*axes)[0] != 2) ||
        (in_rank != -1 && in_rank != 3)) {
      return hop_failed("the " + fn_ + " (B, S, D) is not unsqueezed at axis 1 or 2 for the heads");
    }
    unsqueezed_ = true;
    out_.seq_axis = (*axes)[0] == 1 ? 2 : 1;
    cur_ = n->inputs()[0];
    return Hop::kNext;
  }

  // A Slice [0:w] of the values (glm's [..., :r/2]).
  Hop take_first_cols(Node* sl) {
    auto b = last_axis_slice(sl);
    if (!b || b->start != 0 || b->step != 1 || b->end <= 0) return Hop::kEnd;
    first_cols_ = b->end;
    cur_ = sl->inputs()[0];
    return Hop::kNext;
  }

  // --- gptj: columns [column, column + width) of a constant table gathered by the positions ---

  bool trace_table(Node* split, Node* cols, bool leading) {
    if (!repeated_) return fail(not_repeated());
    Value* whole = split ? split->inputs()[0] : cols ? cols->inputs()[0] : cur_;
    int64_t column = 0, width = 0;
    if (leading) {
      width = *first_cols_;
    } else if (!(cols ? slice_columns(cols, column, width)
                      : split_columns(split, whole, column, width))) {
      return false;
    }
    std::vector<int32_t> inner_casts;
    Value* src = whole;
    while (Node* c = made_by(src, "Cast")) {
      inner_casts.push_back(static_cast<int32_t>(int_attr(c, "to").value_or(0)));
      src = c->inputs()[0];
    }
    const Value* table = gathered_table(src);
    auto t = table ? constant_tensor(table) : nullptr;
    if (!t || t->dims.size() != 2) {
      return fail("the " + fn_ +
                  " columns are not split from a constant (M, r) table gathered by the "
                  "positions");
    }
    for (int32_t to : inner_casts) casts_.push_back(to);
    return clip_columns(*t, column, width) && take_table(t, column, width);
  }

  bool slice_columns(Node* cols, int64_t& column, int64_t& width) {
    auto b = last_axis_slice(cols);
    if (!b || b->step != 1 || b->start < 0 || b->end <= b->start) {
      return fail("the " + fn_ + " columns are not a constant Slice of the table");
    }
    column = b->start;
    width = b->end - b->start;  // clipped against the table below
    return true;
  }

  bool split_columns(Node* split, const Value* whole, int64_t& column, int64_t& width) {
    const int64_t axis = int_attr(split, "axis").value_or(0);
    if (axis != -1 && !(value_rank(whole) > 0 && axis == value_rank(whole) - 1)) {
      return fail("the " + fn_ + " table is not split along its last axis");
    }
    std::optional<std::vector<int64_t>> sizes;
    if (split->inputs().size() > 1 && split->inputs()[1]) {
      sizes = constant_ints(split->inputs()[1]);
    }
    size_t k = 0;
    while (k < split->outputs().size() && split->outputs()[k] != cur_) ++k;
    if (sizes && sizes->size() == split->outputs().size()) {
      for (size_t i = 0; i < k; ++i) column += (*sizes)[i];
      width = (*sizes)[k];
    } else if (!sizes && split->outputs().size() == 2) {
      width = -1;  // equal halves of the table: known below
      column = static_cast<int64_t>(k);
    } else {
      return fail("the " + fn_ + " table's Split sizes are not constant");
    }
    return true;
  }

  // The table `src` gathers rows of (Gather axis 0, or GatherND(table, Unsqueeze(pos, -1)),
  // which reads the rows pos); the positions go into the source. Null for anything else.
  const Value* gathered_table(Value* src) {
    CosSinSource& s = out_.source;
    if (Node* gather = made_by(src, "Gather")) {
      if (int_attr(gather, "axis").value_or(0) != 0) return nullptr;
      s.positions = gather->inputs()[1];
      return gather->inputs()[0];
    }
    Node* gnd = made_by(src, "GatherND");
    if (!gnd || int_attr(gnd, "batch_dims").value_or(0) != 0) return nullptr;
    Node* u = made_by(gnd->inputs()[1], "Unsqueeze");
    auto axes = u ? unsqueeze_axes(u) : std::nullopt;
    if (!axes || axes->size() != 1 || ((*axes)[0] != -1 && (*axes)[0] != 2) ||
        value_rank(u->inputs()[0]) != 2) {
      return nullptr;
    }
    s.positions = u->inputs()[0];
    return gnd->inputs()[0];
  }

  // The columns within the table (and within [..., :w]); none left is a refusal.
  bool clip_columns(const Tensor& t, int64_t& column, int64_t& width) {
    if (width == -1) {
      width = t.dims[1] / 2;
      column *= width;
    }
    width = std::min(width, t.dims[1] - column);
    if (first_cols_) width = std::min(width, *first_cols_);
    if (width <= 0) return fail("the " + fn_ + " columns of the table are empty");
    return true;
  }

  // The table in the input's dtype, every Cast on the way keeping it.
  bool take_table(const std::shared_ptr<const Tensor>& t, int64_t column, int64_t width) {
    CosSinSource& s = out_.source;
    if (s.dtype == 0) s.dtype = casts_.empty() ? t->dtype() : casts_.front();
    bool same = t->dtype() == s.dtype;
    for (int32_t to : casts_) same = same && to == s.dtype;
    if (!same) return fail("the " + fn_ + " table's dtype differs from the input's");
    s.kind = CosSinSource::Kind::kTable;
    s.table = t;
    s.table_column = column;
    s.half = width;
    return true;
  }

  // --- cohere, glm: Cos/Sin(angles) [* scaling], angles = positions * inv_freq ---

  bool trace_trig() {
    CosSinSource& s = out_.source;
    if (!take_scaling(&cur_, fn_, &s, why_)) return false;
    Node* trig = made_by(cur_, fn_.c_str());
    if (!trig) {
      return fail("the " + fn_ + " operand comes neither from " + fn_ +
                  "(angles) nor from a table");
    }
    if (s.dtype == 0) s.dtype = casts_.empty() ? kFloat : casts_.front();
    Value* angles = trig->inputs()[0];
    s.angles = angles;
    Value* f = frequencies_of(angles);
    if (!f || !trace_frequencies(f, &s, why_)) return false;
    if (first_cols_ && *first_cols_ != s.half) {
      return fail("the " + fn_ + " is sliced to " + std::to_string(*first_cols_) +
                  " columns, not the " + std::to_string(s.half) + " frequencies");
    }
    return true;
  }

  // f of the angles Concat(f, f) (glm, read through [..., :half]) or repeat_interleave(f)
  // (cohere: the repeat before the Cos); null with the reason when neither.
  Value* frequencies_of(Value* angles) {
    if (Node* cat = made_by(angles, "Concat")) {
      const auto axis = int_attr(cat, "axis");
      if (cat->inputs().size() != 2 || cat->inputs()[0] != cat->inputs()[1] ||
          !(axis == -1 || axis == 2) || !first_cols_ || !repeated_) {
        fail("the angles are not Concat(f, f, axis -1) read through [..., :D/2]");
        return nullptr;
      }
      return cat->inputs()[0];
    }
    if (Repeated r = repeated_twice(angles); r.y && !r.head_axis) {
      if (first_cols_ || repeated_) {
        fail("the repeated angles are sliced or repeated again");
        return nullptr;
      }
      return r.y;
    }
    fail("the angles are neither Concat(f, f) nor repeat_interleave(f)");
    return nullptr;
  }

  const std::string& fn_;
  std::string* why_;
  InterleavedSource out_;
  std::vector<int32_t> casts_;  // the Casts between the operand and its source, outermost first
  bool repeated_;
  bool unsqueezed_ = false;
  std::optional<int64_t> first_cols_;  // a Slice [0:w] of the values (glm's [..., :r/2])
  Value* cur_ = nullptr;
};

}  // namespace

std::optional<InterleavedSource> trace_interleaved(Value* v, const std::string& fn,
                                                   std::string* why, bool repeated_pairs) {
  return InterleavedTrace(fn, why, repeated_pairs).run(v);
}

}  // namespace fastopt::passes::rotary
