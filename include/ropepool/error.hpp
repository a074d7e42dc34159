// Errors raised by ropepool. Messages are part of the contract (SPEC §2); hints are not.
#pragma once

#include <stdexcept>
#include <string>

namespace ropepool {

/// Invalid input: wrong shape, dtype, layout, slot range, ... The Python binding maps it
/// to ValueError. `what()` is the exact contract message; `hint()` is optional extra help
/// (a likely cause and fix) that the binding attaches as an exception note.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message, std::string hint = {})
      : std::invalid_argument(message), hint_(std::move(hint)) {}
  const std::string& hint() const noexcept { return hint_; }

 private:
  std::string hint_;
};

/// A failure of the backend itself (a CUDA runtime error, a device-side slot error
/// reported after the fact). The Python binding maps it to RuntimeError.
class BackendError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace ropepool
