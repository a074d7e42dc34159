"""Multi-head latent attention (SPEC §8): ``mla_rope_pool_fused`` and its torch custom op.

The C++ core (``_ropepool.mla_rope_pool_fused_into``) validates every argument; this layer
makes the schedule, allocates q_pe_rot/k_pe_rot with the caller's framework, picks the CUDA
stream and returns the caller's own cache object.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from ropepool import _ropepool
from ropepool._op import (_known_scaling_schedule, _new_array_output, _refuse_immutable,
                         _remember_scaling_schedule)
from ropepool._schedule import RopeSchedule, _is_bool, _is_real, rope_schedule

try:
    import torch
except ImportError:  # NumPy / DLPack use needs no torch
    torch = None

_OP = "mla_rope_pool_fused"
_FAST_TENSOR: Any = None  # torch.Tensor where torch is installed (the fast path's type test)
_TENSOR_ARGS = ("q_pe", "k_pe", "kv_c", "positions", "slots", "kv_cache")
_SCHEDULE_KEYWORDS = ("rope_scaling", "inv_freq", "attention_scaling", "max_position_embeddings",
                      "original_max_position_embeddings", "seq_len")


def _renamed(err: Exception) -> Exception:
    """The schedule's messages name rope_pool_fused; in this op they name this op."""
    text = str(err)
    if text.startswith("rope_pool_fused: "):
        new = type(err)("mla_" + text)
        for note in getattr(err, "__notes__", ()):
            new.add_note(note)
        return new
    return err


