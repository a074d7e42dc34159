"""Caller-provided outputs (`q_out=`, `k_out=`; SPEC §4): the same bits as the default call
in the caller's buffers (strided views too, an fp8 q_out), the very objects returned, every
error with its exact message and nothing written, the torch custom op
(`ropepool::rope_pool_fused_out`: schema, opcheck, torch.compile(fullgraph=True), CUDA graph
capture), the eager fast path and the NumPy front end."""

import re

import numpy as np
import pytest
import torch

import ropepool
import ropepool._op
from rope_testing import (assert_same_bits, capture_graph, copy_pools, default_call, make_case,
                          raw_bits)

FP8 = torch.float8_e4m3fn
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def poison(x):
    """NaN everywhere (every bit pattern checked afterwards, so a skipped element shows)."""
    if isinstance(x, np.ndarray):
        x[...] = np.nan
    elif x.dtype == FP8:
        x.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        x.fill_(float("nan"))
    return x


def poisoned_like(x, dtype=None):
    if isinstance(x, np.ndarray):
        return poison(np.empty_like(x))
    return poison(torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device))


# Keyword sets the out= call must pass through unchanged (SPEC §4, §7).
EXTRA = {
    "plain": {},
    "partial_interleaved": dict(rotary_dim=32, interleaved=True),
    "llama3_checked": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192},
                           check_slots=True),
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("given", ["q_out", "k_out", "both"])
@pytest.mark.parametrize("extra", sorted(EXTRA))
def test_out_matches_the_default_call(kernel_device, rng, dtype, given, extra):
    """Poisoned buffers receive exactly the default call's q_rot/k_rot, are returned as the
    very objects, the pools get the same rows, and q/k/v/positions/slots are unchanged."""
    case = make_case("torch", dtype, rng, T=13, Hq=8, Hk=2, D=64, P=40,
                     device=kernel_device).snapshot()
    kw = EXTRA[extra]
    q_ref, k_ref, k_pool_ref, v_pool_ref = default_call(case, **kw)
    outs = {}
    if given in ("q_out", "both"):
        outs["q_out"] = poisoned_like(case.q)
    if given in ("k_out", "both"):
        outs["k_out"] = poisoned_like(case.k)
    q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(*case.args(),
                                                            **case.kwargs(**kw, **outs))
    assert k_pool is case.k_pool and v_pool is case.v_pool
    if "q_out" in outs:
        assert q_rot is outs["q_out"]
    if "k_out" in outs:
        assert k_rot is outs["k_out"]
    assert_same_bits(q_rot, q_ref, "q_rot")
    assert_same_bits(k_rot, k_ref, "k_rot")
    assert_same_bits(case.k_pool, k_pool_ref, "k_pool")
    assert_same_bits(case.v_pool, v_pool_ref, "v_pool")
    case.assert_unchanged("q", "k", "v", "positions", "slots")


def test_out_buffers_reused_across_calls(rng):
    """The engine's pattern: one pair of buffers, many calls with fresh inputs."""
    q_out = k_out = None
    for _ in range(3):
        case = make_case("torch", "bfloat16", rng, T=9, Hq=4, Hk=2, D=32, P=24).snapshot()
        if q_out is None:
            q_out, k_out = poisoned_like(case.q), poisoned_like(case.k)
        q_ref, k_ref, _, _ = default_call(case)
        out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, k_out=k_out))
        assert out[0] is q_out and out[1] is k_out
        assert_same_bits(q_out, q_ref, "q_out")
        assert_same_bits(k_out, k_ref, "k_out")


def test_out_equal_to_the_input_is_in_place_rotation(rng):
    """q_out=q, k_out=k replace their inputs exactly (SPEC §3): the in-place result."""
    case = make_case("torch", "float16", rng, T=7, Hq=4, Hk=4, D=32, P=16).snapshot()
    q_ref, k_ref, _, _ = default_call(case)
    q, k = case.q.clone(), case.k.clone()
    out = ropepool.rope_pool_fused(q, k, *case.args()[2:], **case.kwargs(q_out=q, k_out=k))
    assert out[0] is q and out[1] is k
    assert_same_bits(q, q_ref, "q rotated in place")
    assert_same_bits(k, k_ref, "k rotated in place")


