// Helpers shared by the C++ tests: host buffers that own memory and hand out strided views,
// fresh random inputs, poisoning, and the checks against the float64 reference
// (ropepool/reference.hpp). Tests go through the public API only, so they hold for any
// CPU backend.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ropepool/half.hpp"
#include "ropepool/reference.hpp"
#include "ropepool/ropepool.hpp"

namespace ropepool::test {

// ---------------------------------------------------------------------------------------
// Randomness: a fresh seed every run; ROPEPOOL_TEST_SEED replays a failing one.

inline uint64_t fresh_seed() {
  if (const char* env = std::getenv("ROPEPOOL_TEST_SEED"); env && *env)
    return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t(device()) << 32) ^ uint64_t(device());
}

/// xoshiro256** seeded through splitmix64: the tests draw hundreds of millions of values,
/// and std::mt19937_64 dominated their run time.
class Rng {
 public:
  using result_type = uint64_t;
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t(0); }

  explicit Rng(uint64_t seed) : seed_(seed) {
    uint64_t x = seed;
    for (uint64_t& word : state_) {
      uint64_t z = (x += 0x9e3779b97f4a7c15u);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
      word = z ^ (z >> 31);
    }
  }
  uint64_t seed() const { return seed_; }
  uint64_t operator()() { return bits(); }
  uint64_t bits() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }
  /// Uniform in [lo, hi], both inclusive.
  int64_t integer(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(*this);
  }
  /// Uniform in [0, 1).
  double unit() { return double(bits() >> 11) * 0x1p-53; }
  bool chance(double p) { return unit() < p; }
  template <class It>
  void shuffle(It first, It last) {
    std::shuffle(first, last, *this);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t seed_;
  uint64_t state_[4];
};

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

// ---------------------------------------------------------------------------------------
// Elements

inline std::string dtype_str(DType d) { return dtype_name(d); }

/// "[2, 8, 128]", written here independently of the library's format_shape.
inline std::string shape_str(const TensorView& v) {
  std::string s = "[";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
  return s + "]";
}

inline void* element(const TensorView& v, int64_t t, int64_t h = 0, int64_t d = 0) {
  int64_t off = t * v.strides[0];
  if (v.ndim > 1) off += h * v.strides[1];
  if (v.ndim > 2) off += d * v.strides[2];
  return static_cast<char*>(v.data) + off * int64_t(dtype_size(v.dtype));
}

/// The value of one float element as double (exact for all three dtypes).
inline double load(const TensorView& v, int64_t t, int64_t h, int64_t d) {
  const void* p = element(v, t, h, d);
  switch (v.dtype) {
    case DType::Float32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::Float16: {
      uint16_t u;
      std::memcpy(&u, p, 2);
      return half_to_float(u);
    }
    case DType::BFloat16: {
      uint16_t u;
      std::memcpy(&u, p, 2);
      return bf16_to_float(u);
    }
    default: throw std::logic_error("load: not a float view");
  }
}

inline void store(const TensorView& v, int64_t t, int64_t h, int64_t d, float value) {
  void* p = element(v, t, h, d);
  switch (v.dtype) {
    case DType::Float32: std::memcpy(p, &value, 4); break;
    case DType::Float16: {
      const uint16_t u = float_to_half(value);
      std::memcpy(p, &u, 2);
      break;
    }
    case DType::BFloat16: {
      const uint16_t u = float_to_bf16(value);
      std::memcpy(p, &u, 2);
      break;
    }
    default: throw std::logic_error("store: not a float view");
  }
}

inline bool same_bits(const TensorView& a, int64_t ta, int64_t ha, int64_t da, const TensorView& b,
                      int64_t tb, int64_t hb, int64_t db) {
  return std::memcmp(element(a, ta, ha, da), element(b, tb, hb, db), dtype_size(a.dtype)) == 0;
}

inline int64_t index_at(const TensorView& v, int64_t t) {
  const void* p = element(v, t);
  if (v.dtype == DType::Int64) {
    int64_t x;
    std::memcpy(&x, p, 8);
    return x;
  }
  if (v.dtype == DType::Int32) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return x;
  }
  throw std::logic_error("index_at: not an index view");
}

