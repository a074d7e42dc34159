// A small persistent thread pool for the CPU backend (std::thread; no OpenMP, whose runtime
// clashes with the libgomp that PyTorch ships).
//
// One parallel call at a time: a call that finds the pool busy (another application thread
// is inside rope_pool_fused) runs on its own thread instead of waiting. Workers are started
// on first use and grow to the largest thread count a call has used (bounded by
// max_cpu_threads()); they are never joined: the pool is leaked on purpose so that exit
// never waits on, or destroys, a blocked worker. After fork() the child starts a fresh pool
// (the parent's workers do not exist there).
//
// Each worker sleeps on its own condition variable, and a call wakes only the workers it
// uses: a call on 2 threads wakes 1 worker even when an earlier call (or a
// set_cpu_num_threads(64) in between) started 63. Waking every worker with one
// condition_variable::notify_all made each call pay for every worker ever started (all of
// them contending on one mutex to find out they had nothing to do), which is what made
// calls crawl while another thread changed the thread count in a loop (issue #9).
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_kernels.hpp"

namespace ropepool::detail::cpu {
namespace {

std::atomic<int64_t> g_workers_started{0};
std::atomic<int64_t> g_worker_wakeups{0};

class ThreadPool {
 public:
  // Caller holds call_mutex.
  void run(int num_threads, int64_t num_items, void (*body)(const void*, int64_t),
           const void* ctx) {
    const int num_workers = num_threads - 1;
    while (int(workers_.size()) < num_workers) {
      auto worker = std::make_unique<Worker>();
      Worker* w = worker.get();
      workers_.push_back(std::move(worker));
      std::thread([this, w] { worker_loop(*w); }).detach();
      g_workers_started.fetch_add(1, std::memory_order_relaxed);
    }
    // The job is published to each worker by its mutex (the worker reads it after locking).
    body_ = body;
    ctx_ = ctx;
    num_items_ = num_items;
    next_item_.store(0, std::memory_order_relaxed);
    pending_.store(num_workers, std::memory_order_relaxed);
    for (int i = 0; i < num_workers; ++i) {
      Worker& w = *workers_[size_t(i)];
      {
        std::lock_guard<std::mutex> lock(w.mutex);
        ++w.jobs;
      }
      w.wake.notify_one();
    }
    drain();
    // Wait for the workers; their last stores are ordered before the decrement (acq_rel).
    std::unique_lock<std::mutex> lock(done_mutex_);
    done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }

  std::mutex call_mutex;

 private:
  struct Worker {
    std::mutex mutex;
    std::condition_variable wake;
    uint64_t jobs = 0;  // calls that woke this worker (under mutex)
  };

  void drain() {
    for (;;) {
      const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
      if (item >= num_items_) return;
      body_(ctx_, item);
    }
  }

  void worker_loop(Worker& w) {
    uint64_t done = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(w.mutex);
        w.wake.wait(lock, [&] { return w.jobs != done; });
        done = w.jobs;
      }
      g_worker_wakeups.fetch_add(1, std::memory_order_relaxed);
      drain();
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(done_mutex_);
        done_.notify_one();
      }
    }
  }

  // Only grown, by the thread that holds call_mutex; a worker keeps a pointer to its own
  // entry, which never moves (unique_ptr).
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex done_mutex_;
  std::condition_variable done_;
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

ThreadPoolStats thread_pool_stats() {
  return {g_workers_started.load(std::memory_order_relaxed),
          g_worker_wakeups.load(std::memory_order_relaxed)};
}

void parallel_for(int num_threads, int64_t num_items, void (*body)(const void*, int64_t),
                  const void* ctx) {
  if (num_threads > num_items) num_threads = int(num_items);
  if (num_threads > max_cpu_threads()) num_threads = max_cpu_threads();
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