@pytest.mark.parametrize("layout", ["fused_columns", "every_other_token", "head_major"])
def test_strided_out_views(kernel_device, rng, layout):
    """Any strides with a contiguous last dimension (SPEC §4): the views receive the
    default call's bits, and every element of the buffer outside them keeps its poison."""
    T, Hq, Hk, D = 11, 4, 2, 64
    case = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=32,
                     device=kernel_device).snapshot()
    q_ref, k_ref, _, _ = default_call(case)
    if layout == "fused_columns":  # q_rot and k_rot as columns of one [T, (Hq + Hk + 1) * D]
        buf = poison(torch.empty(T, (Hq + Hk + 1) * D, dtype=torch.bfloat16, device=kernel_device))
        q_out = buf[:, :Hq * D].view(T, Hq, D)
        k_out = buf[:, (Hq + 1) * D:].view(T, Hk, D)
    elif layout == "every_other_token":
        buf = poison(torch.empty(2 * T, Hq + Hk, D, dtype=torch.bfloat16, device=kernel_device))
        q_out, k_out = buf[::2, :Hq], buf[1::2, Hq:]
    else:  # [H, T, D] storage seen as [T, H, D]
        buf = poison(torch.empty(Hq + Hk, T, D, dtype=torch.bfloat16, device=kernel_device))
        q_out, k_out = buf[:Hq].transpose(0, 1), buf[Hq:].transpose(0, 1)
    assert not q_out.is_contiguous() and not k_out.is_contiguous()
    before = raw_bits(buf)
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, k_out=k_out))
    assert out[0] is q_out and out[1] is k_out
    assert_same_bits(q_out, q_ref, "q_out view")
    assert_same_bits(k_out, k_ref, "k_out view")
    # every element outside the two views keeps its poison
    mask = torch.ones(buf.shape, dtype=torch.bool, device=kernel_device)
    mask_q = mask.as_strided(q_out.shape, q_out.stride(), q_out.storage_offset())
    mask_k = mask.as_strided(k_out.shape, k_out.stride(), k_out.storage_offset())
    mask_q.fill_(False)
    mask_k.fill_(False)
    keep = mask.cpu().numpy()
    np.testing.assert_array_equal(raw_bits(buf)[keep], before[keep],
                                  err_msg="an element outside q_out/k_out was written")


@pytest.mark.parametrize("given", ["q_out", "both"])
def test_fp8_q_out(kernel_device, rng, given):
    """q_out_dtype=float8_e4m3fn with a float8_e4m3fn q_out (SPEC §6): the default fp8
    call's bits, q_scale as a number and as a tensor; k_out alone keeps an fp8 q_rot
    allocated by the call."""
    case = make_case("torch", "bfloat16", rng, T=10, Hq=4, Hk=2, D=32, P=24,
                     device=kernel_device).snapshot()
    for q_scale in (0.05, torch.tensor([0.25], device=kernel_device)):
        kw = dict(q_out_dtype=FP8, q_scale=q_scale)
        q_ref, k_ref, k_pool_ref, _ = default_call(case, **kw)
        assert q_ref.dtype == FP8
        q_out = poisoned_like(case.q, FP8)
        k_out = poisoned_like(case.k)
        out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(**kw, q_out=q_out,
                                                                   k_out=k_out))
        assert out[0] is q_out and out[1] is k_out
        assert_same_bits(q_out, q_ref, "fp8 q_out")
        assert_same_bits(k_out, k_ref, "k_out")
        assert_same_bits(case.k_pool, k_pool_ref, "k_pool")
    if given == "both":
        return
    k_out = poisoned_like(case.k)
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out_dtype="float8_e4m3fn",
                                                               k_out=k_out))
    assert out[0].dtype == FP8 and out[1] is k_out
    q_ref, k_ref, _, _ = default_call(case, q_out_dtype=FP8)
    assert_same_bits(out[0], q_ref, "fp8 q_rot")
    assert_same_bits(k_out, k_ref, "k_out")


