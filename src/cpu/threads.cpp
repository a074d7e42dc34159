// The CPU backend's thread count: process-wide, read by every call and settable from any
// thread at any time (an atomic: a call uses the value it reads once at its start).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>

#include "cpu_kernels.hpp"
#include "ropepool/rope_pool.hpp"

namespace ropepool {
namespace detail::cpu {

// More threads than hardware threads never speed up a memory-bound op; the bound leaves room
// for deliberate oversubscription (tests run 8 threads on 2 cores) but keeps a huge n from
// starting thousands of workers.
int max_cpu_threads() {
  static const int cap = [] {
    const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
    return std::max(8, 4 * hw);
  }();
  return cap;
}

}  // namespace detail::cpu

namespace {
int default_threads() {
  int n = 0;
  if (const char* env = std::getenv("ROPEPOOL_NUM_THREADS")) n = std::atoi(env);
  if (n <= 0) n = int(std::max(1u, std::thread::hardware_concurrency()));
  return std::min(n, detail::cpu::max_cpu_threads());
}
std::atomic<int> g_threads{default_threads()};
}  // namespace

int cpu_num_threads() { return g_threads.load(std::memory_order_relaxed); }
void set_cpu_num_threads(int n) {
  g_threads.store(n > 0 ? std::min(n, detail::cpu::max_cpu_threads()) : default_threads(),
                  std::memory_order_relaxed);
}
}  // namespace ropepool
