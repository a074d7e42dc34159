// CUDA backend of mla_rope_pool_fused (SPEC §8): one launch, a CTA per token.
//
// A CTA builds the token's sin/cos table in shared memory (the angle in double, reduced by a
// two-part 2*pi, as rope_pool_fused's kernel), rotates every q_pe head and the k_pe head in
// units of one 16-byte vector (GPT-J: kVec/2 adjacent pairs; NeoX: a vector and its partner
// R/2 further on), then writes the cache row: kv_c copied (or quantised to e4m3 with the one
// kv_scale) and the rotated k_pe, kept in shared memory as float32 so the fp8 row quantises
// the value before it is rounded to k's dtype. A slot >= the cache size is never written; the
// first one is recorded in the slot-error record rope_pool_fused uses (slot_errors.hpp) and
// reported by the next call. Two tokens of one call naming the same row write it one after
// the other under a per-row lock, so the row is one token's complete row (SPEC §3).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <string>
#include <vector>

#include "../mla_backend.hpp"
#include "angle.cuh"
#include "limits.hpp"
#include "ropepool/error.hpp"
#include "slot_errors.hpp"
#include "vec.cuh"

namespace ropepool::detail {
namespace {

constexpr int kMaxHalf = 256;  // inv_freq by value: rope_dim <= 512 (cuda_limits)
constexpr int kRowLocks = 1 << 16;
static_assert(2 * kMaxHalf == cuda_limits_values::kMaxRotaryDim);

struct MlaParams {
  const void* q_pe;
  const void* k_pe;
  const void* kv_c;
  void* q_out;
  void* k_out;
  void* cache;
  int64_t q_row, q_head, qo_row, qo_head, k_row, ko_row, kv_row;  // elements
  int64_t page_stride, row_stride, page_size, pool_size;          // cache elements
  const void* positions;
  const void* slots;
  int64_t positions_stride, slots_stride, num_tokens;
  int num_heads, rope_dim, latent_dim;
  bool positions_int64, slots_int64, lock_rows;
  float attention_scaling;
  float scale_value;
  const float* scale_ptr;
  cuda::SlotErrorRecord* error_record;
  unsigned long long* error_claim;
  double inv_freq[kMaxHalf];
};

__device__ unsigned int g_mla_row_locks[kRowLocks];

using cuda::angle_sincos;
using cuda::load_index;

// SPEC §6: e4m3(x / scale), the division in float32 (IEEE), round to nearest even, +-448 on
// overflow (infinities included), NaN kept NaN with its sign.
__device__ __forceinline__ uint8_t to_e4m3(float x, float scale) {
  const float v = __fdiv_rn(x, scale);
  if (isnan(v)) return signbit(v) ? 0xff : 0x7f;
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ void record_slot_error(const MlaParams& p, int64_t token, int64_t slot) {
  cuda::SlotErrorRecord* rec = p.error_record;
  if (rec == nullptr) return;
  const unsigned long long acked = *reinterpret_cast<volatile unsigned long long*>(&rec->seq_acked);
  if (atomicCAS(p.error_claim, acked, acked + 1) != acked) return;
  volatile cuda::SlotErrorRecord* r = rec;
  r->token = token;
  r->slot = slot;
  r->pool_size = p.pool_size;
  __threadfence_system();
  r->seq_written = acked + 1;
}

// kN consecutive elements: one 16-byte access (kVector) or kN element accesses.
template <class E, int kN, bool kVector>
struct Chunk {
  using Bits = typename E::Bits;
  static __device__ __forceinline__ void load(const void* base, int64_t offset, float (&f)[kN]) {
    const Bits* p = static_cast<const Bits*>(base) + offset;
    if constexpr (kVector) {
      using IO = cuda::VecIO<E, kN>;
      IO::to_float(IO::load(p), f);
    } else {
      using IO = cuda::VecIO<E, 1>;
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float one[1];
        IO::to_float(IO::load(p + i), one);
        f[i] = one[0];
      }
    }
  }
  static __device__ __forceinline__ void store(void* base, int64_t offset, const float (&f)[kN]) {
    Bits* p = static_cast<Bits*>(base) + offset;
    if constexpr (kVector) {
      using IO = cuda::VecIO<E, kN>;
      IO::store(p, IO::from_float(f));
    } else {
      using IO = cuda::VecIO<E, 1>;
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float one[1] = {f[i]};
        IO::store(p + i, IO::from_float(one));
      }
    }
  }
  static __device__ __forceinline__ void store_e4m3(uint8_t* p, const float (&f)[kN], float scale) {
    uint8_t b[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) b[i] = to_e4m3(f[i], scale);
    if constexpr (kVector && kN == 8) {
      uint2 w;
      memcpy(&w, b, 8);
      *reinterpret_cast<uint2*>(p) = w;
    } else if constexpr (kVector && kN == 4) {
      uint32_t w;
      memcpy(&w, b, 4);
      *reinterpret_cast<uint32_t*>(p) = w;
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) p[i] = b[i];
    }
  }
};

