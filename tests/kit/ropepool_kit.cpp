#include "ropepool_kit.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>

namespace ropepool::test {

// --- randomness -------------------------------------------------------------------------

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

uint64_t fresh_seed() {
  if (const char* env = std::getenv("ROPEPOOL_TEST_SEED"); env && *env)
    return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t(device()) << 32) ^ uint64_t(device());
}

Rng::Rng(uint64_t seed) : seed_(seed) {
  for (int i = 0; i < 4; ++i) state_[i] = counter_bits(seed, uint64_t(i));
}

int64_t Rng::integer(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(*this);
}

// --- elements ------------------------------------------------------------------------------

std::string shape_str(const TensorView& v) {
  std::string s = "[";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
  return s + "]";
}

void* element(const TensorView& v, int64_t t, int64_t h, int64_t d) {
  int64_t off = t * v.strides[0];
  if (v.ndim > 1) off += h * v.strides[1];
  if (v.ndim > 2) off += d * v.strides[2];
  return static_cast<char*>(v.data) + off * int64_t(dtype_size(v.dtype));
}

double load(const TensorView& v, int64_t t, int64_t h, int64_t d) {
  const void* p = element(v, t, h, d);
  uint32_t u = 0;
  std::memcpy(&u, p, dtype_size(v.dtype));
  switch (v.dtype) {
    case DType::Float32: return bits_float(u);
    case DType::Float16: return half_to_float(uint16_t(u));
    case DType::BFloat16: return bf16_to_float(uint16_t(u));
    default: throw std::logic_error("load: not a float view");
  }
}

void store(const TensorView& v, int64_t t, int64_t h, int64_t d, float value) {
  switch (v.dtype) {
    case DType::Float32: return store_bits(v, t, h, d, float_bits(value));
    case DType::Float16: return store_bits(v, t, h, d, float_to_half(value));
    case DType::BFloat16: return store_bits(v, t, h, d, float_to_bf16(value));
    default: throw std::logic_error("store: not a float view");
  }
}

void store_bits(const TensorView& v, int64_t t, int64_t h, int64_t d, uint64_t bits) {
  std::memcpy(element(v, t, h, d), &bits, dtype_size(v.dtype));  // little-endian: low bytes
}

bool same_bits(const TensorView& a, int64_t ta, int64_t ha, int64_t da, const TensorView& b,
               int64_t tb, int64_t hb, int64_t db) {
  return std::memcmp(element(a, ta, ha, da), element(b, tb, hb, db), dtype_size(a.dtype)) == 0;
}

