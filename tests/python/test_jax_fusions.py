"""SPEC §7 through the JAX front end: ropepool.jax.rope_pool_fused with QK RMSNorm weights
(operands of the call) and multimodal RoPE (positions [3, T]).

Every element is compared with the torch path (the same C++ op: bit for bit) on fresh
random inputs, and spot-checked against the oracles of test_fusions.py: transformers' norm
modules, and the exact (float64) rotation by transformers' mRoPE code. CUDA cases are
marked `gpu`.
"""

import functools

import numpy as np
import pytest
import torch

from rope_testing import TORCH_DTYPES, raw_bits, to_f64
from test_fusions import (GEMMA3_4B_GLOBAL, QWEN2_VL_7B, QWEN3_4B, QWEN3_VL_4B, _assert_close,
                          _assert_norm_close, _call, _exact_plain, _hf_mrope_exact, _inputs,
                          _inv_freq, _kw, _mrope_positions)
from test_jax import assert_same, jax, jnp, rj, to_jax, to_torch
from test_jax import platform  # noqa: F401 (the fixture: cpu, and gpu where there is one)

pytestmark = pytest.mark.skipif(rj is None, reason="no JAX front end in this build")


def jax_call(a, positions, kw, platform, jit=True):
    """ropepool.jax.rope_pool_fused on the inputs of test_fusions._inputs: CPU tensors."""
    args = [to_jax(a[n], platform) for n in ("q", "k", "v")] + [to_jax(positions, platform)] \
        + [to_jax(a[n], platform) for n in ("slots", "k_pool", "v_pool")]
    kw = {n: to_jax(w, platform) if isinstance(w, torch.Tensor) else w for n, w in kw.items()}
    f = functools.partial(rj.rope_pool_fused, **kw)
    return [to_torch(x) for x in (jax.jit(f) if jit else f)(*args)]


def torch_call(a, positions, kw, platform):
    return _call(a, positions, kw, "cpu" if platform == "cpu" else "cuda")[:4]


def weights(rng, D, dtype, centre=1.0):
    return {n: torch.from_numpy(centre + 0.5 * rng.standard_normal(D)).to(dtype)
            for n in ("q_norm_weight", "k_norm_weight")}


# ---- QK norm (Qwen3 "rms", Gemma 3 "gemma") -------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("cfg,style", [(QWEN3_4B, "rms"), (GEMMA3_4B_GLOBAL, "gemma")],
                         ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_qk_norm_equals_torch_path_and_transformers(platform, rng, cfg, style, dtype, jit):
    T, D = int(rng.integers(1, 30)), cfg["head_dim"]
    a = _inputs(rng, cfg, T, dtype)
    wt = TORCH_DTYPES[dtype] if rng.random() < 0.5 else torch.float32
    w = weights(rng, D, wt, 1.0 if style == "rms" else 0.0)
    positions = torch.from_numpy(rng.integers(0, 2**17, size=T).astype(np.int32))
    kw = _kw(cfg, **w, norm_eps=cfg["eps"], norm_style=style)
    got = jax_call(a, positions, kw, platform, jit)
    assert_same(got, torch_call(a, positions, kw, platform))
    # ropepool's normalised heads (position 0: the identity rotation) against transformers'
    # module, and the rotation of those heads within SPEC §1's bound of the exact one
    zero = torch.zeros(T, dtype=torch.int32)
    normalised = jax_call(a, zero, kw, platform, jit)
    factor = cfg.get("rope_scaling", {}).get("factor", 1.0)
    for i, name in enumerate(("q", "k")):
        _assert_norm_close(normalised[i], a[name], "qwen3" if style == "rms" else "gemma3",
                           cfg["eps"], w[f"{name}_norm_weight"], dtype, f"{name}: {style} norm")
        y64 = torch.from_numpy(to_f64(normalised[i]))
        _assert_close(got[i], _exact_plain(y64, positions, _inv_freq(cfg["rope_base"], D, factor)),
                      y64, dtype, f"{name}_rot")


@pytest.mark.parametrize("which", ["q_norm_weight", "k_norm_weight"])
def test_one_norm_weight(platform, rng, which):
    """One weight: the handler must tell which of the two it received."""
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)
    a = _inputs(rng, cfg, 9, "bfloat16")
    positions = torch.from_numpy(rng.integers(0, 4096, size=9).astype(np.int32))
    kw = _kw(cfg, **{which: weights(rng, 128, torch.bfloat16)[which]})
    got = jax_call(a, positions, kw, platform)
    assert_same(got, torch_call(a, positions, kw, platform))
    plain = torch_call(a, positions, _kw(cfg), platform)
    normalised, untouched = (0, 1) if which == "q_norm_weight" else (1, 0)
    np.testing.assert_array_equal(raw_bits(got[untouched]), raw_bits(plain[untouched]))
    assert not np.array_equal(raw_bits(got[normalised]), raw_bits(plain[normalised]))


