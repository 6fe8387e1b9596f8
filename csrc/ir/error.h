// Error type for every problem with a model: bad input, broken invariants, failed writes.
#pragma once

#include <stdexcept>
#include <string>

namespace fastopt {

class ModelError : public std::runtime_error {
 public:
  explicit ModelError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace fastopt