inline void set_index(const TensorView& v, int64_t t, int64_t value) {
  void* p = element(v, t);
  if (v.dtype == DType::Int64) {
    std::memcpy(p, &value, 8);
  } else if (v.dtype == DType::Int32) {
    if (value < INT32_MIN || value > INT32_MAX) throw std::logic_error("set_index: int32 overflow");
    const int32_t x = int32_t(value);
    std::memcpy(p, &x, 4);
  } else {
    throw std::logic_error("set_index: not an index view");
  }
}

/// A view of tokens [t0, t0 + n) of a tensor whose first dimension is tokens.
inline TensorView token_slice(TensorView v, int64_t t0, int64_t n) {
  v.data = element(v, t0);
  v.shape[0] = n;
  return v;
}

/// A random finite value with a spread of exponents (2^-6 .. 2^3), random sign and all
/// mantissa bits random, exactly representable in `dtype`.
inline float random_value(Rng& rng, DType dtype) {
  const uint64_t r = rng.bits();
  const uint32_t exponent = uint32_t(127 - 6 + (r >> 40) % 9);
  uint32_t mantissa = uint32_t(r) & 0x7fffffu;
  if (dtype == DType::Float16) mantissa &= ~0x1fffu;  // keep the top 10 bits
  if (dtype == DType::BFloat16) mantissa &= ~0xffffu;  // keep the top 7 bits
  return bits_float(uint32_t((r >> 63) << 31) | (exponent << 23) | mantissa);
}

/// A NaN of `dtype` (low bytes of the result) with sign and payload from `r`: quiet or
/// signalling, never the canonical pattern only.
inline uint64_t nan_pattern(DType dtype, uint64_t r) {
  const bool quiet = (r >> 32) & 1;
  switch (dtype) {
    case DType::Float32: return (r & 0x803fffffu) | 0x7f800000u | (quiet ? 0x400000u : 1u);
    case DType::Float16: return (r & 0x81ffu) | 0x7c00u | (quiet ? 0x200u : 1u);
    default: return (r & 0x803fu) | 0x7f80u | (quiet ? 0x40u : 1u);
  }
}

/// +Inf or -Inf of `dtype` (low bytes), the sign from `r`.
inline uint64_t inf_pattern(DType dtype, uint64_t r) {
  const bool negative = r & 1;
  switch (dtype) {
    case DType::Float32: return negative ? 0xff800000u : 0x7f800000u;
    case DType::Float16: return negative ? 0xfc00u : 0x7c00u;
    default: return negative ? 0xff80u : 0x7f80u;
  }
}

/// Writes the low dtype_size bytes of `bits` into one element.
inline void store_bits(const TensorView& v, int64_t t, int64_t h, int64_t d, uint64_t bits) {
  std::memcpy(element(v, t, h, d), &bits, dtype_size(v.dtype));
}

// ---------------------------------------------------------------------------------------
// Host memory

