#include "pattern/rewrite.h"

#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "analysis/shape_facts.h"
#include "ir/error.h"
#include "ir/types.h"

namespace fastopt::pattern {

namespace {
Attribute typed(const std::string& name, AttrType type) {
  Attribute a;
  a.name = name;
  a.type = static_cast<int32_t>(type);
  return a;
}
}  // namespace

Attribute attr_int(const std::string& name, int64_t v) {
  Attribute a = typed(name, AttrType::kInt);
  a.i = v;
  return a;
}
Attribute attr_float(const std::string& name, float v) {
  Attribute a = typed(name, AttrType::kFloat);
  a.f = v;
  return a;
}
Attribute attr_ints(const std::string& name, std::vector<int64_t> v) {
  Attribute a = typed(name, AttrType::kInts);
  a.ints = std::move(v);
  return a;
}
Attribute attr_floats(const std::string& name, std::vector<float> v) {
  Attribute a = typed(name, AttrType::kFloats);
  a.floats = std::move(v);
  return a;
}
Attribute attr_string(const std::string& name, const std::string& v) {
  Attribute a = typed(name, AttrType::kString);
  a.s = v;
  return a;
}
Attribute attr_tensor(const std::string& name, std::shared_ptr<Tensor> t) {
  Attribute a = typed(name, AttrType::kTensor);
  a.t = std::move(t);
  return a;
}
Attribute copy_attribute(const Attribute& src) {
  if (src.g || !src.graphs.empty()) throw ModelError("cannot copy a graph attribute");
  Attribute a;
  a.name = src.name;
  a.type = src.type;
  a.f = src.f;
  a.i = src.i;
  a.s = src.s;
  a.t = src.t;  // tensors are immutable once built: sharing is safe
  a.floats = src.floats;
  a.ints = src.ints;
  a.strings = src.strings;
  a.tensors = src.tensors;
  a.ref_attr_name = src.ref_attr_name;
  a.extras = src.extras;
  return a;
}

std::vector<Value*> Rewriter::op(const std::string& op_type, const std::vector<Value*>& inputs,
                                 std::vector<Attribute> attrs, int num_outputs,
                                 const std::string& domain) {
  // Names: "<root name or op>/<op>_<n>", n counting per model, so they are almost never taken
  // (create_node still makes value names unique). Node names need not be unique.
  const std::string& root_name = root_->name.value;
  const std::string id = std::to_string(graph_.model()->next_node_id++);
  std::string base;
  base.reserve(root_name.size() + 2 * op_type.size() + id.size() + 2);
  base.append(root_name.empty() ? op_type : root_name).append("/").append(op_type);
  base.append("_").append(id);
  std::vector<std::string> names;
  names.reserve(static_cast<size_t>(num_outputs));
  for (int i = 0; i < num_outputs; ++i) {
    names.push_back(num_outputs > 1 ? base + ":" + std::to_string(i) : base);
  }
  Node* n = graph_.create_node(op_type, domain, inputs, names, root_);
  n->name.set(std::move(base));
  n->attributes = std::move(attrs);
  analysis::type_new_node(*graph_.model(), *n);  // outputs typed where the inputs tell
  created_nodes_.push_back(n);
  return n->outputs();
}

Value* Rewriter::initializer(const std::string& base, std::shared_ptr<Tensor> t) {
  Value* v = graph_.add_initializer(base, std::move(t));
  created_initializers_.push_back(v);
  return v;
}

void Rewriter::rollback() {
  for (auto it = created_nodes_.rbegin(); it != created_nodes_.rend(); ++it) {
    graph_.remove_node(*it);
  }
  for (Value* v : created_initializers_) graph_.remove_initializer(v);
  created_nodes_.clear();
  created_initializers_.clear();
}

bool can_replace(const Graph& g, const Value* from, const Value* to) {
  if (!from->is_graph_output()) return true;
  return to->producer() && to->graph() == &g && !to->is_graph_output() && !to->is_graph_input();
}

void replace_value(Graph& g, Value* from, Value* to) {
  if (from == to) return;
  if (from->type.known) refine_type(to->type, from->type);
  const bool keep_name = from->is_graph_output() && can_replace(g, from, to);
  g.replace_all_uses(from, to);
  if (keep_name) {
    // `to` becomes the graph output: the interface keeps its declared type too.
    if (from->type.known) to->type = from->type;
    std::string name = from->name();
    g.rename(from, g.unique_name(name + "__replaced"));
    g.rename(to, name);
  }
}

std::vector<Node*> readers_feeding(const Value* from, const Value* to,
                                   const std::vector<const Value*>& known_upstream) {
  std::vector<Node*> found;
  if (!from || !to || from == to || from->uses().empty()) return found;
  const Graph* g = to->graph();
  const std::unordered_set<const Value*> stop(known_upstream.begin(), known_upstream.end());
  std::unordered_set<const Node*> seen;
  std::vector<Node*> work;
  auto visit = [&](const Value* v) {
    if (!v || stop.count(v)) return;
    Node* p = v->producer();
    if (p && p->graph() == g && seen.insert(p).second) work.push_back(p);
  };
  visit(to);
  while (!work.empty()) {
    Node* n = work.back();
    work.pop_back();
    bool reads = false;
    for (Value* in : n->inputs()) {
      reads = reads || in == from;
      visit(in);
    }
    if (n->has_subgraphs()) {
      for (Graph* sub : n->subgraphs()) {
        for (Value* v : sub->outer_references()) {
          reads = reads || v == from;
          visit(v);
        }
      }
    }
    if (reads) found.push_back(n);
  }
  return found;
}

void remove_dead(Graph& g, const std::vector<Node*>& candidates) {
  // Worklist: removing a node can only make the producers of its inputs dead, so only those
  // (when they are candidates) are looked at again.
  auto is_candidate = [&](const Node* n) {
    return std::find(candidates.begin(), candidates.end(), n) != candidates.end();
  };
  std::vector<Node*> work(candidates.rbegin(), candidates.rend());
  while (!work.empty()) {
    Node* n = work.back();
    work.pop_back();
    if (!n->alive() || n->graph() != &g) continue;
    bool dead = true;
    for (Value* o : n->outputs()) {
      if (o && (!o->uses().empty() || o->is_graph_output())) {
        dead = false;
        break;
      }
    }
    if (!dead) continue;
    for (Value* in : n->inputs()) {  // queued before the removal, processed after it
      if (in && in->producer() && is_candidate(in->producer())) work.push_back(in->producer());
    }
    g.remove_node(n);
  }
}

namespace {

bool explaining(const ApplyOptions& o, const std::string& rule) {
  return o.explain_lines && (o.explain_rule == "*" || o.explain_rule == rule);
}

std::string where(const Node* n) {
  return "node '" + n->name.value + "' (" + n->op_type + ")";
}

// Commits a successful rewrite of `root` (matched with `matched`, root first); false (and nothing
// changed) if an output without replacement is still used.
bool commit(Graph& g, Node* root, const std::vector<Node*>& matched,
            const std::vector<Value*>& replacement, std::vector<Node*>* readers) {
  const auto& outs = root->outputs();
  for (size_t i = 0; i < outs.size(); ++i) {
    Value* r = i < replacement.size() ? replacement[i] : nullptr;
    if (!r && outs[i] && (!outs[i]->uses().empty() || outs[i]->is_graph_output())) return false;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    Value* r = i < replacement.size() ? replacement[i] : nullptr;
    if (r && outs[i]) {
      replace_value(g, outs[i], r);
      for (const Use& u : r->uses()) readers->push_back(u.node);
    }
  }
  remove_dead(g, matched);
  return true;
}

// Why replacing `root`'s outputs by `replacement` would close a cycle (a replacement that
// depends on a reader of the output it replaces: a code rule's walk, or a Python rewrite, may
// build from values downstream of the root); empty when it would not. The inputs of the matched
// nodes (the root and its producers) and of the root's nearest producers cannot depend on its
// outputs: the walk stops there, so a rewrite built from values near the match costs only its
// new nodes.
std::string cycle_refusal(const Node* root, const std::vector<Node*>& matched,
                          const std::vector<Value*>& replacement) {
  std::vector<const Value*> upstream(root->inputs().begin(), root->inputs().end());
  for (const Node* n : matched) {
    upstream.insert(upstream.end(), n->inputs().begin(), n->inputs().end());
  }
  // And the inputs of the root's nearest producers: rewrites read values a few ops above the
  // match (a head split's source), whose walk would otherwise cross every earlier layer.
  constexpr size_t kNearProducers = 64;
  std::unordered_set<const Node*> near;
  for (size_t i = 0; i < upstream.size() && near.size() < kNearProducers; ++i) {
    const Node* p = upstream[i] ? upstream[i]->producer() : nullptr;
    if (!p || p->graph() != root->graph() || !near.insert(p).second) continue;
    upstream.insert(upstream.end(), p->inputs().begin(), p->inputs().end());
  }
  const auto& outs = root->outputs();
  for (size_t i = 0; i < outs.size() && i < replacement.size(); ++i) {
    if (!outs[i] || !replacement[i]) continue;
    std::vector<Node*> readers = readers_feeding(outs[i], replacement[i], upstream);
    if (!readers.empty()) {
      return "the replacement of '" + outs[i]->name() + "' depends on " + where(readers[0]) +
             ", which reads it: rewriting would make a cycle";
    }
  }
  return "";
}

// A rule of either kind, as the driver dispatches it.
struct AnyRule {
  const Rule* pattern_rule = nullptr;
  const CodeRule* code_rule = nullptr;
  const std::string& name() const { return pattern_rule ? pattern_rule->name : code_rule->name; }
  int benefit() const {
    return pattern_rule ? pattern_rule->pattern->benefit() : code_rule->benefit;
  }
  const void* key() const {
    return pattern_rule ? static_cast<const void*>(pattern_rule) : code_rule;
  }
};

}  // namespace

ApplyStats apply_rules(Model& model, const std::vector<Rule>& rules, const ApplyOptions& options) {
  return apply_rules(model, rules, {}, options);
}

ApplyStats apply_rules(Model& model, const std::vector<Rule>& rules,
                       const std::vector<CodeRule>& code_rules, const ApplyOptions& options) {
  ApplyStats stats;
  // Dispatch table: root op type -> rules, larger patterns first (stable among equals).
  std::unordered_map<std::string, std::vector<AnyRule>> by_op;
  for (const Rule& r : rules) {
    for (const auto& op : r.pattern->root_op_types()) by_op[op].push_back({&r, nullptr});
  }
  for (const CodeRule& r : code_rules) {
    for (const auto& op : r.root_op_types) by_op[op].push_back({nullptr, &r});
  }
  for (auto& kv : by_op) {
    std::stable_sort(kv.second.begin(), kv.second.end(),
                     [](const AnyRule& a, const AnyRule& b) { return a.benefit() > b.benefit(); });
  }
  std::set<std::pair<const void*, const Node*>> explained;  // one line per (rule, node)
  struct RuleState {  // reused across candidates: no allocation per candidate
    Matcher matcher;
    Match match;
  };
  std::unordered_map<const Rule*, RuleState> state;
  for (const Rule& r : rules) state.emplace(&r, RuleState{Matcher(*r.pattern), Match(*r.pattern)});
  // The first round visits every node whose op type some rule is rooted at; later rounds only
  // revisit what the previous round touched (new nodes and readers of replaced values), so
  // reaching the fixed point costs no extra walks over the whole graph.
  std::vector<Node*> work;
  model.for_each_graph([&](Graph& g) {
    for (Node* n = g.first(); n; n = n->next()) {
      if (by_op.count(n->op_type)) work.push_back(n);
    }
  });
  std::vector<Node*> readers;  // reused: readers of replaced values
  std::vector<Node*> matched;  // reused: a code rule's matched nodes, root first
  work.reserve(work.size() * 2);
  for (int iteration = 0; iteration < options.max_iterations && !work.empty(); ++iteration) {
    ++stats.iterations;
    int64_t changed = 0;
    std::vector<Node*> next;
    next.reserve(work.size());
    for (Node* node : work) {
      if (!node->alive()) continue;
      auto it = by_op.find(node->op_type);
      if (it == by_op.end()) continue;
      Graph* g = node->graph();
      for (const AnyRule& rule : it->second) {
        ++stats.candidates;
        MatchFailure why;
        const std::string& name = rule.name();
        const bool wants = explaining(options, name) && !explained.count({rule.key(), node});
        Match* m = nullptr;
        CodeMatch cm;
        bool ok = false;
        if (rule.pattern_rule) {
          m = &state.at(rule.pattern_rule).match;
          ok = state.at(rule.pattern_rule).matcher.match(node, m, wants ? &why : nullptr);
        } else {
          cm.root = node;
          ok = rule.code_rule->match(node, cm, why);
        }
        // Pattern rules explain every candidate root; code rules those they give a reason for.
        const bool explain = wants && (rule.pattern_rule || ok || !why.text.empty()) &&
                             explained.insert({rule.key(), node}).second;
        if (!ok) {
          if (explain) {
            options.explain_lines->push_back(
                name + " @ " + where(node) + ": " +
                (rule.pattern_rule ? why.format(*rule.pattern_rule->pattern) : why.text));
          }
          continue;
        }
        Rewriter rw(*g, node);
        Replacement r = rule.pattern_rule ? rule.pattern_rule->rewrite(*m, rw)
                                          : rule.code_rule->rewrite(cm, rw);
        readers.clear();
        if (rule.code_rule) {
          matched.assign(1, node);
          matched.insert(matched.end(), cm.nodes.begin(), cm.nodes.end());
        } else {
          matched = m->matched_nodes();
        }
        if (r) {
          if (std::string cycle = cycle_refusal(node, matched, *r); !cycle.empty()) {
            r = rw.fail(std::move(cycle));
          }
        }
        if (!r || !commit(*g, node, matched, *r, &readers)) {
          rw.rollback();
          if (explain) {
            options.explain_lines->push_back(
                name + " @ " + where(node) + ": matched, but the rewrite declined: " +
                (rw.failure().empty() ? "an output is still used" : rw.failure()));
          }
          continue;
        }
        if (explain) {
          options.explain_lines->push_back(name + " @ " + where(node) + ": rewritten");
        }
        ++changed;
        ++stats.per_rule[name];
        for (Node* n : rw.created()) next.push_back(n);
        if (node->alive()) next.push_back(node);  // edited in place: may match again
        for (Node* n : readers) next.push_back(n);
        break;  // the node is gone
      }
    }
    stats.rewrites += changed;
    // Deduplicate (a mark per round, no sort), keeping nodes some rule may be rooted at.
    const uint32_t round = ++model.rewrite_round;
    work.clear();
    for (Node* n : next) {
      if (n->alive() && n->queued_round != round && by_op.count(n->op_type)) {
        n->queued_round = round;
        work.push_back(n);
      }
    }
  }
  return stats;
}

}  // namespace fastopt::pattern
