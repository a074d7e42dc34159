"""SPEC §6's keywords on ropepool.mlx.rope_pool_fused: paged pools (kv_layout "NHD"/"HND"),
float8 e4m3 pools (uint8 arrays in MLX, as mx.to_fp8 makes them) with k_scale/v_scale as
floats or one-element mx.arrays, and an fp8 q_rot (q_out_dtype="float8_e4m3fn", q_scale).

Every element (bits) equals the torch front end's on the same fresh random inputs (both run
the CPU backend); a spot check against SPEC §6's e4m3 rule and the float64 rotation
(test_caches' oracle); the messages, from the call itself, as torch's; a bad scale array's
value raising at mx.eval.
"""

import math

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed")

import ropepool  # noqa: E402

# (skips this module where ropepool.mlx is unavailable, as test_mlx does)
from rope_testing import raw_bits  # noqa: E402
from test_mlx import assert_same_bits, bits, from_mx, mlx_message, to_mx  # noqa: E402

import ropepool.mlx as rmlx  # noqa: E402
from test_caches import (FP8, e4m3_ordinal, make_inputs, pool_rows, rope_exact,  # noqa: E402
                         small, spec_e4m3)

SHAPES = {None: lambda pages, ps, Hk, D: (pages * ps, Hk, D),
          "NHD": lambda pages, ps, Hk, D: (pages, ps, Hk, D),
          "HND": lambda pages, ps, Hk, D: (pages, Hk, ps, D)}
SCALES = dict(k_scale=0.05, v_scale=0.5, q_scale=0.03)


def random_pool(gen, shape, dtype):
    """A pool of random bytes (NaNs and all): every byte the op must leave alone is poison."""
    width = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, shape[:-1] + (shape[-1] * width,), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype)


@pytest.mark.parametrize("scale_form", ["float", "array"])
@pytest.mark.parametrize("fp8_pool,q_fp8", [(False, False), (True, False), (False, True),
                                            (True, True)], ids=["plain", "fp8_pools", "fp8_q",
                                                                "fp8_both"])
@pytest.mark.parametrize("layout,page_size", [(None, 1), ("NHD", 16), ("HND", 8)],
                         ids=["token", "NHD16", "HND8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
def test_equals_torch_path_and_the_e4m3_rule(rng, dtype, layout, page_size, fp8_pool, q_fp8,
                                            scale_form):
    T, Hq, Hk, D, pages = 21, 4, 2, 64, 6
    q, k, v, positions, slots, gen = make_inputs(rng, "cpu", dtype, T, Hq, Hk, D,
                                                 pages * page_size if layout else 40)
    shape = SHAPES[layout](pages, page_size, Hk, D) if layout else (40, Hk, D)
    pool_dtype = FP8 if fp8_pool else dtype
    k_pool, v_pool = random_pool(gen, shape, pool_dtype), random_pool(gen, shape, pool_dtype)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0, kv_layout=layout)
    names = (["k_scale", "v_scale"] if fp8_pool else []) + (["q_scale"] if q_fp8 else [])
    if scale_form == "float":
        t_kw = m_kw = {n: SCALES[n] for n in names}
    else:
        t_kw = {n: torch.tensor([SCALES[n]]) for n in names}
        m_kw = {n: mx.array([SCALES[n]], dtype=mx.float32) for n in names}
    want = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool.clone(), v_pool.clone(),
                                    **kw, **t_kw, q_out_dtype=FP8 if q_fp8 else None)
    got = rmlx.rope_pool_fused(*(to_mx(x) for x in (q, k, v, positions, slots, k_pool, v_pool)),
                               **kw, **m_kw, q_out_dtype="float8_e4m3fn" if q_fp8 else None)
    assert got[0].dtype == (mx.uint8 if q_fp8 else to_mx(q).dtype)
    assert got[2].dtype == (mx.uint8 if fp8_pool else to_mx(q).dtype)
    assert_same_bits(got, want)

    # spot check: SPEC §6's rule against the float64 rotation, on the MLX results
    written = slots >= 0
    ws = slots[written]
    k_rows = pool_rows(from_mx(got[2], pool_dtype), ws, layout)
    v_rows = pool_rows(from_mx(got[3], pool_dtype), ws, layout)
    k_rot = from_mx(got[1], dtype)
    k_exact = rope_exact(k, positions, 10000.0)
    if fp8_pool:
        d = e4m3_ordinal(k_rows) - e4m3_ordinal(spec_e4m3((k_exact[written] / 0.05).float()))
        assert d.abs().max() <= 1, "k_pool rows: more than one e4m3 step from the exact value"
        want_v = spec_e4m3(v[written].float() / torch.tensor(0.5, dtype=torch.float32))
        assert torch.equal(v_rows.view(torch.uint8), want_v.view(torch.uint8)), "v_pool rows"
    else:
        np.testing.assert_array_equal(raw_bits(k_rows), raw_bits(k_rot[written]), "k_pool rows")
        np.testing.assert_array_equal(raw_bits(v_rows), raw_bits(v[written]), "v_pool rows")
    if q_fp8:
        q_exact = rope_exact(q, positions, 10000.0)
        d = e4m3_ordinal(from_mx(got[0], FP8)) - e4m3_ordinal(spec_e4m3((q_exact / 0.03).float()))
        assert d.abs().max() <= 1, "q_rot: more than one e4m3 step from the exact value"


