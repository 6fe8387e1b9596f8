// add_kv_cache for an encoder-decoder's decoder exported without a cache (optimum's
// decoder_model.onnx without presents: input_ids (B, S), encoder_hidden_states (B, E, D),
// encoder_attention_mask (B, E) where the model has one -> logits).
//
// Per decoder layer i (the i-th self- and the i-th cross-attention in graph order):
//
//   self:   present.i.decoder.key = Concat(past_key_values.i.decoder.key (B, H, P, D), k_new)
//           the attention reads it with the causal mask t <= P + s over T = P + S
//   cross:  present.i.encoder.key = Concat(past_key_values.i.encoder.key (B, H, Pe, D),
//                                          k_new = the projection of encoder_hidden_states)
//           the attention reads it with encoder_attention_mask (B, 1, 1, Pe + E) as padding
//   (the same for the values)
//
// One graph serves every step, so a runtime needs no second decoder and no If: the first step
// feeds the whole encoder output and empty pasts (P = Pe = 0), so the cross cache is computed
// there, once; later steps feed the presents back as pasts and encoder_hidden_states with zero
// rows (B, 0, D), whose projection costs nothing, so present.i.encoder is the past again.
// encoder_attention_mask stays (B, E) for the encoder's E keys at every step. Names and layout
// are optimum's seq2seq ones (past_key_values.<i>.decoder|encoder.key|value, present.<i>...);
// optimum splits the same thing into decoder_model.onnx (first step, presents of both) and
// decoder_with_past_model.onnx (later steps, no encoder_hidden_states), or merges the two with an
// If on use_cache_branch. The decoder has no attention_mask of its own (all rows advance
// together, as in optimum), so P is the past's length: Shape(past_key_values.0.decoder.key)[2].
//
// Positions computed in the graph (bart's learned, marian's sinusoidal and whisper's position
// tables: Gather(table, Range(0, S) ...)) start at P: Range(P, P + S).
//
// Proofs before any edit (refused with the reason otherwise): each attention is classified by
// where its K and V come from (a projection of encoder_hidden_states: cross; of the decoder's own
// states: self; a mix: refused); self and cross come in pairs; every mask is proven by
// evaluation (kv_cache_cross_mask.cc) to be causal (self) or the encoder padding (cross); t5's
// relative position bias (table[f(key - query)], kv_cache_cross_bias.cc) is kept apart from the
// mask it rides on and re-read over the absolute positions P + s and 0 .. T - 1, any other bias
// is refused; every position table lookup's Range runs over the decoder's length.
//
// kv_cache 2 (in place): the self-attention cache is one max-length buffer per layer, bound as
// both past_key_values.i.decoder.* and present.i.decoder.* (GroupQueryAttention updates it). A
// buffer's length says nothing of the tokens it holds and the decoder has no attention_mask, so
// P comes from a new input past_sequence_length (int32 (1), onnxruntime-genai whisper's name):
// the tokens already in the buffer, the same for every row (all rows advance together). The
// cross cache keeps the standard form (filled at the first step, passed through after): its
// attentions get cross_cache = 1, which tells the lowering not to put them in place.
//
// Option cross_attention_cache 0: no cross cache; each cross-attention keeps reading the
// projections of encoder_hidden_states, fed whole at every step. That is the decoder
// onnxruntime-genai's whisper runs when its encoder has no present_key_cross_* outputs (it then
// feeds encoder_hidden_states to every decoder step and only binds the self-attention cache).
//
// Option cross_attention_cache 2 (from the encoder): each cross-attention reads its keys and
// values from the graph inputs past_key_values.<i>.encoder.key|value (B, H, E, D), which nothing
// in the decoder writes; the projections of encoder_hidden_states that computed them become the
// graph outputs present.<i>.encoder.key|value, for move_cross_projections (cross_cache_split.h)
// to move into the encoder. That pair is onnxruntime-genai's other whisper form: the encoder
// computes the cross cache once, every decoder step reads it, and the decoder has no
// encoder_hidden_states.
#include "passes/kv_cache/kv_cache_cross.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "ir/dtype.h"
#include "ir/error.h"
#include "passes/attention/head_split.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"