int64_t index_at(const TensorView& v, int64_t t) {
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

void set_index(const TensorView& v, int64_t t, int64_t value) {
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

TensorView token_slice(TensorView v, int64_t t0, int64_t n) {
  if (v.ndim == 2) {  // mRoPE positions [3, T] (SPEC §7): slice the token dimension
    v.data = static_cast<char*>(v.data) + t0 * v.strides[1] * int64_t(dtype_size(v.dtype));
    v.shape[1] = n;
    return v;
  }
  v.data = element(v, t0);
  v.shape[0] = n;
  return v;
}

float random_value(Rng& rng, DType dtype) {
  const uint64_t r = rng.bits();
  const uint32_t exponent = uint32_t(127 - 6 + (r >> 40) % 9);
  uint32_t mantissa = uint32_t(r) & 0x7fffffu;
  if (dtype == DType::Float16) mantissa &= ~0x1fffu;  // keep the top 10 bits
  if (dtype == DType::BFloat16) mantissa &= ~0xffffu;  // keep the top 7 bits
  return bits_float(uint32_t((r >> 63) << 31) | (exponent << 23) | mantissa);
}

uint64_t nan_pattern(DType dtype, uint64_t r) {
  const bool quiet = (r >> 32) & 1;
  switch (dtype) {
    case DType::Float32: return (r & 0x803fffffu) | 0x7f800000u | (quiet ? 0x400000u : 1u);
    case DType::Float16: return (r & 0x81ffu) | 0x7c00u | (quiet ? 0x200u : 1u);
    default: return (r & 0x803fu) | 0x7f80u | (quiet ? 0x40u : 1u);
  }
}

uint64_t inf_pattern(DType dtype, uint64_t r) {
  const bool negative = r & 1;
  switch (dtype) {
    case DType::Float32: return negative ? 0xff800000u : 0x7f800000u;
    case DType::Float16: return negative ? 0xfc00u : 0x7c00u;
    default: return negative ? 0xff80u : 0x7f80u;
  }
}

void copy_elements(const TensorView& from, const TensorView& to) {
  const size_t es = dtype_size(from.dtype);
  const int64_t H = from.ndim > 1 ? from.shape[1] : 1, D = from.ndim > 2 ? from.shape[2] : 1;
  for (int64_t t = 0; t < from.shape[0]; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) std::memcpy(element(to, t, h, d), element(from, t, h, d), es);
}

std::vector<uint8_t> view_bytes(const TensorView& v) {
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

int64_t count_bit_differences(const TensorView& a, const TensorView& b) {
  int64_t n = 0;
  for (int64_t t = 0; t < a.shape[0]; ++t)
    for (int64_t h = 0; h < a.shape[1]; ++h)
      for (int64_t d = 0; d < a.shape[2]; ++d) n += !same_bits(a, t, h, d, b, t, h, d);
  return n;
}

bool rows_identical(const TensorView& a, int64_t row, const TensorView& b, int64_t b_row) {
  const size_t es = dtype_size(a.dtype);
  for (int64_t h = 0; h < a.shape[1]; ++h) {
    if (a.strides[2] == 1 && b.strides[2] == 1) {
      if (std::memcmp(element(a, row, h, 0), element(b, b_row, h, 0), size_t(a.shape[2]) * es))
        return false;
      continue;
    }
    for (int64_t d = 0; d < a.shape[2]; ++d)
      if (!same_bits(a, row, h, d, b, b_row, h, d)) return false;
  }
  return true;
}

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

namespace {

uint32_t uniform_bits(DType dtype, uint64_t seed, int64_t i, double lo, double hi) {
  const double u = lo + (hi - lo) * (double(counter_bits(seed, uint64_t(i)) >> 11) * 0x1p-53);
  const float f = float(u);
  return dtype == DType::Float32        ? float_bits(f)
         : dtype == DType::Float16      ? float_to_half(f)
         : dtype == DType::Float8E4M3FN ? float_to_e4m3(f)
                                        : float_to_bf16(f);
}

}  // namespace

void fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, double lo, double hi,
                  int threads) {
  const size_t es = dtype_size(dtype);
  parallel_for(count, threads, [&](int64_t b, int64_t e) {
    auto* p = static_cast<uint8_t*>(data);
    for (int64_t i = b; i < e; ++i) {
      const uint32_t bits = uniform_bits(dtype, seed, i, lo, hi);
      std::memcpy(p + size_t(i) * es, &bits, es);
    }
  });
}

bool holds_uniform(const void* data, DType dtype, int64_t i, uint64_t seed, double lo, double hi) {
  const size_t es = dtype_size(dtype);
  uint32_t now = 0;
  std::memcpy(&now, static_cast<const uint8_t*>(data) + size_t(i) * es, es);
  return now == uniform_bits(dtype, seed, i, lo, hi);
}

// --- host memory ------------------------------------------------------------------------------

void HostBuffer::Free::operator()(uint8_t* p) const { std::free(p); }

HostBuffer::HostBuffer(std::string name, DType dtype, int64_t numel, int guard_pages)
    : name_(std::move(name)), dtype_(dtype), numel_(numel) {
  // Page alignment, as framework tensors have (the CPU kernel's non-temporal stores want
  // vector-aligned rows); guards on both sides.
  guard_bytes_ = size_t(guard_pages) * kPage;
  const size_t body = std::max<size_t>(kPage, (bytes() + kPage - 1) / kPage * kPage);
  alloc_bytes_ = guard_bytes_ + body + guard_bytes_;
  storage_.reset(static_cast<uint8_t*>(std::aligned_alloc(kPage, alloc_bytes_)));
  if (!storage_) throw std::bad_alloc();
  base_ = storage_.get() + guard_bytes_;
  std::memset(storage_.get(), 0xa5, guard_bytes_);
  std::memset(base_ + bytes(), 0xa5, alloc_bytes_ - guard_bytes_ - bytes());
}

TensorView HostBuffer::view(std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, int64_t offset,
                            Device device) const {
  return make_view(std::vector<int64_t>(shape), std::vector<int64_t>(strides), offset, device);
}

TensorView HostBuffer::contiguous(std::initializer_list<int64_t> shape, int64_t offset,
                                  Device device) const {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape.begin()[i];
  }
  return make_view(std::vector<int64_t>(shape), strides, offset, device);
}

int64_t HostBuffer::offset_of(const TensorView& v) const {
  const auto* p = static_cast<const uint8_t*>(v.data);
  if (p < base_ || p > base_ + bytes()) return -1;
  return (p - base_) / int64_t(dtype_size(dtype_));
}

std::vector<uint8_t> HostBuffer::snapshot() const {
  return {storage_.get(), storage_.get() + alloc_bytes_};
}

void HostBuffer::restore(const std::vector<uint8_t>& s) {
  std::memcpy(storage_.get(), s.data(), alloc_bytes_);
}

std::vector<int64_t> HostBuffer::changed_elements(const std::vector<uint8_t>& s, size_t most) const {
  std::vector<int64_t> out;
  const uint8_t* now = storage_.get();
  if (std::memcmp(now, s.data(), alloc_bytes_) == 0) return out;
  const size_t es = dtype_size(dtype_);
  for (size_t i = 0; i < alloc_bytes_ && out.size() < most; ++i) {
    if (now[i] == s[i]) continue;
    const bool in_body = i >= guard_bytes_ && i < guard_bytes_ + bytes();
    out.push_back(in_body ? int64_t((i - guard_bytes_) / es) : -1);
    if (in_body) i = guard_bytes_ + (i - guard_bytes_) / es * es + es - 1;  // next element
  }
  return out;
}

void HostBuffer::poison(Rng& rng) {
  const size_t es = dtype_size(dtype_);
  for (int64_t i = 0; i < numel_; ++i) {
    uint64_t bits = rng.bits();
    const uint64_t kind = bits >> 60;  // the element uses at most the low 32 bits
    if (is_float(dtype_) && kind < 8) bits = nan_pattern(dtype_, bits);
    else if (is_float(dtype_) && kind == 8) bits = inf_pattern(dtype_, bits);
    std::memcpy(base_ + size_t(i) * es, &bits, es);  // little-endian: low bytes
  }
}

TensorView HostBuffer::make_view(const std::vector<int64_t>& shape,
                                 const std::vector<int64_t>& strides, int64_t offset,
                                 Device device) const {
  if (shape.size() != strides.size() || shape.size() > size_t(TensorView::kMaxDims))
    throw std::logic_error("view: bad rank");
  TensorView v;
  v.data = base_ + offset * int64_t(dtype_size(dtype_));
  v.dtype = dtype_;
  v.device = device;
  v.ndim = int(shape.size());
  int64_t last = offset;
  bool empty = false;
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = shape[size_t(i)];
    v.strides[i] = strides[size_t(i)];
    if (v.shape[i] == 0) empty = true;
    last += (v.shape[i] - 1) * v.strides[i];
  }
  // An empty view (T = 0) may start past the end: it names no element.
  if (offset < 0 || (!empty && (offset > numel_ || last >= numel_)))
    throw std::logic_error("view outside buffer " + name_);
  return v;
}