# ---- errors: exact message, and nothing written ----------------------------------------------

T, HQ, HK, D, P = 5, 4, 2, 16, 12
OVERLAP = ("rope_pool_fused: {} and {} overlap in memory (they share at least one byte); the "
           "result would depend on the order of reads and writes")
OVERLAP_NOTE = ("pass separate buffers; views that interleave without sharing a byte (e.g. "
                "q/k/v columns of one fused QKV output) are fine")
IN_PLACE = ("rope_pool_fused: {} cannot be combined with inplace=True (inplace writes "
            "q_rot/k_rot into q and k); pass q_out/k_out or inplace=True, not both "
            "(q_out=q, k_out=k is in-place rotation)")


def _empty(device, *shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=device)


# name -> (build(case, device) -> keywords with the bad outputs, exception, message, note).
# Every message names what was received; the core's name what was expected.
BAD_OUTS = {
    "q_out_shape": (lambda c, d: dict(q_out=_empty(d, T, HQ, D + 2)), ValueError,
                    "rope_pool_fused: q_out must have the shape and dtype of q "
                    f"(torch.Size([{T}, {HQ}, {D}]) float32), got "
                    f"torch.Size([{T}, {HQ}, {D + 2}]) float32", None),
    "q_out_tokens": (lambda c, d: dict(q_out=_empty(d, T + 1, HQ, D)), ValueError,
                     "rope_pool_fused: q_out must have the shape and dtype of q "
                     f"(torch.Size([{T}, {HQ}, {D}]) float32), got "
                     f"torch.Size([{T + 1}, {HQ}, {D}]) float32", None),
    "q_out_dtype": (lambda c, d: dict(q_out=_empty(d, T, HQ, D, dtype=torch.float16)), ValueError,
                    "rope_pool_fused: q_out must have the shape and dtype of q "
                    f"(torch.Size([{T}, {HQ}, {D}]) float32), got "
                    f"torch.Size([{T}, {HQ}, {D}]) float16", None),
    "k_out_shape": (lambda c, d: dict(k_out=_empty(d, T, HQ, D)), ValueError,
                    "rope_pool_fused: k_out must have the shape and dtype of k "
                    f"(torch.Size([{T}, {HK}, {D}]) float32), got "
                    f"torch.Size([{T}, {HQ}, {D}]) float32", None),
    "k_out_dtype": (lambda c, d: dict(k_out=_empty(d, T, HK, D, dtype=torch.bfloat16)), ValueError,
                    "rope_pool_fused: k_out must have the shape and dtype of k "
                    f"(torch.Size([{T}, {HK}, {D}]) float32), got "
                    f"torch.Size([{T}, {HK}, {D}]) bfloat16", None),
    "q_out_last_dim_strided": (
        lambda c, d: dict(q_out=_empty(d, T, HQ, 2 * D)[..., ::2]), ValueError,
        "rope_pool_fused: q_out must have a contiguous last dimension (stride 1), got strides "
        f"({HQ * 2 * D}, {2 * D}, 2)",
        "pass a view whose head_dim axis is contiguous, e.g. x.contiguous()"),
    "k_out_broadcast": (
        lambda c, d: dict(k_out=_empty(d, 1, HK, D).expand(T, HK, D)), ValueError,
        f"rope_pool_fused: k_out has overlapping or negative strides (0, {D}, 1); every "
        "element it receives needs its own memory", None),
    "k_out_is_v": (lambda c, d: dict(k_out=c.v), ValueError, OVERLAP.format("k_out", "v"),
                   OVERLAP_NOTE),
    "q_out_overlaps_q": (lambda c, d: dict(q_out=c.q_base[1:]), ValueError,
                         OVERLAP.format("q_out", "q"), OVERLAP_NOTE),
    "k_out_in_k_pool": (lambda c, d: dict(k_out=c.k_pool[:T]), ValueError,
                        OVERLAP.format("k_out", "k_pool"), OVERLAP_NOTE),
    "q_out_and_k_out_share": (
        lambda c, d: (lambda buf: dict(q_out=buf, k_out=buf[:, :HK]))(_empty(d, T, HQ, D)),
        ValueError, OVERLAP.format("q_out", "k_out"), OVERLAP_NOTE),
    "inplace_q_out": (lambda c, d: dict(q_out=_empty(d, T, HQ, D), inplace=True), ValueError,
                      IN_PLACE.format("q_out"), None),
    "inplace_both": (lambda c, d: dict(q_out=_empty(d, T, HQ, D), k_out=_empty(d, T, HK, D),
                                       inplace=True), ValueError,
                     IN_PLACE.format("q_out and k_out"), None),
    "fp8_q_out_without_q_out_dtype": (
        lambda c, d: dict(q_out=_empty(d, T, HQ, D, dtype=FP8)), ValueError,
        "rope_pool_fused: q_out is float8_e4m3fn but q_out_dtype is None; pass "
        "q_out_dtype=torch.float8_e4m3fn for an fp8 q_rot, or a q_out of q's dtype (float32)",
        None),
    "q_out_dtype_fp8_with_float_q_out": (
        lambda c, d: dict(q_out=_empty(d, T, HQ, D), q_out_dtype=FP8), ValueError,
        "rope_pool_fused: q_out must be float8_e4m3fn (q_out_dtype=float8_e4m3fn), got float32",
        None),
    "q_out_numpy": (lambda c, d: dict(q_out=np.empty((T, HQ, D), np.float32)), TypeError,
                    "rope_pool_fused: q_out is a ndarray but other arguments are torch.Tensors; "
                    "pass every array as a torch.Tensor", None),
    "k_out_list": (lambda c, d: dict(k_out=[0.0] * D), TypeError,
                   "rope_pool_fused: k_out is a list but other arguments are torch.Tensors; "
                   "pass every array as a torch.Tensor", None),
    "q_out_meta": (lambda c, d: dict(q_out=_empty("meta", T, HQ, D)), ValueError,
                   "rope_pool_fused: q_out is on the meta device (no memory); meta tensors are "
                   "unsupported outside torch.compile tracing, which uses the op's fake "
                   "implementation", None),
}


