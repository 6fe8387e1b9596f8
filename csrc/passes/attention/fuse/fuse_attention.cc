// Stage 1 of the attention fusion: scaled dot-product attention as exporters write it becomes one
// internal Attention node (internal_op.h); lower_attention turns it into what the target runs.
//
//   q (B,Hq,S,D)       k (B,Hkv,T,D)                 v (B,Hkv,T,Dv)
//     |                  |                             |
//   [Mul|Div c]?      [repeat_kv]?                  [repeat_kv]?     repeat_kv: Unsqueeze(2) ->
//     |                  |                             |              Expand(B,Hkv,G,T,D) ->
//     |               Kt: Transpose(0,1,3,2)           |              Reshape(B,Hq,T,D)
//     |                 | Reshape-Transpose(0,2,1)-Reshape (torchlib SDPA)
//     |                 | Transpose(k_BSHD, 0,2,3,1)   |
//     |               [Mul|Div c]?                      |
//      \               /                                |
//        MatMul -> [Mul|Div c]? -> [softcap]? -> [Cast fp32]? -> [Add(mask)]? -> Softmax(-1)
//                                                                    |
//                                            [Where(IsNaN(p), 0, p)]? -> [Cast]? -> MatMul <-
//                                            [Cast]?
//   (gpt-oss: the Softmax reads Concat(scores, sink column) and is sliced back to the keys:
//    sinks.h)
//
//   ==>  ai.fastopt.internal::Attention(q, k, v, mask?, sinks?) [-> Cast]
//
// Both PyTorch exporters decompose F.scaled_dot_product_attention (what HF's sdpa attention
// calls) this way: TorchScript and dynamo split sqrt(scale) onto Q and K, dynamo transposes K
// through a 3-D Reshape, HF repeats the kv heads for GQA, fp16 TorchScript exports cast the
// scores to fp32 for the softmax (and V to fp32 for the last MatMul), and Where(IsNaN) zeroes
// rows whose keys are all masked. Older exports scale the scores instead; all placements
// multiply into one scale. The mask HF adds is Where(bool_mask, 0, -inf | finfo.min): the
// boolean (true = attend) becomes the internal op's mask; any other additive mask is kept as is.
// gemma2's eager attention soft-caps the scaled scores before the mask, c * tanh(s / c)
// (softcap.h): the internal op's `softcap` = c; a scale after the cap or a mask inside it is
// refused (neither GQA nor Attention-23 can say that).
#include <any>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "analysis/shape_facts.h"
#include "ir/constant.h"
#include "passes/attention/fuse/alibi.h"
#include "passes/attention/fuse/attention_walk.h"
#include "passes/attention/fuse/disentangled.h"
#include "passes/attention/fuse/softcap.h"
#include "passes/attention/internal_op.h"
#include "passes/attention/masked_rows.h"
#include "passes/attention/shapes.h"
#include "passes/attention/sinks.h"
#include "passes/fusion/norm_util.h"
#include "passes/fusion_util.h"
#include "schema/attr_schema.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

using attention_walk::AttentionWalk;
using attention_walk::Found;

// Cheap filter: attention's second MatMul reads a softmax (through Cast / Where / the Slice that
// drops a sink's column).
bool reads_softmax(const Node* n) {
  if (n->op_type != "MatMul" || !n->domain.value.empty() || n->inputs().size() != 2) return false;
  const Node* p = n->inputs()[0]->producer();
  for (int i = 0; i < 2 && p && p->op_type != "Softmax"; ++i) {
    if (p->op_type == "Slice" && !p->inputs().empty() && p->inputs()[0]) {
      p = p->inputs()[0]->producer();
    } else if (p->op_type == "Cast" || p->op_type == "Where") {
      p = p->inputs().back()->producer();
    } else {
      p = nullptr;
    }
  }
  return p && p->op_type == "Softmax";
}

