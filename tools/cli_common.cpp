#include "cli_common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "ropepool/half.hpp"

namespace ropepool::cli {

DType parse_float_dtype(const std::string& name) {
  if (name == "bfloat16" || name == "bf16") return DType::BFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return DType::Float16;
  if (name == "float32" || name == "fp32" || name == "float") return DType::Float32;
  throw UsageError{"--dtype must be bfloat16, float16 or float32, got '" + name + "'"};
}

DType parse_index_dtype(const std::string& name) {
  if (name == "int32") return DType::Int32;
  if (name == "int64") return DType::Int64;
  throw UsageError{"--index-dtype must be int32 or int64, got '" + name + "'"};
}

// --- machine ------------------------------------------------------------------------------

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        size_t b = line.find_first_not_of(" \t", colon + 1);
        return b == std::string::npos ? "unknown CPU" : line.substr(b);
      }
    }
  }
  return "unknown CPU";
}

double load_average() {
  std::ifstream in("/proc/loadavg");
  double one_minute = -1;
  if (!(in >> one_minute)) return -1;
  return one_minute;
}

size_t l3_cache_bytes() {
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (v > 0) return size_t(v);
#endif
  std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::string s;
  if (in >> s && !s.empty()) {
    size_t mult = 1;
    if (s.back() == 'K') mult = 1024;
    if (s.back() == 'M') mult = 1024 * 1024;
    return size_t(std::atoll(s.c_str())) * mult;
  }
  return 0;
}

// --- command line -------------------------------------------------------------------------

int64_t parse_int(const std::string& option, const std::string& value, int64_t min_value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0 || v < min_value)
    throw UsageError{option + " expects an integer >= " + std::to_string(min_value) + ", got '" +
                     value + "'"};
  return v;
}

double parse_double(const std::string& option, const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v))
    throw UsageError{option + " expects a positive number, got '" + value + "'"};
  return v;
}

std::vector<int64_t> parse_int_list(const std::string& option, const std::string& value) {
  std::vector<int64_t> out;
  std::stringstream ss(value);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_int(option, item, 0));
  if (out.empty())
    throw UsageError{option + " expects a comma-separated list, got '" + value + "'"};
  return out;
}

std::string Args::next_option() {
  std::string a = args_[pos_++];
  has_pending_ = false;
  if (a.rfind("--", 0) == 0) {
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      pending_value_ = a.substr(eq + 1);
      has_pending_ = true;
      a.resize(eq);
    }
  }
  return a;
}

std::string Args::value(const std::string& option) {
  if (has_pending_) {
    has_pending_ = false;
    return pending_value_;
  }
  if (pos_ >= args_.size()) throw UsageError{option + " needs a value"};
  return args_[pos_++];
}

void Args::unknown(const std::string& option) const {
  throw UsageError{"unknown argument '" + option + "' for 'ropepool " + command_ + "'"};
}

}  // namespace ropepool::cli