namespace fastopt::passes::kv_cache {
namespace {
using pattern::attr_int;
using pattern::attr_ints;

// The graph input K or V is a projection of: back through the head split and the projection
// (Transpose, Reshape, Cast, (Un)Squeeze, MatMul/Gemm by a constant, elementwise with a
// constant); null when the walk meets anything else first (the decoder's own states).
const Value* projected_input(const Value* x) {
  for (int steps = 0; x && steps < 16; ++steps) {
    if (x->is_graph_input()) return x;
    const Node* p = x->producer();
    if (!p || !is_standard(p) || p->inputs().empty()) return nullptr;
    const std::string& op = p->op_type;
    if (op == "Transpose" || op == "Reshape" || op == "Cast" || op == "Unsqueeze" ||
        op == "Squeeze" || op == "Identity" || op == "Gemm") {
      x = p->inputs()[0];
      continue;
    }
    if (op == "MatMul" || op == "Add" || op == "Mul" || op == "Sub" || op == "Div") {
      if (p->inputs().size() != 2) return nullptr;
      const bool c0 = constant_tensor(p->inputs()[0]) != nullptr;
      const bool c1 = constant_tensor(p->inputs()[1]) != nullptr;
      if (c0 == c1) return nullptr;
      x = p->inputs()[c0 ? 1 : 0];
      continue;
    }
    return nullptr;
  }
  return nullptr;
}

struct Pair {
  Node* self;
  Node* cross;
};

struct KvShape {
  int32_t dtype;
  int64_t heads, dk, dv;
};

KvShape kv_shape(const Node* att) {
  const std::string where = "attention '" + att->name.value + "'";
  const int64_t hkv = int_attr_or(att, "kv_num_heads", 0);
  if (hkv <= 0) refuse(where + " has no kv_num_heads");
  for (int i = 1; i <= 2; ++i) {
    const Value* x = att->inputs()[static_cast<size_t>(i)];
    if (rank_of(x) != 4) refuse(where + ": K/V are not 4-D (B, H, T, D)");
    if (auto h = resolve_dim(x, 1); h && *h != hkv) {
      refuse(where + ": K/V heads on axis 1 are not kv_num_heads");
    }
    if (!resolve_dim(x, 3)) refuse(where + ": K/V have no known head size (axis 3)");
  }
  const int32_t dtype = dtype_of(att->inputs()[1]);
  if (dtype == 0 || dtype_of(att->inputs()[2]) != dtype) {
    refuse(where + ": K/V dtype unknown or different");
  }
  return {dtype, hkv, *resolve_dim(att->inputs()[1], 3), *resolve_dim(att->inputs()[2], 3)};
}

// Self- and cross-attentions, paired by layer, each checked.
std::vector<Pair> pair_layers(const Graph& g, const std::vector<Node*>& attentions,
                              const Value* hidden, const Value* input_ids,
                              std::vector<BiasedLayer>& biased) {
  std::vector<Node*> selfs, crosses;
  for (Node* att : attentions) {
    const std::vector<Value*>& in = att->inputs();
    if (in.size() < 3 || !in[0] || !in[1] || !in[2]) refuse("an attention without Q, K or V");
    if (in.size() > 4 || att->outputs().size() != 1) {
      refuse("attention '" + att->name.value + "' has past/present already");
    }
    const bool k_cross = projected_input(in[1]) == hidden;
    const bool v_cross = projected_input(in[2]) == hidden;
    if (k_cross != v_cross) {
      refuse("attention '" + att->name.value +
             "' reads only one of K and V from encoder_hidden_states");
    }
    if (k_cross && projected_input(in[0]) == hidden) {
      refuse("attention '" + att->name.value +
             "' projects Q from encoder_hidden_states too (an encoder self-attention in the "
             "decoder graph)");
    }
    (k_cross ? crosses : selfs).push_back(att);
  }
  if (crosses.empty()) refuse("no cross-attention reads encoder_hidden_states");
  if (selfs.size() != crosses.size()) {
    refuse(std::to_string(selfs.size()) + " self-attentions and " + std::to_string(crosses.size()) +
           " cross-attentions: not one of each per decoder layer");
  }
  std::vector<Pair> pairs;
  for (size_t i = 0; i < selfs.size(); ++i) {
    for (Node* att : {selfs[i], crosses[i]}) {
      const bool cross = att == crosses[i];
      std::string why;
      const Value* mask = nullptr;
      if (!cross) {  // t5's relative position bias: kept, its mask part proven
        auto bias = match_relative_bias(*g.model(), g, att, input_ids, &why);
        if (!why.empty()) {
          refuse("layer " + std::to_string(i) + "'s self-attention ('" + att->name.value +
                 "') adds a position bias this rewrite cannot prove to follow key - query "
                 "positions, which is all it rebuilds for the cached queries P + s: " +
                 why);
        }
        if (bias) {
          mask = bias->mask_part;
          biased.push_back({att, *bias});
        }
      }
      if (!prove_seq2seq_mask(*g.model(), g, att, cross, &why, mask)) {
        refuse("the mask of layer " + std::to_string(i) + "'s " + (cross ? "cross" : "self") +
               "-attention ('" + att->name.value + "') is not proven to be " +
               (cross ? "the encoder padding" : "causal") +
               ", which is all the cached form reproduces: " + why);
      }
    }
    pairs.push_back({selfs[i], crosses[i]});
  }
  return pairs;
}

// The nodes that compute the attentions' masks (which the cached form replaces).
std::unordered_set<const Node*> mask_nodes(const std::vector<Node*>& attentions) {
  std::unordered_set<const Node*> nodes;
  std::vector<const Value*> todo;
  for (const Node* att : attentions) {
    if (att->inputs().size() > 3) todo.push_back(att->inputs()[3]);
  }
  while (!todo.empty()) {
    const Value* v = todo.back();
    todo.pop_back();
    const Node* p = v ? v->producer() : nullptr;
    if (!p || !nodes.insert(p).second) continue;
    for (const Value* x : p->inputs()) todo.push_back(x);
  }
  return nodes;
}

bool index_keeping(const Node* c, size_t input) {
  const std::string& op = c->op_type;
  if (op == "Unsqueeze" || op == "Squeeze" || op == "Expand" || op == "Tile" || op == "Cast" ||
      op == "Reshape" || op == "Identity") {
    return input == 0;
  }
  // + a constant offset (bart's learned positions start at 2)
  return (op == "Add" || op == "Sub") && c->inputs().size() == 2 &&
         constant_tensor(c->inputs()[1 - input]) != nullptr;
}

bool table_lookup(const Node* c, size_t input) {
  const std::string& op = c->op_type;
  return (op == "Gather" || op == "GatherND" || op == "GatherElements") && input == 1 &&
         constant_tensor(c->inputs()[0]) != nullptr;
}

// A Slice of a constant table over computed bounds (positions sliced from a table, not looked
// up by a Range the rewrite offsets): refused.
void refuse_sliced_table(const Node* n, const std::unordered_set<const Node*>& masks) {
  if (n->op_type == "Slice" && !masks.count(n) && n->inputs().size() >= 3 &&
      constant_tensor(n->inputs()[0]) &&
      (!constant_tensor(n->inputs()[1]) || !constant_tensor(n->inputs()[2]))) {
    refuse("Slice '" + n->name.value + "' reads a constant table over computed bounds " +
           "(positions sliced from a table): the rewrite does not offset those");
  }
}

bool counts_from_zero(const Node* n) {
  if (n->op_type != "Range" || n->inputs().size() != 3) return false;
  auto start = constant_scalar(n->inputs()[0]);
  auto delta = constant_scalar(n->inputs()[2]);
  return start && *start == 0 && delta && *delta == 1;
}

// Whether Range `n` reaches a position table (through index-keeping ops, the masks left
// aside); refused when it reaches anything else.
bool feeds_position_table(const Node* n, const std::unordered_set<const Node*>& masks) {
  bool to_table = false;
  std::vector<const Value*> todo = {n->outputs()[0]};
  std::unordered_set<const Node*> seen;
  while (!todo.empty()) {
    const Value* v = todo.back();
    todo.pop_back();
    for (const Use& u : v->uses()) {
      const Node* c = u.node;
      const size_t at = static_cast<size_t>(u.input_index);
      if (!seen.insert(c).second) continue;
      // index-keeping ops and lookups are followed even where a mask reads them (4.49's
      // TorchScript whisper sizes its mask from the hidden states, which its position lookup
      // feeds, and reads the same Range in its causal mask): the Range is offset for the
      // lookup, and the masks it also feeds are replaced
      if (is_standard(c) && table_lookup(c, at)) {
        to_table = true;
      } else if (is_standard(c) && index_keeping(c, at)) {
        todo.push_back(c->outputs()[0]);
      } else if (masks.count(c)) {
        continue;
      } else {
        refuse("Range '" + n->name.value + "' (0, 1, ...) feeds " + c->op_type + " '" +
               c->name.value + "', which is neither a position table lookup nor a mask: " +
               "the rewrite does not know what it computes after a past");
      }
    }
  }
  return to_table;
}

// Positions computed in the graph: every Range(0, n, 1) is followed through index-keeping ops;
// one reaching a constant table (a position embedding) must run over the decoder's length and is
// returned (it gets offset by P); one reaching only the masks (which are replaced) is left; one
// reaching anything else is refused: its result would change with the cache in a way the
// rewrite does not know.
std::vector<Node*> position_ranges(const Model& m, Graph& g, const Value* input_ids,
                                   const std::vector<Node*>& attentions) {
  const std::unordered_set<const Node*> masks = mask_nodes(attentions);
  std::vector<Node*> ranges;
  analysis::ShapeFacts facts(m);
  const std::optional<analysis::DimExpr> seq = facts.dim(input_ids, 1);
  for (Node* n = g.first(); n; n = n->next()) {
    if (!is_standard(n)) continue;
    refuse_sliced_table(n, masks);
    if (!counts_from_zero(n) || !feeds_position_table(n, masks)) continue;
    const std::vector<analysis::DimExpr>* limit = facts.shape_value(n->inputs()[1]);
    if (!seq || !limit || limit->size() != 1 || !((*limit)[0] == *seq)) {
      refuse("Range '" + n->name.value +
             "' makes positions for a table lookup over a length not proven to be the "
             "decoder's (input_ids' axis 1)");
    }
    ranges.push_back(n);
  }
  return ranges;
}

Value* add_past(Graph& g, const std::string& name, const KvShape& s, bool value, const Dim& batch,
                const std::string& length) {
  Value* p = g.create_value(name);
  p->type = tensor_type(
      s.dtype, {batch, value_dim(s.heads), param_dim(length), value_dim(value ? s.dv : s.dk)});
  g.add_input(p);
  return p;
}

// K and V of `att` become Concat(past, new) = present graph outputs, named as `form` says.
void cache_kv(Graph& g, KvCacheBuilder& b, Node* att, size_t layer, const CacheForm& form,
              const Dim& batch) {
  const KvShape s = kv_shape(att);
  for (int kv = 0; kv < 2; ++kv) {
    Value* past = add_past(g, past_name(form, layer, kv == 1), s, kv == 1, batch, form.past_dim);
    Node* cat = b.node("Concat", {past, att->inputs()[static_cast<size_t>(1 + kv)]},
                       present_name(form, layer, kv == 1), att, one_attr(attr_int("axis", 2)));
    Value* present = cat->outputs()[0];
    present->type = tensor_type(s.dtype, {batch, value_dim(s.heads), param_dim(form.present_dim),
                                          value_dim(kv ? s.dv : s.dk)});
    g.add_output(present);
    att->set_input(1 + kv, present);
  }
}

// The nodes that compute `v` for its one reader alone: its producer, and theirs while the value
// between has one use (what an edit replacing `v` leaves dead).
std::vector<Node*> exclusive_producers(const Value* v) {
  std::vector<Node*> nodes;
  std::vector<const Value*> todo = {v};
  while (!todo.empty()) {
    const Value* x = todo.back();
    todo.pop_back();
    Node* p = x ? x->producer() : nullptr;
    if (!p || x->uses().size() != 1 || x->is_graph_output()) continue;
    if (std::find(nodes.begin(), nodes.end(), p) != nodes.end()) continue;
    nodes.push_back(p);
    for (const Value* in : p->inputs()) todo.push_back(in);
  }
  return nodes;
}

// Option cross_attention_cache 2: the cross-attention `att` reads K and V from graph inputs; the
// projections (B, E, H*D) they were split from (`sources`, checked before any edit) get a head
// split of their own, Reshape [0, 0, H, D] + Transpose(0,2,1,3), as graph outputs. The export's
// split may take its sizes from the decoder's states (bart's view(bsz, -1, H, D)); this one reads
// nothing but the projection, so the encoder can compute it. The old split goes with the edit.
void cross_from_inputs(Graph& g, KvCacheBuilder& b, Node* att, const std::array<Value*, 2>& sources,
                       size_t layer, const Dim& batch) {
  const KvShape s = kv_shape(att);
  const CacheForm& form = kSeq2SeqCrossFromEncoder;
  const std::string length = form.present_dim;
  for (int kv = 0; kv < 2; ++kv) {
    const std::vector<Node*> old_split = exclusive_producers(att->inputs()[1 + kv]);
    const int64_t d = kv ? s.dv : s.dk;
    Value* split = b.op(
        "Reshape",
        {sources[static_cast<size_t>(kv)], b.constant("kv_cross_heads", {0, 0, s.heads, d}, {4})},
        "kv_cross_split", att);
    Value* present = b.op("Transpose", {split}, present_name(form, layer, kv == 1), att,
                          one_attr(attr_ints("perm", {0, 2, 1, 3})));
    present->type =
        tensor_type(s.dtype, {batch, value_dim(s.heads), param_dim(length), value_dim(d)});
    g.add_output(present);
    att->set_input(1 + kv,
                   add_past(g, past_name(form, layer, kv == 1), s, kv == 1, batch, form.past_dim));
    pattern::remove_dead(g, old_split);
  }
}

// In place: P (int64 scalar) from the new input past_sequence_length (int32 (1)).
Value* past_length_input(Graph& g, KvCacheBuilder& b, Node* head) {
  Value* p = g.create_value(kPastSequenceLength);
  p->type = tensor_type(kInt32, {value_dim(1)});
  g.add_input(p);
  Value* scalar =
      b.op("Squeeze", {p, b.constant("kv_axes_0", {0}, {1})}, "kv_past_length_scalar", head);
  return b.op("Cast", {scalar}, "kv_past_len", head, one_attr(attr_int("to", kInt64)));
}

// P as the self-attention's form gives it: the past's rows, or the length input in place.
Value* past_length(Graph& g, KvCacheBuilder& b, const CacheForm& self, Node* head) {
  if (self.past_length == PastLength::kLengthInput) return past_length_input(g, b, head);
  return b.op("Gather",
              {b.op("Shape", {graph_input(g, past_name(self, 0, false))}, "kv_past_shape", head),
               b.constant("kv_two", {2}, {})},
              "kv_past_len", head, one_attr(attr_int("axis", 0)));
}

// The forms add_cross_cache writes: the self-attention's (in place or not) and the cross
// cache's (option cross_attention_cache: 0 none, 1 filled at the first step, 2 from the encoder).
struct Seq2SeqForms {
  const CacheForm& self;
  const CacheForm* cross;  // null: the cross-attentions read encoder_hidden_states every step
  int64_t cross_mode;
};

Seq2SeqForms seq2seq_forms(int64_t mode, const PassContext& ctx) {
  const auto cross_option = ctx.options.find("cross_attention_cache");
  const int64_t cross_mode = cross_option == ctx.options.end() ? 1 : cross_option->second;
  const CacheForm* cross = cross_mode == 1   ? &kSeq2SeqCross
                           : cross_mode == 2 ? &kSeq2SeqCrossFromEncoder
                                             : nullptr;
  return {mode == 2 ? kSeq2SeqSelfInPlace : kSeq2SeqSelf, cross, cross_mode};
}

// The decoder's inputs: input_ids of a dynamic length, no past yet, encoder_hidden_states of a
// dynamic length where later steps feed it with 0 rows; opset 13.
void check_decoder_inputs(const Model& m, const Graph& g, const Seq2SeqForms& forms) {
  const Value* input_ids = graph_input(g, kInputIds);
  const Value* hidden = graph_input(g, kEncoderHiddenStates);
  if (!input_ids) refuse("the decoder has no input_ids input");
  for (const Value* v : g.inputs()) {
    if (v && v->name().rfind(kExportedPastPrefix, 0) == 0) {
      refuse("the decoder already has past inputs ('" + v->name() +
             "'): converting an exported seq2seq cache is not supported");
    }
  }
  if (const Dim* s = dim_of(input_ids, 1); s && s->value) {
    refuse("input_ids has a fixed sequence length: a static-shape export bakes it into shapes");
  }
  if (const Dim* e = dim_of(hidden, 1); forms.cross == &kSeq2SeqCross && e && e->value) {
    refuse("encoder_hidden_states has a fixed length (" + std::to_string(*e->value) +
           "): later steps feed it with 0 rows");
  }
  if (default_opset(m) < 13) refuse("the model's opset is below 13");
}

// Each cross-attention's mask needs encoder_attention_mask; from the encoder (option 2), the
// (B, E, H*D) projections its K and V are split from, which the encoder will compute.
std::unordered_map<const Node*, std::array<Value*, 2>> cross_sources(Graph& g,
                                                                     const std::vector<Pair>& pairs,
                                                                     const Seq2SeqForms& forms) {
  const Value* hidden = graph_input(g, kEncoderHiddenStates);
  const bool encoder_mask = graph_input(g, kEncoderAttentionMask) != nullptr;
  const bool cross_inputs = forms.cross == &kSeq2SeqCrossFromEncoder;
  std::unordered_map<const Node*, std::array<Value*, 2>> sources;  // option 2: K, V (B,E,HD)
  for (const Pair& p : pairs) {
    if (p.cross->inputs().size() > 3 && p.cross->inputs()[3] && !encoder_mask) {
      refuse("cross-attention '" + p.cross->name.value +
             "' has a mask but the decoder has no encoder_attention_mask input");
    }
    for (int kv = 1; cross_inputs && kv <= 2; ++kv) {
      const Value* x = p.cross->inputs()[static_cast<size_t>(kv)];
      Value* x3 = bsd_source(g, x, dtype_of(x));
      if (!x3 || projected_input(x3) != hidden) {
        refuse("cross-attention '" + p.cross->name.value + "' reads " + (kv == 1 ? "K" : "V") +
               " '" + x->name() + "', not proven a head split of a (B, E, H*D) projection of " +
               "encoder_hidden_states: the encoder could not compute it alone");
      }
      sources[p.cross][static_cast<size_t>(kv - 1)] = x3;
    }
  }
  return sources;
}

// The names the forms add are free.
void check_names_free(const Graph& g, size_t layers, const Seq2SeqForms& forms) {
  for (size_t i = 0; i < layers; ++i) {
    for (const CacheForm* form : {&forms.self, forms.cross}) {
      for (bool past : {true, false}) {
        for (bool value : {false, true}) {
          if (!form) continue;
          const std::string n = past ? past_name(*form, i, value) : present_name(*form, i, value);
          if (Value* v = g.lookup(n); v && v->defined()) refuse("a value named '" + n + "' exists");
        }
      }
    }
  }
  const bool length_input = forms.self.past_length == PastLength::kLengthInput;
  if (Value* v = g.lookup(kPastSequenceLength); length_input && v && v->defined()) {
    refuse(std::string("a value named '") + kPastSequenceLength + "' exists");
  }
}

// The positions the self-attentions' causal mask and t5's bias read: query P + s, keys 0..T-1.
struct DecoderPositions {
  Value* past_len;  // P, int64 scalar
  Value* q_col;     // (S, 1)
  Value* k_pos;     // (T)
  Value* causal;    // bool (1, 1, S, T)
};

DecoderPositions decoder_positions(Graph& g, KvCacheBuilder& b, const CacheForm& self, Node* head) {
  Value* input_ids = graph_input(g, kInputIds);
  Value* zero = b.constant("kv_zero", {0}, {});
  Value* one = b.constant("kv_one", {1}, {});
  Value* past_len = past_length(g, b, self, head);
  Value* seq_len = b.op("Gather", {b.op("Shape", {input_ids}, "kv_ids_shape", head), one},
                        "kv_seq_len", head, one_attr(attr_int("axis", 0)));
  Value* total_len = b.op("Add", {past_len, seq_len}, "kv_total_len", head);
  Value* q_col = b.op("Unsqueeze",
                      {b.op("Range", {past_len, total_len, one}, "kv_query_positions", head),
                       b.constant("kv_axes_1", {1}, {1})},
                      "kv_query_column", head);
  Value* k_pos = b.op("Range", {zero, total_len, one}, "kv_key_positions", head);
  Value* causal = b.op("Unsqueeze",
                       {b.op("LessOrEqual", {k_pos, q_col}, "kv_causal_2d", head),
                        b.constant("kv_axes_0_1", {0, 1}, {2})},
                       "kv_causal", head);
  causal->type =
      tensor_type(kBool, {value_dim(1), value_dim(1), param_dim("decoder_sequence_length"),
                          param_dim(self.present_dim)});
  return {past_len, q_col, k_pos, causal};
}

// encoder_attention_mask as the cross-attentions' padding (B, 1, 1, E), or null without one.
Value* encoder_padding(Graph& g, KvCacheBuilder& b, const Dim& batch, Node* head) {
  Value* encoder_mask = graph_input(g, kEncoderAttentionMask);
  if (!encoder_mask) return nullptr;
  Value* padding = b.op(
      "Unsqueeze",
      {b.op("Cast", {encoder_mask}, "kv_encoder_mask_bool", head, one_attr(attr_int("to", kBool))),
       b.constant("kv_axes_1_2", {1, 2}, {2})},
      "kv_encoder_padding", head);
  padding->type =
      tensor_type(kBool, {batch, value_dim(1), value_dim(1), param_dim(kSeq2SeqCross.present_dim)});
  return padding;
}

void count_layers(PassContext& ctx, const Seq2SeqForms& forms, size_t layers) {
  const auto n = static_cast<int64_t>(layers);
  ctx.counters["seq2seq decoder layers cached"] += n;
  if (forms.cross_mode == 0) {
    ctx.counters["cross-attentions reading encoder_hidden_states every step"] += n;
  }
  if (forms.cross == &kSeq2SeqCrossFromEncoder) {
    ctx.counters["cross-attentions reading a cross cache the encoder computes"] += n;
  }
}

}  // namespace

int64_t add_cross_cache(Model& m, const std::vector<Node*>& attentions, int64_t mode,
                        PassContext& ctx) {
  Graph& g = *m.graph;
  const Seq2SeqForms forms = seq2seq_forms(mode, ctx);
  const bool cross_cached = forms.cross == &kSeq2SeqCross;
  const bool cross_inputs = forms.cross == &kSeq2SeqCrossFromEncoder;
  Value* input_ids = graph_input(g, kInputIds);
  check_decoder_inputs(m, g, forms);
  std::vector<BiasedLayer> biased;
  const std::vector<Pair> pairs =
      pair_layers(g, attentions, graph_input(g, kEncoderHiddenStates), input_ids, biased);
  const auto sources = cross_sources(g, pairs, forms);
  check_names_free(g, pairs.size(), forms);
  const std::vector<Node*> ranges = position_ranges(m, g, input_ids, attentions);
  prove_positionwise(m, attentions, ranges, input_ids);
  const Dim* batch_dim = dim_of(input_ids, 0);
  const Dim batch = batch_dim ? *batch_dim : param_dim("batch_size");

  // ---- edits ----
  KvCacheBuilder b(g);
  for (size_t i = 0; i < pairs.size(); ++i) {
    cache_kv(g, b, pairs[i].self, i, forms.self, batch);
    if (cross_cached) cache_kv(g, b, pairs[i].cross, i, *forms.cross, batch);
    if (cross_inputs) cross_from_inputs(g, b, pairs[i].cross, sources.at(pairs[i].cross), i, batch);
  }
  Node* head = g.first();
  const DecoderPositions pos = decoder_positions(g, b, forms.self, head);
  Value* padding = encoder_padding(g, b, batch, head);
  for (const Pair& p : pairs) {
    if (cross_cached) p.cross->attributes.push_back(attr_int("cross_cache", 1));
    set_attention_mask(p.self, pos.causal);
    const bool masked = p.cross->inputs().size() > 3 && p.cross->inputs()[3];
    set_attention_mask(p.cross, masked ? padding : nullptr);
  }
  use_relative_biases(g, b, biased, pos.q_col, pos.k_pos, pos.causal, ctx);
  offset_positions(b, ranges, pos.past_len, ctx);
  count_layers(ctx, forms, pairs.size());
  return static_cast<int64_t>(pairs.size());
}

}  // namespace fastopt::passes::kv_cache