def make_poisoned_case(device, rng):
    """A valid float32 call whose q is a view into a larger buffer (`q_base`), so an output
    can overlap q without being q."""
    case = make_case("torch", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P, device=device)
    q_base = torch.empty(T + 1, HQ, D, device=device)
    q_base[:T] = case.q
    q_base[T:] = float("nan")
    case.q = q_base[:T]
    case.q_base = q_base
    return case


def check_error(case, keywords, exc, message, note):
    """The call and validate_rope_pool raise exactly `message` (and `note`), and every
    argument, the outputs included, keeps every bit."""
    arrays = [x for x in keywords.values() if isinstance(x, (torch.Tensor, np.ndarray))
              and not (isinstance(x, torch.Tensor) and x.is_meta)]
    for x in arrays:
        if x.flags.writeable if isinstance(x, np.ndarray) else min(x.stride()) > 0:
            poison(x)  # (an output that is an argument's view poisons that argument)
    case.snapshot()
    before = [raw_bits(x) for x in arrays]
    for fn in (ropepool.rope_pool_fused, ropepool.validate_rope_pool):
        # (pytest's `match` also sees the notes: the full text is compared on str() itself)
        with pytest.raises(exc, match=f"^{re.escape(message)}") as info:
            fn(*case.args(), **case.kwargs(**keywords))
        assert str(info.value) == message
        assert getattr(info.value, "__notes__", None) == (None if note is None else [note])
        case.assert_unchanged()
        for x, b in zip(arrays, before):
            np.testing.assert_array_equal(raw_bits(x), b, err_msg="an output was written")


