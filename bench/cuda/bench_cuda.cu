// Benchmark of the CUDA kernel alone (no Python): the default workload (Llama-3-8B: bf16,
// Hq 32, Hk 8, D 128) at T = 1..65536 (or --tokens), with the inputs of bench/gpu_bench.py
// (cold: input sets over 4x the L2; random slots in a 262144-row cache); GPU time per call
// back-to-back on a plain stream (host enqueueing hidden behind a spin kernel) and under
// CUDA-graph replay, with and without PDL and row deduplication; medians of 60; the host
// time of one public rope_pool_fused call at T = 1 (wall clock, no synchronisation); the
// device-to-device copy as the ceiling.
//
//   ropepool_bench_cuda [--sweep] [--pools] [--pool-filter S] [--mla] [--mla-shapes]
//                       [--tokens T1,T2,..] [--json FILE]
//
// --sweep  also the same workload over launch shapes (warps per CTA), to tune the heuristic
//          in src/cuda/rope_pool_cuda.cu.
// --pools  also the SPEC §6 caches: fp8 e4m3 pools (scale values and device pointers), fp8
//          q_out, NHD and HND pools of page size 1, 16 and 64, beside the [P, Hk, D] bf16 pool
//          of the same run; bytes counted at each tensor's element size. The fp8 cases run
//          with scales that are not powers of two, and three of them again with powers of two.
//          Two cases also without k_rot (SPEC §4 return_k_rot=False: a null k_out, bytes
//          without the k_rot write), each after its case with k_rot: the bf16 [P, Hk, D] pool
//          and NHD page 16 fp8 with fp8 q_out (the like-for-like of FlashInfer's
//          rope_quantize_fp8_append_paged_kv_cache, which writes no k_rot). At T <= 256 each
//          case also runs on the head kernel at 2, 4 and 8 warps per CTA (and, where the plan
//          takes the head kernel, on the token kernel), in the same run. At T <= 256 each is
//          also timed alone: one call between the events after the spin, with no launch of
//          its own before it to overlap with (the per-call mode of bench/gpu_bench.py), beside
//          an empty kernel timed the same way.
// --pool-filter S  only the cases of --pools whose name contains S (e.g. "qk-norm", "HND"),
//          and the [P, Hk, D] bf16 pool they are compared with.
// --mla    also mla_rope_pool_fused (SPEC §8) on bench/gpu_bench_mla.py's inputs (DeepSeek-V3,
//          H = 128 and 16, bf16 and fp8 token caches) through the public C++ call, and at
//          T <= 256 with CTAs of 1 to 4 warps forced and with 2, 4 and 8 q units per lane
//          forced, in the same run; from T = 1024 beside a cold device-to-device copy of the
//          call's own bytes, back-to-back and alone (the ceiling at that size).
// --mla-shapes  the forced CTA shapes and q units of --mla at every T, not only T <= 256
//          (back-to-back and alone; graphs only at T <= 256).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ropepool/half.hpp"
#include "ropepool/mla.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"
#include "ropepool_kit.hpp"
#include "ropepool_kit_cuda.hpp"
#include "test_hooks.hpp"

using namespace ropepool;
using namespace ropepool::test;

namespace {

std::string g_json;

// ---- benchmark ---------------------------------------------------------------------------------

/// Fills n bf16 values uniform in [-2, 2) from a hash of (seed, index): on the device, so
/// gigabytes of cold input sets take milliseconds to make.
__global__ void fill_bf16(uint16_t* out, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31, h *= 0xBF58476D1CE4E5B9ull, h ^= h >> 29;
    const float u = float(h >> 40) * (1.0f / 16777216.0f) * 4.0f - 2.0f;
    out[i] = uint16_t(__float_as_uint(u) >> 16);  // truncation: any bf16 in range will do
  }
}

/// A device buffer of `elems` bf16 values of filler (fill_bf16).
std::unique_ptr<DeviceBuffer> filled_bf16(int64_t elems, Rng& rng) {
  auto b = std::make_unique<DeviceBuffer>(size_t(elems) * 2);
  fill_bf16<<<1024, 256>>>(static_cast<uint16_t*>(b->ptr), size_t(elems), rng());
  ROPEPOOL_CUDA_OK(cudaGetLastError());
  return b;
}

/// int32 positions (random below 2^17) and slots for n_sets input sets of T tokens on the
/// device: each set's slots T distinct rows of a P-row cache, consecutive windows of random
/// permutations.
void positions_and_slots(Rng& rng, int64_t n_sets, int64_t T, int64_t P, std::unique_ptr<DeviceBuffer>& pos,
                         std::unique_ptr<DeviceBuffer>& slots) {
  const int64_t rows = n_sets * T;
  std::vector<int32_t> h_pos(static_cast<size_t>(rows)), h_slots(static_cast<size_t>(rows)), perm(static_cast<size_t>(P));
  for (auto& x : h_pos) x = int32_t(rng() % 131072);
  const int64_t per_perm = P / T;
  for (int64_t set = 0; set < n_sets; ++set) {
    if (set % per_perm == 0) {
      for (int64_t r = 0; r < P; ++r) perm[size_t(r)] = int32_t(r);
      std::shuffle(perm.begin(), perm.end(), rng);
    }
    std::copy_n(perm.begin() + (set % per_perm) * T, T, h_slots.begin() + set * T);
  }
  pos = std::make_unique<DeviceBuffer>(size_t(rows) * 4);
  slots = std::make_unique<DeviceBuffer>(size_t(rows) * 4);
  ROPEPOOL_CUDA_OK(cudaMemcpy(pos->ptr, h_pos.data(), pos->bytes, cudaMemcpyHostToDevice));
  ROPEPOOL_CUDA_OK(cudaMemcpy(slots->ptr, h_slots.data(), slots->bytes, cudaMemcpyHostToDevice));
  ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
}

