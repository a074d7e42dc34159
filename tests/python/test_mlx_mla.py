"""ropepool.mlx.mla_rope_pool_fused (SPEC §8, §9): multi-head latent attention as an MLX
primitive.

Every element (bits) equals ropepool.mla_rope_pool_fused's on the same fresh random inputs
(both run the CPU backend), with DeepSeek's layout (q_pe a column slice of q, k_pe and kv_c
column slices of one projection output); spot checks against transformers' DeepSeek-V3
rotation (test_mla's oracle); donation against copies; the op's messages at call time; a bad
slot raising at mx.eval and writing nothing; mx.compile; return_k_rot=False (a primitive
with no k_pe_rot output) against the call with k_pe_rot.
"""


import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed")

import ropepool  # noqa: E402

# (skips this module where ropepool.mlx is unavailable, as test_mlx does)
from test_mlx import (address, assert_same_bits, bits, from_mx, mlx_message,  # noqa: E402
                      node_outputs, to_mx, torch_bits)

import ropepool.mlx as rmlx  # noqa: E402
from test_mla import (CONFIGS, Call, assert_close, deinterleave, hf_rotation,  # noqa: E402
                      pair_sums, schedule_of)

DSV3 = CONFIGS["deepseek-v3"]
YARN = dict(rope_base=10000, rope_scaling=DSV3["rope_scaling"])
FP8 = torch.float8_e4m3fn


def mx_args(call):
    """The call's arrays as MLX arrays laid out as the model makes them: q_pe the last R
    columns of q, kv_c and k_pe column slices of one [T, L + R] projection output."""
    q, kv = to_mx(call.q), to_mx(call.kv)
    k_pe = kv[:, call.L:]
    if call.k_pe.ndim == 3:
        k_pe = k_pe[:, None]
    return (q[..., q.shape[2] - call.R:], k_pe, kv[:, :call.L], to_mx(call.positions),
            to_mx(call.slots), to_mx(call.kv_cache))


def torch_result(call, **kw):
    """ropepool.mla_rope_pool_fused (torch CPU) on copies of the call's tensors."""
    q, kv = call.q.clone(), call.kv.clone()
    k_pe = kv[:, call.L:]
    if call.k_pe.ndim == 3:
        k_pe = k_pe.unsqueeze(1)
    return ropepool.mla_rope_pool_fused(q[..., q.shape[2] - call.R:], k_pe, kv[:, :call.L],
                                        call.positions, call.slots, call.kv_cache.clone(), **kw)


MLA_NAMES = ("q_pe_rot", "k_pe_rot", "kv_cache")


