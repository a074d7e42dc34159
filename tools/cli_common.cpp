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

// --- memory and threads ---------------------------------------------------------------

Buffer::Buffer(size_t bytes) : bytes_(bytes) {
  constexpr size_t kAlign = 4096;
  const size_t rounded = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  void* p = std::aligned_alloc(kAlign, rounded);
  if (!p) throw std::bad_alloc();
  data_.reset(p);
}

void Buffer::Free::operator()(void* p) const { std::free(p); }

void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (workers == 1) {
    body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  auto chunk = [&](int64_t w) { return std::pair{n * w / workers, n * (w + 1) / workers}; };
  for (int64_t w = 1; w < workers; ++w)
    pool.emplace_back([&, w] {
      auto [b, e] = chunk(w);
      body(b, e);
    });
  auto [b, e] = chunk(0);
  body(b, e);
  for (auto& t : pool) t.join();
}

// --- random values ----------------------------------------------------------------------

uint64_t hash64(uint64_t seed, uint64_t i) {
  // splitmix64 finaliser of (seed, i): cheap, and every output bit depends on both.
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double hash_uniform(uint64_t seed, uint64_t i, double lo, double hi) {
  return lo + (hi - lo) * (double(hash64(seed, i) >> 11) * 0x1p-53);
}

uint32_t encode(DType dtype, double value) {
  const float f = float(value);
  switch (dtype) {
    case DType::Float32:
      return float_bits(f);
    case DType::Float16:
      return float_to_half(f);
    case DType::BFloat16:
      return float_to_bf16(f);
    default:
      return 0;
  }
}

uint32_t load_bits(DType dtype, const void* p) {
  if (dtype_size(dtype) == 4) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

void store_bits(DType dtype, void* p, uint32_t bits) {
  if (dtype_size(dtype) == 4) {
    std::memcpy(p, &bits, 4);
  } else {
    const uint16_t h = uint16_t(bits);
    std::memcpy(p, &h, 2);
  }
}

void fill_random(void* data, DType dtype, int64_t count, uint64_t seed, int threads) {
  const size_t es = dtype_size(dtype);
  parallel_for(count, threads, [&](int64_t b, int64_t e) {
    char* p = static_cast<char*>(data);
    for (int64_t i = b; i < e; ++i)
      store_bits(dtype, p + size_t(i) * es, encode(dtype, hash_uniform(seed, uint64_t(i), -4, 4)));
  });
}

void poison(void* data, DType dtype, int64_t count, int threads) {
  const size_t es = dtype_size(dtype);
  parallel_for(count, threads, [&](int64_t b, int64_t e) {
    std::memset(static_cast<char*>(data) + size_t(b) * es, 0xff, size_t(e - b) * es);
  });
}

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

// --- checks against the reference -------------------------------------------------------

void CheckStats::merge(const CheckStats& o) {
  elements += o.elements;
  failures += o.failures;
  worst = std::max(worst, o.worst);
  if (o.first_failure_at < first_failure_at) {
    first_failure_at = o.first_failure_at;
    first_failure = o.first_failure;
  }
}

void CheckStats::fail(int64_t at, const std::function<std::string()>& describe) {
  ++failures;
  if (at < first_failure_at) {
    first_failure_at = at;
    first_failure = describe();
  }
}

namespace {

TensorView token_slice(const TensorView& x, int64_t t_begin, int64_t t_end) {
  TensorView s = x;
  s.data = static_cast<char*>(x.data) + t_begin * x.strides[0] * int64_t(dtype_size(x.dtype));
  s.shape[0] = t_end - t_begin;
  return s;
}

std::string describe(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

}  // namespace

CheckStats check_rotation(const char* name, const TensorView& x, const TensorView& out,
                          const TensorView& positions, const RopeSchedule& schedule,
                          int64_t t_begin, int64_t t_end, int threads, bool interleaved) {
  const int64_t H = x.shape[1], D = x.shape[2], half = schedule.rotary_dim / 2;
  // Chunks of tokens small enough that the reference's float64 result (H*D doubles per
  // token) stays in cache, many enough to balance the threads.
  const int64_t tokens_per_chunk = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * D));
  const int64_t chunks = (t_end - t_begin + tokens_per_chunk - 1) / tokens_per_chunk;
  CheckStats total;
  std::mutex mu;
  parallel_for(chunks, threads, [&](int64_t cb, int64_t ce) {
    CheckStats local;
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t b = t_begin + c * tokens_per_chunk;
      const int64_t e = std::min(t_end, b + tokens_per_chunk);
      const TensorView xs = token_slice(x, b, e), os = token_slice(out, b, e);
      const std::vector<double> exact =
          reference::rotate(xs, token_slice(positions, b, e), schedule, interleaved);
      for (int64_t t = 0; t < e - b; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const double want = exact[size_t((t * H + h) * D + d)];
            const double got = reference::load(os, t, h, d);
            double tol = 0;  // elements past the rotary dimension are copied exactly
            if (d < schedule.rotary_dim) {
              // the pair's inputs: (d, d +- R/2) half-split, (d, d ^ 1) interleaved
              const int64_t other = interleaved ? (d ^ 1) : d < half ? d + half : d - half;
              tol = reference::tolerance(x.dtype, want,
                                         std::abs(reference::load(xs, t, h, d)) +
                                             std::abs(reference::load(xs, t, h, other)));
            }
            const double err = std::abs(got - want);
            ++local.elements;
            // `!(err <= tol)` also catches NaN: a poisoned element the op never wrote.
            if (!(err <= tol)) {
              local.fail(b + t, [&] {
                return std::string(name) + "[" + std::to_string(b + t) + ", " + std::to_string(h) +
                       ", " + std::to_string(d) + "] = " + describe(got) + ", reference " +
                       describe(want) + ", bound " + describe(tol) + " (position " +
                       std::to_string(reference::load_index(positions, b + t)) + ")";
              });
            } else if (tol > 0) {
              local.worst = std::max(local.worst, err / tol);
            }
          }
    }
    std::lock_guard lock(mu);
    total.merge(local);
  });
  return total;
}

bool rows_identical(const TensorView& a, int64_t row, const TensorView& b, int64_t b_row) {
  const int64_t H = a.shape[1], D = a.shape[2];
  const size_t bytes = size_t(D) * dtype_size(a.dtype);
  for (int64_t h = 0; h < H; ++h)
    if (std::memcmp(row_ptr(a, row, h), row_ptr(b, b_row, h), bytes) != 0) return false;
  return true;
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
