// Small integer expressions over symbols: the sizes shape analysis reasons with.
//
// A DimExpr is a polynomial with int64 coefficients over symbol ids, kept in one normal form
// (terms sorted by monomial, no zero coefficients), so two expressions are equal exactly when
// their representations are: B*S*896 built as (B*S)*896 or as B*(S*896) compares equal, and
// Reshape(-1) resolves by dividing the input's element count by the known part of the target.
// Expressions that would grow past a few terms, or overflow int64, become unknown (nullopt)
// instead: facts are only ever exact.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fastopt::analysis {

// A product of at most kMaxDegree symbols (sorted ids, repeated for powers), stored inline:
// shape arithmetic makes millions of these on a large export, so no heap per term.
class Monomial {
 public:
  static constexpr size_t kMaxDegree = 6;
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  const int32_t* begin() const { return ids_.data(); }
  const int32_t* end() const { return ids_.data() + n_; }
  int32_t operator[](size_t i) const { return ids_[i]; }
  bool push_back(int32_t id) {  // false when full
    if (n_ == kMaxDegree) return false;
    ids_[n_++] = id;
    return true;
  }
  void sort() { std::sort(ids_.begin(), ids_.begin() + n_); }
  bool erase_one(int32_t id);  // removes one occurrence; false when absent
  bool operator==(const Monomial& o) const {
    return n_ == o.n_ && std::equal(begin(), end(), o.begin());
  }
  bool operator<(const Monomial& o) const {
    return std::lexicographical_compare(begin(), end(), o.begin(), o.end());
  }

 private:
  std::array<int32_t, kMaxDegree> ids_{};
  uint8_t n_ = 0;
};

class DimExpr {
 public:
  struct Term {
    Monomial symbols;
    int64_t coeff;
    bool operator==(const Term& o) const { return coeff == o.coeff && symbols == o.symbols; }
  };

  DimExpr() = default;  // 0
  static DimExpr constant(int64_t c);
  static DimExpr symbol(int32_t id);

  bool is_constant() const {
    return terms_.empty() || (terms_.size() == 1 && terms_[0].symbols.empty());
  }
  std::optional<int64_t> constant_value() const;
  // The single symbol this expression is (coefficient 1, degree 1), else -1.
  int32_t as_symbol() const;
  const std::vector<Term>& terms() const { return terms_; }
  bool operator==(const DimExpr& o) const { return terms_ == o.terms_; }
  bool operator!=(const DimExpr& o) const { return !(*this == o); }

  // Results are nullopt on overflow or when the expression would exceed the size limits.
  static std::optional<DimExpr> add(const DimExpr& a, const DimExpr& b);
  static std::optional<DimExpr> sub(const DimExpr& a, const DimExpr& b);
  static std::optional<DimExpr> mul(const DimExpr& a, const DimExpr& b);
  // a / b when b is a single term that divides every term of a exactly (symbols and
  // coefficient), else nullopt: no rounding is ever guessed.
  static std::optional<DimExpr> div_exact(const DimExpr& a, const DimExpr& b);

  // Every coefficient >= 0 (with non-negative symbols, the value is >= 0).
  bool nonneg_coeffs() const;
  // `name(id)` spells a symbol; products join with "*", sums with "+".
  template <class NameFn>
  std::string str(NameFn name) const;

 private:
  std::vector<Term> terms_;
  bool normalize();  // sorts and merges terms; false when over the limits
};

template <class NameFn>
std::string DimExpr::str(NameFn name) const {
  if (terms_.empty()) return "0";
  std::string out;
  for (size_t i = 0; i < terms_.size(); ++i) {
    const Term& t = terms_[i];
    if (i)
      out += t.coeff < 0 ? "-" : "+";
    else if (t.coeff < 0)
      out += "-";
    // |coeff| as unsigned: -INT64_MIN overflows int64.
    const uint64_t c =
        t.coeff < 0 ? uint64_t{0} - static_cast<uint64_t>(t.coeff) : static_cast<uint64_t>(t.coeff);
    std::string m;
    for (int32_t s : t.symbols) m += (m.empty() ? "" : "*") + name(s);
    if (m.empty())
      out += std::to_string(c);
    else
      out += (c == 1 ? "" : std::to_string(c) + "*") + m;
  }
  return out;
}

}  // namespace fastopt::analysis
