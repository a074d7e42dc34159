"""The JAX front end of mla_rope_pool_fused (SPEC §8, §9): ropepool.jax.mla_rope_pool_fused
through the XLA FFI.

Every element is compared with the torch path (the same C++ op: bit for bit) on fresh
random inputs laid out as DeepSeek's attention makes them (test_mla.Call), and spot-checked
against transformers' DeepSeek-V3 rotation in float64 and the cache-row contract; donation
by buffer address and the aliasing in the compiled HLO; validation at trace time by exact
message; return_k_rot=False (a custom call of its own, no k_pe_rot result) against the call
with k_pe_rot. CUDA cases are marked `gpu`.
"""

import functools
import re

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import raw_bits
from test_jax import GPU, assert_same, custom_call_results, jax, jnp, rj, to_jax, to_torch, x64
from test_jax import platform  # noqa: F401 (the fixture: cpu, and gpu where there is one)
from test_mla import (CONFIGS, Call, assert_close, deinterleave, e4m3, hf_rotation, pair_sums,
                      schedule_of)

pytestmark = pytest.mark.skipif(rj is None, reason="no JAX front end in this build")

MLA = ("q_pe_rot", "k_pe_rot", "kv_cache")
DEEPSEEK = CONFIGS["deepseek-v3"]


def torch_result(call, platform, **kw):
    """The torch path on copies of the call's tensors (on CUDA for the gpu platform, where
    the same kernel runs), as CPU tensors."""
    device = "cpu" if platform == "cpu" else "cuda"
    args = [x.clone().to(device) for x in call.args()]
    return [o.cpu() for o in ropepool.mla_rope_pool_fused(*args, **kw)]


def jax_args(call, platform):
    return [to_jax(x, platform) for x in call.args()]


def deepseek(**extra):
    return dict(rope_base=DEEPSEEK["rope_theta"], rope_scaling=DEEPSEEK["rope_scaling"], **extra)


def check_against_transformers(call, got, schedule):
    """q_pe_rot/k_pe_rot within SPEC §1's bound of transformers' rotation; cache rows named
    by slots = concat(kv_c, k_pe_rot) bit for bit, every other row unchanged."""
    q_rot, k_rot, cache = (to_torch(x) for x in got)
    q_hf, k_hf = hf_rotation(call.q_pe, call.k_pe, call.positions, schedule)
    assert_close(deinterleave(q_rot), q_hf, pair_sums(call.q_pe), "q_pe_rot")
    assert_close(deinterleave(k_rot.reshape(k_hf.shape)), k_hf,
                 pair_sums(call.k_pe.reshape(k_hf.shape)), "k_pe_rot")
    call.kv_cache = cache
    call.check_cache(k_rot)


# ---- results: every element equal to the torch path -------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_equals_torch_path_and_transformers(platform, rng, dtype, page_size, jit):
    call = Call(rng, dtype=dtype, device="cpu", T=int(rng.integers(1, 40)), H=16, P=64,
                page_size=page_size,
                index_dtype=torch.int32)
    kw = deepseek(kv_layout="NHD" if page_size else None)
    f = functools.partial(rj.mla_rope_pool_fused, **kw)
    got = (jax.jit(f) if jit else f)(*jax_args(call, platform))
    assert_same(got, torch_result(call, platform, **kw), MLA)
    check_against_transformers(call, got, schedule_of("deepseek-v3"))


@pytest.mark.parametrize("extra", [
    dict(interleaved=False, rope_scaling=None),
    dict(rope_scaling=CONFIGS["kimi-k2"]["rope_scaling"], rope_base=50000.0),
    dict(rope_scaling=None, inv_freq=np.geomspace(1.0, 1e-4, 32).astype(np.float32),
         attention_scaling=0.75),
    dict(check_slots=True),
], ids=["neox", "kimi-k2", "inv_freq", "check_slots"])
def test_keywords_equal_torch_path(platform, rng, extra):
    call = Call(rng, dtype="bfloat16", device="cpu", T=13, H=8)
    kw = dict(deepseek(), **extra)
    got = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw))(*jax_args(call, platform))
    assert_same(got, torch_result(call, platform, **kw), MLA)


def test_schedule_and_3d_key(platform, rng):
    call = Call(rng, dtype="float16", device="cpu", T=9, H=16, k_3d=True)
    kw = dict(rope_base=10000, schedule=schedule_of("deepseek-v2-lite"))
    got = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw))(*jax_args(call, platform))
    assert got[1].shape == (9, 1, 64)
    assert_same(got, torch_result(call, platform, **kw), MLA)
    check_against_transformers(call, got, schedule_of("deepseek-v2-lite"))


