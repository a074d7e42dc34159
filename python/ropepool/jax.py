"""The JAX front end (SPEC §9): ``rope_pool_fused`` and ``mla_rope_pool_fused`` on
``jax.Array``s through the XLA FFI.

    import jax, ropepool.jax

    step = jax.jit(functools.partial(ropepool.jax.rope_pool_fused, head_dim=128,
                                     num_qo_heads=32, num_kv_heads=8, rope_base=500000.0),
                   donate_argnums=(5, 6))
    q_rot, k_rot, k_pool, v_pool = step(q, k, v, positions, slots, k_pool, v_pool)

JAX's semantics, not mutation behind its back: the returned pools are new arrays. XLA
aliases the pool operands to the pool results, so with the pools donated
(``donate_argnums``) the op writes into the caller's buffers and nothing is copied; without
donation XLA copies the pools first and the caller's arrays keep their values. The same
holds for mla_rope_pool_fused's latent cache (``donate_argnums=(5,)``).

The handlers (python/src/jax.cpp) are registered for the ``cpu`` platform (ropepool's CPU
backend) and, in builds with the CUDA backend, for ``CUDA`` (ropepool's CUDA backend on
the XLA stream of the computation). This module imports only in builds that found jaxlib's
FFI headers (ROPEPOOL_WITH_JAX, README "JAX").
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ropepool import _ropepool
from ropepool._mla import _TENSOR_ARGS as _MLA_TENSOR_ARGS
from ropepool._mla import _options as _mla_options
from ropepool._op import _TENSOR_ARGS, _cache_args, _fused_scalars, _fusion_args
from ropepool._schedule import RopeSchedule

if not getattr(_ropepool, "jax_front_end", False):
    raise ImportError(
        "ropepool.jax: this build of ropepool has no JAX front end (jaxlib's FFI headers were "
        "not found when it was built); reinstall it with jax installed: "
        "pip install --no-build-isolation .  (README, \"JAX\")")

#: The XLA FFI target name of rope_pool_fused.
TARGET = "ropepool_rope_pool_fused"
#: The XLA FFI target name of rope_pool_fused with ``return_k_rot=False`` (no k_rot result).
NO_K_ROT_TARGET = "ropepool_rope_pool_fused_no_k_rot"
#: The XLA FFI target name of mla_rope_pool_fused.
MLA_TARGET = "ropepool_mla_rope_pool_fused"
#: The XLA FFI target name of mla_rope_pool_fused with ``return_k_rot=False`` (no k_pe_rot
#: result).
MLA_NO_K_ROT_TARGET = "ropepool_mla_rope_pool_fused_no_k_rot"

#: The XLA platforms with handlers: "cpu", plus "CUDA" in builds with the CUDA backend.
platforms: Tuple[str, ...] = ()
for _platform, _handlers in _ropepool.jax_ffi_handlers().items():
    for _target, _capsule in _handlers.items():
        jax.ffi.register_ffi_target(_target, _capsule, platform=_platform)
    platforms += (_platform,)
del _platform, _handlers, _target, _capsule

# One ffi_call per aliasing pattern: operands (q, k, v, positions, slots, k_pool, v_pool,
# then the norm weights given), results (q_rot, k_rot, k_pool, v_pool); inplace also aliases
# q and k to q_rot and k_rot. Without k_rot (NO_K_ROT_TARGET): results (q_rot, k_pool,
# v_pool), inplace aliases q only. MLA: operands (q_pe, k_pe, kv_c, positions, slots,
# kv_cache), results (q_pe_rot, k_pe_rot, kv_cache); without k_pe_rot (MLA_NO_K_ROT_TARGET)
# results (q_pe_rot, kv_cache), inplace aliases q_pe only.
_POOL_ALIASES = {5: 2, 6: 3}
_INPLACE_ALIASES = {0: 0, 1: 1, 5: 2, 6: 3}
_NO_K_ROT_POOL_ALIASES = {5: 1, 6: 2}
_NO_K_ROT_INPLACE_ALIASES = {0: 0, 5: 1, 6: 2}
_MLA_ALIASES = {5: 2}
_MLA_INPLACE_ALIASES = {0: 0, 1: 1, 5: 2}
_MLA_NO_K_ROT_ALIASES = {5: 1}
_MLA_NO_K_ROT_INPLACE_ALIASES = {0: 0, 5: 1}

# The FFI attributes of each op (the handlers' Keywords / MlaKeywords, python/src/jax.cpp)
# and their types, explicit: a Python int would follow the x64 mode. A tuple is an array
# attribute (optional numbers are tuples of none or one value), None an unset string ("").
_ROPE_ATTRIBUTES = dict(
    head_dim=np.int64, num_qo_heads=np.int64, num_kv_heads=np.int64, rope_base=np.float64,
    rotary_dim=np.int64, interleaved=np.bool_, inv_freq=np.float64,
    attention_scaling=np.float64, mrope_section=np.int64, mrope_interleaved=np.bool_,
    q_norm=np.bool_, k_norm=np.bool_, norm_eps=np.float64, norm_style=str, kv_layout=str,
    k_scale=np.float64, v_scale=np.float64, q_scale=np.float64, check_slots=np.bool_)
_MLA_ATTRIBUTES = dict(
    rope_base=np.float64, interleaved=np.bool_, inv_freq=np.float64,
    attention_scaling=np.float64, nhd=np.bool_, kv_scale=np.float64, check_slots=np.bool_)
# The keywords of one call, hashable (the jit cache key below: a call outside jax.jit traces
# once per distinct call, not on every call); q_fp8 (a float8_e4m3fn q_rot) is the result's
# dtype and k_rot (return_k_rot) the choice of target, not attributes.
_RopeKeywords = collections.namedtuple("_RopeKeywords", (*_ROPE_ATTRIBUTES, "q_fp8", "k_rot"))
_MlaKeywords = collections.namedtuple("_MlaKeywords", (*_MLA_ATTRIBUTES, "k_rot"))


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
    kv_layout: Optional[str] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    q_scale: Optional[float] = None,
    q_out_dtype: Any = None,
    q_norm_weight: Any = None,
    k_norm_weight: Any = None,
    norm_eps: Optional[float] = None,
    norm_style: Optional[str] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: Optional[bool] = None,
    return_k_rot: bool = True,
) -> Tuple[jax.Array, Optional[jax.Array], jax.Array, jax.Array]:
    """:func:`ropepool.rope_pool_fused` for JAX: the same arguments and keywords (SPEC §1,
    §4, §6, §7), ``jax.Array``s in and out, usable under ``jax.jit``.

    Returns ``(q_rot, k_rot, k_pool, v_pool)``, all new arrays: q_rot/k_rot of q's dtype
    (q_rot float8_e4m3fn with ``q_out_dtype=jnp.float8_e4m3fn``), and the pools with the
    rotated k and v written at ``slots``. The pool operands are aliased to the returned
    pools, so a caller that donates them (``jax.jit(..., donate_argnums=(5, 6))``) gets its
    own buffers back, written in place, with no copy; otherwise XLA copies them and the
    caller's arrays keep their values. ``inplace=True`` aliases q and k to q_rot and k_rot
    the same way (donate them too to save the copy).

    ``return_k_rot=False``: k_rot is neither written nor returned (the result's k_rot is
    None; the custom call has no k_rot result, so XLA allocates no buffer for it): for
    engines whose attention reads k from the cache. The pools get what they get with k_rot;
    with ``inplace=True`` only q is aliased to q_rot (k is only read: don't donate it).

    SPEC §7: ``q_norm_weight``/``k_norm_weight`` are arrays (operands of the call),
    ``norm_eps``/``norm_style`` and ``mrope_section``/``mrope_interleaved`` (positions
    ``[3, T]``; also read from ``rope_scaling``) constants. SPEC §6: ``kv_layout`` ("NHD",
    "HND"), float8_e4m3fn pools, and ``k_scale``/``v_scale``/``q_scale`` as Python floats
    (compiled into the call; no scale arrays).

    Shapes, dtypes and keywords are validated when the call is traced, with the SPEC §2
    messages (``ValueError``; shapes printed as JAX prints them). Slot values are data: a
    slot >= the pool size is never written and the computation fails with
    ``jax.errors.JaxRuntimeError`` naming it (SPEC §3, §9); so does the CPU angle limit of
    SPEC §1 for int64 positions. positions/slots are int32, or int64 with JAX's x64 mode.
    ``inv_freq`` and ``schedule`` are constants baked into the compiled call (a NumPy array,
    or a jax.Array outside of tracing). Neither ``jax.grad`` nor ``jax.vmap`` applies (a
    KV-cache write has no derivative; batch the tokens instead): both raise.
    """
    op = "rope_pool_fused"
    operands = (q, k, v, positions, slots, k_pool, v_pool)
    _check_arrays(op, zip(_TENSOR_ARGS, operands))
    (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, sched_freqs, sched_scale,
     sched_section, sched_interleaved) = _fused_scalars(
        head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, rope_scaling,
        max_position_embeddings, original_max_position_embeddings, seq_len,
        _constant_inv_freq(op, inv_freq), attention_scaling, schedule, mrope_section,
        mrope_interleaved)
    q_w, k_w, norm_eps, norm_style, section, section_interleaved = _fusion_args(
        q_norm_weight, k_norm_weight, norm_eps, norm_style, sched_section, sched_interleaved)
    weights = tuple((name, w) for name, w in (("q_norm_weight", q_w), ("k_norm_weight", k_w))
                    if w is not None)
    _check_arrays(op, weights)
    inplace = bool(inplace)
    kv_layout, *scales, q_fp8 = _cache_args(kv_layout, k_scale, v_scale, q_scale,
                                            _dtype_name(q_out_dtype), inplace)
    for name, tensor in zip(("k_scale", "v_scale", "q_scale"), scales[0::2]):
        if tensor is not None:
            raise TypeError(f"rope_pool_fused: {name} must be a Python float in ropepool.jax "
                            f"(compiled into the call), got {type(tensor).__name__}")
    keywords = _RopeKeywords(
        head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        rope_base=rope_base, rotary_dim=rotary_dim, interleaved=bool(interleaved),
        inv_freq=_tuple(sched_freqs), attention_scaling=sched_scale,
        mrope_section=_tuple(section), mrope_interleaved=bool(section_interleaved),
        q_norm=q_w is not None, k_norm=k_w is not None, norm_eps=_tuple(norm_eps),
        norm_style=norm_style, kv_layout=kv_layout, k_scale=_tuple(scales[1]),
        v_scale=_tuple(scales[3]), q_scale=_tuple(scales[5]), check_slots=bool(check_slots),
        q_fp8=q_fp8, k_rot=bool(return_k_rot))
    operands += tuple(w for _, w in weights)
    _ropepool.jax_validate(*_abstract(operands), keywords._asdict())
    return _rope_call(*operands, keywords=keywords, inplace=inplace)


def mla_rope_pool_fused(
    q_pe: Any,
    k_pe: Any,
    kv_c: Any,
    positions: Any,
    slots: Any,
    kv_cache: Any,
    *,
    rope_base: float,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
    original_max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    inv_freq: Any = None,
    attention_scaling: Optional[float] = None,
    schedule: Optional[RopeSchedule] = None,
    interleaved: bool = True,
    kv_scale: Optional[float] = None,
    kv_layout: Optional[str] = None,
    inplace: bool = False,
    check_slots: bool = False,
    return_k_rot: bool = True,
) -> Tuple[jax.Array, Optional[jax.Array], jax.Array]:
    """:func:`ropepool.mla_rope_pool_fused` for JAX (SPEC §8): the same arguments and
    keywords, ``jax.Array``s in and out, usable under ``jax.jit``.

    Returns ``(q_pe_rot, k_pe_rot, kv_cache)``, all new arrays: q_pe_rot/k_pe_rot of the
    shapes and dtype of q_pe/k_pe, and the cache with row ``slot`` of each token set to
    ``concat(kv_c, k_pe_rot)``. The cache operand is aliased to the returned cache: donated
    (``jax.jit(..., donate_argnums=(5,))``) it is written in place with no copy; otherwise
    XLA copies it and the caller's array keeps its values. ``inplace=True`` aliases q_pe and
    k_pe to q_pe_rot and k_pe_rot the same way. ``kv_layout="NHD"`` takes a paged cache
    ``[pages, page_size, L + R]``; a float8_e4m3fn cache stores ``e4m3(x / kv_scale)``, with
    ``kv_scale`` a Python float (compiled into the call). q_pe, k_pe and kv_c are whole
    arrays here (a slice of q or of the projection output is an array of its own in JAX).

    ``return_k_rot=False``: k_pe_rot is neither written nor returned (the result's k_pe_rot
    is None; the custom call has no k_pe_rot result, so XLA allocates no buffer for it).
    The cache gets what it gets with k_pe_rot; with ``inplace=True`` only q_pe is aliased
    to q_pe_rot (k_pe is only read: don't donate it).

    Validation, slot errors, constants, ``jax.grad`` and ``jax.vmap``: as
    :func:`rope_pool_fused`, with the op's own messages.
    """
    op = "mla_rope_pool_fused"
    operands = (q_pe, k_pe, kv_c, positions, slots, kv_cache)
    _check_arrays(op, zip(_MLA_TENSOR_ARGS, operands))
    rope_base, freqs, att, nhd, scale, scale_tensor = _mla_options(
        q_pe, rope_base, rope_scaling, max_position_embeddings, original_max_position_embeddings,
        seq_len, _constant_inv_freq(op, inv_freq), attention_scaling, schedule, kv_layout,
        kv_scale)
    if scale_tensor is not None:
        raise TypeError(f"mla_rope_pool_fused: kv_scale must be a Python float in ropepool.jax "
                        f"(compiled into the call), got {type(scale_tensor).__name__}")
    keywords = _MlaKeywords(
        rope_base=rope_base, interleaved=bool(interleaved), inv_freq=_tuple(freqs),
        attention_scaling=att, nhd=nhd, kv_scale=_tuple(scale), check_slots=bool(check_slots),
        k_rot=bool(return_k_rot))
    _ropepool.jax_validate_mla(*_abstract(operands), keywords._asdict())
    return _mla_call(*operands, keywords=keywords, inplace=bool(inplace))


@functools.partial(jax.jit, static_argnames=("keywords", "inplace"))
def _rope_call(q, k, v, positions, slots, k_pool, v_pool, *weights, keywords, inplace):
    q_dtype = jnp.float8_e4m3fn if keywords.q_fp8 else q.dtype
    if not keywords.k_rot:  # no k_rot result at all (return_k_rot=False)
        results = (jax.ShapeDtypeStruct(q.shape, q_dtype),) + tuple(
            jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k_pool, v_pool))
        q_rot, k_pool, v_pool = _custom_call(
            "rope_pool_fused", NO_K_ROT_TARGET, results,
            _NO_K_ROT_INPLACE_ALIASES if inplace else _NO_K_ROT_POOL_ALIASES,
            _attributes(keywords, _ROPE_ATTRIBUTES), q, k, v, positions, slots, k_pool, v_pool,
            *weights)
        return q_rot, None, k_pool, v_pool
    results = (jax.ShapeDtypeStruct(q.shape, q_dtype),) + tuple(
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, k_pool, v_pool))
    return _custom_call(
        "rope_pool_fused", TARGET, results, _INPLACE_ALIASES if inplace else _POOL_ALIASES,
        _attributes(keywords, _ROPE_ATTRIBUTES), q, k, v, positions, slots, k_pool, v_pool,
        *weights)


@functools.partial(jax.jit, static_argnames=("keywords", "inplace"))
def _mla_call(q_pe, k_pe, kv_c, positions, slots, kv_cache, *, keywords, inplace):
    if not keywords.k_rot:  # no k_pe_rot result at all (return_k_rot=False)
        results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q_pe, kv_cache))
        q_rot, kv_cache = _custom_call(
            "mla_rope_pool_fused", MLA_NO_K_ROT_TARGET, results,
            _MLA_NO_K_ROT_INPLACE_ALIASES if inplace else _MLA_NO_K_ROT_ALIASES,
            _attributes(keywords, _MLA_ATTRIBUTES), q_pe, k_pe, kv_c, positions, slots, kv_cache)
        return q_rot, None, kv_cache
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q_pe, k_pe, kv_cache))
    return _custom_call(
        "mla_rope_pool_fused", MLA_TARGET, results,
        _MLA_INPLACE_ALIASES if inplace else _MLA_ALIASES, _attributes(keywords, _MLA_ATTRIBUTES),
        q_pe, k_pe, kv_c, positions, slots, kv_cache)


def _custom_call(name, target, results, aliases, attributes, *operands):
    call = jax.ffi.ffi_call(target, results, input_output_aliases=aliases, vmap_method=None)

    # jax.grad and jax.vmap would otherwise fail inside ffi_call with messages about its
    # own parameters; these rules say what the op is instead. Neither changes the lowering
    # (one custom call, its aliases intact).
    @jax.custom_jvp
    @jax.custom_batching.custom_vmap
    def op(*args):
        return tuple(call(*args, **attributes))

    op.def_vmap(functools.partial(_no_vmap, name))
    op.defjvp(functools.partial(_no_grad, name))
    return op(*operands)


def _attributes(keywords, types):
    """The keywords as typed FFI attributes."""
    out = {}
    for name, kind in types.items():
        value = getattr(keywords, name)
        if kind is str:
            out[name] = "" if value is None else value
        elif isinstance(value, tuple):
            out[name] = np.asarray(value, kind)
        else:
            out[name] = kind(value)
    return out


def _tuple(value) -> tuple:
    """An optional number or list as a hashable array attribute: () when None."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _dtype_name(dtype):
    """q_out_dtype as _cache_args takes it: a JAX / NumPy dtype by its name."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return dtype  # not a NumPy dtype: _cache_args says what is expected


def _check_arrays(op, named) -> None:
    for name, x in named:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{op}: {name} must be an array (jax.Array or NumPy), "
                            f"got {type(x).__name__}")


def _constant_inv_freq(op, inv_freq):
    if isinstance(inv_freq, jax.core.Tracer):
        raise TypeError(
            f"{op}: inv_freq must be a constant (a NumPy array, or a jax.Array outside of "
            "jax.jit): the schedule is baked into the compiled call; make it once with "
            "ropepool.rope_schedule(...) and pass schedule=")
    return np.asarray(inv_freq) if isinstance(inv_freq, jax.Array) else inv_freq


def _abstract(operands):
    """(shapes, dtype names, platform) of the operands, for the validation of the call."""
    return ([tuple(int(d) for d in x.shape) for x in operands],
            [np.dtype(x.dtype).name for x in operands], _platform_of(operands))


def _no_vmap(name, axis_size, in_batched, *args):
    raise ValueError(
        f"{name} does not support jax.vmap: it writes one KV cache per call; fold the batch "
        "into the token axis (T, with one slot per token), or call it once per cache")


def _no_grad(name, primals, tangents):
    raise ValueError(
        f"{name} has no derivative (a KV-cache write, SPEC §9): jax.grad, jax.jvp and "
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


__all__ = ["rope_pool_fused", "mla_rope_pool_fused", "TARGET", "NO_K_ROT_TARGET", "MLA_TARGET",
           "MLA_NO_K_ROT_TARGET", "platforms"]