/// Owns `numel` elements of `dtype` (64-byte aligned base) and hands out views into them.
class HostBuffer {
 public:
  HostBuffer(std::string name, DType dtype, int64_t numel)
      : name_(std::move(name)),
        dtype_(dtype),
        numel_(numel),
        storage_(size_t(numel) * dtype_size(dtype) + 64) {
    const uintptr_t raw = reinterpret_cast<uintptr_t>(storage_.data());
    base_ = storage_.data() + ((64 - raw % 64) % 64);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  const std::string& name() const { return name_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  size_t bytes() const { return size_t(numel_) * dtype_size(dtype_); }
  uint8_t* base() const { return base_; }

  /// A view of `shape` with `strides` (in elements) starting `offset` elements in.
  TensorView view(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides,
                  int64_t offset = 0) const {
    return make_view(std::vector<int64_t>(shape), std::vector<int64_t>(strides), offset);
  }

  /// A row-major view of `shape` starting `offset` elements in.
  TensorView contiguous(std::initializer_list<int64_t> shape, int64_t offset = 0) const {
    std::vector<int64_t> strides(shape.size());
    int64_t stride = 1;
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = stride;
      stride *= shape.begin()[i];
    }
    return make_view(std::vector<int64_t>(shape), strides, offset);
  }

  /// Element offset of a view's origin in this buffer, or -1 if it lives elsewhere.
  int64_t offset_of(const TensorView& v) const {
    const auto* p = static_cast<const uint8_t*>(v.data);
    if (p < base_ || p > base_ + bytes()) return -1;
    return (p - base_) / int64_t(dtype_size(dtype_));
  }

  std::vector<uint8_t> snapshot() const { return {base_, base_ + bytes()}; }

  /// Random garbage in every element: NaN patterns with random payloads, infinities and
  /// random bits for float buffers, random bits for index buffers. Never zeros.
  void poison(Rng& rng) {
    const size_t es = dtype_size(dtype_);
    for (int64_t i = 0; i < numel_; ++i) {
      uint64_t bits = rng.bits();
      const uint64_t kind = bits >> 60;  // the element uses at most the low 32 bits
      if (is_float(dtype_) && kind < 8) bits = nan_pattern(dtype_, bits);
      else if (is_float(dtype_) && kind == 8) bits = inf_pattern(dtype_, bits);
      std::memcpy(base_ + size_t(i) * es, &bits, es);  // little-endian: low bytes
    }
  }

 private:
  TensorView make_view(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                       int64_t offset) const {
    if (shape.size() != strides.size() || shape.size() > size_t(TensorView::kMaxDims))
      throw std::logic_error("view: bad rank");
    TensorView v;
    v.data = base_ + offset * int64_t(dtype_size(dtype_));
    v.dtype = dtype_;
    v.ndim = int(shape.size());
    int64_t last = offset;
    bool empty = false;
    for (int i = 0; i < v.ndim; ++i) {
      v.shape[i] = shape[size_t(i)];
      v.strides[i] = strides[size_t(i)];
      if (v.shape[i] == 0) empty = true;
      last += (v.shape[i] - 1) * v.strides[i];
    }
    if (offset < 0 || offset > numel_ || (!empty && last >= numel_))
      throw std::logic_error("view outside buffer " + name_);
    return v;
  }

  std::string name_;
  DType dtype_;
  int64_t numel_;
  std::vector<uint8_t> storage_;
  uint8_t* base_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// A complete call: buffers, views, params

enum class QkvLayout { Contiguous, Fused, Padded };
enum class PoolLayout { Contiguous, LayerOfStack, HeadMajor };
enum class OutLayout { Contiguous, Padded };
enum class IndexLayout { Contiguous, Strided };

inline const char* name(QkvLayout l) {
  return l == QkvLayout::Contiguous ? "qkv_dense" : l == QkvLayout::Fused ? "qkv_fused" : "qkv_padded";
}
inline const char* name(PoolLayout l) {
  return l == PoolLayout::Contiguous     ? "pool_dense"
         : l == PoolLayout::LayerOfStack ? "pool_layer"
                                         : "pool_head_major";
}
inline const char* name(OutLayout l) { return l == OutLayout::Contiguous ? "out_dense" : "out_padded"; }
inline const char* name(IndexLayout l) {
  return l == IndexLayout::Contiguous ? "index_dense" : "index_strided";
}

struct Shape {
  DType dtype = DType::Float32;
  int64_t num_tokens = 2;
  int64_t num_qo_heads = 8;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 128;
  int64_t pool_size = 16;
  DType position_dtype = DType::Int32;
  DType slot_dtype = DType::Int32;
  double rope_base = 10000;
};

struct Layout {
  QkvLayout qkv = QkvLayout::Contiguous;
  PoolLayout pool = PoolLayout::Contiguous;
  OutLayout out = OutLayout::Contiguous;
  IndexLayout index = IndexLayout::Contiguous;
  /// Elements after every view: writes past a view's end land there and are caught.
  int64_t tail_slack = 67;
};

struct Snapshot {
  std::vector<std::vector<uint8_t>> bytes;  // per buffer, in Case::buffers() order
};

/// Owns every tensor of one rope_pool_fused call, laid out as `layout` says.
class Case {
 public:
  explicit Case(const Shape& s, const Layout& l = {}) : shape(s), layout(l) {
    const int64_t T = s.num_tokens, Hq = s.num_qo_heads, Hk = s.num_kv_heads, D = s.head_dim,
                  P = s.pool_size, slack = l.tail_slack;
    params.head_dim = D;
    params.num_qo_heads = Hq;
    params.num_kv_heads = Hk;
    params.rope_base = s.rope_base;

    // q, k, v
    switch (l.qkv) {
      case QkvLayout::Contiguous: {
        auto& q = own("q", s.dtype, T * Hq * D + slack);
        auto& k = own("k", s.dtype, T * Hk * D + slack);
        auto& v = own("v", s.dtype, T * Hk * D + slack);
        tensors.q = q.contiguous({T, Hq, D});
        tensors.k = k.contiguous({T, Hk, D});
        tensors.v = v.contiguous({T, Hk, D});
        break;
      }
      case QkvLayout::Fused: {
        // Slices of one fused projection output [T, (Hq + 2 Hk) * D].
        const int64_t width = (Hq + 2 * Hk) * D;
        auto& qkv = own("qkv", s.dtype, T * width + slack);
        tensors.q = qkv.view({T, Hq, D}, {width, D, 1}, 0);
        tensors.k = qkv.view({T, Hk, D}, {width, D, 1}, Hq * D);
        tensors.v = qkv.view({T, Hk, D}, {width, D, 1}, (Hq + Hk) * D);
        break;
      }
      case QkvLayout::Padded: {
        // Gaps between heads and rows, and an origin 3 elements into the buffer (so not
        // vector-aligned).
        auto padded = [&](const char* n, int64_t H) -> TensorView {
          const int64_t head = D + 5, row = H * head + 3;
          auto& b = own(n, s.dtype, 3 + T * row + slack);
          return b.view({T, H, D}, {row, head, 1}, 3);
        };
        tensors.q = padded("q", Hq);
        tensors.k = padded("k", Hk);
        tensors.v = padded("v", Hk);
        break;
      }
    }

    // positions, slots
    if (l.index == IndexLayout::Contiguous) {
      tensors.positions = own("positions", s.position_dtype, T + slack).contiguous({T});
      tensors.slots = own("slots", s.slot_dtype, T + slack).contiguous({T});
    } else {
      // Columns of [T, 2] and [T, 3] tables.
      tensors.positions = own("positions", s.position_dtype, 2 * T + slack).view({T}, {2}, 1);
      tensors.slots = own("slots", s.slot_dtype, 3 * T + slack).view({T}, {3}, 2);
    }

    // pools
    for (const char* n : {"k_pool", "v_pool"}) {
      TensorView pool;
      switch (l.pool) {
        case PoolLayout::Contiguous: pool = own(n, s.dtype, P * Hk * D + slack).contiguous({P, Hk, D}); break;
        case PoolLayout::LayerOfStack: {
          // Layer 1 of a [3, P, Hk, D] stacked cache; layers 0 and 2 must stay untouched.
          auto& b = own(n, s.dtype, 3 * P * Hk * D + slack);
          pool = b.view({P, Hk, D}, {Hk * D, D, 1}, P * Hk * D);
          break;
        }
        case PoolLayout::HeadMajor: {
          // Storage [Hk, P, D] seen as [P, Hk, D].
          pool = own(n, s.dtype, Hk * P * D + slack).view({P, Hk, D}, {D, P * D, 1}, 0);
          break;
        }
      }
      (n[0] == 'k' ? tensors.k_pool : tensors.v_pool) = pool;
    }

    // outputs
    if (l.out == OutLayout::Contiguous) {
      tensors.q_out = own("q_out", s.dtype, T * Hq * D + slack).contiguous({T, Hq, D});
      tensors.k_out = own("k_out", s.dtype, T * Hk * D + slack).contiguous({T, Hk, D});
    } else {
      auto padded = [&](const char* n, int64_t H) -> TensorView {
        const int64_t head = D + 3, row = H * head + 7;
        return own(n, s.dtype, 1 + T * row + slack).view({T, H, D}, {row, head, 1}, 1);
      };
      tensors.q_out = padded("q_out", Hq);
      tensors.k_out = padded("k_out", Hk);
    }
  }

  Case(const Case&) = delete;
  Case& operator=(const Case&) = delete;

  Shape shape;
  Layout layout;
  RopePoolTensors tensors;
  RopePoolParams params;

  const std::vector<std::unique_ptr<HostBuffer>>& buffers() const { return buffers_; }

  int64_t num_tokens() const { return shape.num_tokens; }
  int64_t slot(int64_t t) const { return index_at(tensors.slots, t); }
  int64_t position(int64_t t) const { return index_at(tensors.positions, t); }
  void set_slot(int64_t t, int64_t s) { set_index(tensors.slots, t, s); }
  void set_position(int64_t t, int64_t p) { set_index(tensors.positions, t, p); }

  /// Fresh random call: every buffer poisoned, then random finite q/k/v, positions in
  /// [0, 2^20) including the extremes, and distinct slots with about `negative_fraction`
  /// negative ones.
  void randomize(Rng& rng, double negative_fraction = 0.125) {
    for (auto& b : buffers_) b->poison(rng);
    for (const TensorView* x : {&tensors.q, &tensors.k, &tensors.v})
      for (int64_t t = 0; t < x->shape[0]; ++t)
        for (int64_t h = 0; h < x->shape[1]; ++h)
          for (int64_t d = 0; d < x->shape[2]; ++d) store(*x, t, h, d, random_value(rng, shape.dtype));
    randomize_positions(rng);
    randomize_slots(rng, negative_fraction);
  }

  void randomize_positions(Rng& rng) {
    // The accuracy contract covers |position| < 2^20; the far end is where a float32
    // angle would fail.
    static constexpr int64_t kSpecial[] = {(1 << 20) - 1, 1000003, 0, 1, (1 << 20) - 2, 65536, 524287};
    const int64_t T = num_tokens();
    for (int64_t t = 0; t < T; ++t) set_position(t, rng.integer(0, (1 << 20) - 1));
    for (int64_t i = 0; i < int64_t(std::size(kSpecial)) && i < T; ++i)
      set_position(rng.integer(0, T - 1), kSpecial[i]);
    if (T > 0) set_position(0, kSpecial[0]);
  }

  /// Distinct non-negative slots; negative ones (-1, INT32_MIN, ...) for about
  /// `negative_fraction` of the tokens, or for the tokens the pool has no room for.
  void randomize_slots(Rng& rng, double negative_fraction) {
    const int64_t T = num_tokens(), P = shape.pool_size;
    std::vector<int64_t> rows(static_cast<size_t>(P));
    std::iota(rows.begin(), rows.end(), 0);
    rng.shuffle(rows.begin(), rows.end());
    size_t next = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (next < rows.size() && !rng.chance(negative_fraction)) {
        set_slot(t, rows[next++]);
      } else {
        const int64_t negatives[] = {-1, -2, INT32_MIN, -int64_t(rng.integer(1, 1 << 30))};
        int64_t s = negatives[rng.integer(0, 3)];
        if (shape.slot_dtype == DType::Int64 && rng.chance(0.25)) s = INT64_MIN;
        set_slot(t, s);
      }
    }
  }

  Snapshot snapshot() const {
    Snapshot s;
    for (auto& b : buffers_) s.bytes.push_back(b->snapshot());
    return s;
  }

  /// Puts every buffer back to a snapshot of this case.
  void restore(const Snapshot& s) {
    for (size_t i = 0; i < buffers_.size(); ++i)
      std::memcpy(buffers_[i]->base(), s.bytes[i].data(), s.bytes[i].size());
  }

  /// Poisons the buffers of q_out and k_out (fresh garbage before a call).
  void poison_outputs(Rng& rng) {
    for (auto& b : buffers_)
      if (b->offset_of(tensors.q_out) >= 0 || b->offset_of(tensors.k_out) >= 0) b->poison(rng);
  }

  /// The buffer a view lives in.
  const HostBuffer& buffer_of(const TensorView& v) const {
    for (auto& b : buffers_)
      if (b->offset_of(v) >= 0) return *b;
    throw std::logic_error("view of no buffer");
  }

 private:
  HostBuffer& own(const char* n, DType dtype, int64_t numel) {
    buffers_.push_back(std::make_unique<HostBuffer>(n, dtype, numel));
    return *buffers_.back();
  }

  std::vector<std::unique_ptr<HostBuffer>> buffers_;
};

// ---------------------------------------------------------------------------------------
// Checks

/// Every buffer bit-identical to `before` (after a rejected call).
inline void expect_unchanged(const Case& c, const Snapshot& before) {
  for (size_t i = 0; i < c.buffers().size(); ++i) {
    const auto& b = *c.buffers()[i];
    const uint8_t* now = b.base();
    if (std::memcmp(now, before.bytes[i].data(), b.bytes()) != 0) {
      const auto at = std::mismatch(now, now + b.bytes(), before.bytes[i].begin()).first - now;
      ADD_FAILURE() << "buffer " << b.name() << " changed at byte " << at << " (element "
                    << at / int64_t(dtype_size(b.dtype())) << ")";
    }
  }
}

/// Checks every element of `out` against the float64 rotation of `in` (SPEC §1 bound).
/// Non-finite exact values must come out the same (NaN stays NaN, +-Inf stays itself).
/// Returns the number of bad elements; reports the first few.
/// With `round_to_nearest`, float16/bfloat16 outputs must also be the float32 result
/// rounded to nearest (SPEC §1 "rounded once"): within half an ulp plus the float32 term,
/// which a truncating conversion misses.
inline int64_t check_rotation(const char* what, const TensorView& in, const TensorView& out,
                              const TensorView& positions, const RopePoolParams& params,
                              bool round_to_nearest = false) {
  const RopeSchedule schedule = make_rope_schedule(params);
  const int64_t T = in.shape[0], H = in.shape[1], D = in.shape[2], half = schedule.rotary_dim / 2;
  int64_t bad = 0;
  constexpr int64_t kChunk = 256;  // bounds the reference's float64 buffer
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int64_t n = std::min(kChunk, T - t0);
    const std::vector<double> exact =
        reference::rotate(token_slice(in, t0, n), token_slice(positions, t0, n), schedule);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t t = t0 + i;
          const double want = exact[size_t((i * H + h) * D + d)];
          const double got = load(out, t, h, d);
          double tol = 0;
          bool ok;
          if (std::isnan(want)) {
            ok = std::isnan(got);
          } else if (std::isinf(want)) {
            ok = got == want;
          } else {
            double pair = 0;
            if (d < schedule.rotary_dim) {
              const int64_t lo = d < half ? d : d - half;
              pair = std::abs(load(in, t, h, lo)) + std::abs(load(in, t, h, lo + half));
            }
            tol = reference::tolerance(out.dtype, want, pair);
            if (round_to_nearest && out.dtype != DType::Float32) {
              const double float32_term = std::ldexp(pair, -18);
              tol = 0.5 * reference::tolerance(out.dtype, std::abs(want) + float32_term, 0) + float32_term;
            }
            ok = std::abs(got - want) <= tol;
          }
          if (!ok && ++bad <= 5)
            ADD_FAILURE() << what << "[" << t << ", " << h << ", " << d << "] = " << got
                          << ", exact " << want << " (tolerance " << tol << "), position "
                          << index_at(positions, t) << ", dtype " << dtype_name(out.dtype);
        }
  }
  if (bad > 5) ADD_FAILURE() << what << ": " << bad << " elements out of bound in total";
  return bad;
}

