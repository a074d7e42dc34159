"""The JAX front end (SPEC §9): ``rope_pool_fused`` on ``jax.Array``s through the XLA FFI.

    import jax, ropepool.jax

    step = jax.jit(functools.partial(ropepool.jax.rope_pool_fused, head_dim=128,
                                     num_qo_heads=32, num_kv_heads=8, rope_base=500000.0),
                   donate_argnums=(5, 6))
    q_rot, k_rot, k_pool, v_pool = step(q, k, v, positions, slots, k_pool, v_pool)

JAX's semantics, not mutation behind its back: the returned pools are new arrays. XLA
aliases the pool operands to the pool results, so with the pools donated
(``donate_argnums``) the op writes into the caller's buffers and nothing is copied; without
donation XLA copies the pools first and the caller's arrays keep their values.

The handlers (python/src/jax.cpp) are registered for the ``cpu`` platform (ropepool's CPU
backend) and, in builds with the CUDA backend, for ``CUDA`` (ropepool's CUDA backend on
the XLA stream of the computation). This module imports only in builds that found jaxlib's
FFI headers (ROPEPOOL_WITH_JAX, README "JAX").
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Tuple

import jax
import numpy as np

from ropepool import _ropepool
from ropepool._op import _TENSOR_ARGS, _scalars
from ropepool._schedule import RopeSchedule

if not getattr(_ropepool, "jax_front_end", False):
    raise ImportError(
        "ropepool.jax: this build of ropepool has no JAX front end (jaxlib's FFI headers were "
        "not found when it was built); reinstall it with jax installed: "
        "pip install --no-build-isolation .  (README, \"JAX\")")

#: The XLA FFI target name of the op.
TARGET = "ropepool_rope_pool_fused"

#: The XLA platforms with a handler: "cpu", plus "CUDA" in builds with the CUDA backend.
platforms: Tuple[str, ...] = ()
for _platform, _capsule in _ropepool.jax_ffi_handlers().items():
    jax.ffi.register_ffi_target(TARGET, _capsule, platform=_platform)
    platforms += (_platform,)
del _platform, _capsule

# One ffi_call per aliasing pattern: operands (q, k, v, positions, slots, k_pool, v_pool),
# results (q_rot, k_rot, k_pool, v_pool); inplace also aliases q and k to q_rot and k_rot.
_POOL_ALIASES = {5: 2, 6: 3}
_INPLACE_ALIASES = {0: 0, 1: 1, 5: 2, 6: 3}


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
    rotary_dim: Optional[int] = None,
    interleaved: bool = False,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
    original_max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    inv_freq: Any = None,
    attention_scaling: Optional[float] = None,
    schedule: Optional[RopeSchedule] = None,
    inplace: bool = False,
    check_slots: bool = False,
) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`ropepool.rope_pool_fused` for JAX: the same arguments and keywords (SPEC §1,
    §4), ``jax.Array``s in and out, usable under ``jax.jit``.

    Returns ``(q_rot, k_rot, k_pool, v_pool)``, all new arrays: q_rot/k_rot of q's dtype,
    and the pools with the rotated k and v written at ``slots``. The pool operands are
    aliased to the returned pools, so a caller that donates them (``jax.jit(...,
    donate_argnums=(5, 6))``) gets its own buffers back, written in place, with no copy;
    otherwise XLA copies them and the caller's arrays keep their values. ``inplace=True``
    aliases q and k to q_rot and k_rot the same way (donate them too to save the copy).

    Shapes, dtypes and keywords are validated when the call is traced, with the SPEC §2
    messages (``ValueError``; shapes printed as JAX prints them). Slot values are data: a
    slot >= the pool size is never written and the computation fails with
    ``jax.errors.JaxRuntimeError`` naming it (SPEC §3, §9); so does the CPU angle limit of
    SPEC §1 for int64 positions. positions/slots are int32, or int64 with JAX's x64 mode.
    ``inv_freq`` and ``schedule`` are constants baked into the compiled call (a NumPy array,
    or a jax.Array outside of tracing). Neither ``jax.grad`` nor ``jax.vmap`` applies (a
    KV-cache write has no derivative; batch the tokens instead): both raise.
    """
    operands = (q, k, v, positions, slots, k_pool, v_pool)
    for name, x in zip(_TENSOR_ARGS, operands):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"rope_pool_fused: {name} must be an array (jax.Array or NumPy), "
                            f"got {type(x).__name__}")
    if inv_freq is not None and isinstance(inv_freq, jax.core.Tracer):
        raise TypeError(
            "rope_pool_fused: inv_freq must be a constant (a NumPy array, or a jax.Array "
            "outside of jax.jit): the schedule is baked into the compiled call; make it "
            "once with ropepool.rope_schedule(...) and pass schedule=")
    if isinstance(inv_freq, jax.Array):
        inv_freq = np.asarray(inv_freq)
    head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, sched_freqs, sched_scale = \
        _scalars(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, rope_scaling,
                 max_position_embeddings, original_max_position_embeddings, seq_len, inv_freq,
                 attention_scaling, schedule)
    interleaved, inplace, check_slots = bool(interleaved), bool(inplace), bool(check_slots)

    _ropepool.jax_validate(
        [tuple(int(d) for d in x.shape) for x in operands],
        [np.dtype(x.dtype).name for x in operands], _platform_of(operands),
        inplace=inplace, head_dim=head_dim, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, rope_base=rope_base, rotary_dim=rotary_dim,
        interleaved=interleaved, schedule_inv_freq=sched_freqs,
        schedule_attention_scaling=sched_scale, check_slots=check_slots)

    # The keywords as a hashable key of the jit cache below: a call outside jax.jit then
    # traces once per distinct call, not on every call.
    keywords = (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, interleaved,
                None if sched_freqs is None else tuple(sched_freqs), sched_scale, check_slots)
    return _call(*operands, keywords=keywords, inplace=inplace)