@pytest.mark.parametrize("name", sorted(BAD_OUTS))
def test_bad_out_is_rejected_and_nothing_written(kernel_device, rng, name):
    build, exc, message, note = BAD_OUTS[name]
    case = make_poisoned_case(kernel_device, rng)
    check_error(case, build(case, kernel_device), exc, message, note)


@pytest.mark.parametrize("name", ["q_out_shape", "k_out_is_v", "inplace_q_out",
                                  "fp8_q_out_without_q_out_dtype"])
def test_bad_out_on_the_fast_path(rng, monkeypatch, name):
    """With the geometry already seen (the eager fast path), the same errors."""
    monkeypatch.setattr(ropepool._op, "_FAST_GEOMETRIES", set())
    case = make_poisoned_case("cpu", rng)
    ropepool.rope_pool_fused(*case.args(), **case.kwargs())  # registers the geometry
    assert (D, HQ, HK, case.rope_base) in ropepool._op._FAST_GEOMETRIES
    build, exc, message, note = BAD_OUTS[name]
    check_error(case, build(case, "cpu"), exc, message, note)


def test_core_error_with_good_outs_writes_nothing(rng):
    """A failure that is not about the outputs (an out-of-range slot, found after every
    other check) leaves the poisoned q_out/k_out untouched too."""
    case = make_poisoned_case("cpu", rng)
    case.slots[2] = P
    q_out, k_out = poisoned_like(case.q), poisoned_like(case.k)
    before = raw_bits(q_out), raw_bits(k_out)
    case.snapshot()
    with pytest.raises(ValueError, match=r"^rope_pool_fused: slots\[2\] = 12 is out of range"):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, k_out=k_out))
    case.assert_unchanged()
    assert_same_bits(q_out, before[0], "q_out")
    assert_same_bits(k_out, before[1], "k_out")


# ---- NumPy / DLPack front end -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy_out(rng, dtype):
    case = make_case("numpy", dtype, rng, T=9, Hq=4, Hk=2, D=32, P=20).snapshot()
    q_ref, k_ref, k_pool_ref, _ = default_call(case)
    buf = poison(np.empty((9, 7, 32), dtype=dtype))  # q and k columns of one buffer
    q_out, k_out = buf[:, :4], buf[:, 5:]
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, k_out=k_out))
    assert out[0] is q_out and out[1] is k_out
    assert_same_bits(q_out, q_ref, "q_out")
    assert_same_bits(k_out, k_ref, "k_out")
    assert_same_bits(case.k_pool, k_pool_ref, "k_pool")
    assert np.isnan(buf[:, 4]).all()
    case.assert_unchanged("q", "k", "v", "positions", "slots")
    # only one of them
    q_out = poisoned_like(case.q)
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out))
    assert out[0] is q_out and isinstance(out[1], np.ndarray)
    assert_same_bits(out[1], k_ref, "k_rot")


def test_numpy_out_errors(rng):
    case = make_case("numpy", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P)
    check_error(case, dict(q_out=np.empty((T, HQ, D), np.float64)), ValueError,
                "rope_pool_fused: q_out must have the shape and dtype of q "
                f"(({T}, {HQ}, {D}) float32), got ({T}, {HQ}, {D}) float64", None)
    read_only = np.empty((T, HK, D), np.float32)
    read_only.flags.writeable = False
    check_error(case, dict(k_out=read_only), TypeError,
                "rope_pool_fused: k_out is read-only; the op writes into it, pass a writable "
                "array", None)
    check_error(case, dict(k_out=torch.empty(T, HK, D)), TypeError,
                "rope_pool_fused: q is a ndarray but other arguments are torch.Tensors; pass "
                "every array as a torch.Tensor", None)
    check_error(case, dict(q_out=np.empty((T, HQ, D), np.float32), inplace=True), ValueError,
                IN_PLACE.format("q_out"), None)
    with pytest.raises(ValueError, match="q_out_dtype=float8_e4m3fn needs torch tensors"):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs(
            q_out=np.empty((T, HQ, D), np.uint8), q_out_dtype="float8_e4m3fn"))


