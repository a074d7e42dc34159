"""SPEC §7's keywords on ropepool.mlx.rope_pool_fused: QK norm (Qwen3, Gemma 3) and
multimodal RoPE (Qwen2-VL, Qwen3-VL).

Every element (bits) equals the torch front end's on the same fresh random inputs (both run
the CPU backend); spot checks against transformers' norm modules and mRoPE code
(test_fusions' oracles); the keywords' messages at call time; mx.compile.
"""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed")

import ropepool  # noqa: E402

# (skips this module where ropepool.mlx is unavailable, as test_mlx does)
from test_mlx import address, assert_same_bits, bits, from_mx, to_mx  # noqa: E402

import ropepool.mlx as rmlx  # noqa: E402
from rope_testing import TORCH_DTYPES, to_f64  # noqa: E402
from test_fusions import (QWEN2_VL_7B, QWEN3_4B, QWEN3_VL_4B, _assert_close,  # noqa: E402
                          _assert_norm_close, _exact_plain, _hf_mrope_exact, _inputs,
                          _inv_freq, _kw, _mrope_positions)

CFG = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)  # head_dim 128


def weights(rng, dtype, centre=1.0):
    return {n: torch.from_numpy(centre + 0.3 * rng.standard_normal(128)).to(dtype)
            for n in ("q_norm_weight", "k_norm_weight")}