// --- a complete call --------------------------------------------------------------------------

const char* name(QkvLayout l) {
  return l == QkvLayout::Contiguous ? "qkv_dense" : l == QkvLayout::Fused ? "qkv_fused" : "qkv_padded";
}
const char* name(PoolLayout l) {
  switch (l) {
    case PoolLayout::Contiguous: return "pool_dense";
    case PoolLayout::LayerOfStack: return "pool_layer";
    case PoolLayout::HeadMajor: return "pool_head_major";
    case PoolLayout::CombinedVllm: return "pool_vllm";
    case PoolLayout::CombinedFlashInfer: return "pool_flashinfer";
  }
  return "?";
}
const char* name(OutLayout l) { return l == OutLayout::Contiguous ? "out_dense" : "out_padded"; }
const char* name(IndexLayout l) {
  return l == IndexLayout::Contiguous ? "index_dense" : "index_strided";
}

RopeScaling scaling_preset(RopeType type, int64_t rotary_dim) {
  RopeScaling s;
  s.type = type;
  switch (type) {
    case RopeType::Default: break;
    case RopeType::Linear: s.factor = 4; break;
    case RopeType::Dynamic:
      s.factor = 2;
      s.max_position_embeddings = 4096;
      s.seq_len = 1 << 20;
      break;
    case RopeType::Yarn:
      s.factor = 4;
      s.original_max_position_embeddings = 4096;
      break;
    case RopeType::Llama3:
      s.factor = 8;
      s.low_freq_factor = 1;
      s.high_freq_factor = 4;
      s.original_max_position_embeddings = 8192;
      break;
    case RopeType::LongRope:
      s.original_max_position_embeddings = 4096;
      s.max_position_embeddings = 131072;
      s.seq_len = 1 << 20;
      for (int64_t i = 0; i < rotary_dim / 2; ++i) {
        s.short_factor.push_back(1.0 + 0.05 * double(i));
        s.long_factor.push_back(1.0 + 0.5 * double(i));
      }
      break;
  }
  return s;
}