// kN elements per chunk: 16 bytes on the vector path; on the scalar path 2 (one GPT-J pair,
// or one element of each half for NeoX, kN = 1).
template <class E, int kN, bool kVector, bool kGptj, bool kFp8>
__global__ void __launch_bounds__(1024) mla_token_kernel(const __grid_constant__ MlaParams p) {
  using C = Chunk<E, kN, kVector>;
  extern __shared__ float smem[];
  const int R = p.rope_dim, half = R / 2, L = p.latent_dim;
  float* cos_row = smem;
  float* sin_row = smem + half;
  float* k_rot = smem + R;  // the rotated k_pe in float32, for the cache row
  const int64_t t = blockIdx.x;
  const int64_t pos = load_index(p.positions, p.positions_stride, p.positions_int64, t);
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    angle_sincos(pos, p.inv_freq[i], p.attention_scaling, &cos_row[i], &sin_row[i]);
  __syncthreads();

  // Units of one head: GPT-J a chunk of kN/2 pairs; NeoX a chunk at i and its partner at
  // i + R/2. Heads 0..H-1 are q_pe, head H is k_pe.
  const int units = kGptj ? R / kN : half / kN;
  const int total = (p.num_heads + 1) * units;
  for (int u = threadIdx.x; u < total; u += blockDim.x) {
    const int h = u / units, j = u % units;
    const bool is_k = h == p.num_heads;
    const void* src = is_k ? p.k_pe : p.q_pe;
    void* dst = is_k ? p.k_out : p.q_out;
    const int64_t s0 = is_k ? t * p.k_row : t * p.q_row + h * p.q_head;
    const int64_t d0 = is_k ? t * p.ko_row : t * p.qo_row + h * p.qo_head;
    if constexpr (kGptj) {
      float x[kN], y[kN];
      C::load(src, s0 + j * kN, x);
#pragma unroll
      for (int e = 0; e < kN; e += 2) {
        const int i = (j * kN + e) / 2;
        const float a = x[e], b = x[e + 1], c = cos_row[i], s = sin_row[i];
        y[e] = a * c - b * s;
        y[e + 1] = a * s + b * c;
      }
      C::store(dst, d0 + j * kN, y);
      if (is_k)
#pragma unroll
        for (int e = 0; e < kN; ++e) k_rot[j * kN + e] = y[e];
    } else {
      float x[kN], z[kN], y[kN], w[kN];
      C::load(src, s0 + j * kN, x);
      C::load(src, s0 + half + j * kN, z);
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        const int i = j * kN + e;
        const float c = cos_row[i], s = sin_row[i];
        y[e] = x[e] * c - z[e] * s;
        w[e] = x[e] * s + z[e] * c;
      }
      C::store(dst, d0 + j * kN, y);
      C::store(dst, d0 + half + j * kN, w);
      if (is_k)
#pragma unroll
        for (int e = 0; e < kN; ++e) k_rot[j * kN + e] = y[e], k_rot[half + j * kN + e] = w[e];
    }
  }

  const int64_t slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
  if (slot < 0) return;
  if (slot >= p.pool_size) {
    if (threadIdx.x == 0) record_slot_error(p, t, slot);
    return;
  }
  __syncthreads();  // k_rot complete
  __shared__ unsigned int* lock;
  if (p.lock_rows) {
    if (threadIdx.x == 0) {
      lock = &g_mla_row_locks[uint64_t(slot) & (kRowLocks - 1)];
      while (atomicCAS(lock, 0u, 1u) != 0u) __nanosleep(32);
      __threadfence();
    }
    __syncthreads();
  }
  const int64_t row = (slot / p.page_size) * p.page_stride + (slot % p.page_size) * p.row_stride;
  // kv_c, then k_pe_rot, in chunks of kN elements (L and R are multiples of kN).
  const int latent_chunks = L / kN, rope_chunks = R / kN;
  for (int c = threadIdx.x; c < latent_chunks + rope_chunks; c += blockDim.x) {
    float f[kN];
    const int e0 = c * kN;
    if (c < latent_chunks) {
      if constexpr (!kFp8) {  // bit for bit (NaN payloads too): no conversion
        using IO = cuda::VecIO<E, kVector ? kN : 1>;
        auto* out = static_cast<typename E::Bits*>(p.cache) + row + e0;
        const auto* in = static_cast<const typename E::Bits*>(p.kv_c) + t * p.kv_row + e0;
#pragma unroll
        for (int e = 0; e < (kVector ? 1 : kN); ++e) IO::store(out + e, IO::load(in + e));
        continue;
      }
      C::load(p.kv_c, t * p.kv_row + e0, f);
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) f[e] = k_rot[e0 - L + e];
    }
    if constexpr (kFp8) {
      const float scale = p.scale_ptr ? *p.scale_ptr : p.scale_value;
      C::store_e4m3(static_cast<uint8_t*>(p.cache) + row + e0, f, scale);
    } else {
      C::store(p.cache, row + e0, f);  // k_pe_rot, rounded as k_out is
    }
  }
  if (p.lock_rows) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicExch(lock, 0u);
  }
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw BackendError(std::string("mla_rope_pool_fused: CUDA error in ") + what + ": " +
                       cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    switched_ = device != previous_;
    if (switched_) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <class E, int kN, bool kVector, bool kGptj, bool kFp8>
void launch(const MlaProblem& m, const MlaParams& params, cudaStream_t stream) {
  const int units = kGptj ? int(m.rope_dim / kN) : int(m.rope_dim / 2 / kN);
  const int64_t work = std::max<int64_t>((m.num_heads + 1) * units, (m.latent_dim + m.rope_dim) / kN);
  // A thread per unit (up to 1024): a decode step (T = 1) is one chain of memory latencies,
  // and more loads in flight shorten it.
  const int threads = int(std::clamp<int64_t>((work + 31) / 32 * 32, 32, 1024));
  const size_t shared = size_t(2 * m.rope_dim) * sizeof(float);
  mla_token_kernel<E, kN, kVector, kGptj, kFp8>
      <<<dim3(unsigned(m.num_tokens)), dim3(unsigned(threads)), shared, stream>>>(params);
  check(cudaGetLastError(), "mla_token_kernel launch");
}

template <class E>
void launch_dtype(const MlaProblem& m, const MlaParams& params, cudaStream_t stream) {
  constexpr int kVec = 16 / E::kBytes;
  const int64_t es = E::kBytes;
  const bool fp8 = m.cache_dtype == DType::Float8E4M3FN;
  const int64_t T = m.num_tokens, H = m.num_heads;
  auto ok = [&](const void* base, int64_t stride, int64_t extent, int64_t elem) {
    return aligned(base, 16) && (extent <= 1 || (stride * elem) % 16 == 0);
  };
  // 16-byte accesses everywhere, and a chunk never straddles a pair half or the row's parts.
  const int64_t cache_es = fp8 ? 1 : es;
  const bool vector =
      (m.interleaved ? m.rope_dim % kVec : (m.rope_dim / 2) % kVec) == 0 &&
      m.latent_dim % kVec == 0 && ok(m.q_pe.data, m.q_pe.row_stride, T, es) &&
      ok(m.q_pe.data, m.q_pe.head_stride, H, es) && ok(m.q_out.data, m.q_out.row_stride, T, es) &&
      ok(m.q_out.data, m.q_out.head_stride, H, es) && ok(m.k_pe.data, m.k_pe.row_stride, T, es) &&
      ok(m.k_out.data, m.k_out.row_stride, T, es) && ok(m.kv_c.data, m.kv_c.row_stride, T, es) &&
      aligned(m.cache.data, 16) && (m.cache.page_stride * cache_es) % (kVec * cache_es) == 0 &&
      (m.cache.row_stride * cache_es) % (kVec * cache_es) == 0 &&
      (fp8 || ((m.cache.page_stride * es) % 16 == 0 && (m.cache.row_stride * es) % 16 == 0));
  if (vector) {
    if (m.interleaved)
      return fp8 ? launch<E, kVec, true, true, true>(m, params, stream)
                 : launch<E, kVec, true, true, false>(m, params, stream);
    return fp8 ? launch<E, kVec, true, false, true>(m, params, stream)
               : launch<E, kVec, true, false, false>(m, params, stream);
  }
  // Scalar path: GPT-J chunks are one pair; NeoX chunks one element of each half. The cache
  // part is written in chunks of the same size, so L must be a multiple of it (always for
  // NeoX; for GPT-J L is even in every MLA model, and odd L is refused below).
  if (m.interleaved) {
    if (m.latent_dim % 2 != 0)
      throw BackendError("mla_rope_pool_fused: the CUDA scalar path needs an even kv_lora_rank");
    return fp8 ? launch<E, 2, false, true, true>(m, params, stream)
               : launch<E, 2, false, true, false>(m, params, stream);
  }
  return fp8 ? launch<E, 1, false, false, true>(m, params, stream)
             : launch<E, 1, false, false, false>(m, params, stream);
}

}  // namespace

