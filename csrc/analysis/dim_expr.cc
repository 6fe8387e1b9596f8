#include "analysis/dim_expr.h"

#include <algorithm>

namespace fastopt::analysis {
namespace {
// Limits that keep every operation cheap; real shape arithmetic stays far below them.
constexpr size_t kMaxTerms = 8;
}  // namespace

bool Monomial::erase_one(int32_t id) {
  for (size_t i = 0; i < n_; ++i) {
    if (ids_[i] == id) {
      for (size_t j = i + 1; j < n_; ++j) ids_[j - 1] = ids_[j];
      --n_;
      return true;
    }
  }
  return false;
}

DimExpr DimExpr::constant(int64_t c) {
  DimExpr e;
  if (c != 0) e.terms_.push_back({Monomial{}, c});
  return e;
}

DimExpr DimExpr::symbol(int32_t id) {
  DimExpr e;
  Monomial m;
  m.push_back(id);
  e.terms_.push_back({m, 1});
  return e;
}

std::optional<int64_t> DimExpr::constant_value() const {
  if (terms_.empty()) return 0;
  if (terms_.size() == 1 && terms_[0].symbols.empty()) return terms_[0].coeff;
  return std::nullopt;
}

int32_t DimExpr::as_symbol() const {
  if (terms_.size() == 1 && terms_[0].coeff == 1 && terms_[0].symbols.size() == 1) {
    return terms_[0].symbols[0];
  }
  return -1;
}

bool DimExpr::nonneg_coeffs() const {
  return std::all_of(terms_.begin(), terms_.end(), [](const Term& t) { return t.coeff >= 0; });
}

bool DimExpr::normalize() {
  std::sort(terms_.begin(), terms_.end(),
            [](const Term& a, const Term& b) { return a.symbols < b.symbols; });
  std::vector<Term> out;
  for (Term& t : terms_) {
    if (!out.empty() && out.back().symbols == t.symbols) {
      if (__builtin_add_overflow(out.back().coeff, t.coeff, &out.back().coeff)) return false;
    } else {
      out.push_back(std::move(t));
    }
    if (out.size() >= 2 && out[out.size() - 2].coeff == 0) out.erase(out.end() - 2);
  }
  if (!out.empty() && out.back().coeff == 0) out.pop_back();
  if (out.size() > kMaxTerms) return false;
  terms_ = std::move(out);
  return true;
}

std::optional<DimExpr> DimExpr::add(const DimExpr& a, const DimExpr& b) {
  DimExpr r = a;
  r.terms_.insert(r.terms_.end(), b.terms_.begin(), b.terms_.end());
  if (!r.normalize()) return std::nullopt;
  return r;
}

std::optional<DimExpr> DimExpr::sub(const DimExpr& a, const DimExpr& b) {
  DimExpr nb = b;
  for (Term& t : nb.terms_) {
    if (t.coeff == INT64_MIN) return std::nullopt;
    t.coeff = -t.coeff;
  }
  return add(a, nb);
}

std::optional<DimExpr> DimExpr::mul(const DimExpr& a, const DimExpr& b) {
  if (a.terms_.size() * b.terms_.size() > kMaxTerms * 2) return std::nullopt;
  DimExpr r;
  for (const Term& x : a.terms_) {
    for (const Term& y : b.terms_) {
      Term t;
      if (__builtin_mul_overflow(x.coeff, y.coeff, &t.coeff)) return std::nullopt;
      t.symbols = x.symbols;
      for (int32_t id : y.symbols) {
        if (!t.symbols.push_back(id)) return std::nullopt;  // degree past the limit
      }
      t.symbols.sort();
      r.terms_.push_back(std::move(t));
    }
  }
  if (!r.normalize()) return std::nullopt;
  return r;
}

std::optional<DimExpr> DimExpr::div_exact(const DimExpr& a, const DimExpr& b) {
  if (b.terms_.size() != 1 || b.terms_[0].coeff == 0) return std::nullopt;
  const Term& d = b.terms_[0];
  DimExpr r;
  for (const Term& t : a.terms_) {
    // INT64_MIN / -1 overflows (and traps, in % too): checked first.
    if (d.coeff == -1 && t.coeff == INT64_MIN) return std::nullopt;
    if (t.coeff % d.coeff != 0) return std::nullopt;
    Term q{t.symbols, t.coeff / d.coeff};
    // Remove d's symbols (a multiset) from t's.
    for (int32_t s : d.symbols) {
      if (!q.symbols.erase_one(s)) return std::nullopt;
    }
    r.terms_.push_back(std::move(q));
  }
  if (!r.normalize()) return std::nullopt;
  return r;
}

}  // namespace fastopt::analysis