/// The benchmark's inputs, as bench/gpu_bench.py makes them (docs/PERFORMANCE.md, Method):
/// N input sets for T tokens, N chosen so that one pass over them exceeds 4x the L2 (at
/// least 20, for graphs of 20 calls on 20 different sets, where graphs are timed); set i is
/// rows [iT, (i+1)T) of one buffer per argument. Positions random below 2^17; slots T
/// distinct rows of a 262144-row cache, consecutive windows of random permutations.
/// The cache a workload writes (SPEC §6): layout, page size, fp8 pools and q_out.
struct PoolSpec {
  enum Layout { Flat, NHD, HND } layout = Flat;  ///< Flat: [P, Hk, D]
  int64_t page_size = 1;
  bool fp8_pool = false, fp8_q = false;
  bool scale_ptrs = false;  ///< scales as device float32 (read by the kernel) instead of values
  /// Scales 0.5 / 0.25 / 0.125 (k, v, q: powers of two, which skip the division's Newton
  /// steps) instead of 0.05 / 0.0375 / 0.02.
  bool pow2_scales = false;
  /// false: no k_rot (SPEC §4 return_k_rot=False): a null k_out, nothing written there.
  bool k_rot = true;
  /// SPEC §7's QK norm ("rms", bf16 weights for q and k: Qwen3's), in the main kernel.
  bool qk_norm = false;
  const float* scale_values() const {
    static const float pow2[3] = {0.5f, 0.25f, 0.125f}, other[3] = {0.05f, 0.0375f, 0.02f};
    return pow2_scales ? pow2 : other;
  }
  std::string name() const {
    std::string n = layout == Flat ? "[P,Hk,D]" : layout == NHD ? "NHD" : "HND";
    if (layout != Flat) n += " ps=" + std::to_string(page_size);
    n += fp8_pool ? " fp8" : " bf16";
    if (fp8_pool) n += scale_ptrs ? " (scale ptrs)" : " (scale values)";
    if (fp8_q) n += ", q_out fp8";
    if ((fp8_pool || fp8_q) && pow2_scales) n += ", 2^-k scales";
    if (!k_rot) n += ", no k_rot";
    if (qk_norm) n += ", qk-norm";
    return n;
  }
};

struct Workload {
  int64_t T, P = 262144, Hq = 32, Hk = 8, D = 128, n_sets = 0;
  DType dtype = DType::BFloat16;
  PoolSpec pool;
  std::unique_ptr<DeviceBuffer> q, k, v, pos, slots, q_out, k_out, k_pool, v_pool, scales, norm_w;
  RopePoolParams params;
  std::vector<double> inv_freq;
  /// Bytes one call moves, each tensor at its own element size: q, k, v read; q_out, k_out
  /// (not without k_rot) written; one k and one v pool row written per token; int32
  /// positions and slots read; the QK norm's two weights read.
  double bytes() const {
    const double es = 2, pool_es = pool.fp8_pool ? 1 : 2, q_out_es = pool.fp8_q ? 1 : 2;
    const double k_es = pool.k_rot ? 3 * es : 2 * es;  // k, v read; k_out written
    return double(T) * D * (Hq * (es + q_out_es) + Hk * (k_es + 2 * pool_es)) + 2.0 * 4 * T +
           (pool.qk_norm ? 2.0 * D * es : 0.0);
  }
  Workload(int64_t tokens, bool with_graphs, Rng& rng, const PoolSpec& spec = {}) : T(tokens), pool(spec) {
    P = std::max<int64_t>(P, T);
    params.head_dim = D, params.num_qo_heads = Hq, params.num_kv_heads = Hk, params.rope_base = 500000;
    cudaDeviceProp prop{};
    ROPEPOOL_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    const double set_bytes = double(T) * D * 2 * (Hq + 2 * Hk) + 2.0 * 4 * T;
    n_sets = std::max<int64_t>(with_graphs ? 20 : 2,
                               int64_t(std::ceil(4.0 * prop.l2CacheSize / set_bytes)));
    const int64_t rows = n_sets * T;
    auto filled = [&](int64_t elems) { return filled_bf16(elems, rng); };
    q = filled(rows * Hq * D), k = filled(rows * Hk * D), v = filled(rows * Hk * D);
    P = (P + pool.page_size - 1) / pool.page_size * pool.page_size;
    // An fp8 pool: half as many bf16 elements of filler (any bytes will do).
    k_pool = filled(P * Hk * D / (pool.fp8_pool ? 2 : 1)), v_pool = filled(P * Hk * D / (pool.fp8_pool ? 2 : 1));
    q_out = std::make_unique<DeviceBuffer>(size_t(rows * Hq * D) * (pool.fp8_q ? 1 : 2));
    scales = std::make_unique<DeviceBuffer>(3 * sizeof(float));
    ROPEPOOL_CUDA_OK(cudaMemcpy(scales->ptr, pool.scale_values(), 3 * sizeof(float), cudaMemcpyHostToDevice));
    if (pool.k_rot) k_out = std::make_unique<DeviceBuffer>(size_t(rows * Hk * D) * 2);
    positions_and_slots(rng, n_sets, T, P, pos, slots);
    if (pool.qk_norm) norm_w = filled(2 * D);  // q's weight, then k's
    inv_freq = make_rope_schedule(params).inv_freq;
  }
  detail::RopePoolProblem problem(int64_t i, cudaStream_t stream) const {
    const int64_t row = (i % n_sets) * T;
    auto at = [&](const std::unique_ptr<DeviceBuffer>& b, int64_t heads, size_t elem) {
      return b->bytes_at(size_t(row * heads * D) * elem);
    };
    detail::RopePoolProblem p;
    p.dtype = dtype, p.num_tokens = T, p.num_qo_heads = Hq, p.num_kv_heads = Hk, p.head_dim = D;
    p.rotary_dim = D, p.pool_size = P;
    p.q = {at(q, Hq, 2), Hq * D, D}, p.k = {at(k, Hk, 2), Hk * D, D}, p.v = {at(v, Hk, 2), Hk * D, D};
    p.q_out = {at(q_out, Hq, pool.fp8_q ? 1 : 2), Hq * D, D};
    if (pool.k_rot) p.k_out = {at(k_out, Hk, 2), Hk * D, D};  // else null: no k_rot
    const int64_t ps = pool.page_size;
    switch (pool.layout) {
      case PoolSpec::Flat:
        p.k_pool = {k_pool->ptr, Hk * D, 0, D}, p.v_pool = {v_pool->ptr, Hk * D, 0, D};
        break;
      case PoolSpec::NHD:  // [pages, ps, Hk, D]
        p.k_pool = {k_pool->ptr, ps * Hk * D, Hk * D, D}, p.v_pool = {v_pool->ptr, ps * Hk * D, Hk * D, D};
        break;
      case PoolSpec::HND:  // [pages, Hk, ps, D]
        p.k_pool = {k_pool->ptr, Hk * ps * D, D, ps * D}, p.v_pool = {v_pool->ptr, Hk * ps * D, D, ps * D};
        break;
    }
    p.page_size = pool.layout == PoolSpec::Flat ? 1 : ps;
    p.pool_dtype = pool.fp8_pool ? DType::Float8E4M3FN : dtype;
    p.q_out_dtype = pool.fp8_q ? DType::Float8E4M3FN : dtype;
    const float* sp = static_cast<const float*>(scales->ptr);
    const float* values = pool.scale_values();
    detail::Scale* s3[3] = {&p.k_scale, &p.v_scale, &p.q_scale};
    for (int j = 0; j < 3; ++j) *s3[j] = pool.scale_ptrs ? detail::Scale{1.0f, sp + j} : detail::Scale{values[j], nullptr};
    p.positions = {pos->bytes_at(size_t(row) * 4), 1, false};
    p.slots = {slots->bytes_at(size_t(row) * 4), 1, false};
    p.inv_freq = inv_freq.data();
    if (pool.qk_norm) {
      p.q_norm_weight = norm_w->ptr, p.k_norm_weight = norm_w->bytes_at(size_t(D) * 2);
      p.q_norm_dtype = p.k_norm_dtype = dtype;
    }
    p.stream = stream;
    return p;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// Spins for about `ns` nanoseconds of GPU time: queued before a timed batch, it keeps the
/// GPU busy while the host enqueues the batch, so the events time the GPU, not the host.
__global__ void spin_kernel(long long ns) {
  const long long end = ns + [] {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }();
  for (;;) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t >= end) break;
  }
}