@pytest.mark.parametrize("kv_scale", [None, 0.0078125])
def test_fp8_cache(platform, rng, kv_scale):
    call = Call(rng, dtype="bfloat16", device="cpu", T=19, H=16, page_size=16,
                cache_dtype=torch.float8_e4m3fn)
    kw = deepseek(kv_layout="NHD", kv_scale=kv_scale)
    got = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw))(*jax_args(call, platform))
    assert got[2].dtype == jnp.float8_e4m3fn
    assert_same(got, torch_result(call, platform, **kw), MLA)
    # kv_c's part of each written row: SPEC §6's rule exactly
    rows = to_torch(got[2]).reshape(call.P, -1)
    for t, s in enumerate(call.slots.numpy()):
        if s >= 0:
            want = e4m3(call.kv_c[t].float() / (kv_scale or 1.0))
            np.testing.assert_array_equal(raw_bits(rows[s, :512]), raw_bits(want))


def test_int64_indices_with_x64(platform, rng):
    with x64():
        call = Call(rng, dtype="bfloat16", device="cpu", T=11, H=8, index_dtype=torch.int64)
        args = jax_args(call, platform)
        assert args[3].dtype == jnp.int64 and args[4].dtype == jnp.int64
        got = jax.jit(functools.partial(rj.mla_rope_pool_fused, **deepseek()))(*args)
        assert_same(got, torch_result(call, platform, **deepseek()), MLA)


def test_zero_tokens(platform, rng):
    call = Call(rng, dtype="float32", device="cpu", T=0, H=4, P=8)
    got = jax.jit(functools.partial(rj.mla_rope_pool_fused, rope_base=10000.0))(
        *jax_args(call, platform))
    assert got[0].shape == (0, 4, 64) and got[1].shape == (0, 64)
    np.testing.assert_array_equal(raw_bits(to_torch(got[2])), raw_bits(call.before))


# ---- functional semantics: donation, aliasing, the caller's arrays ------------------------

def test_donated_cache_is_written_in_place(platform, rng):
    call = Call(rng, dtype="bfloat16", device="cpu", T=7, H=16)
    args = jax_args(call, platform)
    ptr = args[5].unsafe_buffer_pointer()
    f = jax.jit(functools.partial(rj.mla_rope_pool_fused, **deepseek()), donate_argnums=(5,))
    got = jax.block_until_ready(f(*args))
    assert got[2].unsafe_buffer_pointer() == ptr, "kv_cache was copied"
    assert args[5].is_deleted()
    got2 = jax.block_until_ready(f(*args[:5], got[2]))  # a decode loop: still no copy
    assert got2[2].unsafe_buffer_pointer() == ptr
    assert_same(got2, torch_result(call, platform, **deepseek()), MLA)


def test_without_donation_caller_keeps_old_values(platform, rng):
    call = Call(rng, dtype="bfloat16", device="cpu", T=7, H=16)
    args = jax_args(call, platform)
    before = [raw_bits(to_torch(x)) for x in args]
    got = jax.block_until_ready(
        jax.jit(functools.partial(rj.mla_rope_pool_fused, **deepseek()))(*args))
    for name, x, b in zip(("q_pe", "k_pe", "kv_c", "positions", "slots", "kv_cache"), args, before):
        assert not x.is_deleted()
        np.testing.assert_array_equal(raw_bits(to_torch(x)), b, err_msg=f"{name} changed")
    assert got[2].unsafe_buffer_pointer() != args[5].unsafe_buffer_pointer()
    assert_same(got, torch_result(call, platform, **deepseek()), MLA)


def test_inplace_aliases_q_pe_and_k_pe(platform, rng):
    call = Call(rng, dtype="float16", device="cpu", T=6, H=8)
    kw = deepseek(inplace=True)
    args = jax_args(call, platform)
    q_ptr, k_ptr = args[0].unsafe_buffer_pointer(), args[1].unsafe_buffer_pointer()
    got = jax.block_until_ready(jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw),
                                        donate_argnums=(0, 1, 5))(*args))
    assert got[0].unsafe_buffer_pointer() == q_ptr and got[1].unsafe_buffer_pointer() == k_ptr
    assert_same(got, torch_result(call, platform, **deepseek()), MLA)
    args = jax_args(call, platform)  # without donation q_pe and k_pe keep their values
    got = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw))(*args)
    np.testing.assert_array_equal(raw_bits(to_torch(args[0])), raw_bits(call.q_pe))
    np.testing.assert_array_equal(raw_bits(to_torch(args[1])), raw_bits(call.k_pe))
    assert_same(got, torch_result(call, platform, **deepseek()), MLA)