VARIANTS = {
    "yarn": ({}, YARN),
    "paged": ({"page_size": 16}, dict(YARN, kv_layout="NHD")),
    "neox_default": ({}, dict(rope_base=10000.0, interleaved=False)),
    "schedule": ({"index_dtype": torch.int64},
                 dict(rope_base=10000, schedule=schedule_of("deepseek-v3"))),
    "inplace_3d_key": ({"k_3d": True}, dict(YARN, inplace=True)),
    "check_slots": ({}, dict(YARN, check_slots=True)),
    "fp8_float_scale": ({"cache_dtype": FP8, "page_size": 16},
                        dict(YARN, kv_layout="NHD", kv_scale=0.0078125)),
    "fp8_array_scale": ({"cache_dtype": FP8}, dict(YARN, kv_scale="array")),
    "fp8_no_scale": ({"cache_dtype": FP8}, YARN),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_equals_torch_path(rng, dtype, variant):
    call_kw, kw = VARIANTS[variant]
    call = Call(rng, dtype=dtype, device="cpu", T=19, H=16, P=64, **call_kw)
    scale = kw.get("kv_scale")
    t_kw, m_kw = dict(kw), dict(kw)
    if scale == "array":  # a one-element float32 array, read when the graph runs
        value = float(rng.uniform(0.01, 1.0))
        t_kw["kv_scale"] = torch.tensor([value], dtype=torch.float32)
        m_kw["kv_scale"] = mx.array([value], dtype=mx.float32)
    want = torch_result(call, **t_kw)
    got = rmlx.mla_rope_pool_fused(*mx_args(call), **m_kw)
    assert all(isinstance(g, mx.array) for g in got)
    assert got[2].dtype == (mx.uint8 if call_kw.get("cache_dtype") else got[0].dtype)
    assert_same_bits(got, want, MLA_NAMES)
    # the cache holds something new (the comparison above is not of two unchanged copies)
    assert not np.array_equal(bits(got[2]), torch_bits(call.kv_cache))


@pytest.mark.parametrize("name", ["deepseek-v3", "yarn-mscale-pair", "kimi-k2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [0, 16])
def test_matches_transformers(rng, name, dtype, page_size):
    """Spot check against transformers' DeepSeek-V3 rotation in float64 (after its
    de-interleaving) and the cache rows, as test_mla checks the torch front end."""
    c = CONFIGS[name]
    call = Call(rng, dtype=dtype, device="cpu", T=23, H=c["num_attention_heads"] // 4,
                page_size=page_size)
    q_rot, k_rot, cache = rmlx.mla_rope_pool_fused(
        *mx_args(call), rope_base=c["rope_theta"], rope_scaling=c["rope_scaling"],
        kv_layout="NHD" if page_size else None)
    tdt = call.q.dtype
    q_rot, k_rot = from_mx(q_rot, tdt), from_mx(k_rot, tdt)
    q_hf, k_hf = hf_rotation(call.q_pe, call.k_pe, call.positions, schedule_of(name))
    assert_close(deinterleave(q_rot), q_hf, pair_sums(call.q_pe), "q_pe_rot")
    assert_close(deinterleave(k_rot), k_hf, pair_sums(call.k_pe), "k_pe_rot")
    call.kv_cache = from_mx(cache, tdt)
    call.check_cache(k_rot)


def test_donation_and_old_values(rng):
    """A cache nothing else references gives its buffer to the result; one still
    referenced is copied and keeps its values."""
    call = Call(rng, dtype="float16", device="cpu", T=8, H=16, P=4096)
    want = torch_result(call, **YARN)
    q_pe, k_pe, kv_c, pos, slots, cache = mx_args(call)
    mx.eval(q_pe, k_pe, kv_c, pos, slots, cache)
    old, at = bits(cache), address(cache)
    out = rmlx.mla_rope_pool_fused(q_pe, k_pe, kv_c, pos, slots, cache, **YARN)
    mx.eval(*out)
    assert address(out[2]) != at
    np.testing.assert_array_equal(bits(cache), old)
    assert_same_bits(out, want, MLA_NAMES)

    _, _, cache2 = rmlx.mla_rope_pool_fused(q_pe, k_pe, kv_c, pos, slots, cache, **YARN)
    del cache  # rebound: no other reference at evaluation time
    mx.eval(cache2)
    assert address(cache2) == at
    np.testing.assert_array_equal(bits(cache2), torch_bits(want[2]))

    # inplace=True: contiguous q_pe/k_pe give their buffers to q_pe_rot/k_pe_rot
    q_pe, k_pe = mx.contiguous(q_pe), mx.contiguous(k_pe)
    mx.eval(q_pe, k_pe)
    q_at, k_at = address(q_pe), address(k_pe)
    q_rot, k_rot, _ = rmlx.mla_rope_pool_fused(q_pe, k_pe, kv_c, pos, slots, cache2, **YARN,
                                               inplace=True)
    del q_pe, k_pe
    mx.eval(q_rot, k_rot)
    assert (address(q_rot), address(k_rot)) == (q_at, k_at)
    np.testing.assert_array_equal(bits(q_rot), torch_bits(want[0]))
    np.testing.assert_array_equal(bits(k_rot), torch_bits(want[1]))


def _bad(call, field, value):
    setattr(call, field, value)
    return call


# case: (change to the call's tensors, keywords, whether the cache is fp8)
BAD = {
    "kv_c rows": (lambda c: _bad(c, "kv_c", c.kv[:3, :512]), {}, False),
    "k_pe width": (lambda c: _bad(c, "k_pe", c.kv[:, 512:544]), {}, False),
    "q_pe 2-D": (lambda c: _bad(c, "q_pe", c.q[:, 0, 128:]), {}, False),
    "cache width": (lambda c: _bad(c, "kv_cache", c.kv_cache[:, :570]), {}, False),
    "cache dtype": (lambda c: _bad(c, "kv_cache", c.kv_cache.float()), {}, False),
    "float positions": (lambda c: _bad(c, "positions", c.positions.float()), {}, False),
    "2-D cache with NHD": (lambda c: c, {"kv_layout": "NHD"}, False),
    "HND": (lambda c: c, {"kv_layout": "HND"}, False),
    "scale without fp8": (lambda c: c, {"kv_scale": 0.5}, False),
    "zero scale": (lambda c: c, {"kv_scale": 0.0}, True),
    "scale shape": (lambda c: c, {"kv_scale": "two"}, True),
    "yarn key": (lambda c: c, {"rope_scaling": {"type": "yarn", "factor": 40, "bogus": 1}},
                 False),
    "schedule and rope_scaling": (lambda c: c, {"schedule": schedule_of("deepseek-v3"),
                                                "rope_scaling": DSV3["rope_scaling"]}, False),
}


@pytest.mark.parametrize("case", list(BAD))
def test_messages_at_call_time_are_the_torch_paths(rng, case):
    """The call itself raises (not mx.eval) what the torch front end raises, shapes as MLX
    prints them."""
    change, kw, fp8 = BAD[case]
    call = change(Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16,
                       cache_dtype=FP8 if fp8 else None))
    kw = dict({"rope_base": 10000.0}, **kw)
    t_kw, m_kw = dict(kw), dict(kw)
    if kw.get("kv_scale") == "two":
        t_kw["kv_scale"] = torch.ones(2)
        m_kw["kv_scale"] = mx.ones((2,))
    t_args = (call.q_pe, call.k_pe, call.kv_c, call.positions, call.slots, call.kv_cache)
    with pytest.raises((ValueError, TypeError)) as want:
        ropepool.mla_rope_pool_fused(*t_args, **t_kw)
    with pytest.raises(type(want.value)) as got:
        rmlx.mla_rope_pool_fused(*(to_mx(t) for t in t_args), **m_kw)
    assert str(got.value) == mlx_message(str(want.value))
    assert str(got.value).startswith("mla_rope_pool_fused")


def test_bad_slot_and_scale_raise_at_eval_and_write_nothing(rng):
    call = Call(rng, dtype="bfloat16", device="cpu", T=6, H=4, P=32)
    call.slots[4] = 32
    args = mx_args(call)
    old = bits(args[5])
    out = rmlx.mla_rope_pool_fused(*args, **YARN)  # the value is data: no error yet
    with pytest.raises((RuntimeError, ValueError),
                       match=r"^mla_rope_pool_fused: slots\[4\] = 32 is out of range for a "
                             r"kv_cache of 32 slots$"):
        mx.eval(*out)
    np.testing.assert_array_equal(bits(args[5]), old)

    fp8 = Call(rng, dtype="float32", device="cpu", T=6, H=4, P=32, cache_dtype=FP8)
    args = mx_args(fp8)
    old = bits(args[5])
    out = rmlx.mla_rope_pool_fused(*args, **YARN, kv_scale=mx.array([0.0]))
    with pytest.raises((RuntimeError, ValueError),
                       match=r"^mla_rope_pool_fused: kv_scale must be finite and > 0, got 0\.0$"):
        mx.eval(*out)
    np.testing.assert_array_equal(bits(args[5]), old)


def test_mx_compile_decode_loop(rng):
    """Under mx.compile: two steps feeding the cache back, the bits of the torch path."""
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=16, P=32, page_size=8)
    kw = dict(rope_base=10000, schedule=schedule_of("deepseek-v3"), kv_layout="NHD")

    @mx.compile
    def step(q_pe, k_pe, kv_c, positions, slots, cache):
        q_rot, k_rot, cache = rmlx.mla_rope_pool_fused(q_pe, k_pe, kv_c, positions, slots,
                                                       cache, **kw)
        return q_rot * 2, k_rot, cache

    q_pe, k_pe, kv_c, pos, slots, cache = mx_args(call)
    got = step(q_pe, k_pe, kv_c, pos, slots, cache)
    want = torch_result(call, **kw)
    np.testing.assert_array_equal(np.array(got[0].astype(mx.float32)),
                                  (want[0] * 2).float().numpy())
    np.testing.assert_array_equal(bits(got[1]), torch_bits(want[1]))
    np.testing.assert_array_equal(bits(got[2]), torch_bits(want[2]))
    slots2 = torch.tensor([7, 8, -1, 9, 31], dtype=torch.int32)
    got2 = step(q_pe, k_pe, kv_c, pos, to_mx(slots2), got[2])
    call.slots, call.kv_cache = slots2, want[2]
    np.testing.assert_array_equal(bits(got2[2]), torch_bits(torch_result(call, **kw)[2]))
    bad = step(q_pe, k_pe, kv_c, pos, mx.array(np.array([0, 1, 2, 3, 32], np.int32)), cache)
    with pytest.raises((RuntimeError, ValueError), match=r"slots\[4\] = 32 is out of range"):
        mx.eval(*bad)


def test_refusals_gradients_and_empty_call(rng):
    call = Call(rng, dtype="float32", device="cpu", T=3, H=2, P=8)
    args = list(mx_args(call))
    with pytest.raises(ValueError, match=r"mla_rope_pool_fused runs on MLX's CPU stream only"):
        rmlx.mla_rope_pool_fused(*args, rope_base=10000.0, stream=mx.gpu)
    with pytest.raises(TypeError,
                       match=r"^mla_rope_pool_fused: kv_c must be an mlx.core.array, got ndarray$"):
        rmlx.mla_rope_pool_fused(*args[:2], np.zeros((3, 512), np.float32), *args[3:],
                                 rope_base=10000.0)

    def f(q_pe):
        return rmlx.mla_rope_pool_fused(q_pe, *args[1:], rope_base=10000.0)[0].sum()

    with pytest.raises(NotImplementedError,
                       match=r"mla_rope_pool_fused: vjp \(gradient\) is not implemented"):
        mx.grad(f)(mx.array(args[0]))
    with pytest.raises(NotImplementedError, match=r"mla_rope_pool_fused: vmap"):
        mx.vmap(lambda q: rmlx.mla_rope_pool_fused(q, *args[1:], rope_base=10000.0)[0])(
            args[0][None])

    empty = Call(rng, dtype="bfloat16", device="cpu", T=0, H=16)
    q_rot, k_rot, cache = rmlx.mla_rope_pool_fused(*mx_args(empty), rope_base=10000.0)
    assert q_rot.shape == (0, 16, 64) and k_rot.shape == (0, 64)
    np.testing.assert_array_equal(bits(cache), torch_bits(empty.before))


# ---- return_k_rot=False (SPEC §8): no k_pe_rot output, the cache as with it ----------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_without_k_rot_equals_with_it(rng, dtype, variant):
    """k_pe_rot is None; q_pe_rot and every element of the cache have the bits of the torch
    path's call with k_pe_rot; k_pe keeps its values."""
    call_kw, kw = VARIANTS[variant]
    call = Call(rng, dtype=dtype, device="cpu", T=19, H=16, P=64, **call_kw)
    t_kw, m_kw = dict(kw), dict(kw)
    if kw.get("kv_scale") == "array":
        value = float(rng.uniform(0.01, 1.0))
        t_kw["kv_scale"] = torch.tensor([value], dtype=torch.float32)
        m_kw["kv_scale"] = mx.array([value], dtype=mx.float32)
    want = torch_result(call, **t_kw)
    args = mx_args(call)
    got = rmlx.mla_rope_pool_fused(*args, **m_kw, return_k_rot=False)
    assert len(got) == 3 and got[1] is None
    assert_same_bits((got[0], got[2]), (want[0], want[2]), ("q_pe_rot", "kv_cache"))
    assert not np.array_equal(bits(got[2]), torch_bits(call.kv_cache))  # (rows were written)
    np.testing.assert_array_equal(bits(args[1]), torch_bits(call.k_pe), err_msg="k_pe changed")


def test_without_k_rot_donation_and_outputs(rng, tmp_path):
    """The primitive has two outputs (q_pe_rot and the cache: no k_pe_rot array); with
    inplace=True q_pe_rot takes over q_pe's buffer and the cache its own, k_pe is never
    given away."""
    call = Call(rng, dtype="float16", device="cpu", T=8, H=16, P=64)
    want = torch_result(call, **YARN)
    q_pe, k_pe, kv_c, pos, slots, cache = mx_args(call)
    q_pe, k_pe = mx.contiguous(q_pe), mx.contiguous(k_pe)
    mx.eval(q_pe, k_pe, kv_c, pos, slots, cache)
    at, k_at = (address(q_pe), address(cache)), address(k_pe)
    q_rot, none, cache2 = rmlx.mla_rope_pool_fused(q_pe, k_pe, kv_c, pos, slots, cache, **YARN,
                                                   inplace=True, return_k_rot=False)
    assert none is None
    assert node_outputs(q_rot, "MlaRopePoolFused", tmp_path) == 2  # two outputs, not three
    del q_pe, cache
    mx.eval(q_rot, cache2)
    assert (address(q_rot), address(cache2)) == at
    assert_same_bits((q_rot, cache2), (want[0], want[2]), ("q_pe_rot", "kv_cache"))
    np.testing.assert_array_equal(bits(k_pe), torch_bits(call.k_pe), err_msg="k_pe changed")
    assert address(k_pe) == k_at


def test_without_k_rot_under_mx_compile(rng):
    """mx.compile traces the two-output primitive: the bits of the torch path."""
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=16, P=32, page_size=8,
                cache_dtype=FP8)
    kw = dict(rope_base=10000, schedule=schedule_of("deepseek-v3"), kv_layout="NHD",
              kv_scale=0.25)

    @mx.compile
    def step(q_pe, k_pe, kv_c, positions, slots, cache):
        q_rot, none, cache = rmlx.mla_rope_pool_fused(q_pe, k_pe, kv_c, positions, slots,
                                                      cache, **kw, return_k_rot=False)
        assert none is None
        return q_rot * 2, cache

    got = step(*mx_args(call))
    want = torch_result(call, **kw)
    np.testing.assert_array_equal(np.array(got[0].astype(mx.float32)),
                                  (want[0] * 2).float().numpy())
    np.testing.assert_array_equal(bits(got[1]), torch_bits(want[2]))


def test_without_k_rot_validates_k_pe(rng):
    """k_pe is still validated (it is read), with the same messages; MLX has no k_out
    keyword, so nothing conflicts with return_k_rot=False."""
    for change in (lambda c: _bad(c, "k_pe", c.kv[:, 512:544]),
                   lambda c: _bad(c, "k_pe", c.k_pe.float())):
        call = change(Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16))
        args = [to_mx(t) for t in (call.q_pe, call.k_pe, call.kv_c, call.positions, call.slots,
                                   call.kv_cache)]
        with pytest.raises(ValueError) as want:
            rmlx.mla_rope_pool_fused(*args, rope_base=10000.0)
        with pytest.raises(ValueError) as got:
            rmlx.mla_rope_pool_fused(*args, rope_base=10000.0, return_k_rot=False)
        assert str(got.value) == str(want.value)