// The internal op must always be able to go back to standard ops (decompose_attention), which
// need Range: "" where the model's opset has it, else the refusal.
std::string opset_refusal(const Node* root) {
  const int64_t opset = default_opset(*root->graph()->model());
  if (opset >= kDecomposeOpset) return "";
  return "opset " + std::to_string(opset) + ": standard ops for the attention need " +
         std::to_string(kDecomposeOpset) + " (Range)";
}

bool match_attention(Node* root, CodeMatch& m, MatchFailure& why, PassContext& ctx) {
  if (!reads_softmax(root)) return false;  // no candidate: nothing to explain
  auto refuse = [&](std::string reason) {
    why.text = std::move(reason);
    ctx.counters["not fused"] += 1;
    return false;
  };
  if (std::string r = opset_refusal(root); !r.empty()) return refuse(r);
  Found f;
  AttentionWalk walk(f);
  if (!walk.match(root)) return refuse(walk.error);
  // A node ORT refuses (an attribute of the wrong type: Softmax's axis as a string) is never
  // fused into one it runs; its attribute was read as the default above.
  const Node* mistyped = nullptr;
  for (const Node* n : f.nodes) {
    if (pattern::mistyped_attribute(*n)) mistyped = n;
  }
  if (mistyped) {
    return refuse(pattern::describe_mistyped(*mistyped, *pattern::mistyped_attribute(*mistyped)));
  }
  m.nodes = f.nodes;
  m.found = std::move(f);
  return true;
}

// Flat heads (alibi.h, bloom): the root is Reshape(MatMul(Reshape(probs), v3), 4-D target).
bool match_flat_attention(Node* root, CodeMatch& m, MatchFailure& why, PassContext& ctx) {
  Node* mm = alibi::flat_candidate(root);
  if (!mm) return false;  // no candidate
  auto refuse = [&](std::string reason) {
    why.text = std::move(reason);
    ctx.counters["not fused"] += 1;
    return false;
  };
  if (std::string r = opset_refusal(root); !r.empty()) return refuse(r);
  const Value* flat = mm->outputs()[0];
  if (std::string r = alibi::flat_output_refusal(flat, root); !r.empty()) return refuse(r);
  Found f;
  AttentionWalk walk(f);
  if (!walk.match(mm)) return refuse(walk.error);
  // TorchScript reads the flat output's shape for the head merge: the same as flat Q's when
  // Dv == D, which the rewrite hands those Shape nodes instead.
  analysis::ShapeFacts& sf = analysis::facts_of(*root->graph()->model());
  if (flat->uses().size() > 1 && !alibi::flat_output_shape_is_q3(flat, f.q3, sf)) {
    return refuse("flat heads: the flat output's shape is read and is not flat Q's");
  }
  for (const Node* n : f.nodes) {
    if (pattern::mistyped_attribute(*n)) {
      return refuse(pattern::describe_mistyped(*n, *pattern::mistyped_attribute(*n)));
    }
  }
  f.flat_out_4d = alibi::flat_output_is_4d(root->outputs()[0], f.q, f.v, sf);
  f.nodes.push_back(mm);
  m.nodes = f.nodes;
  m.found = std::move(f);
  return true;
}

// The internal op's mask input (t: Q's dtype), or null without one.
Value* attention_mask(const Found& f, Rewriter& rw, int32_t t) {
  if (f.bias) {  // alibi.h: one additive mask, bias + the export's mask
    Value* bias = f.bias;
    if (f.bias_flat != alibi::FlatBias::kNone) bias = alibi::bias_4d(rw, bias, f.bias_flat, f.hq);
    Value* mask = alibi::combine(rw, bias, f.mask_bool ? f.mask_additive : f.mask,
                                 f.masked_value ? f.mask : nullptr, f.masked_value);
    if (dtype_of(mask) != t) mask = rw.op1("Cast", {mask}, one_attr(attr_int("to", t)));
    return mask;
  }
  if (f.masked_value) return rw.op1("Not", {f.mask});  // masked_fill without a bias: kept keys
  if (f.mask && !f.mask_bool && dtype_of(f.mask) != t) {
    return rw.op1("Cast", {f.mask}, one_attr(attr_int("to", t)));
  }
  return f.mask;
}