def test_hlo_shows_the_cache_alias(rng):
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=8)
    args = jax_args(call, "cpu")
    f = functools.partial(rj.mla_rope_pool_fused, rope_base=10000.0)
    lowered = jax.jit(f).lower(*args)
    assert re.search(r"stablehlo\.custom_call @ropepool_mla_rope_pool_fused", lowered.as_text())
    assert "output_to_operand_aliasing={{2}: (5, {})}" in lowered.compile().as_text()
    donated = jax.jit(f, donate_argnums=(5,)).lower(*args).compile().as_text()
    assert re.search(r"input_output_alias=\{ \{2\}: \(5, \{\}, [\w-]+\) \}", donated), \
        donated.splitlines()[0]


# ---- return_k_rot=False (SPEC §8): no k_pe_rot result, the cache as with it --------------

NO_K_ROT_LAYOUTS = {
    "token": ({}, {}),
    "nhd16": ({"page_size": 16}, {"kv_layout": "NHD"}),
    "fp8_nhd": ({"page_size": 8, "cache_dtype": torch.float8_e4m3fn},
                {"kv_layout": "NHD", "kv_scale": 0.25}),
    "neox_3d_key": ({"k_3d": True}, {"interleaved": False}),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["fresh", "inplace"])
@pytest.mark.parametrize("layout", list(NO_K_ROT_LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_k_rot_equals_with_it(platform, rng, dtype, layout, inplace):
    """Under jax.jit: k_pe_rot is None, q_pe_rot and every element of the cache bit for bit
    the torch path's call with k_pe_rot; the caller's arrays (not donated) keep their
    values."""
    call_kw, extra = NO_K_ROT_LAYOUTS[layout]
    call = Call(rng, dtype=dtype, device="cpu", T=int(rng.integers(2, 40)), H=16, P=64,
                **call_kw)
    kw = deepseek(**extra)
    want = torch_result(call, platform, **kw)
    args = jax_args(call, platform)
    before = [raw_bits(to_torch(x)) for x in args]
    got = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw, inplace=inplace,
                                    return_k_rot=False))(*args)
    assert len(got) == 3 and got[1] is None
    assert_same((got[0], got[2]), (want[0], want[2]), ("q_pe_rot", "kv_cache"))
    assert not np.array_equal(raw_bits(to_torch(got[2])), raw_bits(call.before))  # (written)
    for name, x, b in zip(("q_pe", "k_pe", "kv_c", "positions", "slots", "kv_cache"), args,
                          before):
        np.testing.assert_array_equal(raw_bits(to_torch(x)), b, err_msg=f"{name} changed")


def test_without_k_rot_donation_and_hlo(rng):
    """The call without k_pe_rot is its own custom call with two results (q_pe_rot and the
    aliased cache: no k_pe_rot buffer); with inplace=True q_pe is aliased to q_pe_rot and
    k_pe is only read, so donating q_pe and the cache writes the caller's buffers and k_pe
    keeps its values."""
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=8, P=32)
    args = jax_args(call, "cpu")
    f = functools.partial(rj.mla_rope_pool_fused, **deepseek(), inplace=True, return_k_rot=False)
    lowered = jax.jit(f).lower(*args)
    assert re.search(r"stablehlo\.custom_call @ropepool_mla_rope_pool_fused_no_k_rot\(",
                     lowered.as_text())
    compiled = lowered.compile().as_text()
    assert "output_to_operand_aliasing={{0}: (0, {}), {1}: (5, {})}" in compiled
    assert custom_call_results(compiled, "ropepool_mla_rope_pool_fused_no_k_rot") == [
        "bf16[5,8,64]", "bf16[32,576]"], compiled
    with pytest.warns(UserWarning, match="donated buffers were not usable"):
        # (k_pe donated too: XLA has no result for it, so it is not taken)
        jax.jit(f, donate_argnums=(1,)).lower(*args).compile()

    want = torch_result(call, "cpu", **deepseek())
    ptrs = [args[i].unsafe_buffer_pointer() for i in (0, 5)]
    got = jax.block_until_ready(jax.jit(f, donate_argnums=(0, 5))(*args))
    assert got[1] is None
    assert [got[i].unsafe_buffer_pointer() for i in (0, 2)] == ptrs, "a buffer was copied"
    assert args[0].is_deleted() and args[5].is_deleted() and not args[1].is_deleted()
    np.testing.assert_array_equal(raw_bits(to_torch(args[1])), raw_bits(call.k_pe),
                                  err_msg="k_pe changed")
    assert_same((got[0], got[2]), (want[0], want[2]), ("q_pe_rot", "kv_cache"))