Case::Case(const Shape& s0, const Layout& l) : shape(s0), layout(l) {
  Shape& s = shape;
  if (s.pool_dtype == DType::Other) s.pool_dtype = s.dtype;
  if (s.q_out_dtype == DType::Other) s.q_out_dtype = s.dtype;
  const bool paged = s.kv_layout != KvLayout::None;
  if (!paged) s.page_size = 1;
  const int64_t pages = paged ? (s.pool_size + s.page_size - 1) / s.page_size : s.pool_size;
  if (paged) s.pool_size = pages * s.page_size;
  const int64_t T = s.num_tokens, Hq = s.num_qo_heads, Hk = s.num_kv_heads, D = s.head_dim,
                P = s.pool_size, ps = s.page_size, slack = l.tail_slack;
  params.head_dim = D;
  params.num_qo_heads = Hq;
  params.num_kv_heads = Hk;
  params.rope_base = s.rope_base;
  params.rotary_dim = s.rotary_dim;
  params.interleaved = s.interleaved;
  params.rope_scaling = s.rope_scaling;
  params.kv_layout = s.kv_layout;
  for (auto [value, scale, n] : {std::tuple{s.k_scale, &params.k_scale, "k_scale"},
                                 {s.v_scale, &params.v_scale, "v_scale"},
                                 {s.q_scale, &params.q_scale, "q_scale"}}) {
    if (value == 0) continue;
    if (!s.tensor_scales) {
      scale->value = value;
      continue;
    }
    scale->tensor = own(n, DType::Float32, 1 + slack).contiguous({1});
    *static_cast<float*>(scale->tensor.data) = static_cast<float>(value);
  }

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

  // pools: the shape of one pool, its row-major strides, and the other head/row order
  std::vector<int64_t> g, g_strides, other_strides;
  switch (s.kv_layout) {
    case KvLayout::None:
      g = {P, Hk, D}, g_strides = {Hk * D, D, 1};
      other_strides = {D, P * D, 1};  // storage [Hk, P, D]
      break;
    case KvLayout::NHD:
      g = {pages, ps, Hk, D}, g_strides = {ps * Hk * D, Hk * D, D, 1};
      other_strides = {ps * Hk * D, D, ps * D, 1};  // storage [pages, Hk, ps, D]
      break;
    case KvLayout::HND:
      g = {pages, Hk, ps, D}, g_strides = {Hk * ps * D, ps * D, D, 1};
      other_strides = {Hk * ps * D, D, Hk * D, 1};  // storage [pages, ps, Hk, D]
      break;
  }
  const int64_t pool_elems = P * Hk * D, page_elems = ps * Hk * D;
  const DType pd = s.pool_dtype;
  if (l.pool == PoolLayout::CombinedVllm || l.pool == PoolLayout::CombinedFlashInfer) {
    auto& b = own("kv_cache", pd, 2 * pool_elems + slack);
    if (l.pool == PoolLayout::CombinedVllm) {
      // [2, pages, ...]: kv_cache[0], kv_cache[1]
      tensors.k_pool = b.strided(g, g_strides, 0);
      tensors.v_pool = b.strided(g, g_strides, pool_elems);
    } else {
      // [pages, 2, ...]: kv_cache[:, 0], kv_cache[:, 1] (3-D: [P, 2, Hk, D])
      std::vector<int64_t> st = g_strides;
      st[0] = 2 * (paged ? page_elems : Hk * D);
      tensors.k_pool = b.strided(g, st, 0);
      tensors.v_pool = b.strided(g, st, paged ? page_elems : Hk * D);
    }
  } else {
    for (const char* n : {"k_pool", "v_pool"}) {
      TensorView pool;
      switch (l.pool) {
        case PoolLayout::LayerOfStack:
          // Layer 1 of a [3, ...] stacked cache; layers 0 and 2 must stay untouched.
          pool = own(n, pd, 3 * pool_elems + slack).strided(g, g_strides, pool_elems);
          break;
        case PoolLayout::HeadMajor:
          pool = own(n, pd, pool_elems + slack).strided(g, other_strides, 0);
          break;
        default:
          pool = own(n, pd, pool_elems + slack).strided(g, g_strides, 0);
          break;
      }
      (n[0] == 'k' ? tensors.k_pool : tensors.v_pool) = pool;
    }
  }

  // outputs
  if (l.out == OutLayout::Contiguous) {
    tensors.q_out = own("q_out", s.q_out_dtype, T * Hq * D + slack).contiguous({T, Hq, D});
    tensors.k_out = own("k_out", s.dtype, T * Hk * D + slack).contiguous({T, Hk, D});
  } else {
    auto padded = [&](const char* n, int64_t H) -> TensorView {
      const int64_t head = D + 3, row = H * head + 7;
      return own(n, n[0] == 'q' ? s.q_out_dtype : s.dtype, 1 + T * row + slack)
          .view({T, H, D}, {row, head, 1}, 1);
    };
    tensors.q_out = padded("q_out", Hq);
    tensors.k_out = padded("k_out", Hk);
  }
}

void Case::randomize(Rng& rng, double negative_fraction) {
  for (auto& b : buffers_) b->poison(rng);
  // the scale tensors hold their values, not garbage
  for (auto [value, scale] : {std::pair{shape.k_scale, &params.k_scale}, {shape.v_scale, &params.v_scale},
                              {shape.q_scale, &params.q_scale}})
    if (scale->has_tensor()) *static_cast<float*>(scale->tensor.data) = static_cast<float>(value);
  for (const TensorView* x : {&tensors.q, &tensors.k, &tensors.v})
    for (int64_t t = 0; t < x->shape[0]; ++t)
      for (int64_t h = 0; h < x->shape[1]; ++h)
        for (int64_t d = 0; d < x->shape[2]; ++d) store(*x, t, h, d, random_value(rng, shape.dtype));
  randomize_positions(rng);
  randomize_slots(rng, negative_fraction);
}

void Case::randomize_positions(Rng& rng) {
  // The accuracy contract covers |position| < 2^20; the far end is where a float32
  // angle would fail.
  static constexpr int64_t kSpecial[] = {(1 << 20) - 1, 1000003, 0, 1, (1 << 20) - 2, 65536, 524287};
  const int64_t T = num_tokens();
  for (int64_t t = 0; t < T; ++t) set_position(t, rng.integer(0, (1 << 20) - 1));
  for (int64_t i = 0; i < int64_t(std::size(kSpecial)) && i < T; ++i)
    set_position(rng.integer(0, T - 1), kSpecial[i]);
  if (T > 0) set_position(0, kSpecial[0]);
}

void Case::randomize_slots(Rng& rng, double negative_fraction) {
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

Snapshot Case::snapshot() const {
  Snapshot s;
  for (auto& b : buffers_) s.bytes.push_back(b->snapshot());
  return s;
}

void Case::restore(const Snapshot& s) {
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i]->restore(s.bytes[i]);
}

void Case::poison_outputs(Rng& rng) {
  for (auto& b : buffers_)
    if (b->offset_of(tensors.q_out) >= 0 || b->offset_of(tensors.k_out) >= 0) b->poison(rng);
}

const HostBuffer& Case::buffer_of(const TensorView& v) const {
  for (auto& b : buffers_)
    if (b->offset_of(v) >= 0) return *b;
  throw std::logic_error("view of no buffer");
}

HostBuffer& Case::own(const char* n, DType dtype, int64_t numel) {
  buffers_.push_back(std::make_unique<HostBuffer>(n, dtype, numel));
  return *buffers_.back();
}

// --- checks -------------------------------------------------------------------------------------