# ---- the torch custom op ----------------------------------------------------------------------

def test_out_op_schema():
    """q_out and k_out are declared written in place (`Tensor(c!)`), as are the pools, and
    nothing is returned (a custom op cannot return its mutated inputs)."""
    schema = torch.ops.ropepool.rope_pool_fused_out.default._schema
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["k_pool", "v_pool", "q_out", "k_out"], str(schema)
    names = [a.name for a in schema.arguments]
    assert names[:9] == ["q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_out",
                         "k_out"]
    default = [a.name for a in torch.ops.ropepool.rope_pool_fused.default._schema.arguments]
    assert names[9:] == default[7:]  # the same keyword tail as the default op
    assert len(schema.returns) == 0


def test_opcheck(kernel_device, rng):
    """torch.library.opcheck: the declared mutations are the real ones, the fake kernel
    agrees, FakeTensor and functionalization work (opcheck's schema test cannot compare
    float8 tensors, so the fp8 q_out is covered by the compile test instead)."""
    case = make_case("torch", "bfloat16", rng, T=7, Hq=4, Hk=2, D=64, P=16, device=kernel_device)
    outs = (poisoned_like(case.q), poisoned_like(case.k))
    args = case.args() + outs + (64, 4, 2, case.rope_base)
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused_out.default, args)
    # SPEC §4: partial interleaved rotary with a precomputed schedule
    sched = ropepool.rope_schedule(head_dim=64, rope_base=case.rope_base, rotary_dim=32,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0})
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused_out.default,
                          args + (False, 32, True, list(sched.inv_freq), 0.75))


def test_out_versions_bumped(rng):
    """Autograd learns that q_out/k_out were written (as for any torch in-place op)."""
    case = make_case("torch", "float32", rng, T=3, Hq=4, Hk=2, D=64, P=8)
    q_out, k_out = poisoned_like(case.q), poisoned_like(case.k)
    before = (q_out._version, k_out._version, case.k_pool._version)
    ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, k_out=k_out))
    assert q_out._version > before[0] and k_out._version > before[1]
    assert case.k_pool._version > before[2]


def test_fake_tensors_take_the_out_op(rng):
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case("torch", "bfloat16", rng, T=5, Hq=4, Hk=2, D=64, P=16)
    real_q_out = torch.empty_like(case.q)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in case.args()]
        q_out = mode.from_tensor(real_q_out)
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(*fake, **case.kwargs(q_out=q_out))
        assert q_rot is q_out and k_rot.shape == case.k.shape
        assert k_pool is fake[5] and v_pool is fake[6]


