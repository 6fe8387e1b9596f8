// t5's relative position bias through the decoder's cache (kv_cache_cross.h). Both exporters
// write the self-attention's mask as
//
//   q    = Unsqueeze(Range(0, S, 1), [1])              (S, 1)  query positions
//   k    = Unsqueeze(Range(0, S, 1), [0])              (1, S)  key positions
//   rel  = Sub(k, q)                                   (S, S)  key - query (either order)
//   idx  = f(rel)                                      elementwise: the bucket (Min, Neg, Less,
//                                                      Cast, Div, Log, Mul, Add, Where with
//                                                      scalars and fills of rel's shape)
//   bias = Unsqueeze(Transpose(Gather(table (NB, H), idx), [2, 0, 1]), [0])   (1, H, S, S)
//   mask = Where(c, bias, lowest) | Add(bias, m) | Add(m, bias)
//
// (TorchScript takes the two lengths from Shape(hidden)[1] and Shape(K)[2], dynamo reads one
// Range(0, S) for both; t5 computes the bias in layer 0 and every layer reads it.) So
// bias[h, i, j] = table[f(j - i), h]: a function of the two positions' difference only. In the
// cached decoder query s sits at P + s and the keys at 0 .. P + S - 1, so the rewrite makes rel
// read exactly those (Sub(Range(0, T), Unsqueeze(Range(P, T), [1])), (S, T)): each row is the
// no-cache model's row for query P + s, over the same keys. The mask part (c or m) is proven
// causal like any mask and replaced; the new mask is Where(causal, bias, lowest).
//
// Anything else that reads a float table in the mask is refused with the piece that differs.
#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "ir/dtype.h"
#include "passes/attention/shapes.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/kv_cache_cross.h"

namespace fastopt::passes::kv_cache {
namespace {

constexpr double kMaskedBelow = -1e4;  // exp() underflows to 0 in fp32
constexpr size_t kMaxChain = 256;

enum Axis { kOne, kQuery, kKey, kHead };

bool is_float(int32_t t) {
  return t == kFloat || t == kFloat16;
}

class BiasMatcher {
 public:
  BiasMatcher(const Model& m, const Graph& g, const Node* att, const Value* input_ids)
      : m_(m), g_(g), att_(att), input_ids_(input_ids) {}

  // nullopt with why_ empty: no bias; with why_ set: a bias this cannot prove.
  std::optional<RelativeBias> run() {
    const Value* mask = att_->inputs().size() > 3 ? att_->inputs()[3] : nullptr;
    const Node* gather = mask ? float_table_gather(mask, g_) : nullptr;
    if (!gather) return std::nullopt;
    where_ = "the bias read from the table '" + gather->inputs()[0]->name() + "' (Gather '" +
             gather->name.value + "')";
    RelativeBias r;
    if (!split_mask(mask, r)) return std::nullopt;
    if (!layout(r.bias, gather)) return std::nullopt;
    const Value* idx = gather->inputs()[1];
    const Node* rel = idx ? find_relative(idx) : nullptr;
    if (!rel) {
      fail("its indices do not come from one Sub of key and query positions");
      return std::nullopt;
    }
    r.relative = const_cast<Node*>(rel);
    if (!relative_positions(rel, r)) return std::nullopt;
    if (!elementwise_of(idx, rel->outputs()[0])) return std::nullopt;
    if (!private_chain(rel, gather, r.bias)) return std::nullopt;
    for (const Node* n : chain_) r.chain.push_back(const_cast<Node*>(n));
    return r;
  }

  const std::string& why() const { return why_; }

 private:
  bool fail(const std::string& what) {
    why_ = where_ + ": " + what;
    return false;
  }

  // mask = Where(c, bias, lowest) or Add(bias, m): the bias is the operand whose ancestry holds
  // the table, the other part is the mask the proof checks.
  bool split_mask(const Value* mask, RelativeBias& r) {
    const Node* top = mask->producer();
    if (!top || !is_standard(top) || top->graph() != &g_) {
      return fail("the mask is not Where(mask, bias, lowest) or Add(bias, mask)");
    }
    for (const Use& u : mask->uses()) {
      if (u.node->op_type != kInternalAttention || u.input_index != 3) {
        return fail("the mask '" + mask->name() + "' is also read by " + u.node->op_type + " '" +
                    u.node->name.value + "'");
      }
    }
    if (mask->is_graph_output()) return fail("the mask is a graph output");
    const std::vector<Value*>& in = top->inputs();
    if (top->op_type == "Where" && in.size() == 3) {
      auto low = constant_scalar(in[2]);
      if (!low || *low > kMaskedBelow || float_table_gather(in[0], g_) ||
          !float_table_gather(in[1], g_)) {
        return fail("the mask is Where, but not Where(mask, bias, lowest)");
      }
      r.bias = in[1];
      r.mask_part = in[0];
      return true;
    }
    if (top->op_type == "Add" && in.size() == 2) {
      const bool first = float_table_gather(in[0], g_) != nullptr;
      if (first == (float_table_gather(in[1], g_) != nullptr)) {
        return fail("the mask is Add, but not of one bias and one mask");
      }
      r.bias = in[first ? 0 : 1];
      r.mask_part = in[first ? 1 : 0];
      return true;
    }
    return fail("the mask is " + top->op_type +
                ", not Where(mask, bias, lowest) or Add(bias, mask)");
  }