void CheckStats::merge(const CheckStats& o) {
  elements += o.elements;
  failures += o.failures;
  worst = std::max(worst, o.worst);
  first.insert(first.end(), o.first.begin(), o.first.end());
  std::stable_sort(first.begin(), first.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (first.size() > kKept) first.resize(kKept);
}

void CheckStats::fail(int64_t at, const std::function<std::string()>& describe) {
  ++failures;
  if (first.size() >= kKept && at >= first.back().first) return;
  auto it = std::upper_bound(first.begin(), first.end(), at,
                             [](int64_t a, const auto& e) { return a < e.first; });
  first.insert(it, {at, describe()});
  if (first.size() > kKept) first.pop_back();
}

namespace {

std::string printed(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

/// A [D] norm weight's values.
std::vector<double> weight_values(const TensorView& wv) {
  std::vector<double> w(size_t(wv.shape[0]));
  for (int64_t d = 0; d < wv.shape[0]; ++d) {
    TensorView one = wv;
    one.data = static_cast<char*>(wv.data) + d * wv.strides[0] * int64_t(dtype_size(wv.dtype));
    one.ndim = 3, one.shape[0] = one.shape[1] = one.shape[2] = 1;
    w[size_t(d)] = load(one, 0, 0, 0);
  }
  return w;
}

/// SPEC §7: how far the op's normalised value may be from the float64 reference's y (in
/// `dtype`, weight w): the one ulp a rounding midpoint allows.
double norm_midpoint_ulp(DType dtype, double y, double w, bool gemma) {
  y = std::abs(y), w = std::abs(w);
  // float32: the float32 sum of squares (its order), mean and rsqrt, vs the float64
  // reference, reach every element of the head through up to three roundings: relative 2^-20
  if (dtype == DType::Float32) return std::ldexp(y, -20);
  if (gemma) return reference::tolerance(dtype, y, 0);
  if (w == 0) return 0;  // "rms": w * anything rounds to a zero
  // "rms": the ulp of the normalised value, times w, then the second rounding. The two
  // products round on either side of a power of two when they straddle one: one ulp at the
  // larger one's magnitude (at most y + w ulp + half an ulp of y).
  const double scaled = reference::tolerance(dtype, y / w, 0) * w;
  return scaled + reference::tolerance(dtype, y + scaled + reference::tolerance(dtype, y, 0), 0);
}

/// Token t of x [T, H, D] rotated in float64 (row-major [H, D]); with a norm weight in `how`
/// (SPEC §7) x normalised first (reference::normalize, rounded where §7 rounds), and `slack`
/// per element: the norm's midpoint ulp of the element, and for a rotated element that of its
/// pair's other input and the float32 rotation's 2^-18 (|a| + |b|). Without a norm, slack is
/// all zeros.
std::vector<double> exact_token(const TensorView& x, int64_t t, const TensorView& positions,
                                const RopeSchedule& schedule, bool interleaved, const RotationCheck* how,
                                std::vector<double>& slack) {
  const TensorView xt = token_slice(x, t, 1), pt = token_slice(positions, t, 1);
  const int64_t H = x.shape[1], D = x.shape[2], R = schedule.rotary_dim, half = R / 2;
  slack.assign(size_t(H * D), 0.0);
  if (how == nullptr || how->norm_weight == nullptr) return reference::rotate(xt, pt, schedule, interleaved);
  const std::vector<double> y = reference::normalize(xt, *how->norm_weight, how->norm_eps, how->norm_gemma);
  const std::vector<double> w = weight_values(*how->norm_weight);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) {
      auto mid = [&](int64_t e) { return norm_midpoint_ulp(x.dtype, y[size_t(h * D + e)], w[size_t(e)], how->norm_gemma); };
      double sl = mid(d);
      if (d < R) {
        const int64_t other = interleaved ? (d ^ 1) : d < half ? d + half : d - half;
        sl += mid(other) + std::ldexp(std::abs(y[size_t(h * D + d)]) + std::abs(y[size_t(h * D + other)]), -18);
      }
      slack[size_t(h * D + d)] = sl;
    }
  return reference::rotate(y, 1, H, D, pt, schedule, interleaved);
}

}  // namespace

CheckStats check_rotation(const char* name, const TensorView& x, const TensorView& out,
                          const TensorView& positions, const RopeSchedule& schedule,
                          bool interleaved, const RotationCheck& how) {
  const int64_t H = x.shape[1], D = x.shape[2], R = schedule.rotary_dim, half = R / 2;
  const int64_t t_begin = how.t_begin, t_end = how.t_end < 0 ? x.shape[0] : how.t_end;
  // Chunks of tokens small enough that the reference's float64 result (H*D doubles per
  // token) stays in cache, many enough to balance the threads.
  const int64_t tokens_per_chunk = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * D));
  const int64_t chunks = (t_end - t_begin + tokens_per_chunk - 1) / tokens_per_chunk;
  CheckStats total;
  std::mutex mu;
  parallel_for(chunks, how.threads, [&](int64_t cb, int64_t ce) {
    CheckStats local;
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t b = t_begin + c * tokens_per_chunk;
      const int64_t e = std::min(t_end, b + tokens_per_chunk);
      const TensorView xs = token_slice(x, b, e - b), os = token_slice(out, b, e - b);
      // SPEC §7: with a norm, the rotation's input is the normalised head (float64
      // reference, rounded where §7 rounds), and a pair may differ by the one ulp a
      // rounding midpoint allows (times w for "rms") in each of its normalised inputs.
      std::vector<double> normed;
      std::vector<double> w;
      if (how.norm_weight) {
        normed = reference::normalize(xs, *how.norm_weight, how.norm_eps, how.norm_gemma);
        w = weight_values(*how.norm_weight);
      }
      auto input = [&](int64_t t, int64_t h, int64_t d) {
        return how.norm_weight ? normed[size_t((t * H + h) * D + d)] : load(xs, t, h, d);
      };
      auto midpoint_ulp = [&](int64_t t, int64_t h, int64_t d) {
        if (!how.norm_weight) return 0.0;
        return norm_midpoint_ulp(x.dtype, input(t, h, d), w[size_t(d)], how.norm_gemma);
      };
      const std::vector<double> exact =
          how.norm_weight
              ? reference::rotate(normed, e - b, H, D, token_slice(positions, b, e - b), schedule, interleaved)
              : reference::rotate(xs, token_slice(positions, b, e - b), schedule, interleaved);
      for (int64_t t = 0; t < e - b; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const double want = exact[size_t((t * H + h) * D + d)];
            const double got = load(os, t, h, d);
            // elements past rotary_dim are copied exactly (normalised: up to the midpoint ulp)
            double tol = d < R ? 0 : midpoint_ulp(t, h, d);
            bool ok;
            if (std::isnan(want)) {
              ok = std::isnan(got);
            } else if (std::isinf(want)) {
              ok = got == want;
            } else {
              if (d < R) {
                // the pair's inputs: (d, d +- R/2) NeoX, (d, d ^ 1) GPT-J
                const int64_t other = interleaved ? (d ^ 1) : d < half ? d + half : d - half;
                const double pair = std::abs(input(t, h, d)) + std::abs(input(t, h, other));
                tol = reference::tolerance(out.dtype, want, pair) + midpoint_ulp(t, h, d) +
                      midpoint_ulp(t, h, other);
                if (how.round_to_nearest && out.dtype != DType::Float32) {
                  const double float32_term = std::ldexp(pair, -18);
                  tol = 0.5 * reference::tolerance(out.dtype, std::abs(want) + float32_term, 0) +
                        float32_term;
                }
              }
              const double err = std::abs(got - want);
              // `!(err <= tol)` also catches NaN: a poisoned element the op never wrote.
              ok = err <= tol;
              if (ok && tol > 0) local.worst = std::max(local.worst, err / tol);
            }
            ++local.elements;
            if (!ok)
              local.fail(b + t, [&] {
                return std::string(name) + "[" + std::to_string(b + t) + ", " + std::to_string(h) +
                       ", " + std::to_string(d) + "] = " + printed(got) + ", exact " +
                       printed(want) + " (tolerance " + printed(tol) + "), position " +
                       std::to_string(reference::load_position(positions, mrope_axis(schedule, d < R ? (interleaved ? d / 2 : d % half) : 0), b + t)) +
                       ", " + dtype_name(out.dtype) +
                       (interleaved ? ", GPT-J pairs" : "") + ", rotary_dim " + std::to_string(R);
              });
          }
    }
    std::lock_guard lock(mu);
    total.merge(local);
  });
  return total;
}