std::vector<Attribute> attention_attrs(const Found& f) {
  std::vector<Attribute> attrs;
  attrs.push_back(attr_float("scale", static_cast<float>(f.scale)));
  attrs.push_back(attr_int("is_causal", 0));
  attrs.push_back(attr_int("q_num_heads", f.hq));
  attrs.push_back(attr_int("kv_num_heads", f.hkv));
  if (f.softmax_precision) attrs.push_back(attr_int("softmax_precision", f.softmax_precision));
  if (f.softcap) attrs.push_back(attr_float("softcap", static_cast<float>(f.softcap)));
  if (f.bias) attrs.push_back(attr_int("score_bias", 1));
  // A finite masking value: a row whose every key is masked averages the keys (internal_op.h);
  // with sinks it gives 0 (the sink takes the row: sinks_fit).
  if (!f.bias && !f.sinks && (f.mask_bool || f.masked_value) && std::isfinite(f.mask_value)) {
    attrs.push_back(absorbs_scores(f.mask_value, f.mask_value_dtype)
                        ? attr_int("masked_rows_mean", 1)
                        : attr_float("masked_value", static_cast<float>(f.mask_value)));
  }
  return attrs;
}

void count_fused(const Found& f, PassContext& ctx) {
  ctx.counters["attention"] += 1;
  if (f.hkv != f.hq) ctx.counters["grouped kv heads"] += 1;
  if (f.mask) ctx.counters[f.mask_bool || f.masked_value ? "boolean mask" : "additive mask"] += 1;
  if (f.softcap) ctx.counters["soft-capped"] += 1;
  if (f.sinks) ctx.counters["attention sinks"] += 1;
  if (f.bias) {
    ctx.counters[f.position_terms ? "disentangled position terms" : "attention bias (ALiBi)"] += 1;
  }
  if (f.flat) ctx.counters["flat heads"] += 1;
}

Replacement rewrite_attention(const CodeMatch& m, Rewriter& rw, PassContext& ctx) {
  const Found& f = std::any_cast<const Found&>(m.found);
  Graph& g = rw.graph();
  Node* root = m.root;
  // Every rule's match checks it first (match_attention says why); this covers them all.
  if (default_opset(*g.model()) < kDecomposeOpset) return rw.fail("opset below 11");
  const int32_t t = dtype_of(f.q);
  Value* k = f.k;
  if (f.k_bshd) k = rw.op1("Transpose", {k}, one_attr(attr_ints("perm", {0, 2, 1, 3})));
  std::vector<Value*> inputs = {f.q, k, f.v};
  if (Value* mask = attention_mask(f, rw, t)) inputs.push_back(mask);
  if (f.sinks) {  // input 4, after the mask (or its empty slot)
    inputs.resize(4);
    inputs.push_back(rw.initializer("attention_sinks", f.sinks));
  }
  Value* y = rw.op1(kInternalAttention, inputs, attention_attrs(f), kInternalDomain);
  const int32_t out_dtype = dtype_of(root->outputs()[0]);
  if (out_dtype != t) y = rw.op1("Cast", {y}, one_attr(attr_int("to", out_dtype)));
  // Flat heads: the root is the Reshape of the flat output; a Reshape of y with its target is
  // the same tensor (both row-major views of (B*H, S, Dv)), and y itself where types show it.
  if (f.flat && !f.flat_out_4d) {
    y = rw.op1("Reshape", {y, root->inputs()[1]});
  }
  if (!can_replace(g, root->outputs()[0], y)) {
    ctx.counters["not fused"] += 1;
    return rw.fail("the output cannot be replaced");
  }
  if (f.flat) alibi::shape_reads_to_q3(root, f.q3);  // proven the same (match_flat_attention)
  import_domain(g, kInternalDomain);
  count_fused(f, ctx);
  return std::vector<Value*>{y};
}

