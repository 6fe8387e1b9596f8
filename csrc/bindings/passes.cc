// Bindings of the pass registry: PassInfo (with its options and contracts), running a C++
// pass, what it reports, and the constants the Python side reads instead of restating them.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "bindings/handles.h"
#include "ir/error.h"
#include "passes/attention/internal_op.h"
#include "passes/fold/fold_constants.h"
#include "passes/fusion_util.h"
#include "passes/kv_cache/cache_form.h"
#include "passes/kv_cache/cross_cache_split.h"
#include "passes/quant/options.h"
#include "passes/registry.h"
#include "passes/rotary/rotary_cache.h"
#include "quant/quant_record.h"

namespace fastopt::bindings {
namespace {

// The KV-cache forms (passes/kv_cache/cache_form.h) as read-only objects, by name.
void bind_kv_cache_forms(py::module_& m) {
  using passes::kv_cache::CacheForm;
  using passes::kv_cache::PastLength;
  auto pattern = [](bool past, bool value) {
    return [past, value](const CacheForm& f) {
      return passes::kv_cache::name_pattern(f, past, value);
    };
  };
  auto genai_key = [](bool past, bool value) {
    return [past, value](const CacheForm& f) {
      const std::string stem = past ? f.genai_past : f.genai_present;
      return stem.empty() ? stem : stem + (value ? "_value_names" : "_key_names");
    };
  };
  py::class_<CacheForm>(m, "KvCacheForm",
                        "A KV-cache form: the cache's names, dims and how P is fed "
                        "(passes/kv_cache/cache_form.h)")
      .def_readonly("name", &CacheForm::name)
      .def_readonly("section", &CacheForm::section, "between the layer and .key|.value")
      .def_readonly("past_dim", &CacheForm::past_dim, "the past input's axis 2 (dim_param)")
      .def_readonly("present_dim", &CacheForm::present_dim, "the present output's axis 2")
      .def_readonly("shares_buffer", &CacheForm::shares_buffer,
                    "the present is the past's buffer (search.past_present_share_buffer)")
      .def_property_readonly(
          "past_length",
          [](const CacheForm& f) {
            switch (f.past_length) {
              case PastLength::kMaskWidth: return passes::kv_cache::kAttentionMask;
              case PastLength::kPastRows: return "past_rows";
              case PastLength::kLengthInput: return passes::kv_cache::kPastSequenceLength;
              case PastLength::kEncoder: return "encoder";
            }
            return "";
          },
          "where P comes from: attention_mask's width, the past's rows, the input "
          "past_sequence_length, or none (encoder: a cross cache)")
      .def_property_readonly("past_key", pattern(true, false), "name pattern, %d the layer")
      .def_property_readonly("past_value", pattern(true, true))
      .def_property_readonly("present_key", pattern(false, false))
      .def_property_readonly("present_value", pattern(false, true))
      .def_property_readonly("genai_past_key", genai_key(true, false),
                             "genai_config.json's key for past_key (\"\": genai has none)")
      .def_property_readonly("genai_past_value", genai_key(true, true))
      .def_property_readonly("genai_present_key", genai_key(false, false))
      .def_property_readonly("genai_present_value", genai_key(false, true));
  m.def(
      "kv_cache_forms",
      [] {
        std::map<std::string, const CacheForm*> forms;
        for (const CacheForm* f : passes::kv_cache::kForms) forms[f->name] = f;
        return forms;
      },
      py::return_value_policy::reference, "The KV-cache forms add_kv_cache writes, by name");
}

}  // namespace

void bind_passes(py::module_& m) {
  bind_kv_cache_forms(m);
  // Constants the Python side would otherwise restate.
  m.attr("FOLD_MAX_BYTES") = passes::FoldLimits{}.max_bytes;
  m.attr("FOLD_MAX_EXPAND_BYTES") = passes::FoldLimits{}.max_expand_bytes;
  m.attr("FUSED_OPS_OPSET") = passes::kFusedOpsOpset;
  m.attr("ROTARY_MAX_POSITIONS_LIMIT") = passes::rotary::kMaxPositionsLimit;
  m.attr("INTERNAL_DOMAIN") = passes::kInternalDomain;
  m.attr("KV_PAST_PREFIX") = passes::kv_cache::kPastPrefix;
  m.attr("KV_PRESENT_PREFIX") = passes::kv_cache::kPresentPrefix;
  m.attr("FACT_ATTENTION_FUSED") = passes::kAttentionFused;
  m.attr("FACT_NO_INTERNAL_OPS") = passes::kNoInternalOps;
  m.attr("FACT_VALUE_TYPES") = passes::kValueTypes;
  m.attr("QUANT_BLOCK_SIZE_MIN") = quant::kMinBlockSize;
  m.attr("QUANT_BLOCK_SIZE_MAX") = quant::kMaxBlockSize;
  m.def("quant_block_size_problem", &quant::block_size_problem, py::arg("block_size"),
        "Why a quantization block size is not one MatMulNBits runs (the message every entry "
        "point shows), or \"\"");
  py::class_<passes::OptionInfo>(m, "OptionInfo",
                                 "An option a C++ pass reads, declared with the pass")
      .def_readonly("name", &passes::OptionInfo::name)
      .def_readonly("kind", &passes::OptionInfo::kind)
      .def_readonly("help", &passes::OptionInfo::help)
      .def_readonly("default", &passes::OptionInfo::default_value)
      .def_readonly("choices", &passes::OptionInfo::choices)
      .def_readonly("minimum", &passes::OptionInfo::minimum)
      .def_readonly("maximum", &passes::OptionInfo::maximum)
      .def_readonly("internal", &passes::OptionInfo::internal);
  py::class_<passes::PassInfo>(m, "PassInfo", "A pass implemented in C++")
      .def_readonly("name", &passes::PassInfo::name)
      .def_readonly("description", &passes::PassInfo::description)
      .def_readonly("tags", &passes::PassInfo::tags)
      .def_readonly("min_opset", &passes::PassInfo::min_opset)
      .def_readonly("max_opset", &passes::PassInfo::max_opset)
      .def_readonly("idempotent", &passes::PassInfo::idempotent)
      .def_readonly("requires_facts", &passes::PassInfo::requires_facts,
                    "facts an earlier pass of the list must establish (pass contracts)")
      .def_readonly("ensures_facts", &passes::PassInfo::ensures_facts, "facts the pass establishes")
      .def_readonly("runs_before", &passes::PassInfo::runs_before,
                    "passes it runs before when both are in the list")
      .def_readonly("options", &passes::PassInfo::options, "the options it reads")
      .def_property_readonly(
          "rule_names",
          [](const passes::PassInfo& p) {
            return p.rule_names ? p.rule_names() : std::vector<std::string>{};
          },
          "the rule names --explain takes for this pass (beside the pass's own name)");

  py::class_<quant::QuantRecord>(m, "QuantRecord", "What a quantization pass did to one weight")
      .def_readonly("weight", &quant::QuantRecord::weight)
      .def_readonly("node", &quant::QuantRecord::node)
      .def_readonly("op", &quant::QuantRecord::op)
      .def_readonly("quantized", &quant::QuantRecord::quantized)
      .def_readonly("reason", &quant::QuantRecord::reason)
      .def_readonly("dtype_before", &quant::QuantRecord::dtype_before)
      .def_readonly("dtype_after", &quant::QuantRecord::dtype_after)
      .def_readonly("bytes_before", &quant::QuantRecord::bytes_before)
      .def_readonly("bytes_after", &quant::QuantRecord::bytes_after)
      .def_readonly("max_rel_error", &quant::QuantRecord::max_rel_error)
      .def_readonly("mean_rel_error", &quant::QuantRecord::mean_rel_error)
      .def_readonly("rel_mse", &quant::QuantRecord::rel_mse,
                    "sum imp[k] (w - w')^2 / sum imp[k] w^2 (imp = 1 without an importance file)");

  py::class_<passes::PassContext>(m, "PassResult", "What one run of a C++ pass did")
      .def_readonly("counters", &passes::PassContext::counters)
      .def_readonly("explain_lines", &passes::PassContext::explain_lines)
      .def_readonly("quant_records", &passes::PassContext::quant_records);

  m.def(
      "cpp_passes",
      [] {
        py::typing::List<passes::PassInfo> l;
        for (const auto& p : passes::all_passes()) l.append(p);
        return l;
      },
      "The passes implemented in C++, in registration order");
  m.def(
      "run_pass",
      [](Model& model, const std::string& name, const std::string& target, int max_iterations,
         const std::string& explain_rule, const std::map<std::string, int64_t>& options,
         const std::map<std::string, std::string>& text_options, py::object progress) {
        const passes::PassInfo* info = passes::find_pass(name);
        if (!info) throw ModelError("no C++ pass named '" + name + "'");
        passes::PassContext ctx;
        ctx.target = passes::parse_target(target);
        ctx.max_iterations = max_iterations;
        ctx.explain_rule = explain_rule;
        ctx.options = options;
        ctx.text_options = text_options;
        if (!progress.is_none()) {
          ctx.progress = [progress](int64_t done, int64_t total, const std::string& what) {
            py::gil_scoped_acquire gil;
            progress(done, total, what);
          };
        }
        int64_t rewrites;
        const uint64_t generation = model.edit_generation;
        {
          py::gil_scoped_release release;
          rewrites = info->run(model, ctx);
        }
        // A pass may rewrite attributes in place (no structural edit): memoized analyses
        // must not outlive a pass that changed anything. Structural edits moved the generation
        // already (a pass that kept its shape facts current across them says so:
        // analysis::KeepAcrossEdits).
        if (rewrites && model.edit_generation == generation) model.note_edit();
        return std::make_pair(rewrites, std::move(ctx));
      },
      py::arg("model"), py::arg("name"), py::arg("target") = "ort", py::arg("max_iterations") = 10,
      py::arg("explain_rule") = "", py::arg("options") = std::map<std::string, int64_t>{},
      py::arg("text_options") = std::map<std::string, std::string>{},
      py::arg("progress") = py::none(),
      "Runs a C++ pass; returns (rewrites, result). `progress(done, total, what)` is called "
      "during long passes (quantization)");

  m.def(
      "move_cross_projections",
      [](Model& encoder, const std::string& hidden, Model& decoder) {
        return passes::kv_cache::move_cross_projections(encoder, hidden, decoder);
      },
      py::arg("encoder"), py::arg("hidden"), py::arg("decoder"),
      "Moves the cross cache's projections from a decoder that add_kv_cache gave "
      "cross_attention_cache 2 into the encoder, which reads its output `hidden` for "
      "encoder_hidden_states and gives present.<i>.encoder.key|value (weights shared, not "
      "copied); ModelError with the reason, and neither model changed, when it cannot. Returns "
      "the number of outputs moved");

  // For the Python pass fold_constants_ort: its walks over every node, in C++.
  m.def(
      "nested_graphs",
      [](const ModelPtr& model) {
        py::typing::List<PyGraph> l;
        std::function<void(Graph*)> visit = [&](Graph* g) {
          l.append(PyGraph{model, g});
          for (Node* n = g->first(); n; n = n->next()) {
            for (Graph* sub : n->subgraphs()) visit(sub);
          }
        };
        if (model->graph) visit(model->graph.get());
        return l;
      },
      py::arg("model"),
      "The main graph and the graphs nested in its nodes (If/Loop/Scan bodies), depth first in "
      "node order; function bodies not included");
  m.def(
      "ort_fold_candidates",
      [](const PyGraph& g, uint64_t max_bytes, uint64_t max_expand_bytes,
         const std::unordered_set<std::string>& skip,
         const std::function<bool(const PyNode&)>& safe_division) {
        passes::FoldLimits limits;
        limits.max_bytes = max_bytes;
        limits.max_expand_bytes = max_expand_bytes;
        std::unordered_map<Value*, uint64_t> origin;
        auto nodes = passes::ort_fold_candidates(
            *g.model, *g.graph, limits, skip,
            [&](Node* n) { return safe_division(PyNode{g.model, n}); }, &origin);
        py::typing::List<PyNode> found;
        for (Node* n : nodes) found.append(PyNode{g.model, n});
        py::typing::Dict<PyValue, uint64_t> bytes;
        for (const auto& [v, b] : origin) bytes[py::cast(PyValue{g.model, v})] = b;
        return std::make_pair(found, bytes);
      },
      py::arg("graph"), py::arg("max_bytes"), py::arg("max_expand_bytes"), py::arg("skip"),
      py::arg("safe_division"),
      "The nodes of `graph` fold_constants_ort evaluates through ONNX Runtime, in graph order, "
      "and for each of their outputs the bytes of the constants it is computed from (see "
      "passes/fold/fold_constants.h); `safe_division(node)` decides Div, Mod and Pow");
}

}  // namespace fastopt::bindings