def test_eager_fast_path_with_out(kernel_device, rng, monkeypatch):
    """Once the geometry is known, out= calls with plain tensors take the fast path: the
    same bits, the caller's objects, versions bumped; a fp8 q_out or inplace with an out
    leaves it (those checks live in the slow path)."""
    monkeypatch.setattr(ropepool._op, "_FAST_GEOMETRIES", set())
    taken = []
    fast_call = ropepool._op._fast_call
    monkeypatch.setattr(ropepool._op, "_fast_call",
                        lambda *a: taken.append(a[-2:]) or fast_call(*a))
    case = make_case("torch", "bfloat16", rng, T=6, Hq=4, Hk=2, D=64, P=16,
                     device=kernel_device, rope_base=4321.0).snapshot()
    q_ref, k_ref, k_pool_ref, v_pool_ref = default_call(case)
    taken.clear()
    for outs in ({"q_out": 1}, {"k_out": 1}, {"q_out": 1, "k_out": 1}):
        k_pool, v_pool = copy_pools(case)
        q_out = poisoned_like(case.q) if "q_out" in outs else None
        k_out = poisoned_like(case.k) if "k_out" in outs else None
        versions = [x._version for x in (q_out, k_out, k_pool) if x is not None]
        q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
            *case.args()[:5], k_pool, v_pool, **case.kwargs(q_out=q_out, k_out=k_out))
        assert taken and taken[-1][0] is q_out and taken[-1][1] is k_out
        assert kp is k_pool and vp is v_pool
        assert q_out is None or q_rot is q_out
        assert k_out is None or k_rot is k_out
        after = [x._version for x in (q_out, k_out, k_pool) if x is not None]
        assert all(a > b for a, b in zip(after, versions)), (after, versions)
        assert_same_bits(q_rot, q_ref, "q_rot")
        assert_same_bits(k_rot, k_ref, "k_rot")
        assert_same_bits(k_pool, k_pool_ref, "k_pool")
        assert_same_bits(v_pool, v_pool_ref, "v_pool")
    case.assert_unchanged("q", "k", "v", "positions", "slots")
    n = len(taken)
    with pytest.raises(ValueError, match="q_out is float8_e4m3fn but q_out_dtype is None"):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=poisoned_like(case.q, FP8)))
    with pytest.raises(ValueError, match="cannot be combined with inplace=True"):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs(k_out=poisoned_like(case.k),
                                                             inplace=True))
    assert len(taken) == n


def _with_out(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, kw):
    q = q * 1.0  # an op before, so the custom op sits inside a larger graph
    q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, q_out=q_out, k_out=k_out, **kw)
    return q_rot, k_rot, k_pool, v_pool


def _into_one_buffer(q, k, v, positions, slots, k_pool, v_pool, buf, kw):
    """q_rot and k_rot written as views of one fused buffer [T, Hq + Hk, D]."""
    Hq = q.shape[1]
    ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, q_out=buf[:, :Hq],
                             k_out=buf[:, Hq:], **kw)
    return buf.sum()  # a consumer of the written buffer


@pytest.mark.parametrize("given", ["both", "q_out", "k_out", "fp8_q_out"])
def test_compile_fullgraph(kernel_device, rng, given):
    """torch.compile(fullgraph=True) (aot_eager: FakeTensor and functionalization of the
    declared mutations): the eager bits land in the caller's buffers, which are returned;
    a second shape recompiles or runs dynamic, never breaks the graph."""
    torch._dynamo.reset()
    compiled = torch.compile(_with_out, fullgraph=True, backend="aot_eager")
    for T_ in (13, 29):
        case = make_case("torch", "bfloat16", rng, T=T_, Hq=8, Hk=2, D=64, P=64,
                         device=kernel_device).snapshot()
        kw = case.kwargs()
        if given == "fp8_q_out":
            kw.update(q_out_dtype=FP8, q_scale=0.125)
        q_ref, k_ref, k_pool_ref, v_pool_ref = default_call(case, **{k: kw[k] for k in kw
                                                                     if k.startswith("q_")})
        q_out = poisoned_like(case.q, FP8 if given == "fp8_q_out" else None) \
            if given != "k_out" else None
        k_out = poisoned_like(case.k) if given in ("both", "k_out", "fp8_q_out") else None
        q_rot, k_rot, k_pool, v_pool = compiled(*case.args(), q_out, k_out, kw)
        assert k_pool is case.k_pool and v_pool is case.v_pool
        assert q_out is None or q_rot is q_out
        assert k_out is None or k_rot is k_out
        assert_same_bits(q_rot, q_ref, "q_rot")
        assert_same_bits(k_rot, k_ref, "k_rot")
        assert_same_bits(case.k_pool, k_pool_ref, "k_pool")
        assert_same_bits(case.v_pool, v_pool_ref, "v_pool")
        case.assert_unchanged("q", "k", "v", "positions", "slots")