def test_without_k_rot_at_trace_time():
    """k_pe is still validated (it is read); the traced result has no k_pe_rot; JAX has no
    k_out keyword, so nothing conflicts with return_k_rot=False."""
    out = traced(return_k_rot=False)
    assert out[1] is None and out[0].shape == (4, 2, 64) and out[2].shape == (16, 576)
    for changes in ({"k_pe": ((4, 32), "bfloat16")}, {"k_pe": ((4, 64), "float16")}):
        with pytest.raises(ValueError) as want:
            traced(changes)
        with pytest.raises(ValueError) as got:
            traced(changes, return_k_rot=False)
        assert str(got.value) == str(want.value)


# ---- validation at trace time (SPEC §2, §8) ----------------------------------------------------

def spec(shape, dtype="bfloat16"):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


BASE = dict(q_pe=((4, 2, 64), "bfloat16"), k_pe=((4, 64), "bfloat16"),
            kv_c=((4, 512), "bfloat16"), positions=((4,), "int32"), slots=((4,), "int32"),
            kv_cache=((16, 576), "bfloat16"))


def traced(changes=(), **kw):
    """Traces (never runs) a call on abstract arrays: BASE with `changes` applied."""
    args = dict(BASE, **dict(changes))
    f = functools.partial(rj.mla_rope_pool_fused, **dict(dict(rope_base=10000.0), **kw))
    return jax.eval_shape(f, *(spec(*args[n]) for n in BASE))


P = "mla_rope_pool_fused: "


@pytest.mark.parametrize("changes,kw,message", [
    ({"q_pe": ((4, 128), "bfloat16")}, {},
     P + "q_pe must be 3-D [num_tokens, num_heads, rope_dim], got (4, 128)"),
    ({"k_pe": ((4, 32), "bfloat16")}, {},
     P + "k_pe shape must be [num_tokens, rope_dim] = [4, 64] (or [4, 1, 64]) for q_pe "
     "(4, 2, 64), got (4, 32)"),
    ({"kv_c": ((3, 512), "bfloat16")}, {},
     P + "kv_c shape must be [num_tokens, kv_lora_rank] with num_tokens = 4 (from q_pe), got "
     "(3, 512)"),
    ({"kv_cache": ((16, 570), "bfloat16")}, {},
     P + "kv_cache shape must be [num_slots, kv_lora_rank + rope_dim] with kv_lora_rank + "
     "rope_dim = 512 + 64 = 576, got (16, 570)"),
    ({}, {"kv_layout": "NHD"},
     P + "kv_cache must be 3-D [pages, page_size, kv_lora_rank + rope_dim] with "
     "kv_layout=\"NHD\", got (16, 576)"),
    ({}, {"kv_layout": "HND"},
     P + "kv_layout must be None (a [P, L + R] cache) or 'NHD' (a [pages, page_size, L + R] "
     "cache), got 'HND'"),
    ({}, {"kv_scale": 0.5}, P + "kv_scale is only used with a float8_e4m3fn kv_cache, got a "
     "bfloat16 cache"),
    ({"kv_cache": ((16, 576), "float8_e4m3fn")}, {"kv_scale": float("nan")},
     P + "kv_scale must be finite and > 0, got nan"),
    ({"positions": ((4,), "float32")}, {}, P + "positions must be int32 or int64, got float32"),
    ({"kv_c": ((4, 512), "float16")}, {},
     P + "q_pe/k_pe/kv_c dtypes must match, got q_pe bfloat16, k_pe bfloat16, kv_c float16"),
], ids=["q_pe_rank", "k_pe_shape", "kv_c_shape", "cache_shape", "nhd_rank", "hnd", "scale_bf16",
        "scale_nan", "positions_dtype", "dtypes"])
def test_trace_time_messages(changes, kw, message):
    with pytest.raises(ValueError) as info:
        traced(changes, **kw)
    assert str(info.value) == message  # exactly (JAX adds its traceback note to __notes__)


