// Lowering of the internal Attention op for target "onnx" (see attention.h). Work in progress.
#include "passes/attention.h"

namespace fastopt::passes {

pattern::Replacement lower_attention_onnx(Node*, pattern::Rewriter& rw, PassContext&) {
  return rw.fail("no lowering for target onnx yet");
}

}  // namespace fastopt::passes