  // The layout ops from the table lookup to `bias` (Transpose / Unsqueeze / Cast / Identity),
  // the lookup's first; false when another op sits between.
  bool layout_path(const Value* bias, const Node* gather, std::vector<const Node*>& path) {
    const Value* v = bias;
    while (v && v->producer() != gather) {
      const Node* p = v->producer();
      if (!p || !is_standard(p) || p->inputs().empty() || path.size() > 8 ||
          !(p->op_type == "Transpose" || p->op_type == "Unsqueeze" || p->op_type == "Cast" ||
            p->op_type == "Identity" || p->op_type == "Slice")) {
        return fail("between the table lookup and the mask there is " +
                    (p ? p->op_type + " '" + p->name.value + "'" : std::string("no node")) +
                    ", not only Transpose / Unsqueeze / Cast / a whole-query Slice");
      }
      path.push_back(p);
      v = p->inputs()[0];
    }
    return true;
  }

  bool transpose_axes(const Node* p, std::vector<Axis>& axes) {
    const Attribute* perm = p->attribute("perm");
    if (!perm || perm->ints.size() != axes.size()) return fail("a Transpose without perm");
    std::vector<Axis> out;
    for (int64_t i : perm->ints) {
      if (i < 0 || i >= static_cast<int64_t>(axes.size())) return fail("a bad perm");
      out.push_back(axes[static_cast<size_t>(i)]);
    }
    axes = out;
    return true;
  }

  bool unsqueeze_axes(const Node* p, std::vector<Axis>& axes) {
    auto at = p->inputs().size() > 1 ? constant_ints(p->inputs()[1]) : std::nullopt;
    if (!at) return fail("an Unsqueeze without constant axes");
    std::vector<int64_t> where = *at;
    const int64_t rank = static_cast<int64_t>(axes.size() + where.size());
    for (int64_t& a : where) a = a < 0 ? a + rank : a;
    std::sort(where.begin(), where.end());
    for (int64_t a : where) {
      if (a < 0 || a > static_cast<int64_t>(axes.size())) return fail("a bad Unsqueeze axis");
      axes.insert(axes.begin() + a, kOne);
    }
    return true;
  }

  // `axes` after layout op `p`; false (with the reason) when `p` is not one this proves.
  bool layout_step(const Node* p, std::vector<Axis>& axes) {
    if (!mistyped_reason(p).empty()) return fail(mistyped_reason(p));
    if (p->op_type == "Transpose") return transpose_axes(p, axes);
    if (p->op_type == "Unsqueeze") return unsqueeze_axes(p, axes);
    if (p->op_type == "Cast" && !is_float(static_cast<int32_t>(int_attr_or(p, "to", 0)))) {
      return fail("the bias is cast to a non-float type");
    }
    if (p->op_type == "Slice" && !whole_query_slice(p, axes)) {
      return fail("Slice '" + p->name.value + "' is not x[..., -S:, ...] over the query axis");
    }
    return true;
  }

  // bias = layout ops over Gather(table (NB, H), idx (q, k), axis 0): its axes, leading ones
  // aside, must be (H, q, k), as the scores' (B, H, S, T).
  bool layout(const Value* bias, const Node* gather) {
    std::vector<const Node*> path;
    if (!layout_path(bias, gather, path)) return false;
    auto table = constant_tensor(gather->inputs()[0]);
    if (int_attr_or(gather, "axis", 0) != 0 || table->dims.size() != 2 ||
        table->dims[1] != int_attr_or(att_, "q_num_heads", 0)) {
      return fail("the table is not (buckets, heads) read along axis 0");
    }
    std::vector<Axis> axes = {kQuery, kKey, kHead};
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      if (!layout_step(*it, axes)) return false;
    }
    while (!axes.empty() && axes.front() == kOne) axes.erase(axes.begin());
    if (axes != std::vector<Axis>{kHead, kQuery, kKey} || value_rank(bias) > 4) {
      return fail("the bias is not laid out as (heads, query, key) with leading ones");
    }
    return true;
  }

