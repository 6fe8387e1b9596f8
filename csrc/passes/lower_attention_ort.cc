// Lowering of the internal Attention op for target "ort" (see attention.h). Work in progress.
#include "passes/attention.h"

namespace fastopt::passes {

pattern::Replacement lower_attention_ort(Node*, pattern::Rewriter& rw, PassContext&) {
  return rw.fail("no lowering for target ort yet");
}

}  // namespace fastopt::passes