CheckStats check_rotation(const char* name, const TensorView& x, const TensorView& out,
                          const TensorView& positions, const RopePoolParams& params,
                          const RotationCheck& how) {
  if (params.schedule)
    return check_rotation(name, x, out, positions, *params.schedule, params.interleaved, how);
  return check_rotation(name, x, out, positions, make_rope_schedule(params), params.interleaved, how);
}

namespace {
uint8_t byte_at(const void* p) { return *static_cast<const uint8_t*>(p); }
/// SPEC §6's e4m3 output `got` of the exact value e (float64) and a scale: a copied element
/// (`rotated` false) is e4m3(float(e) / scale) bit for bit, a rotated one within one e4m3 step of
/// e4m3(e / scale); NaN only where that is NaN. With a norm (SPEC §7) e may be off by `slack`
/// either way, and each bound holds for some value in [e - slack, e + slack] (e4m3 rounding is
/// monotonic, so the ends of the interval bound the codes).
bool e4m3_within(uint8_t got, double e, double slack, float scale, bool rotated) {
  const uint8_t lo = rotated ? float_to_e4m3(float((e - slack) / double(scale))) : float_to_e4m3(float(e - slack) / scale);
  const uint8_t hi = rotated ? float_to_e4m3(float((e + slack) / double(scale))) : float_to_e4m3(float(e + slack) / scale);
  if (!rotated && slack == 0) return got == lo;  // NaN's sign too
  if (e4m3_is_nan(lo) || e4m3_is_nan(hi) || e4m3_is_nan(got))
    return e4m3_is_nan(lo) && e4m3_is_nan(hi) && e4m3_is_nan(got);
  const int step = rotated ? 1 : 0;
  return e4m3_ordinal(got) >= e4m3_ordinal(lo) - step && e4m3_ordinal(got) <= e4m3_ordinal(hi) + step;
}

}  // namespace