  // 4.49-4.57's T5Attention slices its bias to the last S query rows (position_bias[:, :, -S:, :]):
  // a Slice on the query axis, step 1, from -(decoder length) to the end. The query axis holds
  // the S new positions in either model, and -S is read from a decoder length, which in the
  // cached model is S or P + S >= S: clamped, the Slice keeps every row there too.
  bool whole_query_slice(const Node* p, const std::vector<Axis>& axes) {
    return p->inputs().size() > 3 && query_axis_to_end(p, axes) &&
           minus_decoder_length(p->inputs()[1]);
  }

  // axes (one) is the query axis, ends reaches past any length, steps absent or 1
  static bool query_axis_to_end(const Node* p, const std::vector<Axis>& axes) {
    const std::vector<Value*>& in = p->inputs();
    auto axis = constant_ints(in[3]);
    auto ends = constant_ints(in[2]);
    auto steps = in.size() > 4 ? constant_ints(in[4]) : std::optional<std::vector<int64_t>>{{1}};
    if (!axis || !ends || !steps || axis->size() != 1 || ends->size() != 1 ||
        *steps != std::vector<int64_t>{1} || (*ends)[0] < INT32_MAX) {
      return false;
    }
    const int64_t rank = static_cast<int64_t>(axes.size());
    const int64_t a = (*axis)[0] < 0 ? (*axis)[0] + rank : (*axis)[0];
    return a >= 0 && a < rank && axes[static_cast<size_t>(a)] == kQuery;
  }

  // start: Neg(n) (TorchScript: Unsqueeze(Neg(Gather(Shape(hidden), 1)))) with n proven to be
  // the decoder length, or a value proven to be its negation
  bool minus_decoder_length(const Value* start) const {
    analysis::ShapeFacts facts(m_);
    const std::optional<analysis::DimExpr> seq = facts.dim(input_ids_, 1);
    if (!seq) return false;
    auto is = [&](const Value* v, const analysis::DimExpr& want) {
      const std::vector<analysis::DimExpr>* got = v ? facts.shape_value(v) : nullptr;
      return got && got->size() == 1 && (*got)[0] == want;
    };
    const auto minus_seq = analysis::DimExpr::sub(analysis::DimExpr::constant(0), *seq);
    if (minus_seq && is(start, *minus_seq)) return true;
    const Node* neg = start->producer();
    if (neg && is_standard(neg) && neg->op_type == "Unsqueeze" && !neg->inputs().empty()) {
      neg = neg->inputs()[0]->producer();
    }
    return neg && is_standard(neg) && neg->op_type == "Neg" && neg->inputs().size() == 1 &&
           is(neg->inputs()[0], *seq);
  }

  // The Sub both index operands derive from: the first Sub met walking back from idx.
  const Node* find_relative(const Value* idx) const {
    std::vector<const Value*> todo = {idx};
    std::unordered_set<const Value*> seen;
    while (!todo.empty() && seen.size() < kMaxChain) {
      const Value* x = todo.back();
      todo.pop_back();
      if (!x || !seen.insert(x).second) continue;
      const Node* p = x->producer();
      if (!p || p->graph() != &g_) continue;
      if (p->op_type == "Sub" && is_standard(p) && p->inputs().size() == 2 &&
          positions_operand(p->inputs()[0]) && positions_operand(p->inputs()[1])) {
        return p;
      }
      for (const Value* in : p->inputs()) todo.push_back(in);
    }
    return nullptr;
  }

  // Unsqueeze(Range(...), [0] | [1]): the Range, or null.
  static const Node* positions_operand(const Value* v, int64_t* axis = nullptr) {
    const Node* u = v ? v->producer() : nullptr;
    if (!u || !is_standard(u) || u->op_type != "Unsqueeze" || u->inputs().size() != 2) {
      return nullptr;
    }
    auto at = constant_ints(u->inputs()[1]);
    const Node* r = u->inputs()[0] ? u->inputs()[0]->producer() : nullptr;
    if (!at || at->size() != 1 || ((*at)[0] != 0 && (*at)[0] != 1) || !r || !is_standard(r) ||
        r->op_type != "Range" || r->inputs().size() != 3) {
      return nullptr;
    }
    if (axis) *axis = (*at)[0];
    return r;
  }