/// Events around `enqueue()` with the host's enqueueing hidden behind a spin; returns the
/// seconds between the events and doubles `spin_ns` (and retries) whenever the GPU reached
/// the first event before the host had finished enqueueing.
template <class F>
double timed_on_gpu(cudaStream_t s, long long& spin_ns, F&& enqueue) {
  cudaEvent_t a, b;
  ROPEPOOL_CUDA_OK(cudaEventCreate(&a));
  ROPEPOOL_CUDA_OK(cudaEventCreate(&b));
  double seconds = 0;
  for (int attempt = 0;; ++attempt) {
    spin_kernel<<<1, 1, 0, s>>>(spin_ns);
    ROPEPOOL_CUDA_OK(cudaEventRecord(a, s));
    enqueue();
    ROPEPOOL_CUDA_OK(cudaEventRecord(b, s));
    const bool host_kept_up = cudaEventQuery(a) == cudaErrorNotReady;
    ROPEPOOL_CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    ROPEPOOL_CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    seconds = ms * 1e-3;
    if (host_kept_up || attempt == 4) break;
    spin_ns *= 2;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return seconds;
}

/// Median GPU seconds per call over `batches` batches of `per_batch` back-to-back calls;
/// `call(i)` makes the call on input set i (the caller's rotation over its sets).
template <class F>
double stream_median(cudaStream_t s, F&& call, int batches, int per_batch) {
  int64_t i = 0;
  for (int k = 0; k < 5; ++k) call(i++);
  long long spin_ns = 200000;
  std::vector<double> t;
  for (int r = 0; r < batches; ++r)
    t.push_back(timed_on_gpu(s, spin_ns, [&] {
                  for (int k = 0; k < per_batch; ++k) call(i++);
                }) / per_batch);
  return median(t);
}

/// Median GPU seconds per call over `batches` batches of `per_batch` back-to-back calls,
/// inputs rotating among the workload's sets.
double time_stream(const Workload& w, const detail::cuda_launch::LaunchConfig& cfg, cudaStream_t s,
                   int batches = 60, int per_batch = 20) {
  return stream_median(
      s, [&](int64_t i) { detail::cuda_launch::rope_pool_cuda_with(w.problem(i, s), cfg); }, batches, per_batch);
}

/// Median GPU seconds per call of CUDA graphs of `calls` calls on `calls` different input
/// sets out of `n_sets` (`call(i)` on set i): as many graphs as the cold rotation needs,
/// replayed in turn.
template <class F>
double graph_median(cudaStream_t s, F&& call, int64_t n_sets, int calls = 20, int reps = 60) {
  const int64_t n_graphs = std::max<int64_t>(1, n_sets / calls);
  std::vector<cudaGraphExec_t> execs;
  call(0);
  ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
  for (int64_t gi = 0; gi < n_graphs; ++gi) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    ROPEPOOL_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < calls; ++k) call(gi * calls + k);
    ROPEPOOL_CUDA_OK(cudaStreamEndCapture(s, &g));
    ROPEPOOL_CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    cudaGraphDestroy(g);
    execs.push_back(ge);
  }
  for (int64_t k = 0; k < std::min<int64_t>(3, n_graphs); ++k)
    ROPEPOOL_CUDA_OK(cudaGraphLaunch(execs[size_t(k)], s));
  long long spin_ns = 50000;
  std::vector<double> t;
  for (int r = 0; r < reps; ++r)
    t.push_back(timed_on_gpu(s, spin_ns, [&] {
                  ROPEPOOL_CUDA_OK(cudaGraphLaunch(execs[size_t((3 + r) % n_graphs)], s));
                }) / calls);
  for (cudaGraphExec_t ge : execs) cudaGraphExecDestroy(ge);
  return median(t);
}

