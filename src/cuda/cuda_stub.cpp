// Built when the CUDA backend is off: CUDA tensors are rejected during validation.
#include "../backend.hpp"
#include "limits.hpp"
#include "ropepool/cuda.hpp"
#include "ropepool/error.hpp"

namespace ropepool::detail {
bool cuda_backend_available() { return false; }
BackendLimits cuda_limits() { return cuda_limits_values::value(); }
void rope_pool_cuda(const RopePoolProblem&) {
  throw BackendError("rope_pool_fused: ropepool was built without its CUDA backend");
}
}  // namespace ropepool::detail

namespace ropepool {
// No CUDA call can have been made, so no slot error can be pending.
void cuda_check_slot_errors(int) {}
}  // namespace ropepool