def _options(q_pe, rope_base, rope_scaling, max_position_embeddings,
             original_max_position_embeddings, seq_len, inv_freq, attention_scaling, schedule,
             kv_layout, kv_scale):
    """(rope_base, inv_freq list or None, attention_scaling, nhd, kv_scale float or None,
    kv_scale tensor or None), the Python types checked."""
    if _is_bool(rope_base) or not _is_real(rope_base):
        raise TypeError(f"{_OP}: rope_base must be a real number, got {type(rope_base).__name__}")
    rope_base = float(rope_base)
    if kv_layout is None:
        nhd = False
    elif kv_layout == "NHD":
        nhd = True
    else:
        raise ValueError(f"{_OP}: kv_layout must be None (a [P, L + R] cache) or 'NHD' (a "
                         f"[pages, page_size, L + R] cache), got {kv_layout!r}")
    scale_value, scale_tensor = None, None
    if kv_scale is not None:
        if _is_real(kv_scale):
            scale_value = float(kv_scale)
        elif hasattr(kv_scale, "shape"):
            scale_tensor = kv_scale
        else:
            raise TypeError(f"{_OP}: kv_scale must be a float or a one-element float32 tensor, "
                            f"got {type(kv_scale).__name__}")
    given = {"rope_scaling": rope_scaling, "inv_freq": inv_freq,
             "attention_scaling": attention_scaling,
             "max_position_embeddings": max_position_embeddings,
             "original_max_position_embeddings": original_max_position_embeddings,
             "seq_len": seq_len}
    if schedule is not None:
        if not isinstance(schedule, RopeSchedule):
            raise TypeError(f"{_OP}: schedule must be a ropepool.RopeSchedule, got "
                            f"{type(schedule).__name__}")
        extra = [name for name in _SCHEDULE_KEYWORDS if given[name] is not None]
        if extra:
            raise ValueError(f"{_OP}: schedule replaces " + ", ".join(extra)
                             + "; pass them to rope_schedule, or drop schedule")
        if schedule.rope_base and schedule.rope_base != rope_base:
            err = ValueError(f"{_OP}: rope_base = {rope_base!r} disagrees with the schedule, "
                             f"made for rope_base = {float(schedule.rope_base)!r}")
            err.add_note("pass the rope_base the schedule was made with (or make a new schedule)")
            raise err
    elif any(v is not None for v in given.values()):
        # rope_dim comes from q_pe; a q_pe without one is left to the core's shape message.
        shape = getattr(q_pe, "shape", ())
        rope_dim = int(shape[-1]) if len(shape) == 3 else 0
        only_scaling = rope_scaling is not None \
            and sum(v is not None for v in given.values()) == 1
        if only_scaling and rope_dim > 0:
            # rope_pool_fused's memo (the schedule of (rope_dim, rope_base, the dict) is the
            # same for both ops): an engine passes config.rope_scaling on every call
            schedule = _known_scaling_schedule(rope_dim, rope_base, rope_scaling)
        if schedule is None and rope_dim > 0 and rope_dim % 2 == 0:
            try:
                schedule = rope_schedule(
                    head_dim=rope_dim, rope_base=rope_base, rope_scaling=rope_scaling,
                    max_position_embeddings=max_position_embeddings,
                    original_max_position_embeddings=original_max_position_embeddings,
                    seq_len=seq_len, inv_freq=inv_freq, attention_scaling=attention_scaling)
            except (ValueError, TypeError) as err:
                raise _renamed(err) from None
            if only_scaling:
                _remember_scaling_schedule(rope_dim, rope_base, rope_scaling, schedule)
    section = getattr(schedule, "mrope_section", None)
    if section is not None:
        # The core's check (src/mla_rope_pool.cpp), which never sees the schedule's sections:
        # only inv_freq and attention_scaling travel to it.
        err = ValueError(f"{_OP}: the schedule is multimodal (mrope_section = {list(section)}); "
                         "positions here are one per token and the sections would be ignored")
        err.add_note("make the schedule (or rope_scaling) without mrope_section")
        raise err
    freqs = None if schedule is None else list(schedule.inv_freq)
    att = 1.0 if schedule is None else float(schedule.attention_scaling)
    return rope_base, freqs, att, nhd, scale_value, scale_tensor


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
    kv_scale: Any = None,
    kv_layout: Optional[str] = None,
    inplace: bool = False,
    check_slots: bool = False,
    return_k_rot: bool = True,
) -> Tuple[Any, Any, Any]:
    """RoPE on the rotary parts of multi-head latent attention, plus the latent-cache write.

    Args:
        q_pe: ``[T, H, R]`` float32, float16 or bfloat16: the rotary part of every query head,
            usually the view ``q[..., qk_nope_head_dim:]`` of q ``[T, H, 192]``.
        k_pe: ``[T, R]`` (or ``[T, 1, R]``): the one shared rotary key, q_pe's dtype.
        kv_c: ``[T, L]``: the compressed latent (L = kv_lora_rank, 512 for DeepSeek).
            k_pe and kv_c may be column slices of one projection output.
        positions, slots: ``[T]`` int32 or int64; a negative slot skips the token's write.
        kv_cache: ``[P, L + R]``, or ``[pages, page_size, L + R]`` with ``kv_layout="NHD"``;
            q_pe's dtype or float8_e4m3fn. Row ``slot`` becomes ``concat(kv_c, k_pe_rot)``.
        rope_base, rope_scaling, ...: the schedule, as :func:`ropepool.rope_pool_fused`
            (DeepSeek: ``rope_base=config.rope_theta, rope_scaling=config.rope_scaling``).
        interleaved: GPT-J pairs ``(x[2i], x[2i+1])`` (default, DeepSeek's weights);
            False for NeoX half-split pairs.
        kv_scale: fp8 caches: a float or a one-element float32 tensor (read when the kernel
            runs); stored = e4m3(x / kv_scale). None means 1.0.
        inplace: write q_pe_rot/k_pe_rot into q_pe/k_pe and return them.
        check_slots: also reject repeated slots (and on CUDA raise a bad slot at once).
        return_k_rot: False: k_pe_rot is neither written nor returned (the result's k_pe_rot
            is None; k_pe is only read): attention reads k_pe_rot from the cache, so this
            saves writing it. The cache rows are those of the call with k_pe_rot; with
            ``inplace`` q_pe is rotated in place and k_pe is left as it was.

    Returns:
        ``(q_pe_rot, k_pe_rot, kv_cache)``; k_pe_rot has k_pe's shape (None with
        ``return_k_rot=False``); kv_cache is the very object passed in, written in place.
    """
    tensors = (q_pe, k_pe, kv_c, positions, slots, kv_cache)
    # The common decode-step call (plain torch tensors, eager, every keyword of the one Python
    # type the checks below pass through unchanged, a schedule made by rope_schedule or a
    # rope_scaling dict an earlier call made one from) goes straight to the op's kernel
    # function; the core validates every call, so errors are the same.
    scalars = _fast_scalars(tensors, rope_base, rope_scaling, max_position_embeddings,
                            original_max_position_embeddings, seq_len, inv_freq,
                            attention_scaling, schedule, interleaved, kv_scale, kv_layout,
                            inplace, check_slots, return_k_rot) if _FAST_TENSOR else None
    if scalars is not None:
        return _eager_call(tensors, scalars, inplace, return_k_rot)
    if torch is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        _refuse_immutable(_OP, zip(_TENSOR_ARGS, tensors))
    rope_base, freqs, att, nhd, scale_value, scale_tensor = _options(
        q_pe, rope_base, rope_scaling, max_position_embeddings, original_max_position_embeddings,
        seq_len, inv_freq, attention_scaling, schedule, kv_layout, kv_scale)
    interleaved, inplace, check_slots = bool(interleaved), bool(inplace), bool(check_slots)
    k_rot_wanted = bool(return_k_rot)
    if torch is not None and all(isinstance(t, torch.Tensor) for t in tensors):
        scalars = (scale_tensor, rope_base, interleaved, freqs, att, nhd, scale_value, check_slots)
        if not k_rot_wanted:
            # No k_pe_rot: ops of their own, whose schemas name what they write (the cache,
            # and q_pe in place), so k_pe is only read under torch.compile too.
            if _plain_eager(tensors):
                return _eager_call(tensors, scalars, inplace, False)
            if inplace:
                torch.ops.ropepool.mla_rope_pool_fused_no_k_rot_(*tensors, *scalars)
                return q_pe, None, kv_cache
            q_rot = torch.ops.ropepool.mla_rope_pool_fused_no_k_rot(*tensors, *scalars)
            return q_rot, None, kv_cache
        if _plain_eager(tensors):
            return _eager_call(tensors, scalars, inplace, True)
        if inplace:
            torch.ops.ropepool.mla_rope_pool_fused_(*tensors, *scalars)
            return q_pe, k_pe, kv_cache
        q_rot, k_rot = torch.ops.ropepool.mla_rope_pool_fused(*tensors, *scalars)
        return q_rot, k_rot, kv_cache
    if torch is not None and any(isinstance(t, torch.Tensor) for t in tensors):
        name, t = next((n, t) for n, t in zip(_TENSOR_ARGS, tensors)
                       if not isinstance(t, torch.Tensor))
        raise TypeError(f"{_OP}: {name} is a {type(t).__name__} but other arguments are "
                        "torch.Tensors; pass every array as a torch.Tensor")
    q_rot = q_pe if inplace else _new_array_output(q_pe, "q_pe")
    if not k_rot_wanted:
        k_rot = None
    else:
        k_rot = k_pe if inplace else _new_array_output(k_pe, "k_pe")
    _ropepool.mla_rope_pool_fused_into(
        *tensors, q_rot, k_rot, rope_base=rope_base, interleaved=interleaved, inv_freq=freqs,
        attention_scaling=att, nhd=nhd, kv_scale=scale_value, kv_scale_tensor=scale_tensor,
        check_slots=check_slots)
    return q_rot, k_rot, kv_cache


