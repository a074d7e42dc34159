// Built when the CUDA backend is off: CUDA tensors are rejected during validation.
#include "../mla_backend.hpp"
#include "ropepool/error.hpp"

namespace ropepool::detail {
void mla_rope_pool_cuda(const MlaProblem&) {
  throw BackendError("mla_rope_pool_fused: ropepool was built without its CUDA backend");
}
}  // namespace ropepool::detail