def both(a, positions, kw, mx_kw=None):
    """The torch front end's four results (on copies) and ropepool.mlx's on the same bits;
    torch weights in kw become mx.arrays (or mx_kw's, where given)."""
    t = {n: x.clone() for n, x in a.items()}
    want = ropepool.rope_pool_fused(t["q"], t["k"], t["v"], positions, t["slots"], t["k_pool"],
                                    t["v_pool"], **kw)
    m_kw = {n: to_mx(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    m_kw.update(mx_kw or {})
    got = rmlx.rope_pool_fused(to_mx(a["q"]), to_mx(a["k"]), to_mx(a["v"]), to_mx(positions),
                               to_mx(a["slots"]), to_mx(a["k_pool"]), to_mx(a["v_pool"]),
                               **m_kw)
    return got, want


VARIANTS = {
    "rms": lambda rng, t: dict(weights(rng, t), norm_eps=1e-6),
    "rms_float32_weights": lambda rng, t: weights(rng, torch.float32),
    "gemma": lambda rng, t: dict(weights(rng, torch.float32, 0.0), norm_style="gemma",
                                 norm_eps=1e-5),
    "only_k": lambda rng, t: {"k_norm_weight": weights(rng, t)["k_norm_weight"]},
    "norm_inplace_interleaved_partial": lambda rng, t: dict(weights(rng, t), inplace=True,
                                                            interleaved=True, rotary_dim=64),
    "norm_yarn": lambda rng, t: dict(weights(rng, t), rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_norm_equals_torch_path(rng, dtype, variant):
    T = 29
    a = _inputs(rng, CFG, T, dtype)
    positions = torch.from_numpy(rng.integers(0, 2**20, size=T).astype(np.int32))
    got, want = both(a, positions, _kw(CFG, **VARIANTS[variant](rng, TORCH_DTYPES[dtype])))
    assert_same_bits(got, want)


def test_strided_weight_is_read_as_its_values(rng):
    """A weight that is a strided MLX view (w[::2]) gives the bits of its contiguous copy."""
    T = 7
    a = _inputs(rng, CFG, T, "bfloat16")
    positions = torch.from_numpy(rng.integers(0, 2**17, size=T).astype(np.int64))
    w = weights(rng, torch.bfloat16)
    wide = torch.stack([w["q_norm_weight"], w["k_norm_weight"]], dim=1).reshape(-1)  # [2D]
    got, want = both(a, positions, _kw(CFG, **w),
                     {"q_norm_weight": to_mx(wide)[::2], "k_norm_weight": to_mx(wide)[1::2]})
    assert_same_bits(got, want)


MROPE = {
    "qwen2_vl_dict": (QWEN2_VL_7B, {}),
    "qwen3_vl_dict_with_norm": (QWEN3_VL_4B, {"norm": True}),
    "keywords": (QWEN2_VL_7B, {"rope_scaling": None, "mrope_section": [16, 24, 24]}),
    "keywords_interleaved": (QWEN3_VL_4B, {"rope_scaling": None, "mrope_section": [24, 20, 20],
                                           "mrope_interleaved": True}),
    "schedule": (QWEN3_VL_4B, {"schedule": True}),
}


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(MROPE))
def test_mrope_equals_torch_path(rng, variant, dtype, index_dtype):
    cfg, extra = MROPE[variant]
    cfg = dict(cfg, num_qo_heads=4, num_kv_heads=2)
    T = 40
    a = _inputs(rng, cfg, T, dtype)
    positions = _mrope_positions(rng, T, index_dtype)
    kw = _kw(cfg)
    extra = dict(extra)
    if extra.pop("norm", False):
        kw.update(weights(rng, TORCH_DTYPES[dtype]), norm_eps=1e-6)
    if extra.pop("schedule", False):
        kw["schedule"] = ropepool.rope_schedule(head_dim=128, rope_base=cfg["rope_base"],
                                                rope_scaling=kw.pop("rope_scaling"))
    kw.update(extra)
    if kw.get("rope_scaling", 0) is None:
        del kw["rope_scaling"]
    got, want = both(a, positions, kw)
    assert_same_bits(got, want)
    # text-only tokens (three equal rows) are the plain call's bits
    if variant == "keywords":
        flat = positions[0].contiguous()
        plain_kw = {n: x for n, x in kw.items() if not n.startswith("mrope")}
        got3, _ = both(a, flat[None].expand(3, T).contiguous(), kw)
        got1, _ = both(a, flat, plain_kw)
        for name, g3, g1 in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got3, got1):
            np.testing.assert_array_equal(bits(g3), bits(g1), err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("style", ["rms", "gemma"])
def test_norm_matches_transformers(rng, dtype, style):
    """Spot check: the normalised heads (a call at position 0) within SPEC §7's one ulp of
    transformers' Qwen3RMSNorm / Gemma3RMSNorm, the rotation within SPEC §1's bound."""
    T, D = 9, 128
    t = TORCH_DTYPES[dtype]
    a = _inputs(rng, CFG, T, dtype)
    w = weights(rng, t if style == "rms" else torch.float32, 1.0 if style == "rms" else 0.0)
    norm_kw = dict(w, norm_eps=1e-6, norm_style=style)
    positions = torch.from_numpy(rng.integers(0, 2**17, size=T).astype(np.int64))
    rot, _ = both(a, positions, _kw(CFG, **norm_kw))
    y, _ = both(a, torch.zeros(T, dtype=torch.int64), _kw(CFG, **norm_kw))
    kind = "qwen3" if style == "rms" else "gemma3"
    inv_freq = _inv_freq(CFG["rope_base"], D)
    for i, name in ((0, "q"), (1, "k")):
        got, head = from_mx(rot[i], t), from_mx(y[i], t)
        weight = w[f"{name}_norm_weight"]
        _assert_norm_close(head, a[name], kind, 1e-6, weight, dtype, f"{name}: {kind} norm")
        y64 = torch.from_numpy(to_f64(head))
        _assert_close(got, _exact_plain(y64, positions, inv_freq), y64, dtype,
                      f"{name}_rot vs the exact rotation of the normalised head")


@pytest.mark.parametrize("model,cfg,interleaved", [("qwen2_vl", QWEN2_VL_7B, False),
                                                   ("qwen3_vl", QWEN3_VL_4B, True)])
def test_mrope_matches_transformers(rng, model, cfg, interleaved):
    """Spot check against transformers' mRoPE code fed float64 angles."""
    cfg = dict(cfg, num_qo_heads=4, num_kv_heads=2)
    T = 30
    a = _inputs(rng, cfg, T, "float32")
    positions = _mrope_positions(rng, T, "int64")
    got, _ = both(a, positions, _kw(cfg))
    inv_freq = _inv_freq(cfg["rope_base"], 128)
    for i, name in ((0, "q"), (1, "k")):
        x64 = torch.from_numpy(to_f64(a[name]))
        exact = _hf_mrope_exact(model, x64, positions, inv_freq,
                                cfg["rope_scaling"]["mrope_section"], interleaved)
        _assert_close(from_mx(got[i], torch.float32), exact, x64, "float32", f"{model} {name}_rot")


def test_keyword_messages_at_call_time_are_the_torch_paths(rng):
    """Each bad SPEC §7 keyword raises, from the call itself, the torch front end's message
    (shapes as MLX prints them)."""
    T = 6
    a = _inputs(rng, CFG, T, "bfloat16")
    pos = torch.arange(T, dtype=torch.int32)
    pos3 = torch.zeros((3, T), dtype=torch.int32)
    w = torch.ones(128, dtype=torch.bfloat16)
    s = ropepool.rope_schedule(head_dim=128, rope_base=CFG["rope_base"])
    plain = {n: CFG[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")}
    cases = [
        (pos, dict(norm_eps=1e-5), None),
        (pos, dict(norm_style="gemma"), None),
        (pos, dict(q_norm_weight=torch.ones(64, dtype=torch.bfloat16)), None),
        (pos, dict(k_norm_weight=torch.ones(128, dtype=torch.float16)), None),
        (pos, dict(q_norm_weight=w, norm_eps=0.0), None),
        (pos, dict(q_norm_weight=w, norm_eps=1e-50), None),
        (pos, dict(q_norm_weight=w, norm_style="layer"), None),
        (pos, dict(q_norm_weight=w, norm_style=1), None),
        (pos3, dict(mrope_section=[16, 24, 16]), None),
        (pos, dict(mrope_section=[16, 24, 24]),
         "rope_pool_fused: with mrope_section, positions must be [3, num_tokens] (temporal, "
         "height and width rows), got (6,)"),
        (pos3, {}, "rope_pool_fused expects positions/slots to be 1-D"),
        (torch.zeros((3, T + 1), dtype=torch.int32), dict(mrope_section=[16, 24, 24]), None),
        (pos3, dict(mrope_interleaved=True), None),
        (pos3, dict(mrope_section=[16, 24, 24], rope_scaling={"mrope_section": [24, 20, 20]}),
         None),
        (pos3, dict(schedule=s, mrope_section=[16, 24, 24]), None),
    ]
    for positions, bad, message in cases:
        kw = dict(plain, **bad)
        with pytest.raises((ValueError, TypeError)) as want:
            ropepool.rope_pool_fused(a["q"], a["k"], a["v"], positions, a["slots"], a["k_pool"],
                                     a["v_pool"], **kw)
        m_kw = {n: to_mx(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        args = [to_mx(x) for x in (a["q"], a["k"], a["v"], positions, a["slots"], a["k_pool"],
                                   a["v_pool"])]
        with pytest.raises(type(want.value)) as got:
            rmlx.rope_pool_fused(*args, **m_kw)
        assert str(got.value) == (message or str(want.value)), bad
    with pytest.raises(TypeError, match=r"^rope_pool_fused: k_norm_weight must be an "
                                        r"mlx.core.array, got ndarray$"):
        rmlx.rope_pool_fused(*args[:3], to_mx(pos), *args[4:], **plain,
                             k_norm_weight=np.ones(128, np.float32))


def test_fusions_under_mx_compile_with_donation(rng):
    """Qwen3-VL's norm and interleaved mRoPE under mx.compile (the schedule made once): the
    eager bits; pools nothing else references are donated with the weights as inputs too."""
    cfg = dict(QWEN3_VL_4B, num_qo_heads=4, num_kv_heads=2)
    T, P = 10, 4096
    a = _inputs(rng, cfg, T, "float16", P=P)
    positions = _mrope_positions(rng, T, "int64")
    w = weights(rng, torch.float16)
    schedule = ropepool.rope_schedule(head_dim=128, rope_base=cfg["rope_base"],
                                      rope_scaling=cfg["rope_scaling"])
    kw = dict({n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")},
              schedule=schedule, norm_eps=1e-6)
    _, want = both(a, positions, dict(kw, **w))

    @mx.compile
    def step(q, k, v, positions, slots, k_pool, v_pool, q_w, k_w):
        return rmlx.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw,
                                    q_norm_weight=q_w, k_norm_weight=k_w)

    ins = [to_mx(x) for x in (a["q"], a["k"], a["v"], positions, a["slots"])]
    k_pool, v_pool = to_mx(a["k_pool"]), to_mx(a["v_pool"])
    mx.eval(k_pool, v_pool)
    at = address(k_pool), address(v_pool)
    got = step(*ins, k_pool, v_pool, to_mx(w["q_norm_weight"]), to_mx(w["k_norm_weight"]))
    del k_pool, v_pool
    mx.eval(*got)
    assert (address(got[2]), address(got[3])) == at
    assert_same_bits(got, want)