  // rel = Sub of a key row Unsqueeze(Range(0, n, 1), [0]) and a query column (axes [1]), both
  // over the decoder's length (input_ids' axis 1).
  bool relative_positions(const Node* rel, RelativeBias& r) {
    int64_t a0 = -1, a1 = -1;
    const Node* r0 = positions_operand(rel->inputs()[0], &a0);
    const Node* r1 = positions_operand(rel->inputs()[1], &a1);
    if (a0 == a1)
      return fail("the Sub's operands are not one row of keys and one column of queries");
    r.query_operand = a0 == 1 ? 0 : 1;
    analysis::ShapeFacts facts(m_);
    const std::optional<analysis::DimExpr> seq = facts.dim(input_ids_, 1);
    for (const Node* range : {r0, r1}) {
      auto start = constant_scalar(range->inputs()[0]);
      auto delta = constant_scalar(range->inputs()[2]);
      if (!start || *start != 0 || !delta || *delta != 1) {
        return fail("Range '" + range->name.value + "' does not count 0, 1, ...");
      }
      const std::vector<analysis::DimExpr>* limit = facts.shape_value(range->inputs()[1]);
      if (!seq || !limit || limit->size() != 1 || !((*limit)[0] == *seq)) {
        return fail("Range '" + range->name.value +
                    "' runs over a length not proven to be the decoder's (input_ids' axis 1), "
                    "so its positions are not proven to be the tokens'");
      }
    }
    return true;
  }

  bool scalar_constant(const Value* v, const Tensor& t) {
    if (t.numel() == 1) return true;
    return fail("its bucket computation reads the constant '" + v->name() + "' of " +
                std::to_string(t.numel()) + " elements, not a scalar");
  }

  // ConstantOfShape / Expand `p` fills the whole shape of a value elementwise of rel (Expand: with
  // a scalar).
  bool fill_of(const Node* p, const Value* rel) {
    const size_t shape_at = p->op_type == "Expand" ? 1 : 0;
    const Value* s = p->inputs().size() > shape_at ? p->inputs()[shape_at] : nullptr;
    const Node* sp = s ? s->producer() : nullptr;
    if (p->op_type == "Expand" &&
        (!constant_tensor(p->inputs()[0]) || constant_tensor(p->inputs()[0])->numel() != 1)) {
      return fail("Expand '" + p->name.value + "' does not fill a scalar");
    }
    if (!sp || !is_standard(sp) || sp->op_type != "Shape" || sp->inputs().size() != 1 ||
        int_attr_or(sp, "start", 0) != 0 || sp->attribute("end")) {  // the whole shape
      return fail(p->op_type + " '" + p->name.value + "' fills a shape that is not rel's");
    }
    chain_.insert(sp);
    return elementwise_of(sp->inputs()[0], rel);
  }

  // idx is an elementwise function of rel: every node between them is an elementwise op whose
  // other operands are scalar constants or fills of a derived value's shape (ConstantOfShape /
  // Expand of a scalar over Shape(derived)), so idx[i, j] depends on rel[i, j] alone.
  bool elementwise_of(const Value* v, const Value* rel) {
    static const std::unordered_set<std::string> kOps = {
        "Add",         "Sub",        "Mul",
        "Div",         "Min",        "Max",
        "Neg",         "Abs",        "Log",
        "Exp",         "Sqrt",       "Cast",
        "Floor",       "Ceil",       "Round",
        "Sign",        "Less",       "Greater",
        "LessOrEqual", "Equal",      "Not",
        "And",         "Or",         "Where",
        "Mod",         "Identity",   "GreaterOrEqual",
        "Clip",        "Reciprocal", "Pow"};
    if (v == rel) return true;
    if (!v) return fail("a missing operand in its bucket computation");
    if (auto t = constant_tensor(v)) return scalar_constant(v, *t);
    const Node* p = v->producer();
    if (!p || p->graph() != &g_) {
      return fail("its bucket computation reads '" + v->name() + "', not only key - query");
    }
    if (chain_.size() > kMaxChain) return fail("its bucket computation is too long");
    if (chain_.count(p)) return true;
    if (!is_standard(p) || p->outputs().size() != 1 || !mistyped_reason(p).empty()) {
      return fail("its bucket computation uses " + p->op_type + " '" + p->name.value + "'");
    }
    chain_.insert(p);
    if (p->op_type == "ConstantOfShape" || p->op_type == "Expand") return fill_of(p, rel);
    if (!kOps.count(p->op_type)) {
      return fail("its bucket computation uses " + p->op_type + " '" + p->name.value +
                  "', not an elementwise op");
    }
    for (const Value* x : p->inputs()) {
      if (!elementwise_of(x, rel)) return false;
    }
    return true;
  }