def validate_mla_rope_pool(q_pe, k_pe, kv_c, positions, slots, kv_cache, *, rope_base,
                           rope_scaling=None, max_position_embeddings=None,
                           original_max_position_embeddings=None, seq_len=None, inv_freq=None,
                           attention_scaling=None, schedule=None, interleaved=True,
                           kv_scale=None, kv_layout=None, inplace=False,
                           check_slots=False, return_k_rot=True) -> None:
    """Only the validation of :func:`mla_rope_pool_fused`: raises what the op would raise
    for these arguments, writes nothing, never waits for a device."""
    tensors = (q_pe, k_pe, kv_c, positions, slots, kv_cache)
    rope_base, freqs, att, nhd, scale_value, scale_tensor = _options(
        q_pe, rope_base, rope_scaling, max_position_embeddings, original_max_position_embeddings,
        seq_len, inv_freq, attention_scaling, schedule, kv_layout, kv_scale)
    is_torch = torch is not None and all(isinstance(t, torch.Tensor) for t in tensors)
    if inplace:
        q_rot, k_rot = q_pe, k_pe
    elif is_torch:
        q_rot, k_rot = torch.empty_like(q_pe, memory_format=torch.contiguous_format), \
            torch.empty_like(k_pe, memory_format=torch.contiguous_format)
    else:
        q_rot, k_rot = _new_array_output(q_pe, "q_pe"), _new_array_output(k_pe, "k_pe")
    if not return_k_rot:
        k_rot = None
    _ropepool.mla_rope_pool_fused_into(
        *tensors, q_rot, k_rot, rope_base=rope_base, interleaved=bool(interleaved),
        inv_freq=freqs, attention_scaling=att, nhd=nhd, kv_scale=scale_value,
        kv_scale_tensor=scale_tensor, check_slots=bool(check_slots), validate_only=True,
        exporter=_to_dlpack if is_torch else None)


