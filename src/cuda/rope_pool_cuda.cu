// CUDA backend of rope_pool_fused: the host launcher. Picks the kernel (tuned head size,
// generic 16-byte path, scalar fallback) and the launch shape, owns the device-side slot
// error record, and turns every CUDA failure into ropepool::BackendError.
//
// The launcher never allocates device memory, never synchronises (except with
// check_slots, which must read the slots before anything is written) and issues exactly one
// kernel launch on problem.stream, so a call can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cassert>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../backend.hpp"
#include "launch.hpp"
#include "limits.hpp"
#include "fusion_kernel.cuh"
#include "head_kernel.cuh"
#include "rope_pool_kernel.cuh"
#include "slot_errors.hpp"
#include "ropepool/cuda.hpp"
#include "ropepool/error.hpp"

namespace ropepool::detail {
namespace {

using cuda::KernelParams;
using cuda::SlotErrorRecord;
using cuda_launch::LaunchConfig;
using cuda_launch::LaunchPlan;
using cuda_launch::Path;

constexpr int kMaxDevices = int(cuda_limits_values::kMaxDevices);

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw BackendError(std::string("rope_pool_fused: CUDA error in ") + what + ": " +
                       cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

/// Makes `device` current for the scope of a call and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = device != previous_;
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

/// The device that owns q's memory (the Python layer calls under it already; C++ callers
/// need not).
int device_of(const void* data) {
  cudaPointerAttributes attr{};
  check(cudaPointerGetAttributes(&attr, data), "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    throw BackendError("rope_pool_fused: q is marked as a CUDA tensor but its memory is not "
                       "CUDA device memory");
  if (attr.device < 0 || attr.device >= kMaxDevices)
    throw BackendError("rope_pool_fused: CUDA device " + std::to_string(attr.device) +
                       " is beyond the " + std::to_string(kMaxDevices) + " this build supports");
  return attr.device;
}

// ---- the slot error record (SPEC §3 without a device sync) ------------------------------

struct ErrorRecords {
  SlotErrorRecord* host = nullptr;  // kMaxDevices records, mapped pinned host memory
  std::atomic<SlotErrorRecord*> device_view[kMaxDevices] = {};
  std::mutex report_mutex;
};

ErrorRecords& error_records() {
  static ErrorRecords records;
  static std::once_flag once;
  std::call_once(once, [] {
    // The first call may come during stream capture (torch.cuda.graph); a host allocation
    // is not a stream operation, so let this thread make it.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, sizeof(SlotErrorRecord) * kMaxDevices,
                                             cudaHostAllocMapped | cudaHostAllocPortable);
    cudaThreadExchangeStreamCaptureMode(&mode);
    check(status, "cudaHostAlloc (slot error record)");
    std::memset(p, 0, sizeof(SlotErrorRecord) * kMaxDevices);
    records.host = static_cast<SlotErrorRecord*>(p);
  });
  return records;
}

/// Device pointer of `device`'s record (the current device must be `device`).
SlotErrorRecord* error_record_for_device(int device) {
  ErrorRecords& r = error_records();
  SlotErrorRecord* d = r.device_view[device].load(std::memory_order_acquire);
  if (d == nullptr) {
    void* p = nullptr;
    check(cudaHostGetDevicePointer(&p, r.host + device, 0), "cudaHostGetDevicePointer");
    d = static_cast<SlotErrorRecord*>(p);
    r.device_view[device].store(d, std::memory_order_release);
  }
  return d;
}

/// Throws (and clears) the bad slot an earlier call recorded on `device`, if any. Reads
/// host memory only: no synchronisation.
void report_pending_slot_error(int device) {
  ErrorRecords& r = error_records();
  volatile SlotErrorRecord* rec = r.host + device;
  if (rec->seq_written == rec->seq_acked) return;  // the common case: one compare
  std::string message;
  {
    std::lock_guard<std::mutex> lock(r.report_mutex);
    const unsigned long long written = rec->seq_written;
    if (written == rec->seq_acked) return;  // another thread reported it
    std::atomic_thread_fence(std::memory_order_acquire);  // fields were published before
    message = "rope_pool_fused: an earlier call on cuda:" + std::to_string(device) +
              " had slots[" + std::to_string(rec->token) + "] = " + std::to_string(rec->slot) +
              " out of range for a pool of " + std::to_string(rec->pool_size) +
              " slots; that token's pool rows were not written. Bad slots are reported on the "
              "next call (or by cuda_check_slot_errors); pass check_slots=True to raise "
              "before anything is written";
    rec->seq_acked = written;
  }
  throw BackendError(message);
}

// ---- check_slots: the host check of SPEC §3, after a synchronous copy -------------------

void check_slots_on_host(const RopePoolProblem& p, cudaStream_t stream) {
  const int64_t T = p.num_tokens;
  const size_t es = p.slots.is_int64 ? 8 : 4;
  std::vector<unsigned char> bytes(size_t(T) * es);
  const char* src = static_cast<const char*>(p.slots.data);
  if (p.slots.stride == 1)
    check(cudaMemcpyAsync(bytes.data(), src, bytes.size(), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync (slots)");
  else if (p.slots.stride > 1)
    check(cudaMemcpy2DAsync(bytes.data(), es, src, size_t(p.slots.stride) * es, es, size_t(T),
                            cudaMemcpyDeviceToHost, stream),
          "cudaMemcpy2DAsync (slots)");
  else
    for (int64_t t = 0; t < T; ++t)
      check(cudaMemcpyAsync(bytes.data() + t * es, src + t * p.slots.stride * int64_t(es), es,
                            cudaMemcpyDeviceToHost, stream),
            "cudaMemcpyAsync (slots)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check_slots)");
  check_slot_values(Index{bytes.data(), 1, p.slots.is_int64}, T, p.pool_size, true);
}

// ---- launch planning ---------------------------------------------------------------------

bool aligned(const void* data, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(data) % uint64_t(bytes) == 0;
}

/// Vector accesses of `bytes` bytes need every base pointer and every stride that is actually
/// stepped over (extent > 1) to be a multiple of `bytes` (es: the tensor's element size).
bool rows_aligned(const Rows& r, int64_t rows, int64_t heads, size_t es, int64_t bytes) {
  return aligned(r.data, bytes) && (rows <= 1 || (r.row_stride * int64_t(es)) % bytes == 0) &&
         (heads <= 1 || (r.head_stride * int64_t(es)) % bytes == 0);
}

/// The same for a pool of pool_size / page_size pages: the page stride, the row stride inside
/// a page (page_size > 1) and the head stride.
bool pool_aligned(const PoolRows& r, int64_t pool_size, int64_t page_size, int64_t heads, size_t es,
                  int64_t bytes) {
  const int64_t pages = pool_size / page_size;
  return aligned(r.data, bytes) && (pages <= 1 || (r.page_stride * int64_t(es)) % bytes == 0) &&
         (page_size <= 1 || (r.row_stride * int64_t(es)) % bytes == 0) &&
         (heads <= 1 || (r.head_stride * int64_t(es)) % bytes == 0);
}

bool is_tuned_head_dim(int64_t d) { return d == 64 || d == 96 || d == 128 || d == 256; }

/// Units per head for accesses of `vec` elements (kernel header: NeoX pairs of vectors, GPT-J
/// vectors or, on the scalar path, pairs of elements, then the vectors past rotary_dim).
int64_t units_per_head(const RopePoolProblem& p, int64_t vec) {
  const int64_t R = p.rotary_dim, half = R / 2;
  const int64_t rotating_units = !p.interleaved ? half / vec : vec == 1 ? half : R / vec;
  return rotating_units + (p.head_dim - R) / vec;
}

/// The cuda::PoolVariant bits of a call, for the main kernel and the fusion kernels alike.
/// Paged pools, fp8 pools and fp8 q_out run their own kernels; the seed's kernels (variant 0)
/// address a pool of page size 1 as row slot * page_stride. A call without k_rot (null k_out,
/// SPEC §4) runs a pool variant too (a 3-D pool as page size 1): only those kernels test
/// k_out, so the seed's keep their code.
int pool_variant_of(const RopePoolProblem& p) {
  const bool fp8_pool = p.pool_dtype == DType::Float8E4M3FN, fp8_q = p.q_out_dtype == DType::Float8E4M3FN;
  int variant = 0;
  if (fp8_pool || fp8_q || p.page_size > 1 || p.k_out.data == nullptr) variant = cuda::kPoolPaged;
  if (fp8_pool) variant |= cuda::kPoolFp8;
  if (fp8_q) variant |= cuda::kQOutFp8;
  return variant;
}

}  // namespace

// The limits validation asks for (limits.hpp) must be the kernel's.
static_assert(cuda_limits_values::kMaxRotaryDim == 2 * cuda::kMaxHalfRotary);
static_assert(cuda::kFusionMaxHeadDim == kCudaFusionMaxHeadDim);
static_assert(cuda_limits_values::kMaxHeadsXHeadDim + 32 * cuda::kQUnits < (int64_t(1) << 24) &&
              cuda_limits_values::kMaxHeadsXHeadDim + 32 * cuda::kVVecs < (int64_t(1) << 24));

namespace cuda_launch {

LaunchPlan plan_launch(const RopePoolProblem& p, const LaunchConfig& overrides) {
  const size_t es = dtype_size(p.dtype);
  const int64_t T = p.num_tokens, D = p.head_dim, R = p.rotary_dim, half = R / 2;
  // Validation (src/rope_pool.cpp) has checked cuda_limits(): these only assert.
  assert(half <= cuda::kMaxHalfRotary);

  assert(p.page_size >= 1 && p.pool_size % p.page_size == 0);
  assert(p.dtype == DType::Float32 || p.dtype == DType::Float16 || p.dtype == DType::BFloat16);
  assert(p.pool_dtype == p.dtype || p.pool_dtype == DType::Float8E4M3FN);
  assert(p.q_out_dtype == p.dtype || p.q_out_dtype == DType::Float8E4M3FN);

  LaunchPlan plan;
  const bool fp8_pool = p.pool_dtype == DType::Float8E4M3FN, fp8_q = p.q_out_dtype == DType::Float8E4M3FN;
  plan.pool_variant = pool_variant_of(p);

  const int vec = int(16 / es);
  // A vector access (16 bytes of q/k/v, as many elements of each output) must not straddle
  // rotary_dim, nor (NeoX) the middle of the rotated part.
  const size_t pool_es = dtype_size(p.pool_dtype), q_out_es = dtype_size(p.q_out_dtype);
  const int64_t pool_bytes = int64_t(vec * pool_es), q_out_bytes = int64_t(vec * q_out_es);
  const bool vector_ok =
      D % vec == 0 && (p.interleaved ? R % vec : half % vec) == 0 &&
      rows_aligned(p.q, T, p.num_qo_heads, es, 16) &&
      rows_aligned(p.q_out, T, p.num_qo_heads, q_out_es, q_out_bytes) &&
      rows_aligned(p.k, T, p.num_kv_heads, es, 16) && rows_aligned(p.k_out, T, p.num_kv_heads, es, 16) &&
      rows_aligned(p.v, T, p.num_kv_heads, es, 16) &&
      pool_aligned(p.k_pool, p.pool_size, p.page_size, p.num_kv_heads, pool_es, pool_bytes) &&
      pool_aligned(p.v_pool, p.pool_size, p.page_size, p.num_kv_heads, pool_es, pool_bytes);
  if (vector_ok) {
    plan.path = R == D && !p.interleaved && is_tuned_head_dim(D) ? Path::Tuned : Path::Vector;
    plan.vec_elems = vec;
  } else {
    plan.path = Path::Scalar;
    plan.vec_elems = 1;
  }

  LaunchConfig c = overrides;
  // Duplicate slots: none possible with one token; a shared-memory scan for small calls
  // (no atomics, no fences, and the last token wins as on the CPU); locks otherwise.
  plan.pool_write_mode = T == 1 || !c.dedupe_rows ? cuda::kPoolWriteDirect
                         : T <= cuda::kMaxScanTokens ? cuda::kPoolWriteScan
                                                     : cuda::kPoolWriteLock;
  // An fp8 pool's k heads and v heads as two items where no row lock is taken: at small T the
  // e4m3 quantisation of a token's kv row is the longest chain of its CTA (docs/CUDA.md).
  // An fp8 q_out likewise gets q items of kQUnitsFp8 units there.
  assert(c.split_fp8_kv == 0 || c.split_fp8_kv == -1);
  const bool no_row_lock = plan.pool_write_mode != cuda::kPoolWriteLock;
  plan.kv_items = fp8_pool && no_row_lock && c.split_fp8_kv == 0 ? 2 : 1;
  assert(c.fp8_q_units == 0 || c.fp8_q_units == 1 || c.fp8_q_units == 2 || c.fp8_q_units == 4);
  plan.q_item_units = !(fp8_q && no_row_lock) ? cuda::kQUnits : c.fp8_q_units > 0 ? c.fp8_q_units : cuda::kQUnitsFp8;
  assert(c.uncapped >= -1 && c.uncapped <= 1);
  // The kernels of the pool variants (fp8 pools, fp8 q_out, paged pools in q's dtype) without
  // the register cap at small T. (Calls with a QK norm run the norm kernel, which has no
  // uncapped form.)
  const bool norm = p.q_norm_weight != nullptr || p.k_norm_weight != nullptr;
  const bool tuned128 = !norm && plan.path == Path::Tuned && D == 128;
  plan.uncapped = plan.pool_variant != 0 && tuned128 && c.uncapped >= 0 &&
                  (T <= cuda::kUncappedMaxTokens || c.uncapped == 1);
  // Forced only (benchmark, test): a call in q's dtype on the paged variant's uncapped kernel
  // at any T (a 3-D pool as page size 1), its items split as an fp8 call's.
  assert(c.split_plain == 0 || c.split_plain == 1);
  const bool split_plain = c.split_plain == 1 && !fp8_pool && !fp8_q && tuned128;
  if (split_plain) {
    plan.pool_variant = cuda::kPoolPaged;
    plan.uncapped = true;
  }

  // Work per token, in warp items (kernel header): the kv items, plus q items of
  // 32 * plan.q_item_units units.
  const int64_t units = units_per_head(p, plan.vec_elems);
  const int64_t q_units = p.num_qo_heads * units;
  const double items_per_token = plan.kv_items + double(q_units) / (32.0 * plan.q_item_units);
  const int64_t kv_span = p.num_kv_heads * std::max(units, D / plan.vec_elems);

  // Item indices inside a CTA are int (kernel): keep them far from overflow.
  assert(q_units + 32 * cuda::kQUnits < (int64_t(1) << 24) &&
         kv_span + 32 * cuda::kVVecs < (int64_t(1) << 24));
  (void)kv_span;

  // A CTA per token, one warp per item, so the token's items run side by side; for the seed's
  // pools the warp count is the only choice left (no other shape measured faster: docs/CUDA.md).
  // Up to T = 128 the uncapped kernel of an fp8 call spreads a token's items over CTAs of two
  // warps (gridDim.y), up to T = 256 with fp8 pools: at small T a token's e4m3 work is the
  // longest chain, and more CTAs put it on more SMs (docs/CUDA.md, "Launch shape"). A pool in
  // q's dtype keeps one CTA per token on the uncapped kernel (its split measured no faster;
  // with an fp8 q_rot alone, none faster at T = 256).
  assert(c.ctas_per_token >= 0);
  const int whole_items = int(std::ceil(items_per_token));
  const bool split = (fp8_pool && T <= cuda::kSplitFp8PoolMaxTokens) ||
                     ((fp8_q || split_plain) && T <= cuda::kSplitMaxTokens);
  plan.ctas_per_token = 1;
  if (plan.uncapped && c.ctas_per_token > 0) plan.ctas_per_token = std::min(c.ctas_per_token, whole_items);
  else if (plan.uncapped && split) plan.ctas_per_token = (whole_items + 1) / 2;
  if (c.warps_per_cta <= 0)
    c.warps_per_cta = int(std::min<double>(cuda::kMaxWarpsPerCta, std::ceil(items_per_token / plan.ctas_per_token)));
  c.warps_per_cta = std::clamp(c.warps_per_cta, 1, cuda::kMaxWarpsPerCta);
  plan.grid = T * plan.ctas_per_token;
  plan.threads = 32 * c.warps_per_cta;
  plan.shared_bytes = size_t(2) * size_t(half) * sizeof(float);
  if (plan.pool_variant != 0) plan.shared_bytes += cuda::kPoolSharedBytes;  // before the table
  if (plan.pool_write_mode == cuda::kPoolWriteScan) plan.shared_bytes += size_t(T) * 8;
  // The head kernel (head_kernel.cuh): a warp per 32 units of one kind (k, v or q), warps_per_cta
  // of them per CTA (default kHeadKernelWarps), the CTAs of a token along gridDim.y. By default
  // for small calls: with an fp8 pool or q_out from T = 1 (there the token kernel's e4m3 work is
  // the longest link of a token), in q's dtype from T = 2 (at T = 1 the token kernel is as fast
  // under CUDA graphs; docs/CUDA.md); up to T = 128, or 256 on a pool variant.
  assert(c.head_kernel >= -1 && c.head_kernel <= 1);
  const bool head_ok = !norm && plan.path == Path::Tuned && D == 128 && no_row_lock;
  const int64_t head_max = plan.pool_variant != 0 ? cuda::kHeadKernelMaxTokensVariant : cuda::kHeadKernelMaxTokens;
  const bool head_default = T <= head_max && !split_plain &&
                            (fp8_pool || fp8_q || T >= cuda::kHeadKernelMinTokensPlain);
  plan.head_kernel = head_ok && (c.head_kernel == 1 || (c.head_kernel == 0 && head_default));
  if (plan.head_kernel) {
    const int64_t warps = cuda::head_warp_counts(int(p.num_qo_heads), int(p.num_kv_heads), int(D / 2 / plan.vec_elems),
                                                 int(D / plan.vec_elems))
                              .total();
    c.warps_per_cta = int(std::clamp<int64_t>(overrides.warps_per_cta > 0 ? overrides.warps_per_cta : cuda::kHeadKernelWarps, 1,
                                              std::min<int64_t>(warps, cuda::kMaxWarpsPerCta)));
    plan.ctas_per_token = int((warps + c.warps_per_cta - 1) / c.warps_per_cta);
    plan.grid = T * plan.ctas_per_token;
    plan.threads = 32 * c.warps_per_cta;
    plan.shared_bytes = size_t(c.warps_per_cta) * 2 * size_t(half) * sizeof(float);
    plan.uncapped = false;
    plan.kv_items = 1, plan.q_item_units = 1;
  }
  // PDL (docs/CUDA.md): this launch may start while the previous kernel on the stream
  // drains (it waits for that kernel in-kernel before touching memory) and lets the next one
  // start once its table is built, which hides part of the launch gap at every T.
  if (c.pdl == 0) c.pdl = 1;
  assert(plan.grid <= cuda_limits_values::kMaxTokens);
  plan.config = c;
  return plan;
}

}  // namespace cuda_launch

namespace {

template <int kFreqCap>
KernelParams<kFreqCap> make_params(const RopePoolProblem& p, const LaunchPlan& plan,
                                   SlotErrorRecord* record) {
  KernelParams<kFreqCap> k{};
  k.q = p.q.data, k.k = p.k.data, k.v = p.v.data;
  k.q_out = p.q_out.data, k.k_out = p.k_out.data;
  k.k_pool = p.k_pool.data, k.v_pool = p.v_pool.data;
  k.q_row = p.q.row_stride, k.q_head = p.q.head_stride;
  k.k_row = p.k.row_stride, k.k_head = p.k.head_stride;
  k.v_row = p.v.row_stride, k.v_head = p.v.head_stride;
  k.qo_row = p.q_out.row_stride, k.qo_head = p.q_out.head_stride;
  k.ko_row = p.k_out.row_stride, k.ko_head = p.k_out.head_stride;
  k.kp_row = p.k_pool.page_stride, k.kp_head = p.k_pool.head_stride;  // page size 1: row = page
  k.vp_row = p.v_pool.page_stride, k.vp_head = p.v_pool.head_stride;
  k.positions = p.positions.data, k.positions_stride = p.positions.stride;
  k.positions_int64 = p.positions.is_int64;
  k.slots = p.slots.data, k.slots_stride = p.slots.stride, k.slots_int64 = p.slots.is_int64;
  k.num_tokens = p.num_tokens, k.pool_size = p.pool_size;
  k.num_qo_heads = int(p.num_qo_heads), k.num_kv_heads = int(p.num_kv_heads);
  k.head_dim = int(p.head_dim), k.rotary_dim = int(p.rotary_dim);
  k.pool_write_mode = plan.pool_write_mode;
  k.attention_scaling = float(p.attention_scaling);
  k.error_record = record;
  for (int64_t i = 0; i < p.rotary_dim / 2; ++i) k.inv_freq[i] = p.inv_freq[i];
  k.mrope = p.mrope, k.mrope_interleaved = p.mrope_interleaved;  // SPEC §7
  for (int i = 0; i < 3; ++i) k.mrope_section[i] = int(p.mrope_section[i]);
  k.positions_row_stride = p.positions_row_stride;
  return k;
}

/// The parameters of the paged / fp8 kernels: the seed's block (kp_row, vp_row: page strides)
/// and PoolParams.
template <int kFreqCap>
KernelParams<kFreqCap, true> make_pool_params(const RopePoolProblem& p, const LaunchPlan& plan,
                                              SlotErrorRecord* record) {
  KernelParams<kFreqCap, true> k{};
  static_cast<KernelParams<kFreqCap>&>(k) = make_params<kFreqCap>(p, plan, record);
  cuda::PoolParams& x = k.pool;
  x.kp_in_page = p.k_pool.row_stride, x.vp_in_page = p.v_pool.row_stride;
  x.page_size = p.page_size;
  x.page_shift = -1;
  for (int s = 0; s < 63; ++s)
    if (p.page_size == (int64_t(1) << s)) x.page_shift = s;
  x.slots_fit_32_bits = p.pool_size <= int64_t(0xffffffff);
  const Scale none{};
  const Scale* scales[3] = {&p.k_scale, &p.v_scale, &p.q_scale};
  if (p.pool_dtype != DType::Float8E4M3FN) scales[0] = scales[1] = &none;
  if (p.q_out_dtype != DType::Float8E4M3FN) scales[2] = &none;
  for (int i = 0; i < 3; ++i) x.scale_ptr[i] = scales[i]->ptr, x.scale_value[i] = scales[i]->value;
  x.kv_items = plan.kv_items, x.q_units = plan.q_item_units;
  return k;
}

/// One launch of the main kernel, or (norm given) of its SPEC §7 norm variant.
template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved, int kPool, bool kNorm>
void launch(const RopePoolProblem& p, const LaunchPlan& plan, SlotErrorRecord* record,
            cudaStream_t stream, const cuda::FusionParams* norm) {
  KernelParams<kFreqCap, kPool != 0> params;
  if constexpr (kPool != 0) params = make_pool_params<kFreqCap>(p, plan, record);
  else params = make_params<kFreqCap>(p, plan, record);
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(unsigned(plan.grid / plan.ctas_per_token), unsigned(plan.ctas_per_token));
  launch.blockDim = dim3(unsigned(plan.threads));
  launch.dynamicSmemBytes = plan.shared_bytes;
  launch.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  if (plan.config.pdl > 0) {
    launch.attrs = &attr;
    launch.numAttrs = 1;
  }
  if constexpr (kNorm) {
    check(cudaLaunchKernelEx(&launch,
                             cuda::rope_pool_norm_kernel<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool>,
                             params, *norm),
          "cudaLaunchKernelEx (rope_pool_norm_kernel)");
    return;
  }
  if constexpr (kHeadDim == 128 && !kInterleaved) {
    if (plan.head_kernel) {
      check(cudaLaunchKernelEx(&launch, cuda::rope_pool_head_kernel<E, kVec, kHeadDim, kFreqCap, kPool>, params),
            "cudaLaunchKernelEx (rope_pool_head_kernel)");
      return;
    }
  }
  assert(!plan.head_kernel);
  if constexpr (kPool != 0 && kHeadDim == 128) {
    if (plan.uncapped) {
      check(cudaLaunchKernelEx(
                &launch,
                cuda::rope_pool_token_kernel_uncapped<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool>,
                params),
            "cudaLaunchKernelEx (rope_pool_token_kernel_uncapped)");
      return;
    }
  }
  assert(!plan.uncapped);
  check(cudaLaunchKernelEx(&launch,
                           cuda::rope_pool_token_kernel<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool>,
                           params),
        "cudaLaunchKernelEx (rope_pool_token_kernel)");
}

/// kNorm: the SPEC §7 norm variant, compiled for fewer geometries (head_dim 128 tuned, the
/// runtime-head_dim vector kernels for the rest); the planner never sends it the scalar path.
template <class E, int kPool, bool kNorm>
void launch_dtype(const RopePoolProblem& p, const LaunchPlan& plan, SlotErrorRecord* record,
                  cudaStream_t stream, const cuda::FusionParams* norm) {
  constexpr int kVec = 16 / E::kBytes;
  constexpr int kCap = cuda::kMaxHalfRotary;
  if constexpr (kNorm) {
    if (plan.path == Path::Scalar)
      throw BackendError("rope_pool_fused: the CUDA norm kernel has no scalar path");
    if (plan.path == Path::Tuned && p.head_dim == 128)
      return launch<E, kVec, 128, 64, false, kPool, true>(p, plan, record, stream, norm);
    return p.interleaved ? launch<E, kVec, 0, kCap, true, kPool, true>(p, plan, record, stream, norm)
                         : launch<E, kVec, 0, kCap, false, kPool, true>(p, plan, record, stream, norm);
  } else {
    switch (plan.path) {
      case Path::Tuned:
        switch (p.head_dim) {
          case 64: return launch<E, kVec, 64, 32, false, kPool, false>(p, plan, record, stream, nullptr);
          case 96: return launch<E, kVec, 96, 48, false, kPool, false>(p, plan, record, stream, nullptr);
          case 128: return launch<E, kVec, 128, 64, false, kPool, false>(p, plan, record, stream, nullptr);
          case 256: return launch<E, kVec, 256, 128, false, kPool, false>(p, plan, record, stream, nullptr);
          default: break;
        }
        throw BackendError("rope_pool_fused: no tuned CUDA kernel for head_dim " +
                           std::to_string(p.head_dim) + " (tuned: 64, 96, 128, 256)");
      // GPT-J pairs are rare enough to take only the runtime-head_dim kernels.
      case Path::Vector:
        return p.interleaved ? launch<E, kVec, 0, kCap, true, kPool, false>(p, plan, record, stream, nullptr)
                             : launch<E, kVec, 0, kCap, false, kPool, false>(p, plan, record, stream, nullptr);
      case Path::Scalar:
        return p.interleaved ? launch<E, 1, 0, kCap, true, kPool, false>(p, plan, record, stream, nullptr)
                             : launch<E, 1, 0, kCap, false, kPool, false>(p, plan, record, stream, nullptr);
    }
  }
}

/// The pool variant as a compile-time constant: the seed's kernels (0), paged pools in q's
/// dtype, fp8 pools, and fp8 q_out with either pool. norm: SPEC §7's norm variant.
template <class E, bool kNorm = false>
void launch_variant(const RopePoolProblem& p, const LaunchPlan& plan, SlotErrorRecord* record,
                    cudaStream_t stream, const cuda::FusionParams* norm = nullptr) {
  using namespace cuda;
  switch (plan.pool_variant) {
    case 0: return launch_dtype<E, 0, kNorm>(p, plan, record, stream, norm);
    case kPoolPaged: return launch_dtype<E, kPoolPaged, kNorm>(p, plan, record, stream, norm);
    case kPoolPaged | kPoolFp8:
      return launch_dtype<E, kPoolPaged | kPoolFp8, kNorm>(p, plan, record, stream, norm);
    case kPoolPaged | kQOutFp8:
      return launch_dtype<E, kPoolPaged | kQOutFp8, kNorm>(p, plan, record, stream, norm);
    case kPoolPaged | kPoolFp8 | kQOutFp8:
      return launch_dtype<E, kPoolPaged | kPoolFp8 | kQOutFp8, kNorm>(p, plan, record, stream, norm);
    default: break;
  }
  throw BackendError("rope_pool_fused: no CUDA kernel for pool variant " + std::to_string(plan.pool_variant));
}

// SPEC §7 QK norm: the main kernel's norm variant where a head's units fill one lane group
// (norm_in_main_kernel), else the fusion kernels (fusion_kernel.cuh), with every SPEC §6 cache
// format. (mRoPE alone takes the main kernel.)
bool has_fusions(const RopePoolProblem& p) {
  return p.q_norm_weight != nullptr || p.k_norm_weight != nullptr;
}

/// The main kernel normalises (HeadOps::norm_scales) when the plan is a vector path, a head is a
/// power-of-two number of units up to 32 (its units then sit in one aligned lane group) and
/// the weights are 16-byte aligned.
bool norm_in_main_kernel(const RopePoolProblem& p, const LaunchPlan& plan) {
  if (plan.path == Path::Scalar) return false;
  const int64_t units = units_per_head(p, plan.vec_elems);
  const auto aligned16 = [](const void* w) { return w == nullptr || aligned(w, 16); };
  return units >= 1 && units <= 32 && (units & (units - 1)) == 0 && aligned16(p.q_norm_weight) &&
         aligned16(p.k_norm_weight);
}

cuda::FusionParams fusion_params(const RopePoolProblem& p) {
  cuda::FusionParams f{};
  f.q_norm_weight = p.q_norm_weight;
  f.k_norm_weight = p.k_norm_weight;
  f.q_norm_float32 = p.q_norm_dtype == DType::Float32;
  f.k_norm_float32 = p.k_norm_dtype == DType::Float32;
  f.norm_eps = p.norm_eps;
  f.norm_gemma = p.norm_gemma;
  f.interleaved = p.interleaved;
  return f;
}

/// The vector path of the fusion kernel (fusion_kernel.cuh), where the geometry allows it:
/// 16-byte accesses everywhere (rows, heads, pools, weights aligned), D / kVec lanes per head a
/// power of two up to 32, and (NeoX) half / kVec a power of two. Fills `g` and returns true.
bool fusion_vector_geometry(const RopePoolProblem& p, cuda::FusionVecGeometry& g, int& threads) {
  const size_t es = dtype_size(p.dtype), pool_es = dtype_size(p.pool_dtype), q_out_es = dtype_size(p.q_out_dtype);
  const int vec = int(16 / es);
  const int64_t T = p.num_tokens, D = p.head_dim, R = p.rotary_dim, half = R / 2;
  const auto power_of_two = [](int64_t x) { return x > 0 && (x & (x - 1)) == 0; };
  if (D % vec != 0 || !power_of_two(D / vec) || D / vec > 32) return false;
  if (!p.interleaved && (half % vec != 0 || !power_of_two(half / vec))) return false;
  const auto weight_ok = [](const void* w) { return w == nullptr || reinterpret_cast<uintptr_t>(w) % 16 == 0; };
  if (!weight_ok(p.q_norm_weight) || !weight_ok(p.k_norm_weight)) return false;
  const int64_t pool_bytes = int64_t(vec * pool_es), q_out_bytes = int64_t(vec * q_out_es);
  if (!rows_aligned(p.q, T, p.num_qo_heads, es, 16) || !rows_aligned(p.q_out, T, p.num_qo_heads, q_out_es, q_out_bytes) ||
      !rows_aligned(p.k, T, p.num_kv_heads, es, 16) || !rows_aligned(p.k_out, T, p.num_kv_heads, es, 16) ||
      !rows_aligned(p.v, T, p.num_kv_heads, es, 16) ||
      !pool_aligned(p.k_pool, p.pool_size, p.page_size, p.num_kv_heads, pool_es, pool_bytes) ||
      !pool_aligned(p.v_pool, p.pool_size, p.page_size, p.num_kv_heads, pool_es, pool_bytes))
    return false;
  const int per_head = int(D / vec);
  g.group_shift = 0;
  while ((1 << g.group_shift) < per_head) ++g.group_shift;
  g.pair_xor = p.interleaved ? 0 : int(half / vec);
  g.rot_units = int(R / vec);
  g.qk_units = int((p.num_qo_heads + p.num_kv_heads) * per_head);
  g.units = g.qk_units + int(p.num_kv_heads * per_head);
  const int per_thread = cuda::kFusionUnits;
  threads = std::min(1024, (g.units + per_thread - 1) / per_thread);
  threads = (threads + 31) / 32 * 32;
  g.rounds = (g.units + per_thread * threads - 1) / (per_thread * threads);
  return true;
}

template <class E, int kPool>
void launch_fusion_variant(const RopePoolProblem& p, const LaunchPlan& plan,
                           const cuda::FusionParams& f, SlotErrorRecord* record,
                           cudaStream_t stream) {
  constexpr int kCap = cuda::kMaxHalfRotary;
  KernelParams<kCap, kPool != 0> params;
  if constexpr (kPool != 0) params = make_pool_params<kCap>(p, plan, record);
  else params = make_params<kCap>(p, plan, record);
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(unsigned(plan.grid));
  launch.blockDim = dim3(unsigned(plan.threads));
  launch.dynamicSmemBytes = plan.shared_bytes;
  launch.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  launch.attrs = &attr;
  launch.numAttrs = 1;
  cuda::FusionVecGeometry g{};
  int threads = 0;
  if (fusion_vector_geometry(p, g, threads)) {
    launch.blockDim = dim3(unsigned(threads));
    launch.dynamicSmemBytes = sizeof(float) * size_t(p.rotary_dim) + (kPool != 0 ? cuda::kPoolSharedBytes : 0);
    check(cudaLaunchKernelEx(&launch, cuda::rope_pool_fusion_vec_kernel<E, int(16 / E::kBytes), kPool>, params, f, g),
          "cudaLaunchKernelEx (rope_pool_fusion_vec_kernel)");
    return;
  }
  check(cudaLaunchKernelEx(&launch, cuda::rope_pool_fusion_kernel<E, kPool>, params, f),
        "cudaLaunchKernelEx (rope_pool_fusion_kernel)");
}

template <class E>
void launch_fusion(const RopePoolProblem& p, SlotErrorRecord* record, cudaStream_t stream) {
  using namespace cuda;
  assert(p.head_dim <= kFusionMaxHeadDim && p.rotary_dim / 2 <= kMaxHalfRotary);
  assert(p.page_size >= 1 && p.pool_size % p.page_size == 0);
  assert(p.pool_dtype == p.dtype || p.pool_dtype == DType::Float8E4M3FN);
  assert(p.q_out_dtype == p.dtype || p.q_out_dtype == DType::Float8E4M3FN);
  LaunchPlan plan;
  plan.grid = p.num_tokens;
  plan.threads = 32 * kFusionWarps;
  plan.pool_write_mode = p.num_tokens == 1 ? kPoolWriteDirect : kPoolWriteLock;
  // SPEC §6: the main kernel's pool variants (plan_launch), the same bits.
  plan.pool_variant = pool_variant_of(p);
  // The table, a row of head_dim floats per warp, and (pool variants) the scales and the pool
  // row's offsets before them, as in the main kernel.
  plan.shared_bytes = sizeof(float) * size_t(p.rotary_dim + kFusionWarps * p.head_dim) +
                      (plan.pool_variant != 0 ? cuda::kPoolSharedBytes : 0);
  const FusionParams f = fusion_params(p);
  switch (plan.pool_variant) {
    case 0: return launch_fusion_variant<E, 0>(p, plan, f, record, stream);
    case kPoolPaged: return launch_fusion_variant<E, kPoolPaged>(p, plan, f, record, stream);
    case kPoolPaged | kPoolFp8:
      return launch_fusion_variant<E, kPoolPaged | kPoolFp8>(p, plan, f, record, stream);
    case kPoolPaged | kQOutFp8:
      return launch_fusion_variant<E, kPoolPaged | kQOutFp8>(p, plan, f, record, stream);
    case kPoolPaged | kPoolFp8 | kQOutFp8:
      return launch_fusion_variant<E, kPoolPaged | kPoolFp8 | kQOutFp8>(p, plan, f, record,
                                                                        stream);
    default: break;
  }
  throw BackendError("rope_pool_fused: no CUDA fusion kernel for pool variant " +
                     std::to_string(plan.pool_variant));
}

/// f(E{}) with E the kernel element type of `dtype` (validation lets only these through).
template <class F>
void with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(cuda::F32{});
    case DType::Float16: return f(cuda::F16{});
    case DType::BFloat16: return f(cuda::BF16{});
    default: throw BackendError("rope_pool_fused: unsupported dtype reached the CUDA backend");
  }
}

void run(const RopePoolProblem& p, const LaunchConfig& overrides) {
  const LaunchPlan plan = cuda_launch::plan_launch(p, overrides);  // validated: asserts only
  const int device = device_of(p.q.data);
  DeviceGuard guard(device);
  report_pending_slot_error(device);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  if (p.check_slots) check_slots_on_host(p, stream);
  SlotErrorRecord* record = error_record_for_device(device);
  with_element_type(p.dtype, [&](auto element) {
    using E = decltype(element);
    if (!has_fusions(p)) return launch_variant<E>(p, plan, record, stream);
    if (!norm_in_main_kernel(p, plan)) return launch_fusion<E>(p, record, stream);
    const cuda::FusionParams f = fusion_params(p);
    launch_variant<E, true>(p, plan, record, stream, &f);
  });
}

}  // namespace

namespace cuda_launch {
void rope_pool_cuda_with(const RopePoolProblem& problem, const LaunchConfig& overrides) {
  run(problem, overrides);
}
}  // namespace cuda_launch

namespace cuda_slot_errors {  // slot_errors.hpp: the record, for the other ops' launchers
int device_of(const void* data) { return detail::device_of(data); }
void report_pending(int device) { report_pending_slot_error(device); }
cuda::SlotErrorRecord* record(int device) { return error_record_for_device(device); }
unsigned long long* claim(int device) {
  static std::atomic<unsigned long long*> claims[kMaxDevices] = {};
  unsigned long long* p = claims[device].load(std::memory_order_acquire);
  if (p == nullptr) {
    void* address = nullptr;
    check(cudaGetSymbolAddress(&address, cuda::g_slot_error_claim), "cudaGetSymbolAddress");
    p = static_cast<unsigned long long*>(address);
    claims[device].store(p, std::memory_order_release);
  }
  return p;
}
}  // namespace cuda_slot_errors

BackendLimits cuda_limits() { return cuda_limits_values::value(); }

bool cuda_backend_available() {
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
}

void rope_pool_cuda(const RopePoolProblem& problem) { run(problem, {}); }

}  // namespace ropepool::detail

namespace ropepool {

void cuda_check_slot_errors(int device) {
  using namespace detail;
  if (device < 0) check(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= kMaxDevices)
    throw BackendError("rope_pool_fused: CUDA device " + std::to_string(device) +
                       " is beyond the " + std::to_string(kMaxDevices) + " this build supports");
  DeviceGuard guard(device);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  report_pending_slot_error(device);
}

}  // namespace ropepool
