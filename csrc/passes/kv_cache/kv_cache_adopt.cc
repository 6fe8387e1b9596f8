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
struct CachedForm;

// A sliding-window layer in the form transformers' sliding caches export: the attention reads
// Concat(past input, new rows) on axis 2 for K and V, and each present output is the last `rows`
// rows of that Concat (Slice). Adopted as a full cache: the Concats become the presents, the
// past inputs hold every earlier row, and the window is the proven mask's.
struct SlidingLayer {
  Node* att;
  Node* slices[2];  // K, V: the presents, Slice(Concat, last rows)
  Node* inner[2];   // K, V: Slice(past, last rows) before the Concat, or null
  int64_t rows;
};

struct CachedForm {
  std::vector<const Value*> pasts;
  std::unordered_set<const Node*> cache_concats;
  std::vector<SlidingLayer> sliding;
  SlidingRows sliding_rows;  // the sliding layers' pasts and rows, for the mask proof
  std::unordered_set<const Node*> reading_rows;
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

// The sliding form of `att` (SlidingLayer), when it has it: for K and V, the attention reads
// Concat(past input, new) on axis 2, or Concat(Slice(past input, last rows), new) (the cache
// rebuilt from the past keeps its last rows too: a no-op on a past of at most `rows` rows),
// read by the attention and one Slice of its last rows that is a graph output, the same rows
// everywhere.
// `n` when it is a Concat of two inputs on axis 2 (a cache's rows).
const Node* sequence_concat(const Node* n) {
  if (!n || n->op_type != "Concat" || !n->domain.value.empty() || n->inputs().size() != 2 ||
      !n->inputs()[0]) {
    return nullptr;
  }
  const int64_t axis = int_attr_or(n, "axis", 0);
  return axis == 2 || axis == -2 ? n : nullptr;
}

// One side (kv 0: K, 1: V) of sliding_layer's form; false when it is not that form.
bool sliding_side(Node* att, int kv, SlidingLayer* l) {
  auto same_rows = [&](std::optional<int64_t> rows) {
    if (!rows || (l->rows && l->rows != *rows)) return false;
    l->rows = *rows;
    return true;
  };
  const Value* cat = att->inputs().size() > 2 ? att->inputs()[1 + kv] : nullptr;
  const Node* c = cat && !cat->is_graph_output() ? sequence_concat(cat->producer()) : nullptr;
  if (!c) return false;
  const Value* past = c->inputs()[0];
  if (Node* inner = past->producer()) {
    if (!same_rows(last_rows(inner)) || past->uses().size() != 1 || past->is_graph_output()) {
      return false;
    }
    l->inner[kv] = inner;
    past = inner->inputs()[0];
  }
  if (!past || !past->is_graph_input() || past->initializer()) return false;
  for (const Use& u : cat->uses()) {
    if (u.node == att) continue;
    if (l->slices[kv] || !same_rows(last_rows(u.node)) ||
        !u.node->outputs()[0]->is_graph_output()) {
      return false;
    }
    l->slices[kv] = u.node;
  }
  return l->slices[kv] != nullptr;
}

std::optional<SlidingLayer> sliding_layer(Node* att) {
  SlidingLayer l{att, {nullptr, nullptr}, {nullptr, nullptr}, 0};
  if (!sliding_side(att, 0, &l) || !sliding_side(att, 1, &l)) return std::nullopt;
  return l;
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

// A sliding layer (sliding_layer) joins the form, its pasts those of the sliding rows; one
// whose rows differ from another's is refused.
bool add_sliding(Node* att, CachedForm* form) {
  std::optional<SlidingLayer> l = sliding_layer(att);
  if (!l) return false;
  if (form->sliding_rows.rows && form->sliding_rows.rows != l->rows) {
    refuse("the sliding layers keep different numbers of rows (" +
           std::to_string(form->sliding_rows.rows) + " and " + std::to_string(l->rows) + ")");
  }
  form->sliding_rows.rows = l->rows;
  for (int kv = 0; kv < 2; ++kv) {
    const Node* cat = l->slices[kv]->inputs()[0]->producer();
    const Node* inner = l->inner[kv];
    const Value* past = inner ? inner->inputs()[0] : cat->inputs()[0];
    form->pasts.push_back(past);
    form->sliding_rows.pasts.push_back(past->name());
    form->cache_concats.insert({inner, cat});  // the Concat reads the past once adopted
  }
  form->reading_rows.insert(att);
  form->sliding.push_back(*l);
  return true;
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
    if (!c && add_sliding(att, &form)) continue;
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
  pasts.insert(form.pasts.begin(), form.pasts.end());  // the sliding layers' too
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

// A sliding layer's past holds min(P, rows) rows, the adopted one P: a Shape read of its length
// may only reach masks (all of which are replaced); one reaching anything else (an output, a
// Reshape, positions) would read another length after the rewrite, and is refused.
void check_sliding_shape_reads(const CachedForm& form,
                               const std::vector<std::pair<Node*, int64_t>>& shape_reads) {
  const std::vector<std::string>& names = form.sliding_rows.pasts;
  std::vector<const Value*> todo;
  for (auto [shape, at] : shape_reads) {
    const std::string& past = shape->inputs()[0]->name();
    if (std::find(names.begin(), names.end(), past) != names.end()) {
      todo.push_back(shape->outputs()[0]);
    }
  }
  std::unordered_set<const Value*> seen(todo.begin(), todo.end());
  while (!todo.empty()) {
    const Value* v = todo.back();
    todo.pop_back();
    if (v->is_graph_output()) {
      refuse("the length of a sliding layer's past (min(P, " +
             std::to_string(form.sliding_rows.rows) + ") rows) reaches the graph output '" +
             v->name() + "': adopted as a full cache it would read P");
    }
    for (const Use& u : v->uses()) {
      if (is_internal_attention(u.node) && u.input_index == 3) continue;  // a mask: replaced
      if (is_internal_attention(u.node) || u.node->has_subgraphs()) {
        refuse("the length of a sliding layer's past (min(P, " +
               std::to_string(form.sliding_rows.rows) + ") rows) is read by " + u.node->op_type +
               " '" + u.node->name.value +
               "' beyond the masks: adopted as a full cache it would read P");
      }
      for (const Value* out : u.node->outputs()) {
        if (out && seen.insert(out).second) todo.push_back(out);
      }
    }
  }
}

// The sliding layers become full caches: each Concat(past, new) is the present output (its
// name, the total length), the Slice of its last rows goes, and the past input is (B, Hkv, P, D).
void adopt_sliding_layers(Graph& g, const CachedForm& form, const Value* attention_mask) {
  Dim past_dim = param_dim("past_sequence_length");
  for (const Value* v : form.pasts) {
    const auto& names = form.sliding_rows.pasts;
    const Dim* d = dim_of(v, 2);
    if (d && std::find(names.begin(), names.end(), v->name()) == names.end()) past_dim = *d;
  }
  const Dim* total = dim_of(attention_mask, 1);
  const Dim total_dim = total ? *total : param_dim("total_sequence_length");
  for (const SlidingLayer& l : form.sliding) {
    for (int kv = 0; kv < 2; ++kv) {
      Node* slice = l.slices[kv];
      Value* present = slice->outputs()[0];
      Value* cat = slice->inputs()[0];
      if (Node* inner = l.inner[kv]) {  // the whole past, not its last rows
        cat->producer()->set_input(0, inner->inputs()[0]);
        g.remove_node(inner);
      }
      Value* past = cat->producer()->inputs()[0];
      const std::string name = present->name();
      g.rename(present, g.unique_name(name + "_last_rows"));
      g.rename(cat, name);
      if (past->type.known && past->type.has_shape && past->type.dims.size() == 4) {
        past->type.dims[2] = past_dim;
        cat->type = past->type;
        cat->type.dims[2] = total_dim;
      }
      g.replace_all_uses(present, cat);
      g.remove_node(slice);
      for (auto* entries : {&g.input_entries, &g.output_entries}) {
        for (ValueInfoEntry& e : *entries) {
          if (e.value == past || e.value == cat) e.own_type.reset();
        }
      }
    }
  }
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
  // refuses other reads of a past in place; a sliding past's length may reach masks only
  check_sliding_shape_reads(form, past_shape_reads(form, inplace));
  std::vector<ScoreBias> biases = check_score_biases(g, attentions, attention_mask);
  std::vector<int64_t> windows;
  {  // a biased attention's mask part is proven like any mask
    MaskPartsForProof proving(g, biases);
    SlidingRows rows = form.sliding_rows;
    rows.right_padded_only = inplace;
    windows = proven_windows(g, attentions, true, form.sliding.empty() ? nullptr : &rows,
                             form.reading_rows);
  }

  // ---- edits ----
  adopt_sliding_layers(g, form, attention_mask);
  if (!form.sliding.empty()) {
    ctx.counters["sliding caches adopted"] += static_cast<int64_t>(form.sliding.size());
  }
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
