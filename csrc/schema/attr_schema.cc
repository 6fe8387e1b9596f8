#include "schema/attr_schema.h"

#include <cstdint>
#include <unordered_map>

namespace fastopt::pattern {

namespace {

struct Entry {
  const char* domain;
  const char* op;
  const char* attr;
  uint32_t mask;  // bit t set: AttributeProto type t allowed
};

constexpr Entry kTable[] = {
#include "schema/attr_schema_table.inc"
};

std::string key(const std::string& domain, const std::string& op, const std::string& attr) {
  std::string k = domain == "ai.onnx" ? std::string() : domain;
  k += '\0';
  k += op;
  k += '\0';
  k += attr;
  return k;
}

const std::unordered_map<std::string, uint32_t>& table() {
  static const auto* t = [] {
    auto* m = new std::unordered_map<std::string, uint32_t>();
    m->reserve(sizeof(kTable) / sizeof(kTable[0]));
    for (const Entry& e : kTable) (*m)[key(e.domain, e.op, e.attr)] = e.mask;
    return m;
  }();
  return *t;
}

// The type the set fields say, ignoring the declared `type` (kUndefined when no field is set,
// e.g. an empty list).
AttrType field_kind(const Attribute& a) {
  if (a.f) return AttrType::kFloat;
  if (a.i) return AttrType::kInt;
  if (a.s) return AttrType::kString;
  if (a.t) return AttrType::kTensor;
  if (a.g) return AttrType::kGraph;
  if (!a.floats.empty()) return AttrType::kFloats;
  if (!a.ints.empty()) return AttrType::kInts;
  if (!a.strings.empty()) return AttrType::kStrings;
  if (!a.tensors.empty()) return AttrType::kTensors;
  if (!a.graphs.empty()) return AttrType::kGraphs;
  return AttrType::kUndefined;
}

const char* type_name(AttrType t) {
  static const char* const kNames[] = {
      "UNDEFINED",      "FLOAT",      "INT",        "STRING",  "TENSOR", "GRAPH",
      "FLOATS",         "INTS",       "STRINGS",    "TENSORS", "GRAPHS", "SPARSE_TENSOR",
      "SPARSE_TENSORS", "TYPE_PROTO", "TYPE_PROTOS"};
  const auto i = static_cast<size_t>(t);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "an unknown type";
}

std::string mask_text(uint32_t mask) {
  std::string out;
  for (int t = 0; t < 32; ++t) {
    if (mask & (1u << t)) out += (out.empty() ? "" : " or ") + std::string(type_name(AttrType(t)));
  }
  return out;
}

bool self_consistent(const Attribute& a) {
  if (!a.type || *a.type == 0) return true;
  const AttrType fields = field_kind(a);
  return fields == AttrType::kUndefined || fields == static_cast<AttrType>(*a.type);
}

}  // namespace

const Attribute* mistyped_attribute(const Node& n) {
  const auto& t = table();
  for (const Attribute& a : n.attributes) {
    if (!self_consistent(a)) return &a;
    auto it = t.find(key(n.domain.value, n.op_type, a.name));
    if (it == t.end()) continue;  // no schema, or an attribute the schema lacks: not ours to judge
    const auto kind = static_cast<uint32_t>(a.kind());
    if (kind >= 32 || !(it->second & (1u << kind))) return &a;
  }
  return nullptr;
}

std::string describe_mistyped(const Node& n, const Attribute& a) {
  std::string text = "attribute '" + a.name + "' of " + n.op_type;
  if (!self_consistent(a)) {
    return text + " is declared " + type_name(a.kind()) + " but holds a " +
           type_name(field_kind(a));
  }
  auto it = table().find(key(n.domain.value, n.op_type, a.name));
  return text + " is a " + type_name(a.kind()) + "; its schema says " +
         (it == table().end() ? std::string("another type") : mask_text(it->second));
}

}  // namespace fastopt::pattern