if torch is None:
    _to_dlpack = None
else:
    from ropepool._op import _LIB, _plain_eager
    from ropepool._torch_compat import current_device as _current_device
    from ropepool._torch_compat import current_dispatch_mode as _dispatch_mode
    from ropepool._torch_compat import current_raw_stream as _current_raw_stream
    from ropepool._torch_compat import increment_version as _increment_version
    from ropepool._torch_compat import to_dlpack as _to_dlpack

    # The schedule travels as plain numbers (as rope_pool_fused's); kv_scale as an optional
    # tensor (read when the kernel runs, so a CUDA graph sees its current value) or a float.
    _TAIL = ("Tensor? kv_scale_tensor, float rope_base, bool interleaved, float[]? inv_freq, "
             "float attention_scaling, bool nhd, float? kv_scale, bool check_slots)")
    _LIB.define("mla_rope_pool_fused(Tensor q_pe, Tensor k_pe, Tensor kv_c, Tensor positions, "
                "Tensor slots, Tensor(a!) kv_cache, " + _TAIL + " -> (Tensor, Tensor)")
    _LIB.define("mla_rope_pool_fused_(Tensor(b!) q_pe, Tensor(c!) k_pe, Tensor kv_c, "
                "Tensor positions, Tensor slots, Tensor(a!) kv_cache, " + _TAIL + " -> ()")
    # return_k_rot=False: no k_pe_rot result, and in place only q_pe is written.
    _LIB.define("mla_rope_pool_fused_no_k_rot(Tensor q_pe, Tensor k_pe, Tensor kv_c, "
                "Tensor positions, Tensor slots, Tensor(a!) kv_cache, " + _TAIL + " -> Tensor")
    _LIB.define("mla_rope_pool_fused_no_k_rot_(Tensor(b!) q_pe, Tensor k_pe, Tensor kv_c, "
                "Tensor positions, Tensor slots, Tensor(a!) kv_cache, " + _TAIL + " -> ()")

    def _run(q_pe, k_pe, kv_c, positions, slots, kv_cache, q_rot, k_rot, kv_scale_tensor,
             rope_base, interleaved, inv_freq, attention_scaling, nhd, kv_scale, check_slots):
        kwargs = dict(rope_base=rope_base, interleaved=interleaved, inv_freq=inv_freq,
                      attention_scaling=attention_scaling, nhd=nhd, kv_scale=kv_scale,
                      kv_scale_tensor=kv_scale_tensor, check_slots=check_slots,
                      exporter=_to_dlpack)
        args = (q_pe, k_pe, kv_c, positions, slots, kv_cache, q_rot, k_rot)
        if q_pe.is_cuda:
            device = q_pe.device.index
            stream = _current_raw_stream(device)
            if device == _current_device():
                _ropepool.mla_rope_pool_fused_into(*args, **kwargs, stream=stream)
            else:
                with torch.cuda.device(q_pe.device):
                    _ropepool.mla_rope_pool_fused_into(*args, **kwargs, stream=stream)
        else:
            _ropepool.mla_rope_pool_fused_into(*args, **kwargs, stream=0)

    def _new_output(x):
        """q_pe_rot/k_pe_rot: uninitialised, contiguous, x's dtype and device."""
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    _FAST_TENSOR = torch.Tensor
    _is_compiling = torch.compiler.is_compiling

    def _eager_call(tensors, scalars, inplace, k_rot_wanted):
        """As rope_pool_fused: eager calls on plain tensors run the op's kernel function
        directly, without the dispatcher's Python overhead."""
        q_pe, k_pe, kv_cache = tensors[0], tensors[1], tensors[5]
        if not k_rot_wanted:
            if inplace:
                _mla_no_k_rot_inplace_kernel(*tensors, *scalars)
                return q_pe, None, kv_cache
            return _mla_no_k_rot_kernel(*tensors, *scalars), None, kv_cache
        if inplace:
            _mla_inplace_kernel(*tensors, *scalars)
            return q_pe, k_pe, kv_cache
        q_rot, k_rot = _mla_kernel(*tensors, *scalars)
        return q_rot, k_rot, kv_cache

    def _fast_scalars(tensors, rope_base, rope_scaling, max_position_embeddings,
                      original_max_position_embeddings, seq_len, inv_freq, attention_scaling,
                      schedule, interleaved, kv_scale, kv_layout, inplace, check_slots,
                      return_k_rot):
        """The op's scalars for a call the fast path takes, else None: plain tensors, eager,
        a float rope_base, bools, kv_layout None or "NHD", kv_scale None, a float or a plain
        tensor, and the schedule of rope_base (none; a RopeSchedule made for it; a
        rope_scaling dict alone whose schedule an earlier call made)."""
        for t in tensors:
            if type(t) is not _FAST_TENSOR:
                return None
        if type(rope_base) is not float or max_position_embeddings is not None \
                or original_max_position_embeddings is not None or seq_len is not None \
                or inv_freq is not None or attention_scaling is not None:
            return None
        for flag in (interleaved, inplace, check_slots, return_k_rot):
            if flag is not True and flag is not False:
                return None
        if kv_layout is not None and (type(kv_layout) is not str or kv_layout != "NHD"):
            return None
        if kv_scale is not None and type(kv_scale) is not float \
                and type(kv_scale) is not _FAST_TENSOR:
            return None
        if rope_scaling is not None:
            if schedule is not None or tensors[0].dim() != 3:
                return None
            schedule = _known_scaling_schedule(tensors[0].shape[-1], rope_base, rope_scaling)
            if schedule is None:
                return None
        if schedule is not None and (type(schedule) is not RopeSchedule
                                     or schedule.mrope_section is not None
                                     or (schedule.rope_base and schedule.rope_base != rope_base)):
            return None
        if _is_compiling() or _dispatch_mode() is not None:
            return None
        tensor_scale = kv_scale if type(kv_scale) is _FAST_TENSOR else None
        return (tensor_scale, rope_base, interleaved,
                None if schedule is None else schedule.inv_freq,
                1.0 if schedule is None else schedule.attention_scaling,
                kv_layout is not None, kv_scale if tensor_scale is None else None, check_slots)

    def _mla_kernel(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        q_rot = _new_output(q_pe)
        k_rot = _new_output(k_pe)
        _run(q_pe, k_pe, kv_c, positions, slots, kv_cache, q_rot, k_rot, *scalars)
        _increment_version((kv_cache,))
        return q_rot, k_rot

    def _mla_inplace_kernel(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        _run(q_pe, k_pe, kv_c, positions, slots, kv_cache, q_pe, k_pe, *scalars)
        _increment_version((q_pe, k_pe, kv_cache))

    def _mla_no_k_rot_kernel(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        q_rot = _new_output(q_pe)
        _run(q_pe, k_pe, kv_c, positions, slots, kv_cache, q_rot, None, *scalars)
        _increment_version((kv_cache,))
        return q_rot

    def _mla_no_k_rot_inplace_kernel(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        _run(q_pe, k_pe, kv_c, positions, slots, kv_cache, q_pe, None, *scalars)
        _increment_version((q_pe, kv_cache))

    _LIB.impl("mla_rope_pool_fused", _mla_kernel, "CompositeExplicitAutograd")
    _LIB.impl("mla_rope_pool_fused_", _mla_inplace_kernel, "CompositeExplicitAutograd")
    _LIB.impl("mla_rope_pool_fused_no_k_rot", _mla_no_k_rot_kernel, "CompositeExplicitAutograd")
    _LIB.impl("mla_rope_pool_fused_no_k_rot_", _mla_no_k_rot_inplace_kernel,
              "CompositeExplicitAutograd")

    @torch.library.register_fake("ropepool::mla_rope_pool_fused", lib=_LIB)
    def _mla_fake(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        return (torch.empty_like(q_pe, memory_format=torch.contiguous_format),
                torch.empty_like(k_pe, memory_format=torch.contiguous_format))

    @torch.library.register_fake("ropepool::mla_rope_pool_fused_", lib=_LIB)
    def _mla_inplace_fake(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        return None

    @torch.library.register_fake("ropepool::mla_rope_pool_fused_no_k_rot", lib=_LIB)
    def _mla_no_k_rot_fake(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        return torch.empty_like(q_pe, memory_format=torch.contiguous_format)

    @torch.library.register_fake("ropepool::mla_rope_pool_fused_no_k_rot_", lib=_LIB)
    def _mla_no_k_rot_inplace_fake(q_pe, k_pe, kv_c, positions, slots, kv_cache, *scalars):
        return None
