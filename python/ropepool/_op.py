"""The user-facing op: output allocation with the caller's framework, the torch custom ops.

The C++ core (``_ropepool.rope_pool_fused_into``) never allocates and validates every
argument itself (SPEC §2); this layer only allocates q_rot/k_rot like the inputs (or takes
the caller's ``q_out``/``k_out``), picks the CUDA stream, and returns the caller's own
objects.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Mapping, Optional, Sequence, Tuple

from ropepool._schedule import RopeSchedule, _int, _is_bool, _real, _rotary_dim, rope_schedule

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
    rotary_dim: Optional[int] = None,
    interleaved: bool = False,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
    original_max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    inv_freq: Any = None,
    attention_scaling: Optional[float] = None,
    schedule: Optional["RopeSchedule"] = None,
    inplace: bool = False,
    q_out: Any = None,
    k_out: Any = None,
    check_slots: bool = False,
    kv_layout: Optional[str] = None,
    k_scale: Any = None,
    v_scale: Any = None,
    q_scale: Any = None,
    q_out_dtype: Any = None,
    q_norm_weight: Any = None,
    k_norm_weight: Any = None,
    norm_eps: Optional[float] = None,
    norm_style: Optional[str] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: Optional[bool] = None,
    return_k_rot: bool = True,
) -> Tuple[Any, Any, Any, Any]:
    """Applies RoPE to q and k and writes rotated k and v into the KV-cache pools.

    Args:
        q: ``[T, num_qo_heads, head_dim]`` float32, float16 or bfloat16.
        k, v: ``[T, num_kv_heads, head_dim]``, same dtype as q.
        positions: ``[T]`` int32 or int64, the token positions.
        slots: ``[T]`` int32 or int64, the pool row of each token; a negative slot means
            "no pool write" for that token.
        k_pool, v_pool: ``[P, num_kv_heads, head_dim]`` (or 4-D with ``kv_layout``), same
            dtype as q or both ``float8_e4m3fn``; any strides with a contiguous last
            dimension (a layer of a stacked cache, the K/V halves of a combined cache);
            updated in place.
        head_dim, num_qo_heads, num_kv_heads: the head geometry (checked against shapes).
        rope_base: the RoPE base (theta), finite and > 0.
        rotary_dim: rotate only the first ``rotary_dim`` elements of each head (even,
            in (0, head_dim]; partial rotary); the rest is copied. None (default): head_dim.
        interleaved: GPT-J / "traditional" pairs ``(x[2i], x[2i+1])`` instead of NeoX
            half-split pairs ``(x[i], x[i + rotary_dim/2])``.
        rope_scaling: a Hugging Face ``config.rope_scaling`` dict (``rope_type`` or
            ``type``: default, linear, dynamic, yarn, llama3, longrope); see
            :func:`rope_schedule` for the keys and the sequence-length rule.
        max_position_embeddings: the model's ``config.max_position_embeddings`` (dynamic,
            longrope, and yarn without ``original_max_position_embeddings``).
        original_max_position_embeddings: longrope's pre-extension context length, which
            Phi-3 keeps at the top level of its config (required for longrope).
        seq_len: the sequence length the schedule is for (dynamic, longrope).
        inv_freq: any other schedule: a CPU float32 array of ``rotary_dim/2`` inverse
            frequencies (replaces rope_base and rope_scaling).
        attention_scaling: multiplies cos and sin (replaces the schedule's own factor).
        schedule: a :class:`RopeSchedule` made once by :func:`rope_schedule` (the cheapest
            per call); replaces rope_scaling, inv_freq, attention_scaling,
            max_position_embeddings, original_max_position_embeddings and seq_len (passing
            any of them too is an error); rope_base must be the schedule's.
        inplace: write q_rot/k_rot into q and k and return them as q_rot/k_rot.
        q_out, k_out: caller-provided outputs (either or both; not with ``inplace``): q_rot
            is written into ``q_out`` (q's shape; q's dtype, or float8_e4m3fn with
            ``q_out_dtype=float8_e4m3fn``), k_rot into ``k_out`` (k's shape and dtype), and
            they are returned as q_rot/k_rot (the very objects). Same framework and device
            as q, any strides with a contiguous last dimension, no memory shared with any
            other argument (validated like every argument: SPEC §3); ``q_out=q`` is in-place
            rotation of q. Saves the allocation of fresh outputs every call.
        check_slots: also reject two tokens writing the same slot (otherwise the row ends
            up holding one of those tokens' complete rows).
        kv_layout: ``"NHD"``: pools are ``[pages, page_size, num_kv_heads, head_dim]``;
            ``"HND"``: ``[pages, num_kv_heads, page_size, head_dim]``; slot ``s`` is page
            ``s // page_size``, row ``s % page_size``. None (default): 3-D pools.
        k_scale, v_scale: float8_e4m3fn pools only: the pools store ``e4m3(x / scale)``
            (vLLM's convention: value = stored * scale). A float (rounded to float32; finite
            and > 0) or a one-element float32 tensor on the pools' device, read when the
            kernel runs (a captured CUDA graph sees its current value). None: 1.0.
        q_scale: with ``q_out_dtype``: q_rot is ``e4m3(rotated q / q_scale)``; as k_scale.
        q_out_dtype: None (q_rot in q's dtype) or ``torch.float8_e4m3fn`` /
            ``"float8_e4m3fn"`` (an fp8 q_rot for FP8 attention; torch tensors only; not with
            ``inplace``). k_rot stays in q's dtype.
        q_norm_weight, k_norm_weight: SPEC §7's per-head RMSNorm before RoPE (Qwen3,
            Gemma 3): ``[head_dim]`` weights (q's dtype or float32, q's device), either or
            both; the pool receives the normalised, rotated k (v is never normalised).
        norm_eps: the norm's epsilon (default 1e-6; ``config.rms_norm_eps``).
        norm_style: ``"rms"`` (default; transformers' Qwen3RMSNorm: ``w * x``) or
            ``"gemma"`` (Gemma3RMSNorm: ``(1 + w) * x``, float32 throughout).
        mrope_section: multimodal RoPE (SPEC §7; Qwen2-VL, Qwen2.5-VL, Qwen3-VL):
            ``[s_t, s_h, s_w]`` summing to ``rotary_dim/2``; positions are then ``[3, T]``
            (temporal, height, width rows). Also read from ``rope_scaling``.
        mrope_interleaved: Qwen3-VL's interleaved axis order (default False).
        return_k_rot: False: k_rot is neither written nor returned (the result's k_rot is
            None; k is only read): for engines whose attention reads k from the cache,
            this saves writing k_rot. Not with ``k_out``; with ``inplace`` q is rotated in
            place and k is left as it was.

    Returns:
        ``(q_rot, k_rot, k_pool, v_pool)``: q_rot and k_rot are new contiguous arrays of
        q's framework, dtype and device (or q/k with ``inplace``, q_out/k_out where given;
        k_rot is None with ``return_k_rot=False``); k_pool and v_pool are the very objects
        passed in.

    Arrays are PyTorch tensors (CPU; CUDA with the CUDA backend, run on the current stream
    of their device) or any DLPack / buffer-protocol producer (NumPy, ...); they are never
    converted or copied. Raises ValueError with the SPEC §2 message (extra help in the
    exception's ``__notes__``), TypeError for arguments that are not arrays, RuntimeError
    for backend failures. Nothing is written when an error is raised.
    """
    # The common decode-step call (plain torch tensors, eager, the four required keywords,
    # maybe inplace or plain q_out/k_out, a schedule made by rope_schedule, SPEC §6's cache
    # keywords, return_k_rot and SPEC §7's norm keywords; its geometry validated once) skips
    # the keyword machinery below; the core still validates every call (SPEC §2), so errors
    # are the same. What only this layer checks takes the slow path: inplace with
    # q_out/k_out, a float8 q_out without q_out_dtype, keyword values of other Python types
    # (an int scale, a bool, a dtype name), a rope_scaling dict no call has made a schedule
    # from yet.
    if type(q) is _FAST_TENSOR and type(k) is _FAST_TENSOR and type(v) is _FAST_TENSOR \
            and type(positions) is _FAST_TENSOR and type(slots) is _FAST_TENSOR \
            and type(k_pool) is _FAST_TENSOR and type(v_pool) is _FAST_TENSOR \
            and rotary_dim is None and interleaved is False \
            and max_position_embeddings is None and original_max_position_embeddings is None \
            and seq_len is None and inv_freq is None and attention_scaling is None \
            and check_slots is False and mrope_section is None and mrope_interleaved is None \
            and type(head_dim) is int and type(num_qo_heads) is int \
            and type(num_kv_heads) is int and type(rope_base) is float \
            and (head_dim, num_qo_heads, num_kv_heads, rope_base) in _FAST_GEOMETRIES \
            and _fast_eager():
        fast_schedule = schedule
        if rope_scaling is not None:  # the schedule an earlier call made from this dict
            known = _known_scaling_schedule(head_dim, rope_base, rope_scaling) \
                if schedule is None else None
            fast_schedule = _NOT_FAST if known is None else known
        if fast_schedule is None and kv_layout is None and k_scale is None and v_scale is None \
                and q_scale is None and q_out_dtype is None and return_k_rot is True \
                and q_norm_weight is None and k_norm_weight is None and norm_eps is None \
                and norm_style is None:
            if (inplace is False
                    and (q_out is None
                         or (type(q_out) is _FAST_TENSOR and q_out.dtype is not _FAST_FP8))
                    and (k_out is None or type(k_out) is _FAST_TENSOR)) \
                    or (inplace is True and q_out is None and k_out is None):
                return _fast_call(q, k, v, positions, slots, k_pool, v_pool, head_dim,
                                  num_qo_heads, num_kv_heads, rope_base, inplace, q_out, k_out)
        elif fast_schedule is not _NOT_FAST and _fast_keywords(
                kv_layout, k_scale, v_scale, q_scale, q_out_dtype, inplace, q_out, k_out,
                return_k_rot, q_norm_weight, k_norm_weight, norm_eps, norm_style, fast_schedule,
                rope_base):
            result = _fast_keyword_call(
                q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads,
                num_kv_heads, rope_base, inplace, q_out, k_out, q_out_dtype is not None,
                return_k_rot, kv_layout, k_scale, v_scale, q_scale, q_norm_weight,
                k_norm_weight, norm_eps, norm_style, fast_schedule)
            if result is not None:
                return result
    tensors = (q, k, v, positions, slots, k_pool, v_pool)
    has_out = q_out is not None or k_out is not None
    all_torch = torch is not None and isinstance(q, torch.Tensor) \
        and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) \
        and isinstance(positions, torch.Tensor) and isinstance(slots, torch.Tensor) \
        and isinstance(k_pool, torch.Tensor) and isinstance(v_pool, torch.Tensor)
    if not all_torch:
        _refuse_immutable_arrays(tensors, q_out, k_out)
    (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, sched_freqs, sched_scale,
     sched_section, sched_interleaved) = \
        _fused_scalars(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
                       rope_scaling, max_position_embeddings, original_max_position_embeddings,
                       seq_len, inv_freq, attention_scaling, schedule, mrope_section,
                       mrope_interleaved)
    fusion = _fusion_args(q_norm_weight, k_norm_weight, norm_eps, norm_style, sched_section,
                          sched_interleaved)
    _remember_geometry(head_dim, num_qo_heads, num_kv_heads, rope_base)
    check_slots = bool(check_slots)
    interleaved = bool(interleaved)
    inplace = bool(inplace)
    k_rot_wanted = bool(return_k_rot)
    if has_out:
        _check_out_keywords(q_out, k_out, inplace)
    if not k_rot_wanted:
        _check_no_k_rot(k_out)
    cache = _cache_args(kv_layout, k_scale, v_scale, q_scale, q_out_dtype, inplace)

    if all_torch:
        _check_torch_scales(cache)
        if has_out:
            _check_torch_outs(q, q_out, k_out, cache[-1])
        if (fusion[0] is not None or fusion[1] is not None) and any(
                w is not None and not isinstance(w, torch.Tensor) for w in fusion[:2]):
            raise TypeError("rope_pool_fused: q_norm_weight/k_norm_weight must be "
                            "torch.Tensors when the other arguments are")
        scalars = (head_dim, num_qo_heads, num_kv_heads, rope_base, check_slots, rotary_dim,
                   interleaved, sched_freqs, sched_scale) + cache + fusion
        if has_out or not k_rot_wanted:
            # One op for every out= call: the output not given is allocated here, as the
            # default op would, so the op has a fixed set of mutated arguments. No k_rot
            # (return_k_rot=False): the op's k_out is None; with inplace q_out is q.
            if inplace:  # only here without k_rot (inplace with k_out is refused above)
                q_rot = q
            else:
                q_rot = _new_q_rot(q, cache[-1]) if q_out is None else q_out
            k_rot = _new_torch_output(k) if k_out is None and k_rot_wanted else k_out
            outs = (q_rot, k_rot) if k_rot is not None else (q_rot,)
            if _plain_eager(tensors + outs) and _plain_scales(cache) \
                    and _plain_weights(fusion):
                _rope_pool_fused_out_kernel(*tensors, q_rot, k_rot, *scalars)
            else:
                torch.ops.ropepool.rope_pool_fused_out(*tensors, q_rot, k_rot, *scalars)
            return q_rot, k_rot, k_pool, v_pool
        if _plain_eager(tensors) and _plain_scales(cache) and _plain_weights(fusion):
            # Eager calls on plain tensors run the op's own kernel function directly: the
            # same code the dispatcher would reach, without its ~10 us of Python dispatch,
            # which is most of a decode step's host time.
            if inplace:
                _rope_pool_fused_inplace_kernel(*tensors, *scalars)
                return q, k, k_pool, v_pool
            q_rot, k_rot = _rope_pool_fused_kernel(*tensors, *scalars)
            return q_rot, k_rot, k_pool, v_pool
        # Through the custom op, so torch.compile sees one opaque call that mutates the
        # pools (and tensor subclasses and dispatch modes, e.g. FakeTensor, get its fake
        # implementation). A custom op cannot return its mutated inputs, so the pools are
        # returned here, as the caller's own objects.
        if inplace:
            torch.ops.ropepool.rope_pool_fused_(
                q, k, v, positions, slots, k_pool, v_pool, *scalars)
            return q, k, k_pool, v_pool
        q_rot, k_rot = torch.ops.ropepool.rope_pool_fused(
            q, k, v, positions, slots, k_pool, v_pool, *scalars)
        return q_rot, k_rot, k_pool, v_pool
    _refuse_mixed_frameworks(tensors, q_out, k_out)
    if cache[-1]:
        raise ValueError("rope_pool_fused: q_out_dtype=float8_e4m3fn needs torch tensors "
                         "(NumPy cannot export float8 through DLPack)")
    # (without k_rot, k_out is None: checked above)
    if inplace:
        q_rot, k_rot = q, (k if k_rot_wanted else None)
    else:
        q_rot = _new_array_output(q, "q") if q_out is None else q_out
        k_rot = _new_array_output(k, "k") if k_out is None and k_rot_wanted else k_out
    _ropepool.rope_pool_fused_into(
        q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot,
        head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        rope_base=rope_base, check_slots=check_slots, stream=0, rotary_dim=rotary_dim,
        interleaved=interleaved, schedule_inv_freq=sched_freqs,
        schedule_attention_scaling=sched_scale, **_cache_kwargs(cache),
        **_fusion_kwargs(fusion),
    )
    return q_rot, k_rot, k_pool, v_pool


# Geometries (head_dim, num_qo_heads, num_kv_heads, rope_base) whose Python types the slow
# path has checked (ints that are not bools, a float rope_base): the fast path passes them
# to the core as they are. Bounded: a process runs a handful of models.
_FAST_GEOMETRIES: set = set()


def _remember_geometry(head_dim, num_qo_heads, num_kv_heads, rope_base):
    if len(_FAST_GEOMETRIES) < 64 and type(head_dim) is int and type(num_qo_heads) is int \
            and type(num_kv_heads) is int and type(rope_base) is float:
        _FAST_GEOMETRIES.add((head_dim, num_qo_heads, num_kv_heads, rope_base))


# Schedules made from a rope_scaling dict alone (no other schedule keyword, rotary_dim None),
# by (head_dim, rope_base, the dict's items with their types, a list's elements too): an
# engine passes its config.rope_scaling on every call, and making the schedule costs more
# than the rest of a decode call's host work. Only what a call has made without error is
# kept, so a dict that is wrong still raises each time. Bounded like _FAST_GEOMETRIES.
_SCALING_SCHEDULES: dict = {}
_NOT_FAST = object()  # the fast path's "no": a schedule it cannot use
_SCALING_VALUE_TYPES = (int, float, str, bool, type(None))


def _scaling_key(head_dim, rope_base, rope_scaling):
    """The memo's key, or None: not a dict, or values other than plain scalars and lists of
    ints and floats (numpy numbers, nested containers: made every call)."""
    if type(rope_scaling) is not dict:
        return None
    items = []
    for key, value in rope_scaling.items():
        kind = type(value)
        if kind is list or kind is tuple:  # mrope_section, ...: each element with its type
            for x in value:
                if type(x) is not int and type(x) is not float:
                    return None
            value = tuple((type(x), x) for x in value)
        elif kind not in _SCALING_VALUE_TYPES:
            return None
        items.append((key, kind, value))
    return head_dim, rope_base, tuple(items)


def _known_scaling_schedule(head_dim, rope_base, rope_scaling):
    """The schedule an earlier call made from an equal dict, or None."""
    return _SCALING_SCHEDULES.get(_scaling_key(head_dim, rope_base, rope_scaling))


def _remember_scaling_schedule(head_dim, rope_base, rope_scaling, schedule) -> None:
    key = _scaling_key(head_dim, rope_base, rope_scaling)
    if key is not None and len(_SCALING_SCHEDULES) < 64:
        _SCALING_SCHEDULES[key] = schedule


# Frameworks whose arrays are immutable (SPEC §9): the op would write behind their back, so
# they have front ends of their own. Keyed by the top-level module of the array's type.
_IMMUTABLE_FRONT_ENDS = {"mlx": ("an mlx.core.array", "ropepool.mlx"),
                         "jax": ("a jax.Array", "ropepool.jax"),
                         "jaxlib": ("a jax.Array", "ropepool.jax")}


def _refuse_immutable(op: str, named) -> None:
    """TypeError for MLX and JAX arrays among `named` ((name, array) pairs), before anything
    is converted: DLPack would hand out their memory and the op's writes would mutate arrays
    their framework treats as immutable (a lazy MLX value computed before the call would see
    it). The message names the front end's own version of `op`."""
    for name, t in named:
        front = _IMMUTABLE_FRONT_ENDS.get(type(t).__module__.partition(".")[0])
        if front is not None:
            raise TypeError(
                f"{op}: {name} is {front[0]}, which ropepool.{op} cannot write (it is "
                f"immutable); use {front[1]}.{op}, which takes and returns that framework's "
                "arrays")


def _refuse_immutable_arrays(tensors, q_out=None, k_out=None) -> None:
    _refuse_immutable("rope_pool_fused",
                      zip(_TENSOR_ARGS + ("q_out", "k_out"), tuple(tensors) + (q_out, k_out)))


_FP8_NAMES = ("float8_e4m3fn",)


_NO_CACHE = (None, None, None, None, None, None, None, False)


def _cache_args(kv_layout, k_scale, v_scale, q_scale, q_out_dtype, inplace):
    """SPEC §6 keywords as the core and the torch op schema take them: (kv_layout,
    k_scale_tensor, k_scale, v_scale_tensor, v_scale, q_scale_tensor, q_scale, q_fp8). The
    core validates the values; here only Python types are told apart."""
    if kv_layout is None and k_scale is None and v_scale is None and q_scale is None \
            and q_out_dtype is None:
        return _NO_CACHE  # the common call: no per-call work here
    if kv_layout is not None and not isinstance(kv_layout, str):
        raise TypeError("rope_pool_fused: kv_layout must be None, \"NHD\" or \"HND\", got "
                        f"{type(kv_layout).__name__}")
    out = [kv_layout]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)):
        if scale is None:
            out += [None, None]
        elif _is_bool(scale):
            raise TypeError(f"rope_pool_fused: {name} must be a float or a one-element float32 "
                            "tensor, got bool")
        elif isinstance(scale, numbers.Real):
            out += [None, float(scale)]
        elif hasattr(scale, "shape") or hasattr(scale, "__dlpack__"):
            out += [scale, None]
        else:
            raise TypeError(f"rope_pool_fused: {name} must be a float or a one-element float32 "
                            f"tensor, got {type(scale).__name__}")
    if q_out_dtype is None:
        q_fp8 = False
    elif q_out_dtype in _FP8_NAMES or (torch is not None and q_out_dtype is torch.float8_e4m3fn):
        q_fp8 = True
    else:
        raise ValueError("rope_pool_fused: q_out_dtype must be None or float8_e4m3fn "
                         f"(torch.float8_e4m3fn or \"float8_e4m3fn\"), got {q_out_dtype!r}")
    if q_fp8 and inplace:
        raise ValueError("rope_pool_fused: q_out_dtype=float8_e4m3fn cannot be combined with "
                         "inplace=True (q_rot would be written into q, of q's dtype)")
    out.append(q_fp8)
    return tuple(out)


def _refuse_mixed_frameworks(tensors, q_out, k_out) -> None:
    """TypeError when some arrays are torch.Tensors and others are not (the torch path needs
    them all; the DLPack path would write a tensor behind torch's back)."""
    if torch is None:
        return
    named = tuple(zip(_TENSOR_ARGS, tensors))
    named += tuple((n, t) for n, t in (("q_out", q_out), ("k_out", k_out)) if t is not None)
    if any(isinstance(t, torch.Tensor) for _, t in named):
        name, t = next((name, t) for name, t in named if not isinstance(t, torch.Tensor))
        raise TypeError(
            f"rope_pool_fused: {name} is a {type(t).__name__} but other arguments are "
            "torch.Tensors; pass every array as a torch.Tensor"
        )


def _check_out_keywords(q_out, k_out, inplace) -> None:
    """q_out/k_out against inplace: the one conflict the core cannot see (with inplace, q/k
    themselves are the outputs it receives)."""
    if inplace:
        given = " and ".join(n for n, t in (("q_out", q_out), ("k_out", k_out)) if t is not None)
        raise ValueError(f"rope_pool_fused: {given} cannot be combined with inplace=True "
                         "(inplace writes q_rot/k_rot into q and k); pass q_out/k_out or "
                         "inplace=True, not both (q_out=q, k_out=k is in-place rotation)")


def _check_no_k_rot(k_out) -> None:
    """return_k_rot=False against k_out: a k_rot output for a call that writes none."""
    if k_out is not None:
        raise ValueError("rope_pool_fused: k_out cannot be combined with return_k_rot=False "
                         "(no k_rot is written); pass k_out or return_k_rot=False, not both")


def _cache_kwargs(cache):
    if cache[0] is None and all(x is None for x in cache[1:7]):
        return {}
    kv_layout, kt, kf, vt, vf, qt, qf, _ = cache
    return dict(kv_layout=kv_layout, k_scale_tensor=kt, k_scale=kf, v_scale_tensor=vt,
                v_scale=vf, q_scale_tensor=qt, q_scale=qf)


_SCHEDULE_KEYWORDS = ("rope_scaling", "inv_freq", "attention_scaling", "max_position_embeddings",
                      "original_max_position_embeddings", "seq_len", "mrope_section",
                      "mrope_interleaved")


# SPEC §7 keywords as the core and the torch op schema take them: (q_norm_weight,
# k_norm_weight, norm_eps, norm_style, mrope_section, mrope_interleaved).
_NO_FUSION = (None, None, None, None, None, False)


def _fusion_args(q_norm_weight, k_norm_weight, norm_eps, norm_style, section, interleaved):
    if q_norm_weight is None and k_norm_weight is None and norm_eps is None \
            and norm_style is None and section is None:
        return _NO_FUSION  # the common call: no per-call work here
    norm_eps, norm_style = _norm_scalars(norm_eps, norm_style)
    return (q_norm_weight, k_norm_weight, norm_eps, norm_style, section, interleaved)


def _fusion_kwargs(fusion):
    """SPEC §7's keywords as the binding takes them (none for a call without them: each
    keyword costs the binding's argument parsing)."""
    if fusion is _NO_FUSION:
        return {}
    q_w, k_w, eps, style, section, interleaved = fusion
    return dict(q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=eps, norm_style=style,
                mrope_section=section, mrope_interleaved=interleaved)


def _norm_scalars(norm_eps, norm_style):
    """Python types of the norm keywords (their values are checked by the core)."""
    if norm_eps is not None:
        norm_eps = _real("norm_eps", norm_eps)
    if norm_style is not None and not isinstance(norm_style, str):
        raise TypeError("rope_pool_fused: norm_style must be a str ('rms' or 'gemma'), got "
                        f"{type(norm_style).__name__}")
    return norm_eps, norm_style


def _fused_scalars(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, rope_scaling,
                   max_position_embeddings, original_max_position_embeddings, seq_len, inv_freq,
                   attention_scaling, schedule, mrope_section=None, mrope_interleaved=None):
    """The keyword arguments as the core takes them: Python types checked (bools are not
    numbers), the schedule made or checked against the call."""
    head_dim = _int("head_dim", head_dim)
    num_qo_heads = _int("num_qo_heads", num_qo_heads)
    num_kv_heads = _int("num_kv_heads", num_kv_heads)
    rope_base = _real("rope_base", rope_base)
    rotary_dim = _rotary_dim(rotary_dim, head_dim)
    given = {"rope_scaling": rope_scaling, "inv_freq": inv_freq,
             "attention_scaling": attention_scaling,
             "max_position_embeddings": max_position_embeddings,
             "original_max_position_embeddings": original_max_position_embeddings,
             "seq_len": seq_len, "mrope_section": mrope_section,
             "mrope_interleaved": mrope_interleaved}
    only_scaling = rope_scaling is not None and rotary_dim == 0 \
        and sum(v is not None for v in given.values()) == 1
    if schedule is None and only_scaling:
        schedule = _known_scaling_schedule(head_dim, rope_base, rope_scaling)
        if schedule is None:
            schedule = rope_schedule(head_dim=head_dim, rope_base=rope_base,
                                     rope_scaling=rope_scaling)
            _remember_scaling_schedule(head_dim, rope_base, rope_scaling, schedule)
    elif schedule is None and any(v is not None for v in given.values()):
        schedule = rope_schedule(
            head_dim=head_dim, rope_base=rope_base, rotary_dim=rotary_dim or None,
            rope_scaling=rope_scaling, max_position_embeddings=max_position_embeddings,
            original_max_position_embeddings=original_max_position_embeddings,
            seq_len=seq_len, inv_freq=inv_freq, attention_scaling=attention_scaling,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    elif schedule is not None:
        if not isinstance(schedule, RopeSchedule):
            raise TypeError("rope_pool_fused: schedule must be a ropepool.RopeSchedule, got "
                            f"{type(schedule).__name__}")
        extra = [name for name in _SCHEDULE_KEYWORDS if given[name] is not None]
        if extra:
            raise ValueError("rope_pool_fused: schedule replaces " + ", ".join(extra)
                             + "; pass them to rope_schedule, or drop schedule")
        if schedule.rope_base and schedule.rope_base != rope_base:
            # The core's wording (src/schedule.cpp, check_precomputed_schedule).
            err = ValueError(f"rope_pool_fused: rope_base = {rope_base!r} disagrees with the "
                             f"schedule, made for rope_base = {float(schedule.rope_base)!r}")
            err.add_note("pass the rope_base the schedule was made with (or make a new schedule)")
            raise err
    if schedule is None:
        return head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, None, 1.0, None, False
    section = getattr(schedule, "mrope_section", None)
    return (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
            list(schedule.inv_freq), schedule.attention_scaling,
            None if section is None else list(section),
            bool(getattr(schedule, "mrope_interleaved", False)))


def validate_rope_pool(
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
    schedule: Optional["RopeSchedule"] = None,
    inplace: bool = False,
    q_out: Any = None,
    k_out: Any = None,
    check_slots: bool = False,
    kv_layout: Optional[str] = None,
    k_scale: Any = None,
    v_scale: Any = None,
    q_scale: Any = None,
    q_out_dtype: Any = None,
    q_norm_weight: Any = None,
    k_norm_weight: Any = None,
    norm_eps: Optional[float] = None,
    norm_style: Optional[str] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: Optional[bool] = None,
    return_k_rot: bool = True,
) -> None:
    """Only the validation of :func:`rope_pool_fused`, with its exact arguments: raises the
    same error the op would for this call, writes nothing, never waits for a device.

    As in C++ (``validate_rope_pool``), slot values in device memory are not read (on CUDA
    an out-of-range slot is reported by the op itself, SPEC §3). q_rot/k_rot are q_out/k_out
    where given, else allocated as the op would (their overlap with the inputs is part of
    the check).
    """
    tensors = (q, k, v, positions, slots, k_pool, v_pool)
    _refuse_immutable_arrays(tensors, q_out, k_out)
    has_out = q_out is not None or k_out is not None
    (head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, sched_freqs, sched_scale,
     sched_section, sched_interleaved) = \
        _fused_scalars(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
                       rope_scaling, max_position_embeddings, original_max_position_embeddings,
                       seq_len, inv_freq, attention_scaling, schedule, mrope_section,
                       mrope_interleaved)
    fusion = _fusion_args(q_norm_weight, k_norm_weight, norm_eps, norm_style, sched_section,
                          sched_interleaved)
    if has_out:
        _check_out_keywords(q_out, k_out, bool(inplace))
    k_rot_wanted = bool(return_k_rot)
    if not k_rot_wanted:
        _check_no_k_rot(k_out)
    cache = _cache_args(kv_layout, k_scale, v_scale, q_scale, q_out_dtype, bool(inplace))
    is_torch = torch is not None and all(isinstance(t, torch.Tensor) for t in tensors)
    if is_torch:
        _check_torch_scales(cache)
        if has_out:
            _check_torch_outs(q, q_out, k_out, cache[-1])
    else:
        _refuse_mixed_frameworks(tensors, q_out, k_out)
        if cache[-1]:
            raise ValueError("rope_pool_fused: q_out_dtype=float8_e4m3fn needs torch tensors "
                             "(NumPy cannot export float8 through DLPack)")
    # (without k_rot, k_out is None: checked above)
    if inplace:
        q_rot, k_rot = q, (k if k_rot_wanted else None)
    elif is_torch:
        q_rot = _new_q_rot(q, cache[-1]) if q_out is None else q_out
        k_rot = _new_torch_output(k) if k_out is None and k_rot_wanted else k_out
    else:
        q_rot = _new_array_output(q, "q") if q_out is None else q_out
        k_rot = _new_array_output(k, "k") if k_out is None and k_rot_wanted else k_out
    _ropepool.rope_pool_fused_into(
        q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot,
        head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        rope_base=rope_base, check_slots=bool(check_slots), stream=0, rotary_dim=rotary_dim,
        interleaved=bool(interleaved), schedule_inv_freq=sched_freqs,
        schedule_attention_scaling=sched_scale, validate_only=True,
        exporter=_to_dlpack if is_torch else None, **_cache_kwargs(cache),
        **_fusion_kwargs(fusion))


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


_FAST_TENSOR: Any = None  # torch.Tensor where torch is installed (the fast path's type test)
_FAST_FP8: Any = None  # torch.float8_e4m3fn (a float8 q_out takes the slow path's check)

if torch is not None:

    def _new_torch_output(x: "torch.Tensor") -> "torch.Tensor":
        """q_rot/k_rot: uninitialised, contiguous, q's dtype and device."""
        return torch.empty_like(x, memory_format=torch.contiguous_format)  # 2x torch.empty's speed

    def _new_q_rot(q: "torch.Tensor", fp8: bool) -> "torch.Tensor":
        """q_rot in q's dtype, or float8_e4m3fn (SPEC §6)."""
        if fp8:  # (empty_like: a third of torch.empty's host time)
            return torch.empty_like(q, dtype=torch.float8_e4m3fn,
                                    memory_format=torch.contiguous_format)
        return _new_torch_output(q)

    def _check_torch_scales(cache) -> None:
        if cache[1] is None and cache[3] is None and cache[5] is None:
            return  # (`is` on tuples is not traceable by torch.compile)
        for name, t in (("k_scale", cache[1]), ("v_scale", cache[3]), ("q_scale", cache[5])):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"rope_pool_fused: {name} must be a float or a one-element "
                                f"float32 torch.Tensor, got {type(t).__name__}")

    def _check_torch_outs(q, q_out, k_out, q_fp8) -> None:
        """q_out/k_out with torch tensors: torch.Tensors too, and q_out's dtype the one
        q_out_dtype asks for (the core takes a float8_e4m3fn q_out as the fp8 q_rot, so
        only here can a q_out that disagrees with q_out_dtype be told apart). Shapes, the
        other dtypes, devices, layouts and overlaps are the core's (SPEC §2, §3)."""
        for name, t in (("q_out", q_out), ("k_out", k_out)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"rope_pool_fused: {name} is a {type(t).__name__} but other "
                                "arguments are torch.Tensors; pass every array as a "
                                "torch.Tensor")
        if q_out is None:
            return
        fp8 = q_out.dtype == torch.float8_e4m3fn
        if q_fp8 and not fp8:
            raise ValueError("rope_pool_fused: q_out must be float8_e4m3fn "
                             "(q_out_dtype=float8_e4m3fn), got "
                             f"{str(q_out.dtype).removeprefix('torch.')}")
        if fp8 and not q_fp8:
            raise ValueError("rope_pool_fused: q_out is float8_e4m3fn but q_out_dtype is None; "
                             "pass q_out_dtype=torch.float8_e4m3fn for an fp8 q_rot, or a "
                             f"q_out of q's dtype ({str(q.dtype).removeprefix('torch.')})")

    def _plain_weights(fusion) -> bool:
        if fusion[0] is None and fusion[1] is None:
            return True
        return all(w is None or type(w) is torch.Tensor for w in fusion[:2])

    def _plain_scales(cache) -> bool:
        if cache[1] is None and cache[3] is None and cache[5] is None:
            return True
        return all(t is None or type(t) is torch.Tensor for t in (cache[1], cache[3], cache[5]))

    # The op is defined with torch.library's low-level API rather than the
    # @torch.library.custom_op decorator: the schema says the same thing (k_pool and v_pool
    # mutated in place: `Tensor(a!)`), torch.compile treats both alike, but the decorator's
    # Python autograd and ADInplaceOrView layers cost ~20 us per eager call against ~1.5 us
    # here, which matters for a decode step that launches a few-microsecond kernel.
    _LIB = torch.library.Library("ropepool", "DEF")
    # The schedule travels as plain numbers (inv_freq as float64 values, or None for the
    # default schedule of rope_base), which the schema can carry and torch.compile can bake
    # into a graph; `rope_pool_fused_` is the in-place variant (q and k mutated too).
    # SPEC §6: kv_layout, each scale as (Tensor?, float?) (a tensor is read when the kernel
    # runs, so a captured graph sees its current value), q_fp8 for a float8_e4m3fn q_rot.
    _SCHEMA_TAIL = ("int head_dim, int num_qo_heads, int num_kv_heads, float rope_base, "
                    "bool check_slots=False, int rotary_dim=0, bool interleaved=False, "
                    "float[]? inv_freq=None, float attention_scaling=1.0, "
                    "str? kv_layout=None, Tensor? k_scale_tensor=None, float? k_scale=None, "
                    "Tensor? v_scale_tensor=None, float? v_scale=None, "
                    "Tensor? q_scale_tensor=None, float? q_scale=None, bool q_fp8=False, "
                    "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, "
                    "float? norm_eps=None, str? norm_style=None, int[]? mrope_section=None, "
                    "bool mrope_interleaved=False)")
    _LIB.define(
        "rope_pool_fused(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor slots, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, " + _SCHEMA_TAIL + " -> (Tensor, Tensor)"
    )
    _LIB.define(
        "rope_pool_fused_(Tensor(c!) q, Tensor(d!) k, Tensor v, Tensor positions, "
        "Tensor slots, Tensor(a!) k_pool, Tensor(b!) v_pool, " + _SCHEMA_TAIL + " -> ()"
    )
    # q_out=/k_out= (caller-provided outputs, both given: rope_pool_fused allocates the one
    # the caller left out): written in place like the pools, nothing returned (a custom op
    # cannot return its mutated inputs; rope_pool_fused returns the caller's objects). A
    # float8_e4m3fn q_out is the fp8 q_rot; q_fp8 is not read (q_out's dtype says it).
    # k_out None: no k_rot (return_k_rot=False).
    _LIB.define(
        "rope_pool_fused_out(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor slots, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) q_out, Tensor(d!)? k_out, "
        + _SCHEMA_TAIL + " -> ()"
    )
    # Private torch APIs (each with a public fallback) are named in _torch_compat only.
    from ropepool._torch_compat import current_device as _current_device
    from ropepool._torch_compat import current_dispatch_mode as _dispatch_mode
    from ropepool._torch_compat import current_raw_stream as _current_raw_stream
    from ropepool._torch_compat import increment_version as _increment_version
    from ropepool._torch_compat import to_dlpack as _to_dlpack

    def _run(q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, head_dim,
             num_qo_heads, num_kv_heads, rope_base, check_slots=False, rotary_dim=0,
             interleaved=False, inv_freq=None, attention_scaling=1.0, kv_layout=None,
             k_scale_tensor=None, k_scale=None, v_scale_tensor=None, v_scale=None,
             q_scale_tensor=None, q_scale=None, q_fp8=False, q_norm_weight=None,
             k_norm_weight=None, norm_eps=None, norm_style=None, mrope_section=None,
             mrope_interleaved=False):
        # (the dispatcher leaves trailing schema defaults out of the call)
        args = (q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot)
        kwargs = dict(head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                      rope_base=rope_base, check_slots=check_slots, exporter=_to_dlpack,
                      rotary_dim=rotary_dim, interleaved=interleaved,
                      schedule_inv_freq=inv_freq, schedule_attention_scaling=attention_scaling)
        if kv_layout is not None or k_scale_tensor is not None or k_scale is not None \
                or v_scale_tensor is not None or v_scale is not None \
                or q_scale_tensor is not None or q_scale is not None:
            # (left out otherwise: each keyword costs the binding's argument parsing)
            kwargs.update(kv_layout=kv_layout, k_scale_tensor=k_scale_tensor, k_scale=k_scale,
                          v_scale_tensor=v_scale_tensor, v_scale=v_scale,
                          q_scale_tensor=q_scale_tensor, q_scale=q_scale)
        if q_norm_weight is not None or k_norm_weight is not None or norm_eps is not None \
                or norm_style is not None or mrope_section is not None or mrope_interleaved:
            kwargs.update(_fusion_kwargs((q_norm_weight, k_norm_weight, norm_eps, norm_style,
                                          mrope_section, mrope_interleaved)))
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

    _Tensor = torch.Tensor
    _is_compiling = torch.compiler.is_compiling

    def _plain_eager(tensors) -> bool:
        """True outside torch.compile tracing, with no dispatch mode active, when every
        array is a plain torch.Tensor (not a subclass such as FakeTensor)."""
        for t in tensors:
            if type(t) is not _Tensor:
                return False
        return not _is_compiling() and _dispatch_mode() is None

    def _q_fp8(scalars, kwargs) -> bool:
        # q_fp8 is the schema's last argument (index 16 of the scalars); the dispatcher may
        # pass it by keyword or leave it out (default False)
        if "q_fp8" in kwargs:
            return bool(kwargs["q_fp8"])
        return bool(scalars[16]) if len(scalars) > 16 else False

    def _rope_pool_fused_kernel(q, k, v, positions, slots, k_pool, v_pool, *scalars, **kwargs):
        q_rot = _new_q_rot(q, _q_fp8(scalars, kwargs))
        k_rot = _new_torch_output(k)
        _run(q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, *scalars, **kwargs)
        # What the decorator's ADInplaceOrView layer would do: tell autograd the pools were
        # written in place (a no-op for inference-mode tensors, which have no version).
        _increment_version((k_pool, v_pool))
        return q_rot, k_rot

    def _rope_pool_fused_inplace_kernel(q, k, v, positions, slots, k_pool, v_pool, *scalars,
                                        **kwargs):
        _run(q, k, v, positions, slots, k_pool, v_pool, q, k, *scalars, **kwargs)
        _increment_version((q, k, k_pool, v_pool))

    def _rope_pool_fused_out_kernel(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out,
                                    *scalars, **kwargs):
        _run(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, *scalars, **kwargs)
        _increment_version((q_out, k_out, k_pool, v_pool) if k_out is not None
                           else (q_out, k_pool, v_pool))

    def _fast_eager() -> bool:
        return not _is_compiling() and _dispatch_mode() is None

    def _fast_call(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads,
                   num_kv_heads, rope_base, inplace, q_out, k_out):
        """What _rope_pool_fused_kernel / _rope_pool_fused_inplace_kernel /
        _rope_pool_fused_out_kernel do for a call with only the four required keywords
        (and inplace, or q_out/k_out in q's/k's dtype), without building the keyword
        tuples."""
        if inplace:
            q_rot, k_rot = q, k
        else:
            q_rot = _new_torch_output(q) if q_out is None else q_out
            k_rot = _new_torch_output(k) if k_out is None else k_out
        stream = 0
        if q.is_cuda:
            device = q.device.index
            if device != _current_device():  # rare: _run switches the device
                scalars = (head_dim, num_qo_heads, num_kv_heads, rope_base)
                _rope_pool_fused_out_kernel(q, k, v, positions, slots, k_pool, v_pool, q_rot,
                                            k_rot, *scalars)
                return q_rot, k_rot, k_pool, v_pool
            stream = _current_raw_stream(device)
        _ropepool.rope_pool_fused_into(
            q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, head_dim=head_dim,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base,
            stream=stream, exporter=_to_dlpack)
        if inplace or q_out is not None or k_out is not None:
            _increment_version((q_rot, k_rot, k_pool, v_pool))
        else:
            _increment_version((k_pool, v_pool))
        return q_rot, k_rot, k_pool, v_pool

    def _fast_keywords(kv_layout, k_scale, v_scale, q_scale, q_out_dtype, inplace, q_out, k_out,
                       return_k_rot, q_norm_weight, k_norm_weight, norm_eps, norm_style, schedule,
                       rope_base) -> bool:
        """Whether a call with a schedule, SPEC §6's keywords, return_k_rot=False or SPEC
        §7's norm keywords can take the fast path: each keyword of the one Python type the
        slow path passes through unchanged (a RopeSchedule made for this rope_base, mRoPE
        included, a str layout or style, float or plain-tensor scales, plain tensor weights,
        a float eps, torch.float8_e4m3fn), and none of the combinations only the slow path
        rejects (inplace with outputs or an fp8 q_rot, k_out without k_rot, a q_out whose
        dtype disagrees with q_out_dtype). The values are the core's to check, as on the slow
        path."""
        if schedule is not None and (type(schedule) is not RopeSchedule
                                     or (schedule.rope_base and schedule.rope_base != rope_base)):
            return False
        if kv_layout is not None and type(kv_layout) is not str:
            return False
        for s in (k_scale, v_scale, q_scale):
            if s is not None and type(s) is not float and type(s) is not _FAST_TENSOR:
                return False
        if (q_norm_weight is not None and type(q_norm_weight) is not _FAST_TENSOR) \
                or (k_norm_weight is not None and type(k_norm_weight) is not _FAST_TENSOR) \
                or (norm_eps is not None and type(norm_eps) is not float) \
                or (norm_style is not None and type(norm_style) is not str):
            return False
        q8 = q_out_dtype is not None
        if q8 and q_out_dtype is not _FAST_FP8:
            return False
        if return_k_rot is False:
            if k_out is not None:
                return False
        elif return_k_rot is not True:
            return False
        if inplace is True:
            return q_out is None and k_out is None and not q8
        if inplace is not False:
            return False
        if q_out is not None and (type(q_out) is not _FAST_TENSOR
                                  or (q_out.dtype is _FAST_FP8) is not q8):
            return False
        return k_out is None or type(k_out) is _FAST_TENSOR

    def _fast_keyword_call(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads,
                           num_kv_heads, rope_base, inplace, q_out, k_out, q8, k_rot_wanted,
                           kv_layout, k_scale, v_scale, q_scale, q_norm_weight, k_norm_weight,
                           norm_eps, norm_style, schedule):
        """_fast_call with the keywords that _fast_keywords accepted (those given passed on
        to the core by name, a tensor scale as its *_scale_tensor): what
        _rope_pool_fused_out_kernel / _rope_pool_fused_kernel do for such a call. None when
        q is on a device other than the current one (the slow path switches devices)."""
        stream = 0
        if q.is_cuda:
            device = q.device.index
            if device != _current_device():
                return None
            stream = _current_raw_stream(device)
        if inplace:
            q_rot, k_rot = q, (k if k_rot_wanted else None)
        else:
            q_rot = q_out if q_out is not None else _new_q_rot(q, q8)
            k_rot = k_out if k_out is not None else (_new_torch_output(k) if k_rot_wanted
                                                     else None)
        kwargs = {}
        if schedule is not None:
            kwargs["schedule_inv_freq"] = schedule.inv_freq
            kwargs["schedule_attention_scaling"] = schedule.attention_scaling
            if schedule.mrope_section is not None:  # SPEC §7: positions [3, T]
                kwargs["mrope_section"] = schedule.mrope_section
                kwargs["mrope_interleaved"] = bool(schedule.mrope_interleaved)
        if kv_layout is not None:
            kwargs["kv_layout"] = kv_layout
        if k_scale is not None:
            kwargs["k_scale" if type(k_scale) is float else "k_scale_tensor"] = k_scale
        if v_scale is not None:
            kwargs["v_scale" if type(v_scale) is float else "v_scale_tensor"] = v_scale
        if q_scale is not None:
            kwargs["q_scale" if type(q_scale) is float else "q_scale_tensor"] = q_scale
        if q_norm_weight is not None:
            kwargs["q_norm_weight"] = q_norm_weight
        if k_norm_weight is not None:
            kwargs["k_norm_weight"] = k_norm_weight
        if norm_eps is not None:
            kwargs["norm_eps"] = norm_eps
        if norm_style is not None:
            kwargs["norm_style"] = norm_style
        _ropepool.rope_pool_fused_into(
            q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, head_dim=head_dim,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base,
            stream=stream, exporter=_to_dlpack, **kwargs)
        # Versions of what the caller passed and the op wrote (fresh outputs have no readers)
        if inplace:
            _increment_version((q, k, k_pool, v_pool) if k_rot_wanted else (q, k_pool, v_pool))
        elif q_out is not None or k_out is not None:
            _increment_version(tuple(x for x in (q_out, k_out, k_pool, v_pool) if x is not None))
        else:
            _increment_version((k_pool, v_pool))
        return q_rot, k_rot, k_pool, v_pool

    _FAST_TENSOR = torch.Tensor
    _FAST_FP8 = torch.float8_e4m3fn

    # One kernel for every backend key (CPU, CUDA, ...): the C++ side dispatches on the
    # tensors' device itself and rejects what it cannot run.
    _LIB.impl("rope_pool_fused", _rope_pool_fused_kernel, "CompositeExplicitAutograd")
    _LIB.impl("rope_pool_fused_", _rope_pool_fused_inplace_kernel, "CompositeExplicitAutograd")
    _LIB.impl("rope_pool_fused_out", _rope_pool_fused_out_kernel, "CompositeExplicitAutograd")

    @torch.library.register_fake("ropepool::rope_pool_fused_", lib=_LIB)
    def _rope_pool_fused_inplace_fake(q, k, v, positions, slots, k_pool, v_pool, *scalars,
                                      **kwargs):
        return None

    @torch.library.register_fake("ropepool::rope_pool_fused_out", lib=_LIB)
    def _rope_pool_fused_out_fake(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out,
                                  *scalars, **kwargs):
        return None  # every output is a mutated argument: nothing to describe

    @torch.library.register_fake("ropepool::rope_pool_fused", lib=_LIB)
    def _rope_pool_fused_fake(q, k, v, positions, slots, k_pool, v_pool, *scalars, **kwargs):
        return (_new_q_rot(q, _q_fp8(scalars, kwargs)),
                torch.empty_like(k, memory_format=torch.contiguous_format))