@functools.partial(jax.jit, static_argnames=("keywords", "inplace"))
def _call(q, k, v, positions, slots, k_pool, v_pool, *, keywords, inplace):
    (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, interleaved, sched_freqs,
     sched_scale, check_slots) = keywords
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, k_pool, v_pool))
    call = jax.ffi.ffi_call(TARGET, results,
                            input_output_aliases=_INPLACE_ALIASES if inplace else _POOL_ALIASES,
                            vmap_method=None)
    # The FFI attributes, typed explicitly (a Python int would follow the x64 mode). An
    # empty inv_freq means the default schedule of rope_base, made by the handler.
    attributes = dict(
        head_dim=np.int64(head_dim), num_qo_heads=np.int64(num_qo_heads),
        num_kv_heads=np.int64(num_kv_heads), rope_base=np.float64(rope_base),
        rotary_dim=np.int64(rotary_dim), interleaved=np.bool_(interleaved),
        inv_freq=np.asarray(sched_freqs if sched_freqs is not None else [], np.float64),
        attention_scaling=np.float64(sched_scale), check_slots=np.bool_(check_slots))

    # jax.grad and jax.vmap would otherwise fail inside ffi_call with messages about its
    # own parameters; these rules say what the op is instead. Neither changes the lowering
    # (one custom call, its aliases intact).
    @jax.custom_jvp
    @jax.custom_batching.custom_vmap
    def op(*args):
        return tuple(call(*args, **attributes))

    op.def_vmap(_no_vmap)
    op.defjvp(_no_grad)
    return op(q, k, v, positions, slots, k_pool, v_pool)


def _no_vmap(axis_size, in_batched, *args):
    raise ValueError(
        "rope_pool_fused does not support jax.vmap: it writes one KV-cache pool per call; "
        "fold the batch into the token axis (q [T, Hq, D] with one slot per token), or call "
        "it once per pool")


def _no_grad(primals, tangents):
    raise ValueError(
        "rope_pool_fused has no derivative (a KV-cache write, SPEC §9): jax.grad, jax.jvp and "
        "jax.vjp do not apply; pass its inputs through jax.lax.stop_gradient where no "
        "gradient should flow, or differentiate a reference RoPE")


def _platform_of(operands) -> str:
    """The platform validation checks the backend limits for (SPEC §5): that of the first
    operand placed on a device, else (tracers under jax.jit) JAX's default backend. The
    handler validates again when it runs, on the platform that runs it."""
    platform = None
    for x in operands:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            try:
                platform = next(iter(x.devices())).platform
            except Exception:  # an array without devices (deleted, ...): keep looking
                continue
            break
    if platform is None:
        platform = jax.default_backend()
    return {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(platform, platform)


__all__ = ["rope_pool_fused", "TARGET", "platforms"]
