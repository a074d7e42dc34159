// Internal interface of the CPU backend: the per-block Highway kernel, the vectorised
// sin/cos table and the thread pool they run on.
#pragma once

#include <cstdint>
#include <cstring>

#include "../backend.hpp"
#include "../test_hooks.hpp"

namespace ropepool::detail {
struct MlaProblem;  // ../mla_backend.hpp
}

namespace ropepool::detail::cpu {

/// Padding (in elements) of the inv_freq copy and of the sin/cos tables: a multiple of every
/// vector length Highway may pick (up to 2048-bit vectors), so table loops need no tail.
inline constexpr int64_t kTablePad = 64;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/// Partial rotary (SPEC §4): x[rotary_dim, head_dim) passes through unchanged into `out`
/// (and `out2` when not null). Every row kernel ends with this.
template <class T>
inline void copy_pass_through(const T* x, T* out, T* out2, int64_t rotary_dim, int64_t head_dim) {
  if (rotary_dim >= head_dim) return;
  const size_t rest = size_t(head_dim - rotary_dim) * sizeof(T);
  std::memcpy(out + rotary_dim, x + rotary_dim, rest);
  if (out2) std::memcpy(out2 + rotary_dim, x + rotary_dim, rest);
}

/// What every block of one call shares. Built once per call by rope_pool_cpu.
struct CallPlan {
  const RopePoolProblem* problem = nullptr;
  /// R/2 inverse frequencies followed by zeros up to `table_size` (a multiple of kTablePad).
  const double* inv_freq_padded = nullptr;
  int64_t table_size = 0;
  /// nullptr, or one flag per token: 1 when a later token of this call writes the same pool
  /// slot, so this token's pool write is skipped (deterministic "last token wins" when
  /// several threads write; only built for multithreaded calls without check_slots).
  const uint8_t* pool_write_superseded = nullptr;
  /// Non-temporal stores for q_out/k_out/pool rows: large calls whose outputs cannot stay in
  /// cache anyway, where skipping the read-for-ownership saves a third of the write traffic.
  bool stream_stores = false;
  /// How bfloat16 heads are normalised (SPEC §7): set_norm_rows, for tests.
  NormRows norm_rows = NormRows::kFused;
};

/// One flag per token (rope_pool_cpu.cpp): 1 when a later token of the call names the same
/// slot, so its pool write is skipped and, with several threads, the row is exactly the last
/// token's. O(T); the flags live in thread-local storage until this thread's next call.
const uint8_t* mark_superseded_pool_writes(const Index& slots, int64_t num_tokens);

/// One unit of work: tokens [token_begin, token_end) x heads [head_begin, head_end) of the
/// combined head list (q heads 0..Hq-1, then kv heads Hq..Hq+Hk-1; a kv head also copies its
/// v row and writes both pool rows).
struct Block {
  int64_t token_begin, token_end, head_begin, head_end;
};

/// cos_out[i] = scale * cos(pos * inv_freq[i]), sin_out likewise, for i < n (n a multiple of
/// kTablePad). The angle is formed and reduced mod 2*pi in double, then float32 sin/cos on
/// [-pi, pi] (Highway's vector Sin/Cos are only specified on about +-39000).
void sincos_table(const double* inv_freq, int64_t n, int64_t pos, float scale, float* cos_out,
                  float* sin_out);

/// The Highway kernel (runtime dispatch to the best target this CPU supports).
void run_block_hwy(const CallPlan& plan, const Block& block);

/// What every token run of one mla_rope_pool_fused call shares (SPEC §8). Built once per call
/// by mla_rope_pool_cpu (mla_kernel.cpp); the rows are rotated by mla_hwy-inl.h.
struct MlaPlan {
  const MlaProblem* problem = nullptr;
  /// As CallPlan's: R/2 inverse frequencies, then zeros up to a multiple of kTablePad.
  const double* inv_freq_padded = nullptr;
  float kv_scale = 1.0f;  // fp8 caches: read when the call runs
  /// nullptr, or 1 for a token whose cache row a later token of the call also writes (as
  /// CallPlan::pool_write_superseded).
  const uint8_t* superseded = nullptr;
  /// Non-temporal stores for q_pe_rot and the cache rows (as CallPlan::stream_stores).
  bool stream_stores = false;
};

/// Tokens [token_begin, token_end) of an MLA call (runtime dispatch, as run_block_hwy).
void mla_run_tokens_hwy(const MlaPlan& plan, int64_t token_begin, int64_t token_end);

/// The most threads a call uses: set_cpu_num_threads clamps to it (4 x hardware threads,
/// at least 8).
int max_cpu_threads();

/// Counters of the thread pool since the process started (for tests): workers started,
/// and worker wake-ups (one per worker a parallel call uses).
struct ThreadPoolStats {
  int64_t workers_started = 0;
  int64_t worker_wakeups = 0;
};
ThreadPoolStats thread_pool_stats();

/// Runs body(ctx, item) for every item in [0, num_items) on up to num_threads threads, the
/// caller included; returns when all items are done. Falls back to the calling thread alone
/// when another call is using the pool.
/// Wakes only the num_threads - 1 workers it uses.
void parallel_for(int num_threads, int64_t num_items, void (*body)(const void* ctx, int64_t item),
                  const void* ctx);

}  // namespace ropepool::detail::cpu