# ---- multimodal RoPE (Qwen2-VL, Qwen3-VL) -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model,cfg,interleaved", [("qwen2_vl", QWEN2_VL_7B, False),
                                                   ("qwen3_vl", QWEN3_VL_4B, True)],
                         ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("form", ["rope_scaling", "keywords"])
def test_mrope_equals_torch_path_and_transformers(platform, rng, model, cfg, interleaved,
                                                  dtype, form):
    T, D = 40, cfg["head_dim"]
    cfg = dict(cfg, num_qo_heads=8, num_kv_heads=2)
    a = _inputs(rng, cfg, T, dtype)
    positions = _mrope_positions(rng, T, "int32")
    section = cfg["rope_scaling"]["mrope_section"]
    if form == "rope_scaling":
        kw = _kw(cfg)
    else:
        kw = _kw(dict(cfg, rope_scaling={"rope_type": "default"}), mrope_section=section,
                 mrope_interleaved=interleaved)
    got = jax_call(a, positions, kw, platform)
    assert_same(got, torch_call(a, positions, kw, platform))
    inv_freq = _inv_freq(cfg["rope_base"], D)
    for i, name in enumerate(("q", "k")):
        x64 = torch.from_numpy(to_f64(a[name]))
        exact = _hf_mrope_exact(model, x64, positions, inv_freq, section, interleaved)
        _assert_close(got[i], exact, x64, dtype, f"{model} {name}_rot")


def test_mrope_with_qk_norm(platform, rng):
    """Qwen3-VL as the model runs it: both fusions in one call."""
    cfg = dict(QWEN3_VL_4B, num_qo_heads=8, num_kv_heads=2)
    a = _inputs(rng, cfg, 24, "bfloat16")
    positions = _mrope_positions(rng, 24, "int32")
    kw = _kw(cfg, **weights(rng, 128, torch.bfloat16), norm_eps=cfg["eps"])
    assert_same(jax_call(a, positions, kw, platform), torch_call(a, positions, kw, platform))


# ---- validation at trace time ----------------------------------------------------------------

def traced(q_norm=None, k_norm=None, positions=(2,), **kw):
    args = [((2, 8, 128), "float32"), ((2, 2, 128), "float32"), ((2, 2, 128), "float32"),
            (positions, "int32"), ((2,), "int32"), ((16, 2, 128), "float32"),
            ((16, 2, 128), "float32")]
    w = {n: jax.ShapeDtypeStruct(*s) for n, s in (("q_norm_weight", q_norm),
                                                  ("k_norm_weight", k_norm)) if s is not None}

    def f(*ops):
        return rj.rope_pool_fused(*ops[:7], **dict(zip(w, ops[7:])), head_dim=128,
                                  num_qo_heads=8, num_kv_heads=2, rope_base=10000.0, **kw)
    return jax.eval_shape(f, *(jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in args),
                          *w.values())


@pytest.mark.parametrize("args,message", [
    (dict(norm_eps=1e-6), "rope_pool_fused: norm_eps is given but neither q_norm_weight nor "
     "k_norm_weight"),
    (dict(k_norm=((64,), jnp.float32)), "rope_pool_fused: k_norm_weight must be [head_dim] = "
     "[128], got [64]"),
    (dict(q_norm=((128,), jnp.float16)), "rope_pool_fused: q_norm_weight must be float32 (q's "
     "dtype) or float32, got float16"),
    (dict(q_norm=((128,), jnp.float32), norm_style="layer"),
     "rope_pool_fused: norm_style must be 'rms' or 'gemma', got 'layer'"),
    (dict(q_norm=((128,), jnp.float32), norm_style=""),
     "rope_pool_fused: norm_style must be 'rms' or 'gemma', got ''"),
    (dict(q_norm=((128,), jnp.float32), norm_eps=0.0),
     "rope_pool_fused: norm_eps must be finite and > 0 (as a float32), got 0.0"),
], ids=["eps_alone", "weight_shape", "weight_dtype", "style", "empty_style", "eps"])
def test_trace_time_messages(args, message):
    with pytest.raises(ValueError) as info:
        traced(**args)
    assert str(info.value) == message


def test_trace_time_mrope_and_types():
    with pytest.raises(ValueError, match=r"^rope_pool_fused: .*positions"):
        traced(mrope_section=[16, 24, 24])  # positions [T], not [3, T]
    traced(positions=(3, 2), mrope_section=[16, 24, 24])  # the right shape traces
    with pytest.raises(TypeError, match=r"^rope_pool_fused: q_norm_weight must be an array"):
        traced(q_norm_weight=[1.0] * 128)