def test_trace_time_keywords_and_types():
    with pytest.raises(ValueError, match=r"^mla_rope_pool_fused: rope_scaling"):
        traced(rope_scaling={"type": "yarn", "factor": 40, "bogus": 1})
    with pytest.raises(TypeError, match=r"^mla_rope_pool_fused: kv_scale must be a Python "
                                        r"float in ropepool\.jax .*got ArrayImpl"):
        traced({"kv_cache": ((16, 576), "float8_e4m3fn")}, kv_scale=jnp.ones((1,)))
    with pytest.raises(TypeError, match=r"^mla_rope_pool_fused: slots must be an array"):
        rj.mla_rope_pool_fused(*(jnp.zeros(*BASE[n]) for n in ("q_pe", "k_pe", "kv_c",
                                                                "positions")),
                               [0, 1, 2, 3], jnp.zeros(*BASE["kv_cache"]), rope_base=10000.0)
    with pytest.raises(TypeError, match=r"^mla_rope_pool_fused: inv_freq must be a constant"):
        jax.jit(lambda f, *a: rj.mla_rope_pool_fused(*a, rope_base=1.0, inv_freq=f))(
            jnp.ones(32), *(jnp.zeros(*BASE[n]) for n in BASE))


# ---- data errors when the computation runs (SPEC §3, §9) ------------------------------------

@pytest.mark.parametrize("page_size", [0, 16])
def test_out_of_range_slot_fails_the_run(rng, page_size):
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=4, P=32, page_size=page_size)
    call.slots[3] = 32
    kw = dict(rope_base=10000.0, kv_layout="NHD" if page_size else None)
    args = jax_args(call, "cpu")
    lowered = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw)).lower(*args)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=re.escape(P + "slots[3] = 32 is out of range for a kv_cache of 32 "
                                       "slots")):
        jax.block_until_ready(lowered.compile()(*args))
    np.testing.assert_array_equal(raw_bits(to_torch(args[5])), raw_bits(call.before))
    # Donated too: the same error.
    f = jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw), donate_argnums=(5,))
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("slots[3] = 32")):
        jax.block_until_ready(f(*jax_args(call, "cpu")))
    call.slots[3] = -1  # the op is usable afterwards
    assert_same(f(*jax_args(call, "cpu")), torch_result(call, "cpu", **kw), MLA)


def test_repeated_slot_with_check_slots_fails_the_run(rng):
    call = Call(rng, dtype="float16", device="cpu", T=6, H=4, P=32)
    call.slots[:] = torch.tensor([7, -1, 3, 9, 3, 20], dtype=call.slots.dtype)
    kw = dict(rope_base=10000.0, check_slots=True)
    args = jax_args(call, "cpu")
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=re.escape(P + "slots[4] = 3 repeats slots[2]")):
        jax.block_until_ready(jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw))(*args))
    np.testing.assert_array_equal(raw_bits(to_torch(args[5])), raw_bits(call.before))
    kw["check_slots"] = False  # without it, the call runs (the row holds one token's row)
    jax.block_until_ready(jax.jit(functools.partial(rj.mla_rope_pool_fused, **kw))(*args))


# ---- transformations the op does not support: errors, never silent results ------------------

def test_grad_and_vmap_are_errors(rng):
    call = Call(rng, dtype="float32", device="cpu", T=4, H=2)
    args = jax_args(call, "cpu")
    f = functools.partial(rj.mla_rope_pool_fused, rope_base=10000.0)
    with pytest.raises(ValueError, match=r"^mla_rope_pool_fused has no derivative"):
        jax.grad(lambda q: f(q, *args[1:])[0].sum())(args[0])
    with pytest.raises(ValueError, match=r"^mla_rope_pool_fused does not support jax\.vmap"):
        jax.vmap(f)(*(x[None] for x in args))


# ---- CUDA: slot errors without and with check_slots ------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason="no JAX GPU device")
@pytest.mark.skipif(not ropepool.cuda_backend, reason="no CUDA backend in this build")
def test_cuda_out_of_range_slot(rng):
    ropepool.cuda_check_slot_errors()
    call = Call(rng, dtype="bfloat16", device="cpu", T=8, H=16, P=32)
    call.slots[5] = 32
    # check_slots: the call checks the slots on the host first and fails before writing.
    f = jax.jit(functools.partial(rj.mla_rope_pool_fused, **deepseek(check_slots=True)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=re.escape(P + "slots[5] = 32 is out of range")):
        jax.block_until_ready(f(*jax_args(call, "gpu")))
    # Without it the kernel skips that token's row (SPEC §3) and the error is reported later.
    got = jax.block_until_ready(
        jax.jit(functools.partial(rj.mla_rope_pool_fused, **deepseek()))(*jax_args(call, "gpu")))
    with pytest.raises(RuntimeError,
                       match=re.escape("slots[5] = 32 out of range for a pool of 32")):
        ropepool.cuda_check_slot_errors(GPU.id)
    call.slots[5] = -1
    assert_same(got, torch_result(call, "gpu", **deepseek()), MLA)