void mla_rope_pool_cuda(const MlaProblem& m) {
  assert(m.rope_dim / 2 <= kMaxHalf);
  const int device = cuda_slot_errors::device_of(m.q_pe.data);
  DeviceGuard guard(device);
  cuda_slot_errors::report_pending(device);
  const auto stream = static_cast<cudaStream_t>(m.stream);
  const int64_t T = m.num_tokens;
  if (m.check_slots) {
    // SPEC §3 exactly as on the CPU, for one synchronisation: a host copy of the slots.
    const size_t es = m.slots.is_int64 ? 8 : 4;
    std::vector<unsigned char> bytes(size_t(T) * es);
    const char* src = static_cast<const char*>(m.slots.data);
    if (m.slots.stride >= 1)
      check(cudaMemcpy2DAsync(bytes.data(), es, src, size_t(m.slots.stride) * es, es, size_t(T),
                              cudaMemcpyDeviceToHost, stream),
            "cudaMemcpy2DAsync (slots)");
    else  // a reversed or broadcast view: one entry at a time
      for (int64_t t = 0; t < T; ++t)
        check(cudaMemcpyAsync(bytes.data() + t * es, src + t * m.slots.stride * int64_t(es), es,
                              cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync (slots)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check_slots)");
    mla_check_slot_values(Index{bytes.data(), 1, m.slots.is_int64}, T, m.pool_size, true);
  }
  MlaParams p{};
  p.q_pe = m.q_pe.data, p.k_pe = m.k_pe.data, p.kv_c = m.kv_c.data;
  p.q_out = m.q_out.data, p.k_out = m.k_out.data, p.cache = m.cache.data;
  p.q_row = m.q_pe.row_stride, p.q_head = m.q_pe.head_stride;
  p.qo_row = m.q_out.row_stride, p.qo_head = m.q_out.head_stride;
  p.k_row = m.k_pe.row_stride, p.ko_row = m.k_out.row_stride, p.kv_row = m.kv_c.row_stride;
  p.page_stride = m.cache.page_stride, p.row_stride = m.cache.row_stride;
  p.page_size = m.page_size, p.pool_size = m.pool_size;
  p.positions = m.positions.data, p.positions_stride = m.positions.stride;
  p.positions_int64 = m.positions.is_int64;
  p.slots = m.slots.data, p.slots_stride = m.slots.stride, p.slots_int64 = m.slots.is_int64;
  p.num_tokens = T, p.num_heads = int(m.num_heads);
  p.rope_dim = int(m.rope_dim), p.latent_dim = int(m.latent_dim);
  p.lock_rows = T > 1;
  p.attention_scaling = float(m.attention_scaling);
  p.scale_value = m.kv_scale.value, p.scale_ptr = m.kv_scale.ptr;
  p.error_record = cuda_slot_errors::record(device);
  p.error_claim = cuda_slot_errors::claim(device);
  for (int64_t i = 0; i < m.rope_dim / 2; ++i) p.inv_freq[i] = m.inv_freq[i];
  switch (m.dtype) {
    case DType::Float32: return launch_dtype<cuda::F32>(m, p, stream);
    case DType::Float16: return launch_dtype<cuda::F16>(m, p, stream);
    case DType::BFloat16: return launch_dtype<cuda::BF16>(m, p, stream);
    default: throw BackendError("mla_rope_pool_fused: unsupported dtype reached the CUDA backend");
  }
}

}  // namespace ropepool::detail
