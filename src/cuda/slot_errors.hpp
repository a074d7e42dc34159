// The slot-error record of the CUDA backend (SPEC §3 without a device sync), shared by every
// op's kernel: a kernel never writes a row for an out-of-range slot and records the first
// such (token, slot, pool size) here; the next call on the device reports it. The record and
// the reporting live in rope_pool_cuda.cu; this header lets other launchers use them.
#pragma once

#include <cstdint>

namespace ropepool::cuda {

/// The first out-of-range slot seen by any call on a device since the host last looked.
/// Lives in mapped pinned host memory so the host reads it without a device sync.
struct SlotErrorRecord {
  unsigned long long seq_written;  ///< device: bumped after token/slot/pool_size are written
  long long token;
  long long slot;
  long long pool_size;
  unsigned long long seq_acked;  ///< host: the last seq_written it reported
};

}  // namespace ropepool::cuda

namespace ropepool::detail::cuda_slot_errors {

/// The device that owns `data` (device or managed memory); throws BackendError otherwise.
int device_of(const void* data);
/// Throws BackendError for (and clears) a bad slot an earlier call recorded on `device`.
/// Reads host memory only: no synchronisation.
void report_pending(int device);
/// Device pointer of `device`'s record (the current device must be `device`).
cuda::SlotErrorRecord* record(int device);
/// Device address of the claim counter that lets exactly one thread write the record per
/// acknowledgement (the current device must be `device`). Every kernel that records slot
/// errors must claim through this one counter.
unsigned long long* claim(int device);

}  // namespace ropepool::detail::cuda_slot_errors
