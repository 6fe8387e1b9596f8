// The internal Attention op (see attention.h) written back as standard ops. Work in progress.
#include "passes/attention.h"

namespace fastopt::passes {

pattern::Replacement decompose_attention(Node*, pattern::Rewriter& rw, PassContext&) {
  return rw.fail("decomposition not written yet");
}

}  // namespace fastopt::passes