def test_compile_counts_one_graph(rng):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_with_out, fullgraph=True, backend=counter)
    case = make_case("torch", "float32", rng, T=11, Hq=4, Hk=4, D=64, P=32)
    compiled(*case.args(), poisoned_like(case.q), poisoned_like(case.k), case.kwargs())
    assert counter.frame_count == 1
    code = counter.graphs[0].code
    assert code.count("ropepool.rope_pool_fused_out") == 1, code


def test_inductor_writes_the_caller_views_in_place(rng):
    """Inductor calls the op on the graph's own buffer (views of it), with no clone or
    copy-back: the caller's memory is written directly, as in eager."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    case = make_case("torch", "float16", rng, T=6, Hq=4, Hk=2, D=64, P=20).snapshot()
    q_ref, k_ref, k_pool_ref, _ = default_call(case)
    buf = poison(torch.empty(6, 6, 64, dtype=torch.float16))
    compiled = torch.compile(_into_one_buffer, fullgraph=True, backend="inductor")
    total, codes = run_and_get_code(compiled, *case.args(), buf, case.kwargs())
    code = "\n".join(codes)
    assert "torch.ops.ropepool.rope_pool_fused_out.default(" in code, code
    assert ".clone(" not in code and "copy_(" not in code, code
    assert_same_bits(buf[:, :4], q_ref, "q_out view")
    assert_same_bits(buf[:, 4:], k_ref, "k_out view")
    assert_same_bits(case.k_pool, k_pool_ref, "k_pool")
    assert torch.equal(total, buf.sum())


# ---- CUDA (run on a GPU machine) --------------------------------------------------------------

def _needs_cuda_backend():
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_out_on_another_device_is_rejected(rng):
    _needs_cuda_backend()
    case = make_poisoned_case("cuda", rng)
    check_error(case, dict(q_out=torch.empty(T, HQ, D)), ValueError,
                "rope_pool_fused: all tensors must be on one device, got q on cuda:0 and q_out "
                "on cpu", "move every tensor (the pools too) to the device the model runs on")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_capture_with_out_buffers(rng):
    """SPEC §5: a captured call writes the same caller buffers on every replay (nothing is
    allocated during capture), with the current contents of the static inputs."""
    _needs_cuda_backend()
    T_, Hq, Hk, D_, P_ = 32, 8, 2, 128, 96
    case = make_case("torch", "bfloat16", rng, T=T_, Hq=Hq, Hk=Hk, D=D_, P=P_, device="cuda")
    q_out, k_out = poisoned_like(case.q), poisoned_like(case.k)
    graph, out = capture_graph(
        lambda: ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, k_out=k_out)))
    assert out[0] is q_out and out[1] is k_out
    for _ in range(2):
        case.copy_from(make_case("torch", "bfloat16", rng, T=T_, Hq=Hq, Hk=Hk, D=D_, P=P_,
                                 device="cuda", rope_base=case.rope_base))
        poison(q_out)
        poison(k_out)
        q_ref, k_ref, k_pool_ref, v_pool_ref = default_call(case)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(q_out, q_ref, "q_out after replay")
        assert_same_bits(k_out, k_ref, "k_out after replay")
        assert_same_bits(case.k_pool, k_pool_ref, "k_pool after replay")
        assert_same_bits(case.v_pool, v_pool_ref, "v_pool after replay")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_compile_inductor_with_out(rng):
    _needs_cuda_backend()
    torch._dynamo.reset()
    case = make_case("torch", "bfloat16", rng, T=24, Hq=8, Hk=2, D=128, P=64, device="cuda")
    case.snapshot()
    q_ref, k_ref, k_pool_ref, _ = default_call(case)
    buf = poison(torch.empty(24, 10, 128, dtype=torch.bfloat16, device="cuda"))
    compiled = torch.compile(_into_one_buffer, fullgraph=True, backend="inductor")
    compiled(*case.args(), buf, case.kwargs())
    torch.cuda.synchronize()
    assert_same_bits(buf[:, :8], q_ref, "q_out view")
    assert_same_bits(buf[:, 8:], k_ref, "k_out view")
    assert_same_bits(case.k_pool, k_pool_ref, "k_pool")