CheckStats check_quantized(const char* name, const TensorView& x, const TensorView& out,
                           const TensorView& positions, const RopeSchedule& schedule,
                           bool interleaved, float scale, const RotationCheck* how) {
  const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2], R = schedule.rotary_dim;
  CheckStats stats;
  std::vector<double> slack;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> exact = exact_token(x, t, positions, schedule, interleaved, how, slack);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const double e = exact[size_t(h * D + d)];
        const uint8_t got = byte_at(element(out, t, h, d));
        const uint8_t want = d >= R ? float_to_e4m3(float(e) / scale) : float_to_e4m3(float(e / double(scale)));
        const bool ok = e4m3_within(got, e, slack[size_t(h * D + d)], scale, d < R);
        ++stats.elements;
        if (!ok)
          stats.fail(t, [&] {
            char buf[224];
            std::snprintf(buf, sizeof buf, "%s[%lld, %lld, %lld] = e4m3 0x%02x (%g), want 0x%02x (%g) = e4m3(%.9g / %g)%s",
                          name, (long long)t, (long long)h, (long long)d, got, e4m3_to_float(got), want,
                          e4m3_to_float(want), e, double(scale),
                          slack[size_t(h * D + d)] > 0 ? (", the norm's slack " + printed(slack[size_t(h * D + d)])).c_str() : "");
            return std::string(buf);
          });
      }
  }
  return stats;
}

std::vector<std::string> changes_since(const Case& c, const Snapshot& before) {
  std::vector<std::string> out;
  for (size_t i = 0; i < c.buffers().size(); ++i) {
    const HostBuffer& b = *c.buffers()[i];
    const auto changed = b.changed_elements(before.bytes[i], 1);
    if (!changed.empty())
      out.push_back("buffer " + b.name() + " changed at " +
                    (changed[0] < 0 ? std::string("a guard byte")
                                    : "element " + std::to_string(changed[0])));
  }
  return out;
}

namespace {

/// Marks the elements of pool row `slot` (all heads) in a per-element mask of `b`.
void mark_pool_row(std::vector<bool>& mask, const HostBuffer& b, const TensorView& pool,
                   KvLayout layout, int64_t slot, int64_t H, int64_t D) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) {
      const auto* p = static_cast<const uint8_t*>(reference::pool_element(pool, layout, slot, h, d));
      mask[size_t((p - b.base()) / int64_t(dtype_size(b.dtype())))] = true;
    }
}

/// Marks the elements a view covers (rows `row0..row0+n`) in a per-element mask of `b`.
void mark(std::vector<bool>& mask, const HostBuffer& b, const TensorView& v, int64_t row0,
          int64_t n) {
  const int64_t origin = b.offset_of(v);
  for (int64_t r = row0; r < row0 + n; ++r)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t d = 0; d < v.shape[2]; ++d)
        mask[size_t(origin + r * v.strides[0] + h * v.strides[1] + d * v.strides[2])] = true;
}

}  // namespace