double time_graph(const Workload& w, cudaStream_t s, const detail::cuda_launch::LaunchConfig& cfg = {},
                  int calls = 20, int reps = 60) {
  return graph_median(
      s, [&](int64_t i) { detail::cuda_launch::rope_pool_cuda_with(w.problem(i, s), cfg); }, w.n_sets, calls, reps);
}

__global__ void empty_kernel() {}
/// As big as the kernel's parameter block for head_dim 128 (inv_freq travels by value).
struct BigParams {
  double d[96];
};
__global__ void empty_kernel_big_params(const __grid_constant__ BigParams) {}

/// Per-node time of a graph of 20 empty kernels: what launching costs in a graph (with
/// `big`: a 768-byte parameter block, like the ropepool kernel's).
double empty_graph_us(cudaStream_t s, bool big = false) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  ROPEPOOL_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < 20; ++k) {
    if (big) empty_kernel_big_params<<<1, 32, 0, s>>>(BigParams{{double(k)}});
    else empty_kernel<<<1, 32, 0, s>>>();
  }
  ROPEPOOL_CUDA_OK(cudaStreamEndCapture(s, &g));
  ROPEPOOL_CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
  for (int k = 0; k < 3; ++k) ROPEPOOL_CUDA_OK(cudaGraphLaunch(ge, s));
  long long spin_ns = 50000;
  std::vector<double> t;
  for (int r = 0; r < 30; ++r)
    t.push_back(timed_on_gpu(s, spin_ns, [&] { ROPEPOOL_CUDA_OK(cudaGraphLaunch(ge, s)); }) / 20);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return median(t);
}

double copy_bandwidth(cudaStream_t s) {
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer src(bytes), dst(bytes);
  ROPEPOOL_CUDA_OK(cudaMemset(src.ptr, 1, bytes));
  cudaEvent_t a, b;
  ROPEPOOL_CUDA_OK(cudaEventCreate(&a));
  ROPEPOOL_CUDA_OK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < 12; ++r) {
    ROPEPOOL_CUDA_OK(cudaEventRecord(a, s));
    ROPEPOOL_CUDA_OK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, s));
    ROPEPOOL_CUDA_OK(cudaEventRecord(b, s));
    ROPEPOOL_CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    ROPEPOOL_CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) t.push_back(ms * 1e-3);
  }
  return 2.0 * double(bytes) / median(t);  // read + write
}

/// Host microseconds per call of the public C++ API at T = 1 (validation, launch; no
/// synchronisation): the wall time of 400 calls in a row over one input set, on a stream the
/// GPU keeps up with. The Python front end's host time (bench/gpu_bench.py) is measured the
/// same way, so the two compare directly.
double host_us_public_call(cudaStream_t s, Rng& rng) {
  Workload w(1, false, rng);
  const detail::RopePoolProblem p = w.problem(0, s);
  const Device dev{DeviceType::CUDA, 0};
  auto view = [&](const void* data, DType dtype, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(const_cast<void*>(data), dtype, shape, dev);
  };
  const int64_t T = 1, Hq = w.Hq, Hk = w.Hk, D = w.D;
  RopePoolTensors t;
  t.q = view(p.q.data, w.dtype, {T, Hq, D}), t.k = view(p.k.data, w.dtype, {T, Hk, D});
  t.v = view(p.v.data, w.dtype, {T, Hk, D});
  t.positions = view(p.positions.data, DType::Int32, {T});
  t.slots = view(p.slots.data, DType::Int32, {T});
  t.k_pool = view(w.k_pool->ptr, w.dtype, {w.P, Hk, D}), t.v_pool = view(w.v_pool->ptr, w.dtype, {w.P, Hk, D});
  t.q_out = view(p.q_out.data, w.dtype, {T, Hq, D}), t.k_out = view(p.k_out.data, w.dtype, {T, Hk, D});
  RopePoolParams params = w.params;
  CallOptions options;
  options.stream = s;
  for (int i = 0; i < 20; ++i) rope_pool_fused(t, params, options);
  ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
  const int calls = 400;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) rope_pool_fused(t, params, options);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
  return us / calls;
}

