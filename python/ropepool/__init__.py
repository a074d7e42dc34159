"""ropepool: NeoX RoPE on q and k plus the KV-cache pool write, fused in one pass.

    q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=10000.0)

Takes PyTorch tensors (CPU, and CUDA when built with the CUDA backend; registered as the
custom op ``torch.ops.ropepool.rope_pool_fused`` so ``torch.compile(fullgraph=True)``
traces it), NumPy arrays and other DLPack producers. See SPEC.md for the contract.
"""

from ropepool import _ropepool
from ropepool._op import rope_pool_fused

__version__: str = _ropepool.__version__

#: True when this build has the CUDA backend (CUDA tensors are rejected otherwise).
cuda_backend: bool = _ropepool.cuda_backend


def set_num_threads(n: int) -> None:
    """Sets the number of worker threads of the CPU backend (process-wide).

    ``n >= 1`` sets it; ``0`` restores the default (the ``ROPEPOOL_NUM_THREADS``
    environment variable, else all hardware threads).
    """
    _ropepool.set_num_threads(n)


def get_num_threads() -> int:
    """The number of worker threads the CPU backend uses."""
    return _ropepool.get_num_threads()


__all__ = [
    "rope_pool_fused",
    "set_num_threads",
    "get_num_threads",
    "cuda_backend",
    "__version__",
]