std::vector<std::string> check_call(const Case& c, const Snapshot& before, int threads) {
  std::vector<std::string> problems;
  const RopePoolTensors& x = c.tensors;
  const int64_t T = c.num_tokens(), P = c.shape.pool_size, Hk = x.k.shape[1], D = x.k.shape[2];
  const KvLayout kv_layout = c.params.kv_layout;
  std::vector<std::vector<int64_t>> writers(static_cast<size_t>(P));
  for (int64_t t = 0; t < T; ++t)
    if (const int64_t s = c.slot(t); s >= 0) writers.at(size_t(s)).push_back(t);

  // Bytes outside what the call may write (guards included).
  for (size_t i = 0; i < c.buffers().size(); ++i) {
    const HostBuffer& b = *c.buffers()[i];
    std::vector<bool> may_write(size_t(b.numel()), false);
    for (const TensorView* out : {&x.q_out, &x.k_out})
      if (out->data && b.offset_of(*out) >= 0) mark(may_write, b, *out, 0, out->shape[0]);
    for (const TensorView* pool : {&x.k_pool, &x.v_pool})
      if (b.offset_of(*pool) >= 0)
        for (int64_t s = 0; s < P; ++s)
          if (!writers[size_t(s)].empty()) mark_pool_row(may_write, b, *pool, kv_layout, s, Hk, D);
    int64_t changed = 0;
    for (int64_t e : b.changed_elements(before.bytes[i], size_t(-1))) {
      if (e >= 0 && may_write[size_t(e)]) continue;
      if (++changed <= 3)
        problems.push_back((e < 0 ? std::string("a guard byte") : "element " + std::to_string(e)) +
                           " of buffer " + b.name() + " changed but the call may not write it");
    }
    if (changed > 3)
      problems.push_back(std::to_string(changed) + " elements of " + b.name() +
                         " changed outside the outputs");
  }

  RotationCheck how;
  how.threads = threads;
  how.norm_eps = c.params.norm_eps.value_or(1e-6);  // SPEC §7
  how.norm_gemma = c.params.norm_style.value_or("rms") == "gemma";
  const RopeSchedule schedule =
      c.params.schedule ? *c.params.schedule : make_rope_schedule(c.params);
  // An empty k_out: no k_rot (SPEC §4 return_k_rot=False); the k pool rows are then checked
  // against the float64 rotation below.
  const bool k_rot = x.k_out.data != nullptr || x.k_out.ndim != 0;
  for (auto [name, in, out] : {std::tuple{"q_out", &x.q, &x.q_out}, {"k_out", &x.k, &x.k_out}}) {
    if (out == &x.k_out && !k_rot) continue;
    const TensorView& w = in == &x.q ? c.params.q_norm_weight : c.params.k_norm_weight;
    how.norm_weight = w.data ? &w : nullptr;
    const CheckStats s =
        out->dtype == DType::Float8E4M3FN
            ? check_quantized(name, *in, *out, x.positions, schedule, c.params.interleaved,
                              reference::scale_value(c.params.q_scale), &how)
            : check_rotation(name, *in, *out, x.positions, schedule, c.params.interleaved, how);
    for (const auto& f : s.first) problems.push_back(f.second);
    if (s.failures > int64_t(s.first.size()))
      problems.push_back(std::string(name) + ": " + std::to_string(s.failures) + " of " +
                         std::to_string(s.elements) + " elements out of bound in total");
  }

  // Pool rows: q's dtype: bit-identical to a writer's k_out and v rows; float8_e4m3fn: v
  // bit-exact e4m3(v / v_scale), k within one e4m3 step of e4m3(exact rotated k / k_scale).
  const bool fp8 = x.k_pool.dtype == DType::Float8E4M3FN;
  const float k_scale = reference::scale_value(c.params.k_scale),
              v_scale = reference::scale_value(c.params.v_scale);
  const int64_t R = schedule.rotary_dim;
  auto pool_row_is = [&](const TensorView& pool, int64_t s, const TensorView& from, int64_t t) {
    const size_t es = dtype_size(from.dtype);
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d)
        if (std::memcmp(reference::pool_element(pool, kv_layout, s, h, d), element(from, t, h, d), es))
          return false;
    return true;
  };
  auto fp8_v_row_is = [&](int64_t s, int64_t t) {
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d)
        if (byte_at(reference::pool_element(x.v_pool, kv_layout, s, h, d)) !=
            float_to_e4m3(float(load(x.v, t, h, d)) / v_scale))
          return false;
    return true;
  };
  RotationCheck k_how = how;
  k_how.norm_weight = c.params.k_norm_weight.data ? &c.params.k_norm_weight : nullptr;
  auto fp8_k_row_is = [&](int64_t s, int64_t t) {
    std::vector<double> slack;
    const std::vector<double> exact = exact_token(x.k, t, x.positions, schedule, c.params.interleaved, &k_how, slack);
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const uint8_t got = byte_at(reference::pool_element(x.k_pool, kv_layout, s, h, d));
        if (!e4m3_within(got, exact[size_t(h * D + d)], slack[size_t(h * D + d)], k_scale, d < R)) return false;
      }
    return true;
  };
  // Without k_rot, a k pool row in q's dtype is the float64 rotation of the writer's k
  // within reference::tolerance (check_rotation on the row as a [1, Hk, D] view).
  auto rotated_k_row_is = [&](int64_t s, int64_t t) {
    TensorView row = x.k_pool;
    row.ndim = 3;
    row.data = reference::pool_element(x.k_pool, kv_layout, s, 0, 0);
    row.shape[0] = 1, row.shape[1] = Hk, row.shape[2] = D;
    row.strides[0] = 0;
    row.strides[1] = kv_layout == KvLayout::None  ? x.k_pool.strides[1]
                     : kv_layout == KvLayout::NHD ? x.k_pool.strides[2]
                                                  : x.k_pool.strides[1];
    row.strides[2] = x.k_pool.strides[kv_layout == KvLayout::None ? 2 : 3];
    return check_rotation("k_pool row", token_slice(x.k, t, 1), row, token_slice(x.positions, t, 1),
                          schedule, c.params.interleaved, k_how)
        .ok();
  };
  int64_t bad_rows = 0;
  for (int64_t s = 0; s < P; ++s) {
    const auto& w = writers[size_t(s)];
    if (w.empty()) continue;
    const bool k_ok = std::any_of(w.begin(), w.end(), [&](int64_t t) {
      return fp8 ? fp8_k_row_is(s, t)
             : k_rot ? pool_row_is(x.k_pool, s, x.k_out, t)
                     : rotated_k_row_is(s, t);
    });
    const bool v_ok = std::any_of(w.begin(), w.end(), [&](int64_t t) {
      return fp8 ? fp8_v_row_is(s, t) : pool_row_is(x.v_pool, s, x.v, t);
    });
    if ((!k_ok || !v_ok) && ++bad_rows <= 5)
      problems.push_back("pool row " + std::to_string(s) + " (written by token " +
                         std::to_string(w.front()) + (w.size() > 1 ? " and others" : "") + "): " +
                         (k_ok ? "" : "k_pool row is not a complete k_out row; ") +
                         (v_ok ? "" : "v_pool row is not a complete v row"));
  }
  if (bad_rows > 5) problems.push_back(std::to_string(bad_rows) + " pool rows with wrong contents");
  return problems;
}

std::vector<std::string> check_without_k_rot(Case& c, const Snapshot& before,
                                             const CallOptions& options) {
  const Snapshot with = c.snapshot();
  const TensorView k_out = c.tensors.k_out;
  const HostBuffer* k_buffer = &c.buffer_of(k_out);
  c.restore(before);
  c.tensors.k_out = TensorView{};
  std::vector<std::string> problems;
  try {
    rope_pool_fused(c.tensors, c.params, options);
    for (const std::string& p : check_call(c, before)) problems.push_back("without k_rot: " + p);
  } catch (const std::exception& e) {
    problems.push_back(std::string("without k_rot: the call threw: ") + e.what());
  }
  c.tensors.k_out = k_out;
  const Snapshot without = c.snapshot();
  for (size_t i = 0; i < c.buffers().size(); ++i)
    if (c.buffers()[i].get() != k_buffer && with.bytes[i] != without.bytes[i])
      problems.push_back("without k_rot, buffer " + c.buffers()[i]->name() +
                         " differs from the same call with k_rot");
  return problems;
}

}  // namespace ropepool::test