/// Marks the elements a view covers (rows `row0..row0+n`) in a per-element mask of `b`.
inline void mark(std::vector<bool>& mask, const HostBuffer& b, const TensorView& v, int64_t row0,
                 int64_t n) {
  const int64_t origin = b.offset_of(v);
  for (int64_t r = row0; r < row0 + n; ++r)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t d = 0; d < v.shape[2]; ++d)
        mask[size_t(origin + r * v.strides[0] + h * v.strides[1] + d * v.strides[2])] = true;
}

/// Whether pool row `row` holds token `t`'s complete row of `src` ([T, Hk, D]), bit for bit.
inline bool row_equals(const TensorView& pool, int64_t row, const TensorView& src, int64_t t) {
  for (int64_t h = 0; h < pool.shape[1]; ++h)
    for (int64_t d = 0; d < pool.shape[2]; ++d)
      if (!same_bits(pool, row, h, d, src, t, h, d)) return false;
  return true;
}

/// The whole contract of a successful call, given the buffers before it:
/// - q_out/k_out within the SPEC §1 bound of the float64 reference, every element;
/// - each pool row named by a non-negative slot holds, bit for bit, the k_out / v row of a
///   token that wrote it (the only token, or one of the tokens when slots repeat);
/// - every other byte of every buffer (inputs, pool rows not written, gaps between and
///   after views, other layers of a stacked cache) is unchanged.
inline void expect_call_result(const Case& c, const Snapshot& before) {
  const RopePoolTensors& x = c.tensors;
  const int64_t T = c.num_tokens(), P = x.k_pool.shape[0];
  std::vector<std::vector<int64_t>> writers(static_cast<size_t>(P));
  for (int64_t t = 0; t < T; ++t)
    if (const int64_t s = c.slot(t); s >= 0) writers.at(size_t(s)).push_back(t);

  // Bytes outside what the call may write.
  for (size_t i = 0; i < c.buffers().size(); ++i) {
    const HostBuffer& b = *c.buffers()[i];
    std::vector<bool> may_write(size_t(b.numel()), false);
    for (const TensorView* out : {&x.q_out, &x.k_out})
      if (b.offset_of(*out) >= 0) mark(may_write, b, *out, 0, out->shape[0]);
    for (const TensorView* pool : {&x.k_pool, &x.v_pool})
      if (b.offset_of(*pool) >= 0)
        for (int64_t s = 0; s < P; ++s)
          if (!writers[size_t(s)].empty()) mark(may_write, b, *pool, s, 1);
    const uint8_t* now = b.base();
    const uint8_t* was = before.bytes[i].data();
    const size_t es = dtype_size(b.dtype());
    int64_t changed = 0;
    for (int64_t e = 0; e < b.numel(); ++e)
      if (!may_write[size_t(e)] && std::memcmp(now + size_t(e) * es, was + size_t(e) * es, es) != 0 &&
          ++changed <= 3)
        ADD_FAILURE() << "element " << e << " of buffer " << b.name()
                      << " changed but the call may not write it";
    EXPECT_EQ(changed, 0) << "elements of " << b.name() << " changed outside the outputs";
  }

  EXPECT_EQ(check_rotation("q_out", x.q, x.q_out, x.positions, c.params), 0);
  EXPECT_EQ(check_rotation("k_out", x.k, x.k_out, x.positions, c.params), 0);

  int64_t bad_rows = 0;
  for (int64_t s = 0; s < P; ++s) {
    const auto& w = writers[size_t(s)];
    if (w.empty()) continue;
    const bool k_ok = std::any_of(w.begin(), w.end(), [&](int64_t t) { return row_equals(x.k_pool, s, x.k_out, t); });
    const bool v_ok = std::any_of(w.begin(), w.end(), [&](int64_t t) { return row_equals(x.v_pool, s, x.v, t); });
    if ((!k_ok || !v_ok) && ++bad_rows <= 5)
      ADD_FAILURE() << "pool row " << s << " (written by token " << w.front()
                    << (w.size() > 1 ? " and others" : "") << "): " << (k_ok ? "" : "k_pool row is not a complete k_out row; ")
                    << (v_ok ? "" : "v_pool row is not a complete v row");
  }
  EXPECT_EQ(bad_rows, 0) << "pool rows with wrong contents";
}