@pytest.mark.parametrize("change", [
    dict(k_scale=0.0), dict(v_scale=-2.0), dict(k_scale=math.nan), dict(k_scale=1e-60),
    dict(k_scale="shape 2"), dict(k_scale="float16"), dict(q_scale=2.0), dict(kv_layout="nhd"),
    dict(kv_layout="NHD"), dict(q_out_dtype="float8_e4m3fn", inplace=True),
    dict(k_scale=True), dict(v_scale="1.0"), dict(q_out_dtype="float16"),
], ids=str)
def test_messages_at_call_time_are_the_torch_paths(change):
    """Each bad SPEC §6 keyword raises, from the call itself, the torch front end's message
    (shapes as MLX prints them)."""
    args, kw = small()
    t_kw, m_kw = dict(kw, **change), dict(kw, **change)
    if change.get("k_scale") == "shape 2":
        t_kw["k_scale"], m_kw["k_scale"] = torch.ones(2), mx.ones((2,))
    if change.get("k_scale") == "float16":
        t_kw["k_scale"] = torch.ones(1, dtype=torch.float16)
        m_kw["k_scale"] = mx.ones((1,), dtype=mx.float16)
    if change.get("q_out_dtype") == "float16":
        t_kw["q_out_dtype"] = torch.float16
    with pytest.raises((ValueError, TypeError)) as want:
        ropepool.rope_pool_fused(*args, **t_kw)
    with pytest.raises(type(want.value)) as got:
        rmlx.rope_pool_fused(*(to_mx(a) for a in args), **m_kw)
    # (q_out_dtype: MLX passes the name, which the message repeats)
    assert str(got.value) == mlx_message(str(want.value)).replace("torch.float16", "'float16'")


def test_scale_array_value_is_checked_at_eval_and_nothing_written(rng):
    args, kw = small()
    margs = [to_mx(a) for a in args]
    old = bits(margs[5]), bits(margs[6])
    out = rmlx.rope_pool_fused(*margs, **kw, v_scale=mx.array([0.0]))  # data: no error yet
    with pytest.raises((RuntimeError, ValueError),
                       match=r"^rope_pool_fused: v_scale must be finite and > 0, got 0\.0 "
                             r"\(the tensor's value\)$"):
        mx.eval(*out)
    np.testing.assert_array_equal(bits(margs[5]), old[0])
    np.testing.assert_array_equal(bits(margs[6]), old[1])
    with pytest.raises(TypeError, match=r"^rope_pool_fused: k_scale must be an mlx.core.array, "
                                        r"got ndarray$"):
        rmlx.rope_pool_fused(*margs, **kw, k_scale=np.ones(1, np.float32))