// Removes every node of `g` whose outputs are unused (subgraph holders and nodes with mistyped
// attributes kept).
void remove_unused(Graph& g) {
  for (Node* n = g.last(); n;) {
    Node* prev = n->prev();
    bool dead = !n->has_subgraphs();
    for (Value* o : n->outputs())
      dead = dead && (!o || (o->uses().empty() && !o->is_graph_output()));
    if (dead && !pattern::mistyped_attribute(*n)) g.remove_node(n);  // ORT refuses those
    n = prev;
  }
}

int64_t fuse_attention(Model& model, PassContext& ctx) {
  // Each fusion replaces a subgraph by the internal op computing the same: the shape facts hold
  // across the rewrites (no sweep per fused layer).
  analysis::KeepAcrossEdits keep(analysis::facts_of(model));
  CodeRule rule;
  rule.name = "fuse_attention";
  rule.root_op_types = {"MatMul"};
  rule.match = [&ctx](Node* root, CodeMatch& m, MatchFailure& why) {
    return match_attention(root, m, why, ctx);
  };
  std::set<const Graph*> fused_in;
  rule.rewrite = [&ctx, &fused_in](const CodeMatch& m, Rewriter& rw) {
    Replacement r = rewrite_attention(m, rw, ctx);
    if (r) fused_in.insert(&rw.graph());
    return r;
  };
  ApplyOptions o;
  o.max_iterations = ctx.max_iterations;
  o.explain_rule = ctx.explain_rule;
  o.explain_lines = ctx.explain_rule.empty() ? nullptr : &ctx.explain_lines;
  // Flat heads' proofs read shape facts, which a fused layer's internal op (no shape rule) blurs
  // for the layers after it: every flat candidate is matched on the unedited graph first. A
  // match stays valid: rewrites remove only their own nodes.
  struct Early {
    bool ok;
    CodeMatch m;
    std::string why;
  };
  std::map<const Node*, Early> early;
  model.for_each_graph([&](Graph& g) {
    for (Node* n = g.first(); n; n = n->next()) {
      if (n->op_type != "Reshape") continue;
      Early e{false, {}, {}};
      MatchFailure why;
      e.ok = match_flat_attention(n, e.m, why, ctx);
      e.why = why.text;
      if (e.ok || !e.why.empty()) early.emplace(n, std::move(e));
    }
  });
  CodeRule flat = rule;
  flat.root_op_types = {"Reshape"};
  flat.match = [&ctx, &early](Node* root, CodeMatch& m, MatchFailure& why) {
    auto it = early.find(root);
    if (it == early.end()) return match_flat_attention(root, m, why, ctx);
    m.nodes = it->second.m.nodes;
    m.found = it->second.m.found;
    why.text = it->second.why;
    return it->second.ok;
  };
  const ApplyStats stats = apply_rules(model, {}, {rule, flat}, o);
  // What only fed the matched nodes' shapes (torchlib's K^T reshape targets, Shape reads of the
  // repeated K) is dead now: swept in the graphs from the first one with a fusion on.
  bool swept = false;
  model.for_each_graph([&](Graph& g) {
    swept = swept || fused_in.count(&g);
    if (swept) remove_unused(g);
  });
  return stats.rewrites;
}

const PassRegistrar kRegister{
    PassDecl(
        "fuse_attention",
        "recognise scaled dot-product attention (scale placements, repeat_kv, masks, fp32 softmax "
        "casts) as the internal Attention op; run lower_attention after it")
        .tags({"fusion", "llm"})
        .run(fuse_attention)
        .ensures_facts({kAttentionFused})};

}  // namespace
}  // namespace fastopt::passes
