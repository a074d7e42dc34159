// CUDA-specific public API. Declared in every build; without the CUDA backend the functions
// exist and do nothing (no CUDA call can have been made).
#pragma once

namespace ropepool {

/// Out-of-range slots on CUDA (SPEC §3). Without `check_slots`, a CUDA call never waits for
/// the device: a token whose slot is >= the pool size gets no pool write, and the kernel
/// records the first such (token, slot, pool size) in host-visible memory. The next
/// rope_pool_fused call on that device reads the record (without synchronising) and throws
/// ropepool::BackendError describing it, before doing any work; so does this function,
/// which first waits for all work on `device` (cudaDeviceSynchronize) so that every earlier
/// call is accounted for. `device` < 0 means the current device. Reporting clears the record.
/// Throws BackendError on a CUDA error as well.
void cuda_check_slot_errors(int device = -1);

}  // namespace ropepool
