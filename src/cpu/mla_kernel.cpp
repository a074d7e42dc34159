// CPU backend of mla_rope_pool_fused (SPEC §8): plans one call (threads, repeated slots,
// store policy) and runs the SIMD rows (mla_hwy-inl.h, compiled with kernel_hwy-inl.h on
// rope_pool_fused's helpers) over contiguous token runs on the library's thread pool.
#include <algorithm>
#include <vector>

#include "../mla_backend.hpp"
#include "../test_hooks.hpp"
#include "cpu_kernels.hpp"
#include "ropepool/rope_pool.hpp"

namespace ropepool::detail {
namespace cpu {
namespace {

struct ParallelWork {
  MlaPlan plan;
  int64_t tokens_per_item;
};

void run_item(const void* ctx, int64_t item) {
  const auto& w = *static_cast<const ParallelWork*>(ctx);
  const int64_t t0 = item * w.tokens_per_item;
  mla_run_tokens_hwy(w.plan, t0, std::min(w.plan.problem->num_tokens, t0 + w.tokens_per_item));
}

}  // namespace
}  // namespace cpu

void mla_rope_pool_cpu(const MlaProblem& p) {
  using namespace cpu;
  const int64_t T = p.num_tokens, half = p.rope_dim / 2;
  if (T == 0) return;
  thread_local std::vector<double> inv_freq_padded;
  inv_freq_padded.assign(size_t(round_up(half, kTablePad)), 0.0);
  std::copy(p.inv_freq, p.inv_freq + half, inv_freq_padded.begin());

  MlaPlan plan;
  plan.problem = &p;
  plan.inv_freq_padded = inv_freq_padded.data();
  plan.kv_scale = p.kv_scale.ptr ? *p.kv_scale.ptr : p.kv_scale.value;  // read when the call runs

  // Each tensor at its own element size, as rope_pool_fused counts its traffic; k_out counts
  // when it is not written too (return_k_rot=False), so such a call is planned as the call
  // with k_pe_rot, as rope_pool_cpu plans one.
  const int64_t es = int64_t(dtype_size(p.dtype)), cache_es = int64_t(dtype_size(p.cache_dtype));
  const int64_t bytes =
      T * (es * (2 * p.num_heads * p.rope_dim + 2 * p.rope_dim + p.latent_dim) +
           cache_es * (p.latent_dim + p.rope_dim));
  plan.stream_stores = stream_min_bytes() >= 0 && bytes >= stream_min_bytes();
  const int threads =
      int(std::clamp<int64_t>(bytes / parallel_min_bytes(), 1, std::max(1, cpu_num_threads())));
  if (threads == 1 || T == 1) {
    mla_run_tokens_hwy(plan, 0, T);
    return;
  }
  if (!p.check_slots) plan.superseded = mark_superseded_pool_writes(p.slots, T);
  // A few items per thread, in contiguous token runs (streaming reads), as rope_pool_cpu.
  const int64_t target_items = int64_t(threads) * 8;
  const ParallelWork work{plan, std::max<int64_t>(1, (T + target_items - 1) / target_items)};
  parallel_for(threads, (T + work.tokens_per_item - 1) / work.tokens_per_item, run_item, &work);
}

}  // namespace ropepool::detail