  // The values the rewrite changes (rel's and what follows up to the bias) are read only inside
  // the bias computation or as an attention's mask, which the rewrite replaces.
  bool private_chain(const Node* rel, const Node* gather, const Value* bias) {
    chain_.insert(rel);
    chain_.insert(gather);
    for (const Value* v = bias; v && v->producer() != gather; v = v->producer()->inputs()[0]) {
      chain_.insert(v->producer());
    }
    std::unordered_set<const Node*> masks;
    for (const Node* n = g_.first(); n; n = n->next()) {
      if (n->op_type == kInternalAttention && n->inputs().size() > 3 && n->inputs()[3] &&
          n->inputs()[3]->producer()) {
        masks.insert(n->inputs()[3]->producer());
      }
    }
    for (const Node* n : chain_) {
      for (const Value* o : n->outputs()) {
        if (!o) continue;
        if (o->is_graph_output()) return fail("'" + o->name() + "' is a graph output");
        for (const Use& u : o->uses()) {
          if (!chain_.count(u.node) && !masks.count(u.node)) {
            return fail("'" + o->name() + "' is also read by " + u.node->op_type + " '" +
                        u.node->name.value + "', which the rewrite would change");
          }
        }
      }
    }
    return true;
  }

  const Model& m_;
  const Graph& g_;
  const Node* att_;
  const Value* input_ids_;
  std::unordered_set<const Node*> chain_;
  std::string where_, why_;
};

}  // namespace

const Node* float_table_gather(const Value* v, const Graph& g) {
  std::vector<const Value*> todo = {v};
  std::unordered_set<const Value*> seen;
  while (!todo.empty() && seen.size() < 4096) {
    const Value* x = todo.back();
    todo.pop_back();
    if (!x || !seen.insert(x).second) continue;
    const Node* p = x->producer();
    if (!p || p->graph() != &g || p->op_type == "Shape" || p->op_type == "Size") continue;
    if (p->op_type == "Gather" && !p->inputs().empty()) {
      if (auto t = constant_tensor(p->inputs()[0]); t && is_float(t->dtype())) return p;
    }
    for (const Value* in : p->inputs()) todo.push_back(in);
  }
  return nullptr;
}

std::optional<RelativeBias> match_relative_bias(const Model& m, const Graph& g, const Node* att,
                                                const Value* input_ids, std::string* why) {
  BiasMatcher matcher(m, g, att, input_ids);
  auto r = matcher.run();
  if (why) *why = matcher.why();
  return r;
}

void use_relative_biases(Graph& g, KvCacheBuilder& b, const std::vector<BiasedLayer>& layers,
                         Value* query_column, Value* key_positions, Value* causal,
                         PassContext& ctx) {
  std::unordered_set<const Node*> rewired;
  std::unordered_map<const Value*, Value*> masks;
  for (const BiasedLayer& l : layers) {
    const RelativeBias& r = l.bias;
    Node* rel = r.relative;
    if (rewired.insert(rel).second) {
      for (int operand = 0; operand < 2; ++operand) {
        Value* old = rel->inputs()[static_cast<size_t>(operand)];
        Value* pos = operand == r.query_operand ? query_column : key_positions;
        const int32_t t = value_dtype(old);
        if (t != 0 && t != kInt64) {
          pos = b.op("Cast", {pos}, "kv_relative_positions", rel,
                     one_attr(pattern::attr_int("to", t)));
        }
        rel->set_input(operand, pos);
      }
      // Their types said (S, S); the key axis is T now.
      for (Node* n : r.chain) {
        for (Value* o : n->outputs()) {
          if (o && o->type.has_shape) {
            o->type.has_shape = false;
            o->type.dims.clear();
          }
        }
      }
      ctx.counters["relative position bias over absolute positions"] += 1;
    }
    Value*& mask = masks[r.bias];  // layers reading one bias share its mask
    if (!mask) {
      const int32_t t = value_dtype(r.bias);
      std::string lowest;
      if (t == kFloat16) {
        lowest = std::string("\xff\xfb", 2);  // -65504
      } else {
        const float x = std::numeric_limits<float>::lowest();
        lowest.assign(reinterpret_cast<const char*>(&x), sizeof x);
      }
      Value* low = g.add_initializer(g.unique_name("kv_relative_bias_lowest"),
                                     make_tensor(t, {}, std::move(lowest)));
      mask = b.op("Where", {causal, r.bias, low}, "kv_relative_bias_mask", l.att);
      mask->type.known = mask->type.is_tensor = true;
      mask->type.elem_type = t;
    }
    set_attention_mask(l.att, mask);
  }
}

}  // namespace fastopt::passes::kv_cache
