"""The user-facing op: output allocation with the caller's framework, the torch custom op.

The C++ core (``_ropepool.rope_pool_fused_into``) never allocates and validates every
argument itself (SPEC §2); this layer only allocates q_rot/k_rot like the inputs, picks the
CUDA stream, and returns the caller's own pool objects.
"""

from __future__ import annotations

import numbers
import operator
import sys
from typing import Any, Tuple

from ropepool import _ropepool

try:
    import torch
except ImportError:  # NumPy / DLPack use needs no torch
    torch = None

_TENSOR_ARGS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")


def rope_pool_fused(
    q: Any,
    k: Any,
    v: Any,
    positions: Any,
    slots: Any,
    k_pool: Any,
    v_pool: Any,
    *,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    rope_base: float,
    check_slots: bool = False,
) -> Tuple[Any, Any, Any, Any]:
    """Applies NeoX RoPE to q and k and writes rotated k and v into the KV-cache pools.

    Args:
        q: ``[T, num_qo_heads, head_dim]`` float32, float16 or bfloat16.
        k, v: ``[T, num_kv_heads, head_dim]``, same dtype as q.
        positions: ``[T]`` int32 or int64, the token positions.
        slots: ``[T]`` int32 or int64, the pool row of each token; a negative slot means
            "no pool write" for that token.
        k_pool, v_pool: ``[P, num_kv_heads, head_dim]``, same dtype as q, updated in place.
        head_dim, num_qo_heads, num_kv_heads: the head geometry (checked against shapes).
        rope_base: the RoPE base (theta), finite and > 0.
        check_slots: also reject two tokens writing the same slot (otherwise the row ends
            up holding one of those tokens' complete rows).

    Returns:
        ``(q_rot, k_rot, k_pool, v_pool)``: q_rot and k_rot are new contiguous arrays of
        q's framework, dtype and device; k_pool and v_pool are the very objects passed in.

    Arrays are PyTorch tensors (CPU; CUDA with the CUDA backend, run on the current stream
    of their device) or any DLPack / buffer-protocol producer (NumPy, ...); they are never
    converted or copied. Raises ValueError with the SPEC §2 message (extra help in the
    exception's ``__notes__``), TypeError for arguments that are not arrays, RuntimeError
    for backend failures. Nothing is written when an error is raised.
    """
    tensors = (q, k, v, positions, slots, k_pool, v_pool)
    head_dim = operator.index(head_dim)
    num_qo_heads = operator.index(num_qo_heads)
    num_kv_heads = operator.index(num_kv_heads)
    if not isinstance(rope_base, numbers.Real):
        raise TypeError(
            f"rope_pool_fused: rope_base must be a real number, got {type(rope_base).__name__}"
        )
    rope_base = float(rope_base)
    check_slots = bool(check_slots)

    if torch is not None and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) \
            and isinstance(v, torch.Tensor) and isinstance(positions, torch.Tensor) \
            and isinstance(slots, torch.Tensor) and isinstance(k_pool, torch.Tensor) \
            and isinstance(v_pool, torch.Tensor):
        # Through the custom op, so torch.compile sees one opaque call that mutates the
        # pools. A custom op cannot return its mutated inputs, so the pools are returned
        # here, as the caller's own objects.
        q_rot, k_rot = torch.ops.ropepool.rope_pool_fused(
            q, k, v, positions, slots, k_pool, v_pool,
            head_dim, num_qo_heads, num_kv_heads, rope_base, check_slots,
        )
        return q_rot, k_rot, k_pool, v_pool
    if torch is not None and any(isinstance(t, torch.Tensor) for t in tensors):
        name, t = next((name, t) for name, t in zip(_TENSOR_ARGS, tensors)
                       if not isinstance(t, torch.Tensor))
        raise TypeError(
            f"rope_pool_fused: {name} is a {type(t).__name__} but other arguments are "
            "torch.Tensors; pass every array as a torch.Tensor"
        )

    q_rot = _new_array_output(q, "q")
    k_rot = _new_array_output(k, "k")
    _ropepool.rope_pool_fused_into(
        q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot,
        head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        rope_base=rope_base, check_slots=check_slots, stream=0,
    )
    return q_rot, k_rot, k_pool, v_pool


