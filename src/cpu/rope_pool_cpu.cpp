// CPU backend entry: plans one call (threads, blocks, duplicate slots, store policy) and runs
// the SIMD kernel on the persistent thread pool. The math is in kernel_hwy-inl.h.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <vector>

#include "cpu_kernels.hpp"
#include "ropepool/rope_pool.hpp"

namespace ropepool::detail {
namespace cpu {
namespace {

// Below this much memory traffic a call runs on the calling thread: waking a worker costs
// 5-50 microseconds (more in a VM), as long as one core needs to move ~this many bytes. Above
// it, one thread per this many bytes at most, so a big machine does not wake 100 workers for
// a few megabytes of a memory-bound op.
constexpr int64_t kParallelMinBytes = 1 << 20;
std::atomic<int64_t> g_parallel_min_bytes{kParallelMinBytes};

// Calls moving at least this much use non-temporal stores (rows must be vector-aligned, as
// framework tensors are). Their outputs (32 MiB of q_rot at 4096 tokens of 32 bf16 heads)
// cannot stay in cache for the next op anyway, and skipping the read-for-ownership of every
// written line (and of the randomly placed pool rows) is worth up to ~2x there
// (docs/NOTES.md); small calls (decode) keep their outputs in cache for the next op.
constexpr int64_t kStreamMinBytes = 16 << 20;
std::atomic<int64_t> g_stream_min_bytes{kStreamMinBytes};

std::atomic<NormRows> g_norm_rows{NormRows::kFused};

}  // namespace

// With several threads, tokens that share a slot may be processed concurrently. Mark every
// such token except the last one so exactly one complete row reaches the pool ("last token
// wins", as in a sequential pass). One O(T) pass over an open-addressing table of
// (slot -> latest token); scratch grows with T, never with the pool.
const uint8_t* mark_superseded_pool_writes(const Index& slots, int64_t num_tokens) {
  thread_local std::vector<uint8_t> superseded;
  thread_local std::vector<int64_t> keys;
  thread_local std::vector<int64_t> latest;
  superseded.assign(size_t(num_tokens), 0);
  size_t capacity = 16;
  while (capacity < size_t(2 * num_tokens)) capacity *= 2;
  keys.assign(capacity, -1);
  if (latest.size() < capacity) latest.resize(capacity);
  const size_t mask = capacity - 1;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    size_t i = size_t(uint64_t(slot) * 0x9E3779B97F4A7C15ull >> 32) & mask;
    while (keys[i] != -1 && keys[i] != slot) i = (i + 1) & mask;
    if (keys[i] == slot) superseded[size_t(latest[i])] = 1;
    keys[i] = slot;
    latest[i] = t;
  }
  return superseded.data();
}

namespace {

struct ParallelWork {
  const CallPlan* plan;
  void (*run_block)(const CallPlan&, const Block&);
  int64_t tokens_per_item;  // > 1 only when heads are not split
  int64_t head_groups;      // > 1 only when tokens_per_item == 1
  int64_t num_tokens, num_heads;
};

void run_item(const void* ctx, int64_t item) {
  const auto& w = *static_cast<const ParallelWork*>(ctx);
  const int64_t chunk = item / w.head_groups, group = item % w.head_groups;
  Block b;
  b.token_begin = chunk * w.tokens_per_item;
  b.token_end = std::min(w.num_tokens, b.token_begin + w.tokens_per_item);
  b.head_begin = group * w.num_heads / w.head_groups;
  b.head_end = (group + 1) * w.num_heads / w.head_groups;
  w.run_block(*w.plan, b);
}

}  // namespace

void set_stream_min_bytes(int64_t bytes) { g_stream_min_bytes.store(bytes, std::memory_order_relaxed); }
int64_t stream_min_bytes() { return g_stream_min_bytes.load(std::memory_order_relaxed); }
void set_parallel_min_bytes(int64_t bytes) {
  g_parallel_min_bytes.store(std::max<int64_t>(1, bytes), std::memory_order_relaxed);
}
int64_t parallel_min_bytes() { return g_parallel_min_bytes.load(std::memory_order_relaxed); }
void set_norm_rows(NormRows rows) { g_norm_rows.store(rows, std::memory_order_relaxed); }
NormRows norm_rows() { return g_norm_rows.load(std::memory_order_relaxed); }

}  // namespace cpu

BackendLimits cpu_limits() {
  BackendLimits l;
  l.name = "cpu";
  l.max_angle = kMaxAngle;  // kernel_hwy-inl.h: the angle in double, one-rounding reduction
  return l;
}

void rope_pool_cpu(const RopePoolProblem& p) {
  using namespace cpu;
  assert(p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim);
  const int64_t T = p.num_tokens, half = p.rotary_dim / 2;
  const int64_t num_heads = p.num_qo_heads + p.num_kv_heads;
  if (T == 0) return;

  // inv_freq padded with zeros so the table loops run on whole vectors.
  thread_local std::vector<double> inv_freq_padded;
  const int64_t table_size = round_up(half, kTablePad);
  inv_freq_padded.assign(size_t(table_size), 0.0);
  std::copy(p.inv_freq, p.inv_freq + half, inv_freq_padded.begin());

  CallPlan plan;
  plan.problem = &p;
  plan.inv_freq_padded = inv_freq_padded.data();
  plan.table_size = table_size;
  auto* run_block = run_block_hwy;

  // Each tensor at its own element size (fp8 pools and q_rot: one byte).
  const int64_t es = int64_t(dtype_size(p.dtype)), pool_es = int64_t(dtype_size(p.pool_dtype)),
                q_out_es = int64_t(dtype_size(p.q_out_dtype));
  const int64_t bytes = T * p.head_dim *
                        ((es + q_out_es) * p.num_qo_heads + (3 * es + 2 * pool_es) * p.num_kv_heads);
  plan.stream_stores = stream_min_bytes() >= 0 && bytes >= stream_min_bytes();
  plan.norm_rows = norm_rows();
  const int threads = int(std::clamp<int64_t>(bytes / parallel_min_bytes(), 1,
                                             std::max(1, cpu_num_threads())));
  if (threads == 1) {
    run_block(plan, Block{0, T, 0, num_heads});
    return;
  }
  if (!p.check_slots) plan.pool_write_superseded = mark_superseded_pool_writes(p.slots, T);

  // A few items per thread so a thread slowed by other work on the machine is balanced by
  // the others; tokens in contiguous runs (streaming reads), heads split only when there are
  // too few tokens (decode batches).
  const int64_t target_items = int64_t(threads) * 8;
  ParallelWork work{&plan, run_block, 1, 1, T, num_heads};
  int64_t num_items;
  if (T >= target_items) {
    work.tokens_per_item = (T + target_items - 1) / target_items;
    num_items = (T + work.tokens_per_item - 1) / work.tokens_per_item;
  } else {
    work.head_groups = std::min(num_heads, (target_items + T - 1) / T);
    num_items = T * work.head_groups;
  }
  parallel_for(threads, num_items, run_item, &work);
}

}  // namespace ropepool::detail
