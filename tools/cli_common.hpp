// Shared pieces of the `ropepool` CLI: owned buffers, counter-based random fill, parallel
// loops, and the checks of an op result against the float64 reference.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ropepool/reference.hpp"
#include "ropepool/ropepool.hpp"

namespace ropepool::cli {

/// Raised for a bad command line: main prints it and exits 2.
struct UsageError {
  std::string message;
};

/// Page-aligned, uninitialised bytes. The first write (our parallel fill) places the pages.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_;
  size_t bytes_ = 0;
};

/// Runs body(begin, end) over [0, n) split into `threads` contiguous chunks (the calling
/// thread takes one). Used for filling and checking, never inside a timed region.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& body);

/// A counter-based generator: value i of stream `seed` does not depend on the order in
/// which values are drawn, so buffers can be filled in parallel and regenerated to compare.
uint64_t hash64(uint64_t seed, uint64_t i);
/// Uniform in [lo, hi).
double hash_uniform(uint64_t seed, uint64_t i, double lo, double hi);

/// A sequential generator for small draws (slots, positions, case parameters).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return hash64(0x9e3779b97f4a7c15ull, state_++); }
  /// Uniform in [0, n).
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  int64_t range(int64_t lo, int64_t hi_inclusive) {
    return lo + int64_t(below(uint64_t(hi_inclusive - lo) + 1));
  }
  bool chance(double p) { return double(next() >> 11) * 0x1p-53 < p; }

 private:
  uint64_t state_;
};

/// The bits of `value` rounded once to a float dtype (float32 bits, or the 16-bit pattern).
uint32_t encode(DType dtype, double value);
uint32_t load_bits(DType dtype, const void* p);
void store_bits(DType dtype, void* p, uint32_t bits);

/// Fills `count` elements of a float dtype with uniform values in [-4, 4), element i from
/// hash stream `seed` (parallel).
void fill_random(void* data, DType dtype, int64_t count, uint64_t seed, int threads);
/// Fills with an all-ones bit pattern (a NaN in every float dtype) so that an element the
/// op forgets to write fails the check.
void poison(void* data, DType dtype, int64_t count, int threads);

/// "bfloat16" -> DType::BFloat16; throws UsageError for anything else.
DType parse_float_dtype(const std::string& name);
DType parse_index_dtype(const std::string& name);

/// Result of comparing outputs against the reference.
struct CheckStats {
  int64_t elements = 0;       // output elements compared
  int64_t failures = 0;       // elements outside the bound (or not bit-identical where required)
  double worst = 0;           // max over elements of |error| / SPEC bound
  std::string first_failure;  // the failure with the lowest `at` (token or row index)
  int64_t first_failure_at = INT64_MAX;
  void merge(const CheckStats& other);
  /// Counts a failure at token/row `at`; `describe` runs only if it becomes the first.
  void fail(int64_t at, const std::function<std::string()>& describe);
  bool ok() const { return failures == 0; }
};

/// Compares rows [t_begin, t_end) of `out` with the float64 rotation of `x` (the op's
/// input), element by element against reference::tolerance (pairs half-split, or GPT-J
/// interleaved). Chunked so the reference's
/// float64 buffers stay small; parallel over `threads`.
CheckStats check_rotation(const char* name, const TensorView& x, const TensorView& out,
                          const TensorView& positions, const RopeSchedule& schedule,
                          int64_t t_begin, int64_t t_end, int threads, bool interleaved = false);

/// Whether head row `row` (all heads) of [rows, H, D] view `a` and row `b_row` of `b` hold the
/// same bits.
bool rows_identical(const TensorView& a, int64_t row, const TensorView& b, int64_t b_row);

/// Address of element (row, head, 0) of a [rows, H, D] view.
inline char* row_ptr(const TensorView& x, int64_t row, int64_t head = 0) {
  return static_cast<char*>(x.data) +
         (row * x.strides[0] + head * x.strides[1]) * int64_t(dtype_size(x.dtype));
}

/// The CPU model name (from /proc/cpuinfo), or "unknown CPU".
std::string cpu_model();
/// The 1-minute load average (from /proc/loadavg), negative when unknown. Other processes
/// running during a benchmark show up here.
double load_average();
/// Last-level (L3) cache size in bytes, 0 when unknown.
size_t l3_cache_bytes();

/// Parses a non-negative integer / a positive double / a comma list of integers for option
/// `option`; throws UsageError with a message naming the option.
int64_t parse_int(const std::string& option, const std::string& value, int64_t min_value);
double parse_double(const std::string& option, const std::string& value);
std::vector<int64_t> parse_int_list(const std::string& option, const std::string& value);

/// Command-line cursor shared by the subcommands: "--name value" and "--name=value".
class Args {
 public:
  Args(std::string command, std::vector<std::string> args)
      : command_(std::move(command)), args_(std::move(args)) {}
  bool done() const { return pos_ >= args_.size(); }
  /// The next option name (the part before '=' if any); advances past it.
  std::string next_option();
  /// The value of the option just read (after '=' or the following argument).
  std::string value(const std::string& option);
  [[noreturn]] void unknown(const std::string& option) const;

 private:
  std::string command_;
  std::vector<std::string> args_;
  size_t pos_ = 0;
  std::string pending_value_;
  bool has_pending_ = false;
};

int run_bench(Args& args);
int run_verify(Args& args);
const char* bench_help();
const char* verify_help();

}  // namespace ropepool::cli