/// Runs the call and checks it (see expect_call_result).
inline void run_and_check(Case& c, const CallOptions& options = {}) {
  const Snapshot before = c.snapshot();
  ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params, options));
  expect_call_result(c, before);
}

/// Copies every element of a 1-D or 3-D view into another of the same shape and dtype.
inline void copy_elements(const TensorView& from, const TensorView& to) {
  const size_t es = dtype_size(from.dtype);
  const int64_t H = from.ndim > 1 ? from.shape[1] : 1, D = from.ndim > 2 ? from.shape[2] : 1;
  for (int64_t t = 0; t < from.shape[0]; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) std::memcpy(element(to, t, h, d), element(from, t, h, d), es);
}

/// The bytes of every element of a 3-D view, in row-major element order.
inline std::vector<uint8_t> view_bytes(const TensorView& v) {
  const size_t es = dtype_size(v.dtype);
  std::vector<uint8_t> out;
  out.reserve(size_t(v.numel()) * es);
  for (int64_t t = 0; t < v.shape[0]; ++t)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t d = 0; d < v.shape[2]; ++d) {
        const auto* p = static_cast<const uint8_t*>(element(v, t, h, d));
        out.insert(out.end(), p, p + es);
      }
  return out;
}

/// Number of elements of two same-shaped 3-D views whose bits differ.
inline int64_t count_bit_differences(const TensorView& a, const TensorView& b) {
  int64_t n = 0;
  for (int64_t t = 0; t < a.shape[0]; ++t)
    for (int64_t h = 0; h < a.shape[1]; ++h)
      for (int64_t d = 0; d < a.shape[2]; ++d) n += !same_bits(a, t, h, d, b, t, h, d);
  return n;
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