void bench(bool sweep, const std::vector<int64_t>& tokens, Rng& rng) {
  cudaStream_t s;
  ROPEPOOL_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy = copy_bandwidth(s);
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy / 1e9);
  const double floor_us = empty_graph_us(s) * 1e6;
  std::printf("graph replay of an empty kernel: %.2f us per node (the floor); with a 768-byte "
              "parameter block: %.2f us\n", floor_us, empty_graph_us(s, true) * 1e6);
  g_json += "{\"copy_GBps\": " + std::to_string(copy / 1e9) +
            ", \"empty_graph_us\": " + std::to_string(floor_us) + ", \"rows\": [";
  std::printf("%8s %10s %9s %7s %10s %10s %14s  %s\n", "T", "us/call", "GB/s", "%copy", "graph us",
              "no-dedup us", "plan", "PDL off: us | graph us; best sweep (us)");
  bool first_row = true;
  for (int64_t T : tokens) {
    Workload w(T, T <= 256, rng);
    detail::cuda_launch::LaunchConfig def;
    const auto plan = detail::cuda_launch::plan_launch(w.problem(0, s), def);
    const double t = time_stream(w, def, s);
    detail::cuda_launch::LaunchConfig nolock;
    nolock.dedupe_rows = false;
    const double tn = time_stream(w, nolock, s);
    const double tg = T <= 256 ? time_graph(w, s) : 0;
    std::string best;
    {
      detail::cuda_launch::LaunchConfig off;
      off.pdl = -1;
      char b[100];
      std::snprintf(b, sizeof b, "%.2f | %.2f; ", time_stream(w, off, s) * 1e6,
                    T <= 256 ? time_graph(w, s, off) * 1e6 : 0.0);
      best = b;
    }
    if (sweep) {
      // Warps per CTA: graph replay time for T <= 256 (decode: latency), plain-stream time
      // above; the three fastest.
      std::vector<std::pair<double, std::string>> tried;
      for (int warps : {1, 2, 3, 4, 6, 8}) {
        detail::cuda_launch::LaunchConfig c;
        c.warps_per_cta = warps;
        const double tc = T <= 256 ? time_graph(w, s, c) : time_stream(w, c, s, 7, 10);
        tried.emplace_back(tc, std::to_string(warps) + " warps");
      }
      std::sort(tried.begin(), tried.end());
      best += T <= 256 ? "graph " : "stream ";
      for (size_t k = 0; k < tried.size() && k < 3; ++k) {
        char b[60];
        std::snprintf(b, sizeof b, "%s%s: %.2f", k ? ", " : "", tried[k].second.c_str(), tried[k].first * 1e6);
        best += b;
      }
    }
    char pl[32];
    std::snprintf(pl, sizeof pl, "%s%d warps", plan.head_kernel ? "head " : "", plan.config.warps_per_cta);
    const double gbps = w.bytes() / t;
    std::printf("%8lld %10.2f %9.0f %6.1f%% %10.2f %10.2f %14s  %s\n", (long long)T, t * 1e6, gbps / 1e9,
                100 * gbps / copy, tg * 1e6, tn * 1e6, pl, best.c_str());
    char js[600];
    std::snprintf(js, sizeof js,
                  "%s{\"T\": %lld, \"us\": %.3f, \"GBps\": %.1f, \"graph_us\": %.3f, \"nolock_us\": %.3f, "
                  "\"plan\": \"%s\", \"best\": \"%s\"}",
                  first_row ? "" : ", ", (long long)T, t * 1e6, gbps / 1e9, tg * 1e6, tn * 1e6, pl, best.c_str());
    g_json += js;
    first_row = false;
    std::fflush(stdout);
  }
  g_json += "]";
  // After the table, so that profiling by launch count (scripts/gpu_check.sh) sees the table's
  // launches first.
  const double host_us = host_us_public_call(s, rng);
  std::printf("host time of one public rope_pool_fused call at T = 1 (wall time of 400 calls in "
              "a row, no synchronisation): %.2f us\n", host_us);
  g_json += ", \"host_us_T1\": " + std::to_string(host_us);
  cudaStreamDestroy(s);
}

/// Median GPU seconds of one call alone between the events, after the spin (the field's
/// per-call mode: no previous launch of the kernel to overlap with), inputs rotating.
double time_single(const Workload& w, const detail::cuda_launch::LaunchConfig& cfg, cudaStream_t s) {
  return time_stream(w, cfg, s, 60, 1);
}

/// An empty kernel timed as time_single times a call: the floor of that mode.
double empty_single_us(cudaStream_t s) {
  return stream_median(s, [&](int64_t) { empty_kernel<<<1, 32, 0, s>>>(); }, 60, 1) * 1e6;
}

