// add_kv_cache on a model exported WITH a cache (see add_kv_cache.cc's header and kv_cache.h).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "passes/attention/shapes.h"
#include "passes/kv_cache/kv_cache.h"

namespace fastopt::passes::kv_cache {
namespace {
using pattern::attr_int;

// The past inputs of the cached form, in the order the attentions read them (the edits follow
// it: the same output every run), and the Concat(past, new) of each attention.
struct CachedForm {
  std::vector<const Value*> pasts;
  std::unordered_set<const Node*> cache_concats;
};

// A sliding-window layer's cache as transformers keeps it: the present is
// Slice(Concat(..., new), -rows) on axis 2 of the attention's keys, its last rows only.
struct SlidingCache {
  const Value* present;
  int64_t rows;
};

// The rows a Slice(x, -rows, to the end) on axis 2 keeps, when `p` is one.
std::optional<int64_t> last_rows(const Node* p) {
  if (!p || p->op_type != "Slice" || !p->domain.value.empty() || p->inputs().size() < 4) {
    return std::nullopt;
  }
  const auto starts = constant_ints(p->inputs()[1]), ends = constant_ints(p->inputs()[2]);
  const auto axes = constant_ints(p->inputs()[3]);
  if (!starts || !ends || !axes || starts->size() != 1 || ends->size() != 1 || axes->size() != 1 ||
      ((*axes)[0] != 2 && (*axes)[0] != -2) || (*starts)[0] >= 0 ||
      (*ends)[0] < std::numeric_limits<int32_t>::max()) {
    return std::nullopt;
  }
  if (p->inputs().size() > 4 && p->inputs()[4]) {
    const auto steps = constant_ints(p->inputs()[4]);
    if (!steps || steps->size() != 1 || (*steps)[0] != 1) return std::nullopt;
  }
  return -(*starts)[0];
}

// The attention reads Concat(..., new) and a present is its last rows, or it reads that
// present itself.
std::optional<SlidingCache> sliding_cache(const Graph& g, const Node* att) {
  const Value* keys = att->inputs().size() > 1 ? att->inputs()[1] : nullptr;
  const Node* p = keys ? keys->producer() : nullptr;
  if (!p) return std::nullopt;
  if (std::optional<int64_t> rows = last_rows(p); rows && keys->is_graph_output() &&
                                                  p->inputs()[0]->producer() &&
                                                  p->inputs()[0]->producer()->op_type == "Concat") {
    return SlidingCache{keys, *rows};
  }
  if (p->op_type != "Concat") return std::nullopt;
  for (const Value* out : g.outputs()) {
    const Node* slice = out ? out->producer() : nullptr;
    if (!slice || slice->inputs().empty() || slice->inputs()[0] != keys) continue;
    if (std::optional<int64_t> rows = last_rows(slice)) return SlidingCache{out, *rows};
  }
  return std::nullopt;
}

// A present output that is a past input passed through Identity: the export never returns the
// new rows (transformers 4.49's GPT-2 exports with a cache write Identity(past) as each present:
// the cache it returns does not grow, so the export itself decodes wrongly after one step).
std::string unchanged_present(const Graph& g) {
  for (const Value* out : g.outputs()) {
    const Value* v = out;
    while (v && v->producer() && v->producer()->op_type == "Identity" &&
           v->producer()->domain.value.empty() && v->producer()->inputs().size() == 1) {
      v = v->producer()->inputs()[0];
    }
    if (!v || v == out || v->producer() || v->name().rfind(kExportedPastPrefix, 0) != 0) continue;
    return "present output '" + out->name() + "' is past input '" + v->name() +
           "' unchanged (Identity): the export never returns the new keys and values, so its "
           "cache does not grow and the export itself decodes wrongly after the first step; "
           "not converted (re-export, or export without a cache, which --kv-cache converts)";
  }
  return "";
}

// Every attention reads its K/V as Concat(past input, new rows) feeding a present output, and
// every past input feeds one.
CachedForm check_cached_form(const Graph& g, const std::vector<Node*>& attentions) {
  std::unordered_set<const Value*> pasts;
  CachedForm form;
  for (Node* att : attentions) {
    if (att->inputs().size() > 4 || att->outputs().size() != 1) {
      refuse("attention '" + att->name.value + "' has inputs or outputs the form does not know");
    }
    const std::optional<CachedKV> c = cached_kv(att);
    if (!c) {
      if (std::optional<SlidingCache> w = sliding_cache(g, att)) {
        refuse("attention '" + att->name.value + "' reads a sliding-window cache: '" +
               w->present->name() + "' keeps the last " + std::to_string(w->rows) +
               " rows of Concat(past, new rows) on axis 2 (a window of " +
               std::to_string(w->rows + 1) +
               " keys, as transformers' sliding layers cache), so its keys and mask cover "
               "those rows and the new ones, not past + new; converting it to "
               "GroupQueryAttention's local_window_size needs that mask proven to be the window "
               "over the tokens the rows hold, which this rewrite does not prove: not "
               "converted; export without a cache, which --kv-cache converts with the window");
      }
      if (std::string why = unchanged_present(g); !why.empty()) refuse(why);
      refuse("the model has past inputs, but attention '" + att->name.value +
             "' does not read its keys and values as Concat(past input, new rows) feeding a "
             "present output (the cached form of a model exported with a cache)");
    }
    for (const Value* x : {c->past_k, c->past_v}) {
      if (rank_of(x) != 4) refuse("past input '" + x->name() + "' is not 4-D (B, Hkv, P, D)");
      if (pasts.insert(x).second) form.pasts.push_back(x);
    }
    form.cache_concats.insert({c->present_k->producer(), c->present_v->producer()});
  }
  for (const Value* v : g.inputs()) {
    if (v && v->name().rfind(kExportedPastPrefix, 0) == 0 && !pasts.count(v)) {
      refuse("past input '" + v->name() + "' does not feed the cache of a fused attention");
    }
  }
  return form;
}

// Shape reads of a past that include its length (axis 2), with where that length sits in the
// read; in place (`inplace`), any other read of a past's data besides its cache Concat is
// refused.
std::vector<std::pair<Node*, int64_t>> past_shape_reads(const CachedForm& form, bool inplace) {
  std::vector<std::pair<Node*, int64_t>> shape_reads;
  for (const Value* past : form.pasts) {
    for (const Use& u : past->uses()) {
      if (form.cache_concats.count(u.node)) continue;
      if (u.node->op_type == "Shape" && u.node->domain.value.empty()) {
        if (std::string bad = mistyped_reason(u.node); !bad.empty()) refuse(bad);
        // Shape-15 start/end: negative counts from the end, out of range clamps.
        auto bound = [&](const char* name, int64_t fallback) {
          int64_t x = int_attr_or(u.node, name, fallback);
          x = x < 0 ? x + 4 : x;
          return std::min<int64_t>(std::max<int64_t>(x, 0), 4);
        };
        const int64_t start = bound("start", 0), end = bound("end", 4);
        if (start > 2 || end <= 2) continue;  // the length is not among the dims it reads
        if (u.node->outputs()[0] && u.node->outputs()[0]->is_graph_output()) {
          refuse("the shape of past input '" + past->name() + "' is a graph output");
        }
        shape_reads.emplace_back(u.node, 2 - start);
      } else if (inplace) {
        refuse("past input '" + past->name() + "' is read by " + u.node->op_type + " '" +
               u.node->name.value +
               "' besides its cache Concat: in an in-place buffer, the rows past the valid "
               "length are not the past");
      }
    }
  }

  return shape_reads;
}

// In place, Shape(past) reads (B, Hkv, max_len, D): give them (B, Hkv, P, D).
void fix_past_shape_reads(KvCacheBuilder& b, const SharedMask& mask, Node* head,
                          const std::vector<std::pair<Node*, int64_t>>& shape_reads) {
  Value* p1 =
      b.op("Unsqueeze", {mask.past_len, b.constant("kv_axes_0", {0}, {1})}, "kv_past_len_1d", head);
  for (auto [shape, at_length] : shape_reads) {
    Value* out = shape->outputs()[0];
    if (!out || out->uses().empty()) continue;
    const std::vector<Use> readers = out->uses();  // before the slices below read it too
    Node* at = shape->next();
    auto part = [&](int64_t start, int64_t end) {
      return b.op("Slice",
                  {out, b.constant("kv_start", {start}, {1}), b.constant("kv_end", {end}, {1})},
                  "kv_past_shape_part", at);
    };
    constexpr int64_t kToEnd = std::numeric_limits<int64_t>::max();
    Value* fixed = b.op("Concat", {part(0, at_length), p1, part(at_length + 1, kToEnd)},
                        "kv_past_shape", at, one_attr(attr_int("axis", 0)));
    for (const Use& u : readers) u.node->set_input(u.input_index, fixed);
  }
}

}  // namespace

// A model exported WITH a cache: after fuse_attention its attentions already are in the cached
// form (internal_op.h: K = Concat(past input, new) = present output). Adopting it means checking
// that form everywhere and giving every attention the shared mask (the contract the in-place
// lowering relies on: its causal flag and seqlens_k replace the mask). In place, the past input
// is a max-length buffer: reads of its shape elsewhere (exports derive the past length and the
// positions from it) are given (B, Hkv, P, D) instead; other reads of its data are refused.
// ALiBi (score_bias) attentions keep their bias: check_score_biases, its copies reading the
// keys' length from attention_mask (the present becomes the buffer in place), use_biases.
int64_t adopt_cache(Graph& g, const std::vector<Node*>& attentions, Value* input_ids,
                    Value* attention_mask, const Dim& batch_dim, const CacheForm& cache_form,
                    PassContext& ctx) {
  const bool inplace = cache_form.shares_buffer;
  const CachedForm form = check_cached_form(g, attentions);
  past_shape_reads(form, inplace);  // refuses other reads of a past in place
  std::vector<ScoreBias> biases = check_score_biases(g, attentions, attention_mask);
  std::vector<int64_t> windows;
  {  // a biased attention's mask part is proven like any mask
    MaskPartsForProof proving(g, biases);
    windows = proven_windows(g, attentions, true);
  }

  // ---- edits ----
  KvCacheBuilder b(g);
  Node* head = g.first();  // the shared mask goes before it
  SharedMask mask = build_shared_mask(g, b, input_ids, attention_mask, batch_dim);
  // The biases' copies read the keys' length as attention_mask's width: in place, the keys
  // (the present) become the max-length buffer, whose length is not T.
  copy_biases(g, b, biases, attention_mask, attentions);
  use_masks(b, mask, attentions, windows, batch_dim, ctx);
  use_biases(g, b, biases, ctx);
  // after the copies: their Shape reads of a past are among those given P
  if (inplace) fix_past_shape_reads(b, mask, head, past_shape_reads(form, inplace));
  ctx.counters["layers adopted"] += static_cast<int64_t>(attentions.size());
  return static_cast<int64_t>(attentions.size());
}

}  // namespace fastopt::passes::kv_cache
