"""ropepool: NeoX RoPE on q and k plus the KV-cache pool write, fused in one pass.

    q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=10000.0)

Takes PyTorch tensors (CPU, and CUDA when built with the CUDA backend; registered as the
custom op ``torch.ops.ropepool.rope_pool_fused`` so ``torch.compile(fullgraph=True)``
traces it), NumPy arrays and other DLPack producers. The contract is docs/SPEC.md in the source
repository.
"""

from ropepool import _ropepool
from ropepool._mla import mla_rope_pool_fused, validate_mla_rope_pool
from ropepool._op import rope_pool_fused, validate_rope_pool
from ropepool._schedule import RopeSchedule, rope_schedule

__version__: str = _ropepool.__version__

#: True when this build has the CUDA backend (CUDA tensors are rejected otherwise).
cuda_backend: bool = _ropepool.cuda_backend


def set_num_threads(n: int) -> None:
    """Sets the number of worker threads of the CPU backend (process-wide).

    ``n >= 1`` sets it, clamped to 4 x the hardware threads (at least 8); ``0`` restores
    the default (the ``ROPEPOOL_NUM_THREADS`` environment variable, else all hardware
    threads). Safe to call from any thread while calls run; it does not hold the GIL.
    """
    _ropepool.set_num_threads(n)


def get_num_threads() -> int:
    """The number of worker threads the CPU backend uses."""
    return _ropepool.get_num_threads()


def cuda_check_slot_errors(device: int = -1) -> None:
    """Raises RuntimeError for an out-of-range slot met by an earlier CUDA call.

    Without ``check_slots``, a CUDA call never waits for the GPU: a token whose slot is
    >= the pool size gets no pool write, and the error is reported by the next
    ``rope_pool_fused`` call on that device or by this function, which first waits for all
    work on ``device`` (an index; -1 = the current device). A no-op without the CUDA backend.
    """
    if hasattr(device, "index"):  # a torch.device
        device = -1 if device.index is None else device.index
    _ropepool.cuda_check_slot_errors(int(device))


__all__ = [
    "rope_pool_fused",
    "validate_rope_pool",
    "mla_rope_pool_fused",
    "validate_mla_rope_pool",
    "rope_schedule",
    "RopeSchedule",
    "set_num_threads",
    "get_num_threads",
    "cuda_check_slot_errors",
    "cuda_backend",
    "__version__",
]