/// The SPEC §6 caches at each T beside the [P, Hk, D] bf16 pool of the same run: per call on a
/// plain stream (back-to-back), one call alone (T <= 256) and (T <= 256) per call in graphs;
/// %copy by each case's own bytes.
void bench_pools(const std::vector<int64_t>& tokens, Rng& rng, const std::string& filter) {
  cudaStream_t s;
  ROPEPOOL_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy = copy_bandwidth(s);
  std::vector<PoolSpec> specs;
  // A case again without k_rot (SPEC §4 return_k_rot=False).
  auto without_k_rot = [](PoolSpec spec) {
    spec.k_rot = false;
    return spec;
  };
  specs.push_back({});
  specs.push_back(without_k_rot({}));
  specs.push_back({PoolSpec::Flat, 1, true, false, false});
  specs.push_back({PoolSpec::Flat, 1, true, false, true});
  for (auto layout : {PoolSpec::NHD, PoolSpec::HND})
    for (int64_t ps : {1, 16, 64}) {
      specs.push_back({layout, ps, false, false, false});
      specs.push_back({layout, ps, true, false, false});
    }
  specs.push_back({PoolSpec::NHD, 16, true, true, true});
  // FlashInfer's fused rope_quantize_fp8_append_paged_kv_cache writes no k_rot: its like.
  specs.push_back(without_k_rot({PoolSpec::NHD, 16, true, true, true}));
  specs.push_back({PoolSpec::Flat, 1, false, true, false});
  // The fp8 cases again with power-of-two scales, beside the same cases above.
  specs.push_back({PoolSpec::Flat, 1, true, false, true, true});
  specs.push_back({PoolSpec::NHD, 16, true, true, true, true});
  specs.push_back({PoolSpec::Flat, 1, false, true, false, true});
  // SPEC §7's QK norm (Qwen3: "rms", bf16 weights) on the seed's pool and on an fp8 NHD cache.
  auto with_norm = [](PoolSpec spec) {
    spec.qk_norm = true;
    return spec;
  };
  specs.push_back(with_norm({}));
  specs.push_back(with_norm({PoolSpec::NHD, 16, true, false, false}));
  if (!filter.empty())
    specs.erase(std::remove_if(specs.begin() + 1, specs.end(),
                               [&](const PoolSpec& spec) { return spec.name().find(filter) == std::string::npos; }),
                specs.end());
  std::printf("\nSPEC 6 caches (bf16 q/k/v, Hq 32, Hk 8, D 128, 262144-slot caches; copy %.0f GB/s); "
              "one empty kernel alone between the events: %.2f us\n", copy / 1e9, empty_single_us(s));
  std::printf("%8s  %-40s %10s %9s %7s %10s %10s %10s  %s\n", "T", "cache", "us/call", "GB/s", "%copy", "alone us", "graph us",
              "kernel",
              "us/call: back-to-back; alone: one call between the events (T <= 256); "
              "fp8 k and v on one item (T <= 256): us/call | graph us; the other kernel of a pool variant (T <= 256, capped or uncapped): us/call | graph us; "
              "xN(Ww): the uncapped kernel with a token over N CTAs of W warps: us/call | graph us; "
              "head(Ww): the head kernel with W warps per CTA (token: the token kernel): us/call | alone us | graph us; "
              "pN(Ww): a call in q's dtype on the uncapped kernel (split_plain), likewise");
  g_json += ", \"pools\": [";
  bool first_row = true;
  for (int64_t T : tokens)
    for (const PoolSpec& spec : specs) {
      Workload w(T, T <= 256, rng, spec);
      detail::cuda_launch::LaunchConfig def;
      const auto plan = detail::cuda_launch::plan_launch(w.problem(0, s), def);
      const double t = time_stream(w, def, s);
      const double tg = T <= 256 ? time_graph(w, s) : 0;
      const double t_single = T <= 256 ? time_single(w, def, s) : 0;
      // The same case with the fp8 pool's k and v heads on one warp item: before/after of the
      // split, same run.
      const bool split = plan.kv_items == 2;
      double t1 = 0, tg1 = 0;
      // The token kernel's other shapes below: head_kernel = -1, so a plan that takes the head
      // kernel by default times them as well.
      if (split) {
        detail::cuda_launch::LaunchConfig one;
        one.split_fp8_kv = -1;
        t1 = time_stream(w, one, s);
        tg1 = time_graph(w, s, one);
      }
      // The other kernel of a pool variant in the same run: where the plan takes the one without its
      // register cap (T <= 256), the capped one (LaunchConfig::uncapped = -1); where it
      // takes the capped one at T <= 256, the uncapped one (uncapped = 1).
      double t_other = 0, tg_other = 0;
      detail::cuda_launch::LaunchConfig other;
      other.head_kernel = -1;
      other.uncapped = plan.uncapped ? -1 : 1;
      const bool time_other = plan.uncapped || (T <= 256 && detail::cuda_launch::plan_launch(w.problem(0, s), other).uncapped);
      if (time_other) {
        t_other = time_stream(w, other, s);
        tg_other = time_graph(w, s, other);
      }
      // The uncapped kernel with a token's items over other numbers of CTAs
      // (LaunchConfig::ctas_per_token) than the plan's, in the same run.
      // Up to one warp per CTA (the planner clamps the count to the token's items); each
      // shape once. A call in q's dtype at T <= 256: the same shapes through
      // LaunchConfig::split_plain ("pN(Ww)").
      std::string split_times;
      std::vector<int> timed{plan.uncapped ? plan.ctas_per_token : 0};
      detail::cuda_launch::LaunchConfig plain;
      plain.split_plain = 1;
      detail::cuda_launch::LaunchConfig token;
      token.head_kernel = -1;
      const auto token_plan = detail::cuda_launch::plan_launch(w.problem(0, s), token);
      const bool split_plain = !token_plan.uncapped && T <= 256 && detail::cuda_launch::plan_launch(w.problem(0, s), plain).uncapped;
      if (token_plan.uncapped || split_plain)
        for (int ctas : {1, 2, 3, 4, 6}) {
          detail::cuda_launch::LaunchConfig c = split_plain ? plain : token;
          c.ctas_per_token = ctas;
          const auto sp = detail::cuda_launch::plan_launch(w.problem(0, s), c);
          if (std::find(timed.begin(), timed.end(), sp.ctas_per_token) != timed.end()) continue;
          timed.push_back(sp.ctas_per_token);
          char b[64];
          std::snprintf(b, sizeof b, "; %s%d(%dw) %.2f | %.2f", split_plain ? "p" : "x", sp.ctas_per_token,
                        sp.config.warps_per_cta, time_stream(w, c, s) * 1e6, time_graph(w, s, c) * 1e6);
          split_times += b;
        }
      // The head kernel (LaunchConfig::head_kernel) at 2, 4 and 8 warps per CTA (but the plan's
      // own shape), and the token kernel where the plan takes the head kernel.
      std::string head_times;
      auto time_head = [&](const char* label, const detail::cuda_launch::LaunchConfig& h) {
        char b[80];
        std::snprintf(b, sizeof b, "; %s %.2f | %.2f | %.2f", label, time_stream(w, h, s) * 1e6, time_single(w, h, s) * 1e6,
                      time_graph(w, s, h) * 1e6);
        head_times += b;
      };
      if (T <= 256) {
        if (plan.head_kernel) time_head("token", token);
        for (int warps : {2, 4, 8}) {
          detail::cuda_launch::LaunchConfig h;
          h.head_kernel = 1, h.warps_per_cta = warps;
          const auto hp = detail::cuda_launch::plan_launch(w.problem(0, s), h);
          if (!hp.head_kernel) break;
          if (plan.head_kernel && hp.config.warps_per_cta == plan.config.warps_per_cta) continue;
          time_head(("head(" + std::to_string(warps) + "w)").c_str(), h);
        }
      }
      const double gbps = w.bytes() / t;
      char kernel[48];
      std::snprintf(kernel, sizeof kernel, "%s%s v%d %s%dw%s%s%s", plan.head_kernel ? "head " : "",
                    plan.path == detail::cuda_launch::Path::Tuned ? "tuned" : plan.path == detail::cuda_launch::Path::Vector ? "vector" : "scalar",
                    plan.pool_variant, plan.ctas_per_token > 1 ? ("x" + std::to_string(plan.ctas_per_token) + " ").c_str() : "",
                    plan.config.warps_per_cta, split ? " kv2" : "", plan.q_item_units != 4 && !plan.head_kernel ? " q2" : "",
                    plan.uncapped ? " unc" : "");
      char one_item[48] = "";
      if (t1 > 0) std::snprintf(one_item, sizeof one_item, "%.2f | %.2f", t1 * 1e6, tg1 * 1e6);
      char capped[64] = "";
      if (time_other)
        std::snprintf(capped, sizeof capped, "; %s %.2f | %.2f", plan.uncapped ? "capped" : "uncapped", t_other * 1e6,
                      tg_other * 1e6);
      std::printf("%8lld  %-40s %10.2f %9.0f %6.1f%% %10.2f %10.2f %10s  %s%s%s%s\n", (long long)T, spec.name().c_str(),
                  t * 1e6, gbps / 1e9, 100 * gbps / copy, t_single * 1e6, tg * 1e6, kernel, one_item, capped, split_times.c_str(),
                  head_times.c_str());
      char js[480];
      std::snprintf(js, sizeof js,
                    "%s{\"T\": %lld, \"cache\": \"%s\", \"us\": %.3f, \"GBps\": %.1f, \"graph_us\": %.3f, "
                    "\"alone_us\": %.3f, \"bytes\": %.0f, \"kv_items\": %d, \"one_kv_item_us\": %.3f, \"one_kv_item_graph_us\": %.3f}",
                    first_row ? "" : ", ", (long long)T, spec.name().c_str(), t * 1e6, gbps / 1e9, tg * 1e6, t_single * 1e6,
                    w.bytes(), plan.kv_items, t1 * 1e6, tg1 * 1e6);
      g_json += js;
      first_row = false;
      std::fflush(stdout);
    }
  g_json += "]";
  cudaStreamDestroy(s);
}

