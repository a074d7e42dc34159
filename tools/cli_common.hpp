// Shared pieces of the `ropepool` CLI: command-line parsing and machine facts. Buffers,
// random inputs and the checks against the float64 reference come from the test kit
// (tests/kit/ropepool_kit.hpp).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ropepool/ropepool.hpp"
#include "ropepool_kit.hpp"

namespace ropepool::cli {

using namespace ropepool::test;  // the kit

/// Raised for a bad command line: main prints it and exits 2.
struct UsageError {
  std::string message;
};

/// "bfloat16" -> DType::BFloat16; throws UsageError for anything else.
DType parse_float_dtype(const std::string& name);
DType parse_index_dtype(const std::string& name);

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
/// `ropepool bench --mla` (cli_bench_mla.cpp), with the options after --mla.
int run_bench_mla(Args& args);
/// The memcpy anchor of `ropepool bench`: GB/s (read + written) of a multithreaded copy of
/// `bytes`, the median of `reps` copies.
double memcpy_gbps(size_t bytes, int threads, int reps);
int run_verify(Args& args);
const char* bench_help();
const char* verify_help();

}  // namespace ropepool::cli
