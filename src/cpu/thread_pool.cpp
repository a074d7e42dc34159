// A small persistent thread pool for the CPU backend (std::thread; no OpenMP, whose runtime
// clashes with the libgomp that PyTorch ships).
//
// One parallel call at a time: a call that finds the pool busy (another application thread
// is inside rope_pool_fused) runs on its own thread instead of waiting. Workers are started
// on first use, grow to the largest thread count asked for, and are never joined: the pool
// is leaked on purpose so that exit never waits on, or destroys, a blocked worker. After
// fork() the child starts a fresh pool (the parent's workers do not exist there).
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_kernels.hpp"

namespace ropepool::detail::cpu {
namespace {

class ThreadPool {
 public:
  // Caller holds call_mutex.
  void run(int num_threads, int64_t num_items, void (*body)(const void*, int64_t),
           const void* ctx) {
    const int num_workers = num_threads - 1;
    while (int(workers_.size()) < num_workers) {
      const int index = int(workers_.size());
      workers_.emplace_back([this, index] { worker_loop(index); });
      workers_.back().detach();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = body;
      ctx_ = ctx;
      num_items_ = num_items;
      next_item_.store(0, std::memory_order_relaxed);
      participants_ = num_workers;
      pending_.store(num_workers, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    drain();
    // Wait for the workers; their last stores are ordered before the decrement (acq_rel).
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }

  std::mutex call_mutex;

 private:
  void drain() {
    for (;;) {
      const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
      if (item >= num_items_) return;
      body_(ctx_, item);
    }
  }

  void worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        if (index >= participants_) continue;  // this call asked for fewer threads
      }
      drain();
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> generation_{0};
  int participants_ = 0;
  std::atomic<int> pending_{0};
  void (*body_)(const void*, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t num_items_ = 0;
  std::atomic<int64_t> next_item_{0};
};

std::atomic<ThreadPool*> g_pool{nullptr};

// The child has none of the parent's workers, and the pool's mutexes may have been held by a
// parent thread at the fork: drop (leak) the old pool and let the next call build a new one.
void forget_pool_after_fork() { g_pool.store(nullptr, std::memory_order_relaxed); }

ThreadPool* pool() {
  if (ThreadPool* p = g_pool.load(std::memory_order_acquire)) return p;
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_after_fork); });
  // Workers start lazily in run(), so a pool that loses the race is freed with no threads.
  auto* fresh = new ThreadPool();  // leaked on purpose, see the file comment
  ThreadPool* expected = nullptr;
  if (g_pool.compare_exchange_strong(expected, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;
  return expected;
}

}  // namespace

void parallel_for(int num_threads, int64_t num_items, void (*body)(const void*, int64_t),
                  const void* ctx) {
  if (num_threads > num_items) num_threads = int(num_items);
  if (num_threads > 1) {
    ThreadPool* p = pool();
    std::unique_lock<std::mutex> lock(p->call_mutex, std::try_to_lock);
    if (lock.owns_lock()) {
      p->run(num_threads, num_items, body, ctx);
      return;
    }
  }
  for (int64_t item = 0; item < num_items; ++item) body(ctx, item);
}

}  // namespace ropepool::detail::cpu