/// mla_rope_pool_fused's inputs (SPEC §8), as bench/gpu_bench_mla.py makes them: DeepSeek-V3's
/// shape (q [T, H, 192] with q_pe its last 64 columns, k_pe [T, 64], kv_c [T, 512]), a token
/// cache [P, 576] in bf16 or fp8 e4m3 (kv_scale 0.5), input sets over 4x the L2, positions
/// random below 2^17, slots T distinct random rows of a 262144-row cache.
struct MlaWorkload {
  int64_t T, H, P = 262144, R = 64, L = 512, n_sets = 0;
  bool fp8;
  std::unique_ptr<DeviceBuffer> q, k_pe, kv_c, pos, slots, q_out, k_out, cache;
  RopeSchedule schedule;
  MlaParams params;
  /// Bytes one call moves: q_pe, k_pe, kv_c read; q_pe_rot, k_pe_rot and a cache row written;
  /// int32 positions and slots read.
  double bytes() const {
    return double(T) * (2.0 * (2 * H * R + 3 * R + L) + (fp8 ? 1 : 2) * (L + R) + 8);
  }
  MlaWorkload(int64_t tokens, int64_t heads, bool fp8_cache, Rng& rng) : T(tokens), H(heads), fp8(fp8_cache) {
    P = std::max<int64_t>(P, T);
    cudaDeviceProp prop{};
    ROPEPOOL_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    n_sets = std::max<int64_t>(T <= 256 ? 20 : 2, int64_t(std::ceil(4.0 * prop.l2CacheSize / bytes())));
    const int64_t rows = n_sets * T;
    auto filled = [&](int64_t elems) { return filled_bf16(elems, rng); };
    q = filled(rows * H * 192), k_pe = filled(rows * R), kv_c = filled(rows * L);
    cache = filled(P * (L + R) / (fp8 ? 2 : 1));
    q_out = std::make_unique<DeviceBuffer>(size_t(rows * H * R) * 2);
    k_out = std::make_unique<DeviceBuffer>(size_t(rows * R) * 2);
    positions_and_slots(rng, n_sets, T, P, pos, slots);
    RopePoolParams rp;
    rp.head_dim = R, rp.rope_base = 10000;
    schedule = make_rope_schedule(rp);
    params.schedule = &schedule;
    params.interleaved = true;
    if (fp8) params.kv_scale = 0.5;
  }
  /// The call on input set i.
  void call(int64_t i, cudaStream_t s) const {
    const int64_t t0 = (i % n_sets) * T;
    const Device dev{DeviceType::CUDA, 0};
    MlaTensors m;
    m.q_pe = TensorView::contiguous(q->bytes_at(size_t(t0 * H * 192 + 128) * 2), DType::BFloat16, {T, H, R}, dev);
    m.q_pe.strides[0] = H * 192, m.q_pe.strides[1] = 192;
    m.k_pe = TensorView::contiguous(k_pe->bytes_at(size_t(t0 * R) * 2), DType::BFloat16, {T, R}, dev);
    m.kv_c = TensorView::contiguous(kv_c->bytes_at(size_t(t0 * L) * 2), DType::BFloat16, {T, L}, dev);
    m.positions = TensorView::contiguous(pos->bytes_at(size_t(t0) * 4), DType::Int32, {T}, dev);
    m.slots = TensorView::contiguous(slots->bytes_at(size_t(t0) * 4), DType::Int32, {T}, dev);
    m.kv_cache = TensorView::contiguous(cache->ptr, fp8 ? DType::Float8E4M3FN : DType::BFloat16, {P, L + R}, dev);
    m.q_out = TensorView::contiguous(q_out->bytes_at(size_t(t0 * H * R) * 2), DType::BFloat16, {T, H, R}, dev);
    m.k_out = TensorView::contiguous(k_out->bytes_at(size_t(t0 * R) * 2), DType::BFloat16, {T, R}, dev);
    MlaCallOptions o;
    o.stream = s;
    mla_rope_pool_fused(m, params, o);
  }
};

/// The copy ceiling at a call's own size: device-to-device copies that read and write `bytes`
/// in all (bytes / 2 copied), each from and to its own slice of buffers over 4x the L2, so that
/// like the op's inputs every copy starts cold. What a kernel moving that many bytes at copy
/// speed would take, its launch and ramp included, against the 1 GiB copy of copy_bandwidth.
struct SizedCopy {
  size_t n;
  int64_t sets;
  std::unique_ptr<DeviceBuffer> src, dst;
  explicit SizedCopy(double bytes) : n(size_t(bytes / 2) / 256 * 256) {
    cudaDeviceProp prop{};
    ROPEPOOL_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    sets = std::max<int64_t>(2, int64_t(std::ceil(4.0 * prop.l2CacheSize / double(n))));
    src = std::make_unique<DeviceBuffer>(n * size_t(sets));
    dst = std::make_unique<DeviceBuffer>(n * size_t(sets));
    ROPEPOOL_CUDA_OK(cudaMemset(src->ptr, 1, n * size_t(sets)));
  }
  void call(int64_t i, cudaStream_t s) const {
    const size_t off = size_t(i % sets) * n;
    ROPEPOOL_CUDA_OK(cudaMemcpyAsync(dst->bytes_at(off), src->bytes_at(off), n, cudaMemcpyDeviceToDevice, s));
  }
};

