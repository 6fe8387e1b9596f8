// Stage 2 of the attention fusion: every internal Attention node (see internal_op.h) becomes what
// the target runs. The target's lowering is tried first; when its preconditions do not hold the
// node goes back to standard ops, so the internal op never survives the pass. Why a lowering did
// not apply is kept as an explanation (`--explain lower_attention`) and a counter.
#include "analysis/shape_facts.h"
#include "passes/attention/internal_op.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/kv_cache.h"

namespace fastopt::passes {
namespace {
using namespace pattern;

std::vector<Rule> rules(PassContext& ctx) {
  auto p = std::make_shared<Pattern>("lower_attention");
  P q = p->var("Q"), k = p->var("K"), v = p->var("V");
  P attention = p->op(kInternalAttention, {q, k, v}, kInternalDomain).extra_inputs();
  p->root(attention);

  PassContext* c = &ctx;
  RewriteFn rewrite = [c](const Match& m, Rewriter& rw) -> Replacement {
    Node* node = m.root();
    const bool ort = c->target == Target::kOrt;
    // Option attention_lowering=0: standard ops whatever the target (tests, debugging).
    auto forced = c->options.find("attention_lowering");
    Replacement lowered = forced != c->options.end() && forced->second == 0
                              ? rw.fail("attention_lowering=0")
                          : ort ? lower_attention_ort(node, rw, *c)
                                : lower_attention_onnx(node, rw, *c);
    if (lowered) {
      c->counters[ort ? "lowered for ort" : "lowered to Attention-23"] += 1;
      return lowered;
    }
    const std::string why = rw.failure();
    rw.rollback();
    if (c->explains("lower_attention")) {
      c->explain("lower_attention", node->name.value + ": kept as standard ops: " + why);
    }
    c->counters["kept as standard ops"] += 1;
    return decompose_attention(node, rw, *c);
  };
  return {{"lower_attention", p, rewrite}};
}

PassInfo lower_attention_pass() {
  PassInfo info = rule_pass(
      "lower_attention",
      "lower the internal Attention op for the target: MultiHeadAttention/GroupQueryAttention "
      "(ort), Attention-23 (onnx), else standard ops",
      {"fusion", "llm"}, rules);
  info.requires_facts = {kAttentionFused};
  info.ensures_facts = {kNoInternalOps};
  info.options = {
      OptionDecl("attention_lowering",
                 "lower fused attention to the target's attention ops, or keep standard ops")
          .default_value(1)
          .choices({{0, "keep standard ops"}, {1, "lower"}}),
      OptionDecl(
          "cuda",
          "emit attention ops the CUDA provider runs (no fp32 GroupQueryAttention, no bias on GQA)")
          .default_value(0)
          .choices({{0, "any provider"}, {1, "CUDA"}}),
      OptionDecl("packed_attention",
                 "target ort: self-attention whose Q/K/V project one input becomes com.microsoft "
                 "Attention with packed weights (default 1, 0 with cuda=1)")
          .choices({{0, "off"}, {1, "non-causal only"}, {2, "also causal"}}),
      OptionDecl(
          "pad_rows",
          "a model exported with a cache: outputs at padded positions (attention_mask 0) are "
          "unspecified where the rows of pad queries are proven to reach nothing else, so they "
          "need not be computed as exported (1, the default), or are the export's (0)")
          .default_value(1)
          .choices({{0, "as exported"}, {1, "unspecified where unread"}}),
      OptionDecl("kv_cache"),  // declared by add_kv_cache
  };
  // The internal domain's import goes with its last node. Each lowering replaces one node by
  // ops computing the same: the shape facts hold across them (no sweep per lowered layer).
  info.run = [run = info.run](Model& m, PassContext& ctx) {
    // A model exported with a cache: pad queries' all-masked rows, where proven to reach only
    // padded positions' outputs, need not be reproduced (kv_cache_mask.cc).
    // Option pad_rows=0 keeps the export's rows at every position, pads included.
    std::string why;
    const auto pad_rows = ctx.options.find("pad_rows");
    if (pad_rows != ctx.options.end() && pad_rows->second == 0) {
      why = "pad_rows=0";
    } else if (const int64_t n = kv_cache::mark_unread_masked_rows(m, &why)) {
      ctx.counters["pad rows left unspecified (proven unread)"] += n;
    } else if (!why.empty() && ctx.explains("lower_attention")) {
      ctx.explain("lower_attention", "rows whose every key is masked kept as exported: " + why);
    }
    analysis::KeepAcrossEdits keep(analysis::facts_of(m));
    const int64_t n = run(m, ctx);
    drop_unused_domain(m, kInternalDomain);
    return n;
  };
  return info;
}

const PassRegistrar kRegister{lower_attention_pass()};

}  // namespace
}  // namespace fastopt::passes