def _new_array_output(x: Any, name: str) -> Any:
    """An uninitialised C-contiguous array like x, made by x's own framework: its array-API
    namespace (NumPy 2, ...), else the module that defines its type (CuPy, NumPy 1: on the
    current device; arrays elsewhere are rejected by validation, not moved)."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"rope_pool_fused: {name} must be an array (torch.Tensor, numpy.ndarray or "
            f"another DLPack producer), got {type(x).__name__}"
        )
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is not None:
        xp = namespace()
        device = getattr(x, "device", None)
        if device is not None:
            return xp.empty(shape, dtype=dtype, device=device)
        return xp.empty(shape, dtype=dtype)
    xp = sys.modules.get(type(x).__module__.partition(".")[0])
    if xp is None or not callable(getattr(xp, "empty", None)):
        raise TypeError(
            f"rope_pool_fused: cannot allocate q_rot/k_rot like a {type(x).__name__}: its "
            "framework has no array-API namespace or `empty`"
        )
    return xp.empty(shape, dtype=dtype)


if torch is not None:

    def _new_torch_output(x: "torch.Tensor") -> "torch.Tensor":
        """q_rot/k_rot: uninitialised, contiguous, q's dtype and device."""
        return torch.empty_like(x, memory_format=torch.contiguous_format)  # 2x torch.empty's speed

    # The op is defined with torch.library's low-level API rather than the
    # @torch.library.custom_op decorator: the schema says the same thing (k_pool and v_pool
    # mutated in place: `Tensor(a!)`), torch.compile treats both alike, but the decorator's
    # Python autograd and ADInplaceOrView layers cost ~20 us per eager call against ~1.5 us
    # here, which matters for a decode step that launches a few-microsecond kernel.
    _LIB = torch.library.Library("ropepool", "DEF")
    _LIB.define(
        "rope_pool_fused(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor slots, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, int head_dim, int num_qo_heads, "
        "int num_kv_heads, float rope_base, bool check_slots) -> (Tensor, Tensor)"
    )
    _to_dlpack = torch._C._to_dlpack
    _increment_version = torch._C._increment_version
    # The raw getters inductor's generated code uses: ~10x cheaper than torch.cuda's wrappers.
    _current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                                  lambda device: torch.cuda.current_stream(device).cuda_stream)
    _current_device = getattr(torch._C, "_cuda_getDevice", lambda: torch.cuda.current_device())

    def _rope_pool_fused_kernel(q, k, v, positions, slots, k_pool, v_pool, head_dim,
                                num_qo_heads, num_kv_heads, rope_base, check_slots):
        q_rot = _new_torch_output(q)
        k_rot = _new_torch_output(k)
        args = (q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot)
        kwargs = dict(head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                      rope_base=rope_base, check_slots=check_slots, exporter=_to_dlpack)
        if q.is_cuda:
            # The kernel runs on torch's current stream of q's device, like any torch op
            # (and so inside CUDA-graph capture).
            device = q.device.index
            stream = _current_raw_stream(device)  # = current_stream(device).cuda_stream
            if device == _current_device():
                _ropepool.rope_pool_fused_into(*args, **kwargs, stream=stream)
            else:
                with torch.cuda.device(q.device):
                    _ropepool.rope_pool_fused_into(*args, **kwargs, stream=stream)
        else:
            _ropepool.rope_pool_fused_into(*args, **kwargs, stream=0)
        # What the decorator's ADInplaceOrView layer would do: tell autograd the pools were
        # written in place (a no-op for inference-mode tensors, which have no version).
        _increment_version((k_pool, v_pool))
        return q_rot, k_rot

    # One kernel for every backend key (CPU, CUDA, ...): the C++ side dispatches on the
    # tensors' device itself and rejects what it cannot run.
    _LIB.impl("rope_pool_fused", _rope_pool_fused_kernel, "CompositeExplicitAutograd")

    @torch.library.register_fake("ropepool::rope_pool_fused", lib=_LIB)
    def _rope_pool_fused_fake(q, k, v, positions, slots, k_pool, v_pool, head_dim,
                              num_qo_heads, num_kv_heads, rope_base, check_slots):
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty_like(k, memory_format=torch.contiguous_format))
