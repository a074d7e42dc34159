// The GoogleTest face of the test kit (tests/kit/ropepool_kit.hpp): a seeded fixture, and
// the kit's checks turned into test failures. Tests go through the public API only, so
// they hold for any CPU backend.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "ropepool_kit.hpp"

namespace ropepool::test {

/// Base fixture: every test gets its own seed, printed with each failure.
class SeededTest : public ::testing::Test {
 protected:
  SeededTest()
      : rng(fresh_seed()),
        trace_(__FILE__, __LINE__,
               "seed " + std::to_string(rng.seed()) + " (replay: ROPEPOOL_TEST_SEED=" +
                   std::to_string(rng.seed()) + ")") {}
  Rng rng;

 private:
  ::testing::ScopedTrace trace_;
};

/// Every buffer bit-identical to `before` (after a rejected call).
inline void expect_unchanged(const Case& c, const Snapshot& before) {
  for (const std::string& change : changes_since(c, before)) ADD_FAILURE() << change;
}

/// check_rotation of the kit, each kept failure reported; returns the number of bad
/// elements. `round_to_nearest`: see RotationCheck.
inline int64_t check_rotation(const char* what, const TensorView& in, const TensorView& out,
                              const TensorView& positions, const RopePoolParams& params,
                              bool round_to_nearest = false) {
  RotationCheck how;
  how.round_to_nearest = round_to_nearest;
  const CheckStats s = test::check_rotation(what, in, out, positions, params, how);
  for (const auto& f : s.first) ADD_FAILURE() << f.second;
  if (s.failures > int64_t(s.first.size()))
    ADD_FAILURE() << what << ": " << s.failures << " elements out of bound in total";
  return s.failures;
}

/// The whole contract of a successful call (see check_call in the kit).
inline void expect_call_result(const Case& c, const Snapshot& before) {
  for (const std::string& problem : check_call(c, before)) ADD_FAILURE() << problem;
}

/// Runs the call and checks it (see expect_call_result).
inline void run_and_check(Case& c, const CallOptions& options = {}) {
  const Snapshot before = c.snapshot();
  ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params, options));
  expect_call_result(c, before);
}

/// What a call threw: the message and hint of a ropepool::Error, or a note on anything else.
struct Thrown {
  bool error = false;  // a ropepool::Error was thrown
  std::string what, hint, other;
};

inline Thrown thrown_by(const std::function<void()>& call) {
  Thrown r;
  try {
    call();
    r.other = "nothing was thrown";
  } catch (const Error& e) {
    r.error = true;
    r.what = e.what();
    r.hint = e.hint();
  } catch (const std::exception& e) {
    r.other = std::string("a non-ropepool::Error exception: ") + e.what();
  }
  return r;
}

/// Restores the CPU thread count when a test ends.
class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(cpu_num_threads()) {}
  ~ThreadCountGuard() { set_cpu_num_threads(saved_); }

 private:
  int saved_;
};

}  // namespace ropepool::test
