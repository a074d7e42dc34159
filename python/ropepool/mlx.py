"""The MLX front end (SPEC §9): ``ropepool.mlx.rope_pool_fused`` and
``ropepool.mlx.mla_rope_pool_fused`` take and return ``mx.array``s, as sglang's
``sgl_kernel.metal.rope_pool_fused`` is called.

    import mlx.core as mx
    from ropepool.mlx import rope_pool_fused

    q_rot, k_rot, k_pool, v_pool = rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=10000.0)

Each call is an MLX primitive (C++, ropepool._ropepool_mlx): lazy, a node of the graph that
``mx.eval`` runs, traceable by ``mx.compile``. MLX arrays are immutable, so the caches come
back as new arrays: rebind your cache to them. When nothing else references the caches
passed in at evaluation time, their buffers become the new caches' (no copy); otherwise the
new caches are copies and the old arrays keep their values. It runs on MLX's CPU stream
(ropepool's CPU backend).

The module needs the extension built against the installed MLX: a source build with MLX
present (``pip install --no-build-isolation .`` next to ``mlx``); the published wheel has
no MLX front end.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple

try:
    import mlx.core as mx
except ImportError as e:  # pragma: no cover - exercised where mlx is absent
    raise ImportError(
        "ropepool.mlx needs MLX: pip install 'mlx[cpu]' (Linux) or mlx (macOS), then build "
        "ropepool from source next to it (pip install --no-build-isolation .)"
    ) from e

try:
    from ropepool import _ropepool_mlx as _ext
except ImportError as e:
    raise ImportError(
        "ropepool.mlx: this ropepool was built without its MLX front end (the extension "
        "ropepool._ropepool_mlx is built only when MLX is installed at build time; the "
        "published wheel has none). Build from source with MLX installed: pip install "
        "'mlx[cpu]' && pip install --no-build-isolation <ropepool source>"
    ) from e

from ropepool._mla import _options as _mla_options
from ropepool._op import (_NO_CACHE, _cache_args, _cache_kwargs, _fused_scalars,
                          _fusion_args, _fusion_kwargs)
from ropepool._schedule import RopeSchedule


def _check_abi() -> None:
    # The extension uses MLX's C++ API, which has no stable ABI across releases, and
    # shares nanobind's type records with mlx.core: both must be the ones it was built with.
    built, running = _ext.mlx_version, mx.__version__
    if running.split(".dev")[0].split("+")[0] != built:
        raise ImportError(
            f"ropepool.mlx was built against MLX {built} but MLX {running} is installed; "
            "rebuild ropepool from source (pip install --no-build-isolation .) or install "
            f"mlx=={built}")
    if not _ext.is_mlx_array(mx.array(0)):
        raise ImportError(
            "ropepool.mlx cannot take this MLX's arrays: the extension was built with a "
            "nanobind whose ABI differs from mlx.core's; rebuild ropepool with the nanobind "
            "version MLX was built with")


_check_abi()


def rope_pool_fused(
    q: "mx.array",
    k: "mx.array",
    v: "mx.array",
    positions: "mx.array",
    slots: "mx.array",
    k_pool: "mx.array",
    v_pool: "mx.array",
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
    k_scale: Any = None,
    v_scale: Any = None,
    q_scale: Any = None,
    q_out_dtype: Any = None,
    q_norm_weight: Optional["mx.array"] = None,
    k_norm_weight: Optional["mx.array"] = None,
    norm_eps: Optional[float] = None,
    norm_style: Optional[str] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: Optional[bool] = None,
    return_k_rot: bool = True,
    stream: Any = None,
) -> Tuple["mx.array", Optional["mx.array"], "mx.array", "mx.array"]:
    """RoPE on q and k and the KV-cache pool write, as an MLX primitive (SPEC §1, §9).

    Arguments and keywords are those of :func:`ropepool.rope_pool_fused` (SPEC §4, §6, §7)
    except ``q_out``/``k_out``, all ``mx.array``s; ``inv_freq``, if given, is a float32
    ``mx.array`` or NumPy array (read when the call is made); ``q_norm_weight``/
    ``k_norm_weight`` and array scales (one-element float32) are ``mx.array``s (inputs of
    the graph node, read when it runs); with ``mrope_section`` positions are ``[3, T]``.
    MLX has no float8 dtype: fp8 pools are ``uint8`` arrays of e4m3 bits (as ``mx.to_fp8``
    makes them), and ``q_out_dtype="float8_e4m3fn"`` returns q_rot as one. Returns
    ``(q_rot, k_rot, k_pool, v_pool)``, four new lazy arrays; ``k_pool``/``v_pool`` are the
    updated pools (donated buffers when nothing else references the ones passed in, copies
    otherwise).

    ``return_k_rot=False``: k_rot is neither written nor returned (the result's k_rot is
    None; the primitive has no k_rot output, so no buffer is allocated for it): for engines
    whose attention reads k from the cache. The pools get what they get with k_rot.

    ``inplace=True`` lets q_rot/k_rot take over q's and k's buffers too, when nothing else
    references them at evaluation time (the returned arrays are new either way; with
    ``return_k_rot=False`` only q's).
    ``stream``: an MLX stream or device (default: the default stream); ropepool runs on
    MLX's CPU stream only, and a GPU stream is a ValueError.

    Shapes, dtypes and keywords are checked when the call is made, with SPEC §2's messages.
    Slot and position values are data: an out-of-range slot (or, with ``check_slots``, a
    repeated one) writes nothing and raises ValueError when the graph is evaluated.
    Gradients (``mx.grad``, ``mx.vjp``, ``mx.jvp``) and ``mx.vmap`` raise
    NotImplementedError.
    """
    (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, sched_freqs, sched_scale,
     sched_section, sched_interleaved) = \
        _fused_scalars(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
                       rope_scaling, max_position_embeddings, original_max_position_embeddings,
                       seq_len, inv_freq if inv_freq is None else _host_table(inv_freq),
                       attention_scaling, schedule, mrope_section, mrope_interleaved)
    fusion = _fusion_args(q_norm_weight, k_norm_weight, norm_eps, norm_style, sched_section,
                          sched_interleaved)
    cache = _cache_args(kv_layout, k_scale, v_scale, q_scale, q_out_dtype, bool(inplace))
    # (SPEC §6's and §7's keywords only where given: each costs the binding's parsing)
    extra = _fusion_kwargs(fusion)
    if cache is not _NO_CACHE:
        extra.update(_cache_kwargs(cache), q_fp8=cache[-1])
    if not return_k_rot:
        extra["return_k_rot"] = False
    return _ext.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        rope_base=rope_base, rotary_dim=rotary_dim, interleaved=bool(interleaved),
        schedule_inv_freq=sched_freqs, schedule_attention_scaling=sched_scale,
        inplace=bool(inplace), check_slots=bool(check_slots), stream=stream, **extra)


def mla_rope_pool_fused(
    q_pe: "mx.array",
    k_pe: "mx.array",
    kv_c: "mx.array",
    positions: "mx.array",
    slots: "mx.array",
    kv_cache: "mx.array",
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
    kv_scale: Any = None,
    kv_layout: Optional[str] = None,
    inplace: bool = False,
    check_slots: bool = False,
    return_k_rot: bool = True,
    stream: Any = None,
) -> Tuple["mx.array", Optional["mx.array"], "mx.array"]:
    """Multi-head latent attention's RoPE and latent-cache write, as an MLX primitive
    (SPEC §8, §9).

    Arguments and keywords are those of :func:`ropepool.mla_rope_pool_fused`, all
    ``mx.array``s: q_pe ``[T, H, R]`` (e.g. the view ``q[..., 128:]``), k_pe ``[T, R]`` or
    ``[T, 1, R]``, kv_c ``[T, L]``, kv_cache ``[P, L + R]`` (or ``[pages, page_size, L + R]``
    with ``kv_layout="NHD"``) in q_pe's dtype, or ``uint8`` holding float8 e4m3 bits (MLX's
    fp8 storage: ``mx.to_fp8`` / ``mx.from_fp8``), quantised with ``kv_scale`` (a float or a
    one-element float32 ``mx.array``, read when the graph runs). Returns ``(q_pe_rot,
    k_pe_rot, kv_cache)``, three new lazy arrays; kv_cache is the updated cache (the donated
    buffer when nothing else references the one passed in, a copy otherwise). ``inplace``,
    ``check_slots``, ``stream``, validation and errors are as in :func:`rope_pool_fused`.

    ``return_k_rot=False``: k_pe_rot is neither written nor returned (the result's k_pe_rot
    is None; the primitive has no k_pe_rot output, so no buffer is allocated for it); the
    cache gets what it gets with k_pe_rot, and ``inplace=True`` lets q_pe_rot alone take
    over its input's buffer.
    """
    rope_base, freqs, att, nhd, scale_value, scale_array = _mla_options(
        q_pe, rope_base, rope_scaling, max_position_embeddings, original_max_position_embeddings,
        seq_len, _host_table(inv_freq), attention_scaling, schedule, kv_layout, kv_scale)
    return _ext.mla_rope_pool_fused(
        q_pe, k_pe, kv_c, positions, slots, kv_cache, rope_base=rope_base,
        interleaved=bool(interleaved), inv_freq=freqs, attention_scaling=att, nhd=nhd,
        kv_scale=scale_value, kv_scale_tensor=scale_array, inplace=bool(inplace),
        check_slots=bool(check_slots), return_k_rot=bool(return_k_rot), stream=stream)


def _host_table(inv_freq: Any) -> Any:
    """An mx.array inv_freq as a NumPy copy: a small host table, read once when the call is
    made."""
    if isinstance(inv_freq, mx.array):
        import numpy

        return numpy.array(inv_freq, copy=True)
    return inv_freq


__all__ = ["mla_rope_pool_fused", "rope_pool_fused"]