/// mla_rope_pool_fused at each T (DeepSeek-V3, H = 128 and 16, bf16 and fp8 caches):
/// back-to-back, alone between the events (T <= 256) and in graphs (T <= 256), in the
/// launcher's shape; at T <= 256 also with CTAs of 1 to 4 warps forced, and with q items of
/// 2, 4 and 8 units per lane forced (uU) in CTAs of 1, 2 and 4 warps, in the same run. From
/// T = 1024, the alone time too and a cold copy of the call's bytes (SizedCopy) back-to-back
/// and alone: the ceiling at the call's own size.
void bench_mla(const std::vector<int64_t>& tokens, Rng& rng, bool all_shapes) {
  cudaStream_t s;
  ROPEPOOL_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy = copy_bandwidth(s);
  std::printf("\nSPEC 8 mla_rope_pool_fused (DeepSeek-V3: q_pe a view of q [T, H, 192], kv_c 512, rope 64, bf16; "
              "262144-row token cache; copy %.0f GB/s); one empty kernel alone between the events: %.2f us\n",
              copy / 1e9, empty_single_us(s));
  std::printf("%8s %4s %6s %10s %7s %10s %10s  %s\n", "T", "H", "cache", "us/call", "%copy", "alone us", "graph us",
              "us/call: back-to-back; alone: one call between the events; Ww: CTAs of W warps forced, uU: U q units per lane forced: "
              "us/call | alone us | graph us; T >= 1024: a cold copy of the same bytes, us back-to-back | alone, "
              "and the call's share of it");
  g_json += ", \"mla\": [";
  bool first_row = true;
  for (int64_t T : tokens)
    for (int64_t H : {128, 16})
      for (bool fp8 : {false, true}) {
        MlaWorkload w(T, H, fp8, rng);
        auto call = [&](int64_t i) { w.call(i, s); };
        const double t = stream_median(s, call, 60, 20);
        const double ta = stream_median(s, call, 60, 1);
        const double tg = T <= 256 ? graph_median(s, call, w.n_sets) : 0;
        std::string forced;
        if (T >= 1024) {
          const SizedCopy c(w.bytes());
          auto copy_call = [&](int64_t i) { c.call(i, s); };
          const double cb = stream_median(s, copy_call, 60, 20), ca = stream_median(s, copy_call, 60, 1);
          char b[160];
          std::snprintf(b, sizeof b, "same-bytes copy %.2f | %.2f us (%.1f%% | %.1f%% of copy): call %.2f | %.2f of it",
                        cb * 1e6, ca * 1e6, 100 * w.bytes() / cb / copy, 100 * w.bytes() / ca / copy, cb / t, ca / ta);
          forced = b;
        }
        for (int units : {0, 2, 4, 8})
          for (int warps = 1; warps <= 4 && (T <= 256 || all_shapes); ++warps) {
            if (units > 0 && warps == 3) continue;
            detail::cuda_launch::set_mla_q_units_per_lane(units);
            detail::cuda_launch::set_mla_warps_per_cta(warps);
            char b[80], u[8] = "";
            if (units > 0) std::snprintf(u, sizeof u, "u%d ", units);
            std::snprintf(b, sizeof b, "%s%s%dw %.2f | %.2f | %.2f", forced.empty() ? "" : "; ", u, warps,
                          stream_median(s, call, 60, 20) * 1e6, stream_median(s, call, 60, 1) * 1e6,
                          T <= 256 ? graph_median(s, call, w.n_sets) * 1e6 : 0.0);
            forced += b;
          }
        detail::cuda_launch::set_mla_q_units_per_lane(0);
        detail::cuda_launch::set_mla_warps_per_cta(0);
        std::printf("%8lld %4lld %6s %10.2f %6.1f%% %10.2f %10.2f  %s\n", (long long)T, (long long)H, fp8 ? "fp8" : "bf16",
                    t * 1e6, 100 * w.bytes() / t / copy, ta * 1e6, tg * 1e6, forced.c_str());
        char js[300];
        std::snprintf(js, sizeof js,
                      "%s{\"T\": %lld, \"H\": %lld, \"cache\": \"%s\", \"us\": %.3f, \"alone_us\": %.3f, "
                      "\"graph_us\": %.3f, \"bytes\": %.0f}",
                      first_row ? "" : ", ", (long long)T, (long long)H, fp8 ? "fp8" : "bf16", t * 1e6, ta * 1e6,
                      tg * 1e6, w.bytes());
        g_json += js;
        first_row = false;
        std::fflush(stdout);
      }
  g_json += "]";
  cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  bool sweep = false, pools = false, mla = false, mla_shapes = false;
  std::string json, pool_filter;
  std::vector<int64_t> tokens = {1, 16, 64, 256, 1024, 4096, 16384, 65536};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sweep") sweep = true;
    else if (a == "--pools") pools = true;
    else if (a == "--mla") mla = true;
    else if (a == "--mla-shapes") mla = mla_shapes = true;
    else if (a == "--pool-filter" && i + 1 < argc) pools = true, pool_filter = argv[++i];
    else if (a == "--bench") continue;  // the default (what the old driver needed)
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else if (a == "--tokens" && i + 1 < argc) {
      tokens.clear();
      std::stringstream list(argv[++i]);
      for (std::string t; std::getline(list, t, ',');) tokens.push_back(std::stoll(t));
    } else {
      std::fprintf(stderr,
                   "usage: %s [--sweep] [--pools] [--pool-filter S] [--mla] [--mla-shapes] [--tokens T1,T2,..] "
                   "[--json FILE]\n",
                   argv[0]);
      return 2;
    }
  }
  print_device();
  Rng rng(fresh_seed());
  bench(sweep, tokens, rng);
  if (pools) bench_pools(tokens, rng, pool_filter);
  if (mla) bench_mla(tokens, rng, mla_shapes);
  g_json += "}";
  if (!json.empty()) std::ofstream(json) << (g_json.empty() ? "{}" : g_json) << "\n";
  return 0;
}
