// Lowering of the internal Attention op for target "onnx": ONNX Attention-23, whose semantics the
// internal op copies (attention.h), so the node is renamed rather than rebuilt:
//
//   ai.fastopt.internal::Attention(Q, K, V, mask?)  ==>  Attention-23(Q, K, V, attn_mask?)
//
// 4-D BNSH inputs; q_num_heads/kv_num_heads are carried (Attention-23 needs them only for 3-D
// inputs, but they cost nothing and document GQA), scale, is_causal and softmax_precision as set.
// ORT runs it on CPU since 1.23 (float, fp16; bool or float masks).
#include "passes/attention.h"
#include "passes/fusion_util.h"

namespace fastopt::passes {

pattern::Replacement lower_attention_onnx(Node* node, pattern::Rewriter& rw, PassContext&) {
  const int64_t opset = default_opset(*rw.graph().model());
  if (opset < 23) {
    return rw.fail("the model's opset is " + std::to_string(opset) +
                   " (Attention needs 23: run convert_version with opset=23 first)");
  }
  std::vector<Attribute> attrs;
  for (const char* name :
       {"scale", "is_causal", "q_num_heads", "kv_num_heads", "softmax_precision"}) {
    if (const Attribute* a = node->attribute(name)) attrs.push_back(pattern::copy_attribute(*a));
  }
  return std::vector<Value*>{rw.op1("Attention", node->inputs(), std::move(attrs))};
}

}  // namespace fastopt::passes
