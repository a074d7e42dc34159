#include <cstdlib>
#include <thread>

#include "ropepool/rope_pool.hpp"

namespace ropepool {
namespace {
int initial_threads() {
  if (const char* env = std::getenv("ROPEPOOL_NUM_THREADS"); env && std::atoi(env) > 0)
    return std::atoi(env);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(hw) : 1;
}
int g_threads = initial_threads();
}  // namespace

int cpu_num_threads() { return g_threads; }
void set_cpu_num_threads(int n) { g_threads = n > 0 ? n : initial_threads(); }
}  // namespace ropepool
