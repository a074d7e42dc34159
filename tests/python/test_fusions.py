"""SPEC §7: QK RMSNorm before RoPE (Qwen3, Gemma 3) and multimodal RoPE (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL), fused into rope_pool_fused.

The oracles are transformers' own modules: Qwen3RMSNorm, Gemma3RMSNorm and
Qwen3VLTextRMSNorm for the norm, and the Qwen2-VL / Qwen2.5-VL / Qwen3-VL code that picks
each frequency's position axis (apply_multimodal_rotary_pos_emb, apply_interleaved_mrope),
fed float64 angles so the rotation is exact. Configurations are the published config.json
values of the models named. What is checked, per call:

- the norm: ropepool's normalised head (read back from a call at position 0, where the
  rotation is the identity) is within one ulp of transformers' module output (SPEC §7: a
  value on a rounding midpoint may move by one ulp with the float32 summation order);
- the rotation: every q_rot/k_rot element within SPEC §1's bound of the exact rotation of
  ropepool's normalised head, and within 2 ulp (+ the §1 float32 term, + the effect of
  a one-ulp difference of the norm where there is one) of the exact rotation of
  transformers' output;
- the pool: rows named by slots hold k_rot and raw v bit for bit; every other row and the
  inputs are unchanged.

The transformers API differs between 4.x and 5.x (config keys, method vs function); the
helpers below look it up at run time.
"""

import importlib
import inspect
import types

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import TORCH_DTYPES, raw_bits, to_f64, ulp
# SPEC §6's cache builder (poisoned allocations with guard regions), contract check and e4m3 rule
from test_caches import (FP8, build_cache, check_call, e4m3_ordinal, make_inputs, pool_rows,
                         spec_e4m3)

transformers = pytest.importorskip("transformers")

# ---- the models' published config.json values ---------------------------------------------

# Qwen/Qwen3-4B config.json: head_dim 128, 32 query / 8 kv heads, rope_theta 5e6, rms_norm_eps
# 1e-6 (q_norm/k_norm: Qwen3RMSNorm over head_dim).
QWEN3_4B = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=5e6, eps=1e-6)
# google/gemma-3-4b-it text_config: head_dim 256, 8 query / 4 kv heads, rms_norm_eps 1e-6;
# global layers rope_theta 1e6 with rope_scaling {"rope_type": "linear", "factor": 8.0},
# local (sliding) layers rope_local_base_freq 10000. q_norm/k_norm: Gemma3RMSNorm.
GEMMA3_4B_GLOBAL = dict(head_dim=256, num_qo_heads=8, num_kv_heads=4, rope_base=1e6, eps=1e-6,
                        rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA3_4B_LOCAL = dict(head_dim=256, num_qo_heads=8, num_kv_heads=4, rope_base=10000.0, eps=1e-6)
# Qwen/Qwen2-VL-7B-Instruct: hidden 3584 / 28 heads = head_dim 128, 4 kv heads, rope_theta
# 1e6, rope_scaling {"type": "mrope", "mrope_section": [16, 24, 24]}.
QWEN2_VL_7B = dict(head_dim=128, num_qo_heads=28, num_kv_heads=4, rope_base=1e6,
                   rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
# Qwen/Qwen2.5-VL-7B-Instruct: the same geometry and sections, rope_theta 1e6.
QWEN2_5_VL_7B = dict(head_dim=128, num_qo_heads=28, num_kv_heads=4, rope_base=1e6,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
# Qwen/Qwen3-VL-4B-Instruct text_config: head_dim 128, 32 / 8 heads, rope_theta 5e6,
# rms_norm_eps 1e-6, rope_scaling {"mrope_interleaved": true, "mrope_section": [24, 20, 20],
# "rope_type": "default"}; q_norm/k_norm as Qwen3.
QWEN3_VL_4B = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=5e6, eps=1e-6,
                   rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                 "rope_type": "default"})

DTYPES = ["float32", "float16", "bfloat16"]


# ---- transformers, looked up at run time --------------------------------------------------

def _module(path):
    try:
        return importlib.import_module(path)
    except ImportError:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {path}")


def _norm_module(kind, D, eps, weight):
    """transformers' own norm module with `weight` (a torch tensor) as its parameter."""
    if kind == "qwen3":
        cls = _module("transformers.models.qwen3.modeling_qwen3").Qwen3RMSNorm
    elif kind == "qwen3_vl":
        cls = _module("transformers.models.qwen3_vl.modeling_qwen3_vl").Qwen3VLTextRMSNorm
    else:
        cls = _module("transformers.models.gemma3.modeling_gemma3").Gemma3RMSNorm
    params = inspect.signature(cls.__init__).parameters
    norm = cls(D, eps=eps) if "eps" in params else cls(D, eps)
    norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return norm


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _inv_freq(rope_base, R, factor=1.0):
    """float64 inverse frequencies (default schedule; linear: divided by factor)."""
    return float(rope_base) ** (-np.arange(0, R, 2, dtype=np.float64) / R) / factor


# Each model's text rotary-embedding class (transformers 5.x picks the axes there).
_MROPE_ROTARY = {"qwen2_vl": "Qwen2VLRotaryEmbedding", "qwen2_5_vl": "Qwen2_5_VLRotaryEmbedding",
                 "qwen3_vl": "Qwen3VLTextRotaryEmbedding"}


def _hf_mrope_freqs(mod, model, theta, section, interleaved):
    """transformers' choice of each frequency's position axis, applied to theta [3, 1, T, R/2]
    (float64): [1, T, R] (the half repeated, as its cos/sin tables are), found at run time:
    - 4.x, Qwen2-VL / Qwen2.5-VL: apply_multimodal_rotary_pos_emb picks the axes while it
      rotates (None here: the caller rotates with it);
    - 4.x, Qwen3-VL: apply_interleaved_mrope (a function, or in 4.57 a method of the rotary
      embedding that does not use self);
    - 5.x: the rotary embedding's recomposition_frequencies(freq), a method that reads only
      self.mrope_section. `mod`: the model's transformers module."""
    cls = getattr(mod, _MROPE_ROTARY[model], None)
    recompose = getattr(cls, "recomposition_frequencies", None)
    if recompose is not None:
        return recompose(types.SimpleNamespace(mrope_section=list(section)), theta.clone())
    if not interleaved:
        return None
    fn = getattr(mod, "apply_interleaved_mrope", None)
    if fn is None:
        fn = lambda f, s: cls.apply_interleaved_mrope(None, f, s)  # noqa: E731
    freqs = fn(theta.clone(), list(section))                       # [1, T, R/2]
    return torch.cat((freqs, freqs), dim=-1)


def _hf_mrope_exact(model, x, positions, inv_freq, section, interleaved):
    """x [T, H, D] (float64 torch) rotated by transformers' mRoPE code in float64:
    theta[a, t, i] = positions[a, t] * inv_freq[i] exactly; transformers picks each
    frequency's axis."""
    pos = torch.from_numpy(to_f64(positions))                       # [3, T]
    theta = pos[:, None, :, None] * torch.from_numpy(inv_freq)      # [3, 1, T, R/2]
    xb = x.transpose(0, 1)[None]                                    # [1, H, T, D]
    mod = _module(f"transformers.models.{model}.modeling_{model}")
    emb = _hf_mrope_freqs(mod, model, theta, section, interleaved)  # [1, T, D]
    if emb is not None:
        out = mod.apply_rotary_pos_emb(xb, xb, emb.cos(), emb.sin())[0]
    else:
        emb = torch.cat((theta, theta), dim=-1)                     # [3, 1, T, D]
        out = mod.apply_multimodal_rotary_pos_emb(xb, xb, emb.cos(), emb.sin(), list(section))[0]
    return out[0].transpose(0, 1)                                   # [T, H, D]


def _exact_plain(x, positions, inv_freq, scale=1.0):
    """float64 NeoX rotation of x [T, H, D] at 1-D positions."""
    theta = torch.from_numpy(to_f64(positions))[:, None] * torch.from_numpy(inv_freq)
    emb = torch.cat((theta, theta), dim=-1)[:, None]                # [T, 1, D]
    return x * (emb.cos() * scale) + _rotate_half(x) * (emb.sin() * scale)


# ---- checks -----------------------------------------------------------------------------

def _ulps(got, want, dtype):
    return np.abs(to_f64(got) - to_f64(want)) / ulp(to_f64(want), dtype)


def _assert_norm_close(y, x, kind, eps, w, dtype, what):
    """ropepool's normalised head y against transformers' norm module `kind` with weight w
    applied to the input x (SPEC §7). A float32 rsqrt that differs in its last bit (the
    summation order) moves x * rsqrt across a rounding midpoint only rarely in
    float16/bfloat16: there the normalised value n differs by one ulp. "gemma" rounds once,
    so the result differs by that ulp. The Qwen norms ("rms") then multiply n by w and round
    again: with n_tf transformers' n (its module with a weight of ones), the two results,
    each w * n rounded to nearest, differ by at most |w| ulp(n_tf) plus half an ulp of each
    (plus 2^-23 relative where a float32 weight makes the product round through float32
    first). In float32 the rsqrt's last bit reaches every element of the head: relative
    2^-20 at most (the float32 sums of squares in two orders, three float32 roundings)."""
    t = TORCH_DTYPES[dtype]
    D = x.shape[-1]
    with torch.no_grad():
        y_tf = _norm_module(kind, D, eps, w)(x).to(t)
    g, e = to_f64(y), to_f64(y_tf)
    if dtype == "float32":
        rel = np.abs(g - e) / np.abs(e)
        assert np.nanmax(rel) <= 2.0**-20, f"{what}: relative {np.nanmax(rel):.3g} from transformers"
        return y_tf
    if kind == "gemma3":
        bound = ulp(e, dtype)
    else:
        with torch.no_grad():
            n_tf = to_f64(_norm_module(kind, D, eps, torch.ones_like(w))(x).to(t))
        bound = (np.abs(to_f64(w)) * ulp(n_tf, dtype) + 0.5 * (ulp(g, dtype) + ulp(e, dtype))
                 + 2.0**-23 * np.abs(e))
    bad = np.abs(g - e) > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} values beyond the bound"
    differ = (g != e).mean()
    assert differ < 0.01, f"{what}: {differ:.2%} of the values differ"
    return y_tf


def _pair_sum(x):
    """|a| + |b| of each element's NeoX pair, for x [T, H, D] (float64 numpy)."""
    h = x.shape[-1] // 2
    s = np.abs(x[..., :h]) + np.abs(x[..., h:])
    return np.concatenate([s, s], axis=-1)


def _assert_close(got, exact, y, dtype, what, extra=0.0, ulps=1):
    """|got - exact| <= ulps * ulp(exact) + 2^-18 (|a| + |b|) (+ extra) everywhere."""
    g, e = to_f64(got), to_f64(exact)
    bound = ulps * ulp(e, dtype) + 2.0**-18 * _pair_sum(to_f64(y)) + extra
    bad = ~(np.abs(g - e) <= bound)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements outside the "
                             f"bound; first at {i}: got {g[i]!r}, exact {e[i]!r}, "
                             f"bound {bound[i]:.3g}")


def _assert_same(got, want, device, what):
    """Bit for bit on the CPU (one kernel). On CUDA a call with a norm weight runs the norm
    kernel and one without runs the main kernel, which may contract a*c - b*s into fused
    multiply-adds differently: one ulp of the result there, plus one float32 ulp of the
    products (at most 2x the head's largest element, since the rotation keeps each pair's
    norm), which is more than one ulp of a float32 result where a*c - b*s cancels."""
    if device != "cuda":
        np.testing.assert_array_equal(raw_bits(got), raw_bits(want), what)
        return
    dtype = str(got.dtype).removeprefix("torch.")
    g, w = to_f64(got), to_f64(want)
    products = ulp(2 * np.abs(w).max(axis=-1, keepdims=True), "float32")
    assert (np.abs(g - w) <= ulp(w, dtype) + products).all(), \
        f"{what}: more than one ulp (+ the products' float32 ulp) apart"


def _assert_pool(k_pool, v_pool, before, slots, k_rot, v):
    slots = np.asarray(slots, dtype=np.int64)
    tokens = np.nonzero(slots >= 0)[0]
    rows = slots[tokens]
    kp, vp = raw_bits(k_pool), raw_bits(v_pool)
    np.testing.assert_array_equal(kp[rows], raw_bits(k_rot)[tokens], "k_pool rows != k_rot")
    np.testing.assert_array_equal(vp[rows], raw_bits(v)[tokens], "v_pool rows != raw v")
    other = np.setdiff1d(np.arange(kp.shape[0]), rows)
    np.testing.assert_array_equal(kp[other], before["k_pool"][other], "other k_pool rows changed")
    np.testing.assert_array_equal(vp[other], before["v_pool"][other], "other v_pool rows changed")


def _inputs(rng, cfg, T, dtype, P=None):
    D, Hq, Hk = cfg["head_dim"], cfg["num_qo_heads"], cfg["num_kv_heads"]
    P = P or 2 * T + 7
    t = TORCH_DTYPES[dtype]

    def values(shape):  # several binades per head, never zero
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-2, 3, size=shape[:-1] + (1,)))
        return torch.from_numpy(x).to(t)

    slots = rng.permutation(P)[:T]
    slots[rng.random(T) < 0.2] = -1
    return dict(q=values((T, Hq, D)), k=values((T, Hk, D)), v=values((T, Hk, D)),
                k_pool=values((P, Hk, D)), v_pool=values((P, Hk, D)),
                slots=torch.from_numpy(slots.astype(np.int32)))


def _kw(cfg, **extra):
    kw = {n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")}
    if "rope_scaling" in cfg:
        kw["rope_scaling"] = dict(cfg["rope_scaling"])
    kw.update(extra)
    return kw


def _call(a, positions, kw, device="cpu"):
    """One call on fresh pools; returns (q_rot, k_rot, k_pool, v_pool, pool bits before)."""
    k_pool, v_pool = a["k_pool"].clone().to(device), a["v_pool"].clone().to(device)
    before = {"k_pool": raw_bits(k_pool), "v_pool": raw_bits(v_pool)}
    ins = {n: a[n].to(device) for n in ("q", "k", "v", "slots")}
    snap = {n: raw_bits(x) for n, x in ins.items()}
    kw = {n: (w.to(device) if isinstance(w, torch.Tensor) else w) for n, w in kw.items()}
    q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
        ins["q"], ins["k"], ins["v"], positions.to(device), ins["slots"], k_pool, v_pool, **kw)
    assert kp is k_pool and vp is v_pool
    for n, x in ins.items():
        np.testing.assert_array_equal(raw_bits(x), snap[n], f"{n} was modified")
    return q_rot.cpu(), k_rot.cpu(), k_pool.cpu(), v_pool.cpu(), before


# ---- QK norm: Qwen3 ("rms") and Gemma 3 ("gemma") -----------------------------------------

NORM_CASES = [
    ("qwen3", QWEN3_4B, "rms"),
    ("gemma3_global", GEMMA3_4B_GLOBAL, "gemma"),
    ("gemma3_local", GEMMA3_4B_LOCAL, "gemma"),
]


@pytest.mark.parametrize("weight_dtype", ["input", "float32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,cfg,style", NORM_CASES, ids=[c[0] for c in NORM_CASES])
@pytest.mark.parametrize("T", [5, 300])
def test_qk_norm_matches_transformers(kernel_device, rng, name, cfg, style, dtype,
                                      weight_dtype, T):
    D = cfg["head_dim"]
    a = _inputs(rng, cfg, T, dtype)
    wt = TORCH_DTYPES[dtype] if weight_dtype == "input" else torch.float32
    # Qwen3's trained weights sit around 1 (w * x), Gemma's around 0 ((1 + w) * x).
    centre = 1.0 if style == "rms" else 0.0
    q_w = torch.from_numpy(centre + 0.5 * rng.standard_normal(D)).to(wt)
    k_w = torch.from_numpy(centre + 0.5 * rng.standard_normal(D)).to(wt)
    eps = cfg["eps"]
    positions = torch.from_numpy(rng.integers(0, 2**17, size=T).astype(np.int64))
    norm_kw = dict(q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=eps, norm_style=style)
    q_rot, k_rot, k_pool, v_pool, before = _call(a, positions, _kw(cfg, **norm_kw),
                                                 kernel_device)
    # ropepool's normalised heads: the same call at position 0 (the identity rotation)
    zero = torch.zeros(T, dtype=torch.int64)
    q_y, k_y, *_ = _call(a, zero, _kw(cfg, **norm_kw), kernel_device)

    kind = "qwen3" if style == "rms" else "gemma3"
    factor = cfg.get("rope_scaling", {}).get("factor", 1.0)
    inv_freq = _inv_freq(cfg["rope_base"], D, factor)
    for x, w, rot, y, what in ((a["q"], q_w, q_rot, q_y, "q"), (a["k"], k_w, k_rot, k_y, "k")):
        y_tf = _assert_norm_close(y, x, kind, eps, w, dtype, f"{what}: {kind} norm")
        # the rotation of ropepool's own normalised values: SPEC §1's bound
        y64 = torch.from_numpy(to_f64(y))
        _assert_close(rot, _exact_plain(y64, positions, inv_freq), y64, dtype,
                      f"{what}_rot vs the exact rotation of the normalised head")
        # against transformers' module + the exact rotation: 2 ulp, plus where the norm
        # itself differed by its one ulp, that difference carried through the rotation
        ytf64 = torch.from_numpy(to_f64(y_tf))
        diff = _pair_sum(np.abs(to_f64(y) - to_f64(y_tf)))
        _assert_close(rot, _exact_plain(ytf64, positions, inv_freq), ytf64, dtype,
                      f"{what}_rot vs transformers' {kind} norm + exact rotation",
                      extra=diff, ulps=2)
    _assert_pool(k_pool, v_pool, before, a["slots"].numpy(), k_rot, a["v"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_then_plain_rope_is_bit_identical(kernel_device, rng, dtype):
    """Fused norm + RoPE == ropepool's plain RoPE of the normalised heads, bit for bit, with
    the §4 keywords that change the rotation (partial rotary, GPT-J pairs, yarn, in place)."""
    cfg = dict(QWEN3_4B, num_qo_heads=6, num_kv_heads=2)
    T, D = 33, cfg["head_dim"]
    a = _inputs(rng, cfg, T, dtype)
    w = {n: torch.from_numpy(1 + 0.3 * rng.standard_normal(D)).to(TORCH_DTYPES[dtype])
         for n in ("q_norm_weight", "k_norm_weight")}
    positions = torch.from_numpy(rng.integers(0, 2**20, size=T).astype(np.int32))
    zero = torch.zeros(T, dtype=torch.int32)
    for extra in (dict(), dict(rotary_dim=64), dict(interleaved=True),
                  dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768}),
                  dict(norm_style="gemma", norm_eps=1e-5)):
        kw = _kw(cfg, **w, **extra)
        q_rot, k_rot, k_pool, _, _ = _call(a, positions, kw, kernel_device)
        # The normalised heads: the same call at position 0 (a rotation by zero), with the
        # same head geometry, so that on CUDA the same kernel normalises both (the main
        # kernel's norm and the fusion kernels sum a head's squares in different orders,
        # which may move a normalised value by the one ulp SPEC §7 allows).
        same_geometry = {n: extra[n] for n in extra
                         if n.startswith("norm") or n in ("rotary_dim", "interleaved")}
        q_y, k_y, *_ = _call(a, zero, _kw(cfg, **w, **same_geometry), kernel_device)
        plain = {n: v for n, v in extra.items() if not n.startswith("norm")}
        b = dict(a, q=q_y, k=k_y)
        q_p, k_p, *_ = _call(b, positions, _kw(cfg, **plain), kernel_device)
        _assert_same(q_rot, q_p, kernel_device, f"q {extra}")
        _assert_same(k_rot, k_p, kernel_device, f"k {extra}")
    # in place: the same bits written into q and k
    q, k = a["q"].clone().to(kernel_device), a["k"].clone().to(kernel_device)
    kw = _kw(cfg, **{n: t.to(kernel_device) for n, t in w.items()})
    ropepool.rope_pool_fused(q, k, a["v"].to(kernel_device), positions.to(kernel_device),
                             a["slots"].to(kernel_device), a["k_pool"].clone().to(kernel_device),
                             a["v_pool"].clone().to(kernel_device), inplace=True, **kw)
    q_rot, k_rot, *_ = _call(a, positions, _kw(cfg, **w), kernel_device)
    np.testing.assert_array_equal(raw_bits(q.cpu()), raw_bits(q_rot))
    np.testing.assert_array_equal(raw_bits(k.cpu()), raw_bits(k_rot))


def test_only_k_or_only_q_normalised(kernel_device, rng):
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)
    T, D = 9, cfg["head_dim"]
    a = _inputs(rng, cfg, T, "bfloat16")
    w = torch.from_numpy(1 + 0.3 * rng.standard_normal(D)).to(torch.bfloat16)
    positions = torch.from_numpy(rng.integers(0, 4096, size=T).astype(np.int32))
    plain_q, plain_k, *_ = _call(a, positions, _kw(cfg), kernel_device)
    q_only_q, q_only_k, *_ = _call(a, positions, _kw(cfg, q_norm_weight=w), kernel_device)
    k_only_q, k_only_k, *_ = _call(a, positions, _kw(cfg, k_norm_weight=w), kernel_device)
    _assert_same(q_only_k, plain_k, kernel_device, "k without its norm")
    _assert_same(k_only_q, plain_q, kernel_device, "q without its norm")
    assert not np.array_equal(raw_bits(q_only_q), raw_bits(plain_q))
    assert not np.array_equal(raw_bits(k_only_k), raw_bits(plain_k))


# ---- multimodal RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL --------------------------------------

def _mrope_positions(rng, T, index_dtype):
    """A vision block (a t x h x w grid) between text tokens, as Qwen2-VL's get_rope_index
    makes them: text rows equal, grid rows apart; offsets up to 2^17."""
    base = int(rng.integers(0, 2**17))
    pos = np.empty((3, T), dtype=np.int64)
    n_text = T // 3
    pos[:, :n_text] = base + np.arange(n_text)
    grid = T - 2 * n_text
    h = max(1, int(np.sqrt(grid)))
    idx = np.arange(grid)
    pos[0, n_text:n_text + grid] = base + n_text + idx // (h * h)
    pos[1, n_text:n_text + grid] = base + n_text + (idx // h) % h
    pos[2, n_text:n_text + grid] = base + n_text + idx % h
    start = pos[:, n_text + grid - 1].max() + 1
    pos[:, n_text + grid:] = start + np.arange(T - n_text - grid)
    return torch.from_numpy(pos.astype(index_dtype))


MROPE_CASES = [
    ("qwen2_vl", QWEN2_VL_7B, False),
    ("qwen2_5_vl", QWEN2_5_VL_7B, False),
    ("qwen3_vl", QWEN3_VL_4B, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model,cfg,interleaved", MROPE_CASES, ids=[c[0] for c in MROPE_CASES])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_mrope_matches_transformers(kernel_device, rng, model, cfg, interleaved, dtype,
                                    index_dtype):
    T, D = 70, cfg["head_dim"]
    a = _inputs(rng, cfg, T, dtype)
    positions = _mrope_positions(rng, T, index_dtype)
    section = cfg["rope_scaling"]["mrope_section"]
    extra = {}
    if model == "qwen3_vl":  # the real model normalises q and k too (Qwen3VLTextRMSNorm)
        extra = dict(q_norm_weight=torch.from_numpy(1 + 0.3 * rng.standard_normal(D))
                     .to(TORCH_DTYPES[dtype]),
                     k_norm_weight=torch.from_numpy(1 + 0.3 * rng.standard_normal(D))
                     .to(TORCH_DTYPES[dtype]), norm_eps=cfg["eps"])
    q_rot, k_rot, k_pool, v_pool, before = _call(a, positions, _kw(cfg, **extra), kernel_device)
    inv_freq = _inv_freq(cfg["rope_base"], D)
    for name, rot in (("q", q_rot), ("k", k_rot)):
        x = a[name]
        if extra:
            # ropepool's normalised head (position 0, the identity rotation) against
            # transformers' Qwen3VLTextRMSNorm: within one ulp
            zero = torch.zeros((3, T), dtype=positions.dtype)
            y = _call(a, zero, _kw(cfg, **extra), kernel_device)[0 if name == "q" else 1]
            _assert_norm_close(y, x, "qwen3_vl", cfg["eps"], extra[f"{name}_norm_weight"],
                               dtype, f"{name}: qwen3_vl norm")
            x = y
        x64 = torch.from_numpy(to_f64(x))
        exact = _hf_mrope_exact(model, x64, positions, inv_freq, section, interleaved)
        _assert_close(rot, exact, x64, dtype, f"{model} {name}_rot")
    _assert_pool(k_pool, v_pool, before, a["slots"].numpy(), k_rot, a["v"])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_text_only_mrope_is_the_plain_result(kernel_device, rng, dtype, interleaved):
    """Three equal position rows: exactly the bits of the plain call with 1-D positions,
    also through a strided [3, T] view and the rope_scaling dict."""
    cfg = dict(QWEN3_VL_4B, num_qo_heads=8, num_kv_heads=2)
    T = 41
    a = _inputs(rng, cfg, T, dtype)
    pos1 = torch.from_numpy(rng.integers(0, 2**20, size=T).astype(np.int64))
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    plain = _call(a, pos1, _kw(dict(cfg, rope_scaling={"rope_type": "default"})), kernel_device)
    pos3 = pos1[None].expand(3, T).contiguous()
    strided = pos1[:, None].expand(T, 3).contiguous().t()  # [3, T], strides (1, 3)
    assert strided.stride() == (1, 3)
    for positions, kw in (
            (pos3, dict(mrope_section=section, mrope_interleaved=interleaved)),
            (strided, dict(mrope_section=section, mrope_interleaved=interleaved)),
            (pos3, dict(rope_scaling={"rope_type": "default", "mrope_section": section,
                                      "mrope_interleaved": interleaved}))):
        base = {n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")}
        got = _call(a, positions, dict(base, **kw), kernel_device)
        for i, what in enumerate(("q_rot", "k_rot", "k_pool", "v_pool")):
            np.testing.assert_array_equal(raw_bits(got[i]), raw_bits(plain[i]), what)


@pytest.mark.parametrize("model", ["qwen2-vl", "qwen3-vl"])
def test_mrope_on_the_eager_fast_path(kernel_device, rng, monkeypatch, model):
    """The models' rope_scaling dicts (a list inside) passed on every call: the first call
    makes the schedule, later ones take the fast path with its mRoPE sections, bit for bit
    the first call and schedule=; a changed section list makes its own schedule."""
    import ropepool._op as op
    monkeypatch.setattr(op, "_FAST_GEOMETRIES", set())
    monkeypatch.setattr(op, "_SCALING_SCHEDULES", {})
    taken = []
    fast = op._fast_keyword_call
    monkeypatch.setattr(op, "_fast_keyword_call", lambda *a: taken.append(a[-1]) or fast(*a))
    cfg = dict(QWEN2_VL_7B if model == "qwen2-vl" else QWEN3_VL_4B, num_qo_heads=4,
               num_kv_heads=2)
    T = 9
    a = _inputs(rng, cfg, T, "bfloat16")
    positions = torch.from_numpy(rng.integers(0, 2**16, size=(3, T)).astype(np.int64))
    base = {n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")}
    scaling = {k: (list(v) if isinstance(v, list) else v) for k, v in cfg["rope_scaling"].items()}
    runs = [_call(a, positions, dict(base, rope_scaling=scaling), kernel_device)]
    assert taken == []
    runs.append(_call(a, positions, dict(base, rope_scaling=scaling), kernel_device))
    assert len(taken) == 1 and taken[-1].mrope_section == tuple(scaling["mrope_section"])
    sched = ropepool.rope_schedule(head_dim=128, rope_base=cfg["rope_base"], rope_scaling=scaling)
    runs.append(_call(a, positions, dict(base, schedule=sched), kernel_device))
    assert len(taken) == 2 and taken[-1] is sched
    for run in runs[1:]:
        for i, what in enumerate(("q_rot", "k_rot", "k_pool", "v_pool")):
            np.testing.assert_array_equal(raw_bits(run[i]), raw_bits(runs[0][i]), what)
    scaling["mrope_section"] = scaling["mrope_section"][::-1]  # another split of the frequencies
    other = _call(a, positions, dict(base, rope_scaling=scaling), kernel_device)
    assert len(taken) == 2, "a changed list is a new key"
    assert not np.array_equal(raw_bits(other[0]), raw_bits(runs[0][0]))


def test_mrope_schedule_object(rng):
    """A schedule made once carries mrope_section; keyword, dict and schedule agree."""
    cfg = QWEN2_VL_7B
    s = ropepool.rope_schedule(head_dim=128, rope_base=1e6, rope_scaling=cfg["rope_scaling"])
    assert s.mrope_section == (16, 24, 24) and s.mrope_interleaved is False
    T = 12
    a = _inputs(rng, cfg, T, "bfloat16")
    positions = _mrope_positions(rng, T, "int64")
    via_dict = _call(a, positions, _kw(cfg))
    base = {n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")}
    via_schedule = _call(a, positions, dict(base, schedule=s))
    via_keyword = _call(a, positions, dict(base, mrope_section=[16, 24, 24]))
    for i in range(4):
        np.testing.assert_array_equal(raw_bits(via_dict[i]), raw_bits(via_schedule[i]))
        np.testing.assert_array_equal(raw_bits(via_dict[i]), raw_bits(via_keyword[i]))


def _hf_text_rope(model, cfg):
    """(rope_theta, rope dict) as this transformers' own config class holds them for the
    model's config.json values: 5.x keeps both in text_config.rope_parameters (for Qwen2-VL
    {"type": "mrope", "rope_type": "default", ...}), 4.x in rope_theta and rope_scaling."""
    names = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig",
             "qwen3_vl": "Qwen3VLConfig"}
    cls = getattr(transformers, names[model], None)
    if cls is None:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {names[model]}")
    text = dict(head_dim=cfg["head_dim"], hidden_size=cfg["head_dim"] * cfg["num_qo_heads"],
                num_attention_heads=cfg["num_qo_heads"], num_key_value_heads=cfg["num_kv_heads"],
                rope_theta=cfg["rope_base"], rope_scaling=dict(cfg["rope_scaling"]))
    c = cls(text_config=text).text_config
    params = getattr(c, "rope_parameters", None)
    if params is not None:
        return params["rope_theta"], dict(params)
    return c.rope_theta, dict(c.rope_scaling)


@pytest.mark.parametrize("model,cfg,interleaved", MROPE_CASES, ids=[c[0] for c in MROPE_CASES])
def test_mrope_from_the_transformers_config(rng, model, cfg, interleaved):
    """The rope dict straight from the installed transformers' config object (what an engine
    passes): the same bits as the mrope_section / mrope_interleaved keywords."""
    rope_base, rope = _hf_text_rope(model, cfg)
    assert rope_base == cfg["rope_base"]
    T = 23
    a = _inputs(rng, cfg, T, "bfloat16")
    positions = _mrope_positions(rng, T, "int64")
    base = {n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base")}
    via_config = _call(a, positions, dict(base, rope_scaling=rope))
    via_keywords = _call(a, positions, dict(base, mrope_section=cfg["rope_scaling"]["mrope_section"],
                                            mrope_interleaved=interleaved))
    for i in range(4):
        np.testing.assert_array_equal(raw_bits(via_config[i]), raw_bits(via_keywords[i]))


# ---- validation (SPEC §7): ValueErrors naming the keyword, nothing written --------------------

def _bad_call(a, positions, kw):
    k_pool, v_pool = a["k_pool"].clone(), a["v_pool"].clone()
    before = raw_bits(k_pool), raw_bits(v_pool)
    with pytest.raises(ValueError) as e:
        ropepool.rope_pool_fused(a["q"], a["k"], a["v"], positions, a["slots"], k_pool, v_pool,
                                 **kw)
    np.testing.assert_array_equal(raw_bits(k_pool), before[0])
    np.testing.assert_array_equal(raw_bits(v_pool), before[1])
    with pytest.raises(ValueError) as e2:  # validate_rope_pool says the same
        ropepool.validate_rope_pool(a["q"], a["k"], a["v"], positions, a["slots"], k_pool,
                                    v_pool, **kw)
    assert str(e2.value) == str(e.value)
    return str(e.value)


def test_fusion_keywords_are_validated(rng):
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)
    T, D = 6, 128
    a = _inputs(rng, cfg, T, "bfloat16")
    pos = torch.arange(T, dtype=torch.int32)
    w = torch.ones(D, dtype=torch.bfloat16)
    kw = _kw(cfg)
    assert _bad_call(a, pos, dict(kw, norm_eps=1e-5)) == (
        "rope_pool_fused: norm_eps is given but neither q_norm_weight nor k_norm_weight")
    assert _bad_call(a, pos, dict(kw, norm_style="gemma")) == (
        "rope_pool_fused: norm_style is given but neither q_norm_weight nor k_norm_weight")
    assert _bad_call(a, pos, dict(kw, q_norm_weight=torch.ones(64, dtype=torch.bfloat16))) == (
        "rope_pool_fused: q_norm_weight must be [head_dim] = [128], got [64]")
    assert _bad_call(a, pos, dict(kw, k_norm_weight=torch.ones(D, dtype=torch.float16))) == (
        "rope_pool_fused: k_norm_weight must be bfloat16 (q's dtype) or float32, got float16")
    assert _bad_call(a, pos, dict(kw, k_norm_weight=torch.ones(2 * D, dtype=torch.bfloat16)[::2])
                     ) == "rope_pool_fused: k_norm_weight must be contiguous, got stride 2"
    for eps in (0.0, -1e-6, float("inf"), float("nan"), 1e-50):
        assert _bad_call(a, pos, dict(kw, q_norm_weight=w, norm_eps=eps)).startswith(
            "rope_pool_fused: norm_eps must be finite and > 0")
    assert _bad_call(a, pos, dict(kw, q_norm_weight=w, norm_style="layer")) == (
        "rope_pool_fused: norm_style must be 'rms' or 'gemma', got 'layer'")
    # mRoPE: sections, positions shape
    assert _bad_call(a, torch.zeros((3, T), dtype=torch.int32),
                     dict(kw, mrope_section=[16, 24, 16])) == (
        "rope_pool_fused: mrope_section must be three non-negative integers summing to "
        "rotary_dim/2 = 64, got [16, 24, 16]")
    assert _bad_call(a, pos, dict(kw, mrope_section=[16, 24, 24])) == (
        "rope_pool_fused: with mrope_section, positions must be [3, num_tokens] (temporal, "
        "height and width rows), got torch.Size([6])")
    assert _bad_call(a, torch.zeros((3, T), dtype=torch.int32), kw) == (
        "rope_pool_fused expects positions/slots to be 1-D")
    assert _bad_call(a, torch.zeros((3, T + 1), dtype=torch.int32),
                     dict(kw, mrope_section=[16, 24, 24])) == (
        "positions/slots must have one entry per token")
    assert _bad_call(a, torch.zeros((3, T), dtype=torch.int32),
                     dict(kw, mrope_interleaved=True)) == (
        "rope_pool_fused: mrope_interleaved needs mrope_section")
    assert _bad_call(a, torch.zeros((3, T), dtype=torch.int32),
                     dict(kw, mrope_section=[16, 24, 24],
                          rope_scaling={"mrope_section": [24, 20, 20]})) == (
        "rope_pool_fused: rope_scaling['mrope_section'] = [24, 20, 20] differs from "
        "mrope_section = [16, 24, 24]")
    s = ropepool.rope_schedule(head_dim=D, rope_base=cfg["rope_base"])
    assert _bad_call(a, torch.zeros((3, T), dtype=torch.int32),
                     dict({n: cfg[n] for n in ("head_dim", "num_qo_heads", "num_kv_heads",
                                               "rope_base")},
                          schedule=s, mrope_section=[16, 24, 24])) == (
        "rope_pool_fused: schedule replaces mrope_section; pass them to rope_schedule, "
        "or drop schedule")
    with pytest.raises(TypeError, match="norm_style must be a str"):
        ropepool.rope_pool_fused(a["q"], a["k"], a["v"], pos, a["slots"], a["k_pool"],
                                 a["v_pool"], **kw, q_norm_weight=w, norm_style=1)


def test_norm_keywords_on_the_eager_fast_path(kernel_device, rng, monkeypatch):
    """Once the geometry is known, eager calls with the norm keywords (tensor weights, a
    float eps, a style) take the fast path with the same bits as the first (keyword
    machinery) call; bad values get the core's messages there; weights of another framework
    and a style that is not a str are still the slow path's TypeErrors."""
    import ropepool._op as op
    taken = []
    fast = op._fast_keyword_call
    monkeypatch.setattr(op, "_fast_keyword_call", lambda *a: taken.append(1) or fast(*a))
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2, rope_base=float(rng.integers(1, 10**6)))
    T, D = 7, cfg["head_dim"]
    a = _inputs(rng, cfg, T, "bfloat16")
    positions = torch.from_numpy(rng.integers(0, 2**20, size=T).astype(np.int32))
    weights = dict(q_norm_weight=torch.from_numpy(1 + 0.3 * rng.standard_normal(D)).float(),
                   k_norm_weight=torch.from_numpy(1 + 0.3 * rng.standard_normal(D)).to(torch.bfloat16))
    for extra in (dict(weights), dict(k_norm_weight=weights["k_norm_weight"], norm_eps=1e-5),
                  dict(weights, norm_style="gemma", return_k_rot=False, kv_layout=None)):
        runs = []
        for fast_path in (False, True):
            if not fast_path:
                monkeypatch.setattr(op, "_FAST_GEOMETRIES", set())
            n = len(taken)
            call = _call if extra.get("return_k_rot", True) else _call_without_k_rot
            q_rot, k_rot, k_pool, v_pool, _ = call(a, positions, _kw(cfg, **extra), kernel_device)
            assert len(taken) == n + fast_path, extra
            runs.append([None if x is None else raw_bits(x) for x in (q_rot, k_rot, k_pool, v_pool)])
        for name, slow, quick in zip(("q_rot", "k_rot", "k_pool", "v_pool"), *runs):
            assert (slow is None) == (quick is None), name
            if slow is not None:
                np.testing.assert_array_equal(slow, quick, f"{name} {extra}")
    n = len(taken)
    assert _bad_call(a, positions, _kw(cfg, **weights, norm_eps=0.0)).startswith(
        "rope_pool_fused: norm_eps must be finite and > 0")
    assert _bad_call(a, positions, _kw(cfg, **weights, norm_style="layer")) == (
        "rope_pool_fused: norm_style must be 'rms' or 'gemma', got 'layer'")
    assert len(taken) == n + 2  # (validate_rope_pool has no fast path)
    args = (a["q"], a["k"], a["v"], positions, a["slots"], a["k_pool"].clone(), a["v_pool"].clone())
    with pytest.raises(TypeError, match="norm_style must be a str"):
        ropepool.rope_pool_fused(*args, **_kw(cfg, **weights, norm_style=1))
    with pytest.raises(TypeError, match="q_norm_weight/k_norm_weight must be torch.Tensors"):
        ropepool.rope_pool_fused(*args, **_kw(cfg, q_norm_weight=weights["q_norm_weight"].numpy()))
    assert len(taken) == n + 2


def _call_without_k_rot(a, positions, kw, device):
    """_call with return_k_rot=False: k_rot is None and k unchanged."""
    k = a["k"].to(device)
    before = raw_bits(k)
    k_pool, v_pool = a["k_pool"].clone().to(device), a["v_pool"].clone().to(device)
    kw = {n: (w.to(device) if isinstance(w, torch.Tensor) else w) for n, w in kw.items()}
    q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
        a["q"].to(device), k, a["v"].to(device), positions.to(device), a["slots"].to(device),
        k_pool, v_pool, **kw)
    assert k_rot is None and kp is k_pool and vp is v_pool
    np.testing.assert_array_equal(raw_bits(k), before, "k was modified")
    return q_rot.cpu(), None, k_pool.cpu(), v_pool.cpu(), None


def test_fusion_weights_overlapping_an_output_are_rejected(rng):
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)
    T = 6
    a = _inputs(rng, cfg, T, "float32")
    pos = torch.arange(T, dtype=torch.int32)
    k_pool = a["k_pool"].clone()
    w = k_pool[0, 0]  # a row of the pool the op writes
    with pytest.raises(ValueError, match="k_pool and k_norm_weight overlap in memory"):
        ropepool.rope_pool_fused(a["q"], a["k"], a["v"], pos, a["slots"], k_pool,
                                 a["v_pool"].clone(), **_kw(cfg), k_norm_weight=w)


def test_fusions_under_torch_compile(rng):
    cfg = dict(QWEN3_VL_4B, num_qo_heads=4, num_kv_heads=2)
    T, D = 10, 128
    a = _inputs(rng, cfg, T, "bfloat16")
    positions = _mrope_positions(rng, T, "int64")
    w = torch.from_numpy(1 + 0.3 * rng.standard_normal(D)).to(torch.bfloat16)
    kw = _kw(cfg, q_norm_weight=w, k_norm_weight=w, norm_eps=1e-6)
    eager = _call(a, positions, kw)

    # the schedule (with its mrope_section) made once, outside the compiled step
    schedule = ropepool.rope_schedule(head_dim=D, rope_base=cfg["rope_base"],
                                      rope_scaling=cfg["rope_scaling"])
    compiled_kw = dict(kw, schedule=schedule)
    del compiled_kw["rope_scaling"]

    def step(q, k, v, positions, slots, k_pool, v_pool, w):
        return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool,
                                        **dict(compiled_kw, q_norm_weight=w, k_norm_weight=w))

    k_pool, v_pool = a["k_pool"].clone(), a["v_pool"].clone()
    q_rot, k_rot, _, _ = torch.compile(step, fullgraph=True)(
        a["q"], a["k"], a["v"], positions, a["slots"], k_pool, v_pool, w)
    np.testing.assert_array_equal(raw_bits(q_rot), raw_bits(eager[0]))
    np.testing.assert_array_equal(raw_bits(k_rot), raw_bits(eager[1]))
    np.testing.assert_array_equal(raw_bits(k_pool), raw_bits(eager[2]))


# ---- with SPEC §6's caches: paged pools, fp8 pools, fp8 q_rot ----------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_combines_with_caches_bit_for_bit_on_cpu(rng, dtype):
    """CPU: fused norm + RoPE into a paged NHD pool, fp8 pools and an fp8 q_rot gives the very
    bits of ropepool's plain call on the normalised heads (read back at position 0) with the
    same cache keywords (one kernel does both there; on CUDA the norm runs in the fusion kernel
    and the plain call in the main kernel, whose float32 rotation may contract differently:
    the tests below hold both backends to the float64 rotation and SPEC §6's e4m3 rule)."""
    device = "cpu"
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)
    T, D, Hk, P = 20, 128, 2, 64
    a = _inputs(rng, cfg, T, dtype, P=P)
    t = TORCH_DTYPES[dtype]
    w = {n: torch.from_numpy(1 + 0.3 * rng.standard_normal(D)).to(t)
         for n in ("q_norm_weight", "k_norm_weight")}
    positions = torch.from_numpy(rng.integers(0, 2**17, size=T).astype(np.int32))
    q_y, k_y, *_ = _call(a, torch.zeros(T, dtype=torch.int32), _kw(cfg, **w), device)
    fp8 = FP8
    variants = {
        "paged NHD": (lambda: (a["k_pool"].reshape(P // 16, 16, Hk, D).clone(),
                               a["v_pool"].reshape(P // 16, 16, Hk, D).clone()),
                      dict(kv_layout="NHD")),
        "fp8 pools": (lambda: (torch.zeros(P, Hk, D, dtype=fp8), torch.zeros(P, Hk, D, dtype=fp8)),
                      dict(k_scale=0.5, v_scale=2.0)),
        "fp8 q_rot": (lambda: (a["k_pool"].clone(), a["v_pool"].clone()),
                      dict(q_out_dtype=fp8, q_scale=0.25)),
    }
    for name, (pools, extra) in variants.items():
        kp, vp = pools()
        kw = _kw(cfg, **extra)
        q_rot, k_rot, _, _ = ropepool.rope_pool_fused(a["q"], a["k"], a["v"], positions, a["slots"],
                                                      kp, vp, **kw, **w)
        kp2, vp2 = pools()
        q_p, k_p, _, _ = ropepool.rope_pool_fused(q_y, k_y, a["v"], positions, a["slots"], kp2, vp2,
                                                  **kw)
        for got, want, what in ((q_rot, q_p, "q_rot"), (k_rot, k_p, "k_rot"), (kp, kp2, "k_pool"),
                                (vp, vp2, "v_pool")):
            np.testing.assert_array_equal(raw_bits(got), raw_bits(want), f"{name}: {what}")


def _normalised_heads(q, k, kw, norm_kw, device):
    """ropepool's normalised q and k heads: a call at position 0 (the identity rotation) with
    plain pools and no pool write; every variant normalises with the same code."""
    T, Hk, D = k.shape
    zero = torch.zeros(T, dtype=torch.int32, device=device)
    no_slot = torch.full((T,), -1, dtype=torch.int32, device=device)
    pool = torch.zeros(1, Hk, D, dtype=q.dtype, device=device)
    y_q, y_k, _, _ = ropepool.rope_pool_fused(q, k, k, zero, no_slot, pool, pool.clone(), **kw,
                                              **norm_kw)
    return y_q, y_k


LAYOUTS = [("NHD", 1), ("NHD", 16), ("NHD", 64), ("HND", 1), ("HND", 16), ("HND", 64)]


@pytest.mark.parametrize("q_fp8", [False, True], ids=["q_rot", "q_rot_fp8"])
@pytest.mark.parametrize("fp8_pool", [False, True], ids=["pools", "pools_fp8"])
@pytest.mark.parametrize("layout,page_size", LAYOUTS, ids=[f"{lay}{ps}" for lay, ps in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_with_every_cache_format(kernel_device, rng, dtype, layout, page_size, fp8_pool,
                                      q_fp8):
    """SPEC §7 x §6 on every backend: the QK norm into paged NHD/HND pools (page sizes 1, 16,
    64) in q's dtype or float8_e4m3fn, with q_rot in q's dtype or float8_e4m3fn. The pools
    live in a poisoned allocation with guard regions (test_caches.build_cache). ropepool's
    normalised heads (read back at position 0) are checked against transformers' module
    (within SPEC §7's one ulp); then the call is held to SPEC §6's contract as for the plain
    op (test_caches.check_call) with those heads as the rotation's input: q_rot/k_rot within
    SPEC §1's bound of their exact rotation, fp8 q_rot and k_pool within one e4m3 step of
    e4m3(exact / scale), v_pool rows raw v or e4m3(v / v_scale) bit for bit, k_pool rows k_rot
    bit for bit (q's dtype), every other byte of the allocation unchanged."""
    cfg = dict(QWEN3_4B, num_qo_heads=4, num_kv_heads=2)
    T, Hq, Hk, D = 24, cfg["num_qo_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    pages = (80 + page_size - 1) // page_size
    t = TORCH_DTYPES[dtype]
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, t, T, Hq, Hk, D,
                                                 pages * page_size)
    # Qwen3 "rms" with weights in q's dtype; Gemma "gemma" with float32 weights at page size 16
    style = "gemma" if page_size == 16 else "rms"
    wt = torch.float32 if style == "gemma" else t
    centre = 0.0 if style == "gemma" else 1.0
    w = {n: torch.from_numpy(centre + 0.2 * rng.standard_normal(D)).to(wt).to(kernel_device)
         for n in ("q_norm_weight", "k_norm_weight")}
    norm_kw = dict(w, norm_eps=cfg["eps"], norm_style=style)
    kw = _kw(cfg)
    y_q, y_k = _normalised_heads(q, k, kw, norm_kw, kernel_device)
    kind = "qwen3" if style == "rms" else "gemma3"
    for x, y, n in ((q, y_q, "q"), (k, y_k, "k")):
        weight = w[f"{n}_norm_weight"].cpu()
        _assert_norm_close(y.cpu(), x.cpu(), kind, cfg["eps"], weight, dtype, f"{n}: {kind} norm")

    k_pool, v_pool, arena = build_cache("own", layout, pages, page_size, Hk, D,
                                        FP8 if fp8_pool else t, kernel_device, gen)
    before = arena.cpu().clone()
    # scales as numbers, and (HND) as tensors read when the kernel runs
    scales = dict(k_scale=0.05, v_scale=0.5, q_scale=0.03)
    as_arg = {n: (torch.tensor([s], device=kernel_device) if layout == "HND" else s)
              for n, s in scales.items()}
    extra = dict(k_scale=as_arg["k_scale"], v_scale=as_arg["v_scale"]) if fp8_pool else {}
    if q_fp8:
        extra.update(q_out_dtype=FP8, q_scale=as_arg["q_scale"])
    out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, kv_layout=layout,
                                   **kw, **extra, **norm_kw)
    assert out[0].dtype == (FP8 if q_fp8 else t) and out[1].dtype == t
    check_call(y_q, y_k, v, positions, slots, k_pool, v_pool, before, arena, out, layout=layout,
               fp8=fp8_pool, k_scale=scales["k_scale"], v_scale=scales["v_scale"],
               rope_base=cfg["rope_base"], q_fp8=q_fp8, q_scale=scales["q_scale"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_mrope_with_fp8_paged_cache(kernel_device, rng, dtype):
    """Qwen3-VL as deployed with an FP8 attention kernel: its q/k norm and interleaved mRoPE,
    k and v into an fp8 HND paged cache, q_rot in fp8. Against transformers' mRoPE code on
    ropepool's normalised heads (float64 angles) and SPEC §6's e4m3 rule; pool rows that no
    token writes keep their bits."""
    cfg = dict(QWEN3_VL_4B, num_qo_heads=8, num_kv_heads=2)
    T, Hq, Hk, D, ps, pages = 40, 8, 2, cfg["head_dim"], 16, 6
    a = _inputs(rng, cfg, T, dtype, P=pages * ps)
    t = TORCH_DTYPES[dtype]
    dev = {n: a[n].to(kernel_device) for n in ("q", "k", "v", "slots")}
    positions = _mrope_positions(rng, T, "int64").to(kernel_device)
    section = cfg["rope_scaling"]["mrope_section"]
    w = {n: torch.from_numpy(1 + 0.2 * rng.standard_normal(D)).to(t).to(kernel_device)
         for n in ("q_norm_weight", "k_norm_weight")}
    norm_kw = dict(w, norm_eps=cfg["eps"])
    kw = _kw(cfg)
    # normalised heads: the same call at position 0 ([3, T] zeros), plain pools, no write
    zero = torch.zeros((3, T), dtype=torch.int64, device=kernel_device)
    pool = torch.zeros(1, Hk, D, dtype=t, device=kernel_device)
    no_slot = torch.full((T,), -1, dtype=torch.int32, device=kernel_device)
    y_q, y_k, _, _ = ropepool.rope_pool_fused(dev["q"], dev["k"], dev["v"], zero, no_slot, pool,
                                              pool.clone(), **kw, **norm_kw)

    gen = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    k_pool = torch.randint(0, 256, (pages, Hk, ps, D), dtype=torch.uint8, generator=gen)
    v_pool = torch.randint(0, 256, (pages, Hk, ps, D), dtype=torch.uint8, generator=gen)
    before = (k_pool.clone(), v_pool.clone())
    k_pool, v_pool = k_pool.view(FP8).to(kernel_device), v_pool.view(FP8).to(kernel_device)
    k_scale, v_scale, q_scale = 0.04, 0.3, torch.tensor([0.02], device=kernel_device)
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(
        dev["q"], dev["k"], dev["v"], positions, dev["slots"], k_pool, v_pool, kv_layout="HND",
        k_scale=k_scale, v_scale=v_scale, q_out_dtype=FP8, q_scale=q_scale, **kw, **norm_kw)
    assert q_rot.dtype == FP8 and k_rot.dtype == t

    inv_freq = _inv_freq(cfg["rope_base"], D)
    exact = {n: _hf_mrope_exact("qwen3_vl", torch.from_numpy(to_f64(y)), positions.cpu(),
                                inv_freq, section, True)
             for n, y in (("q", y_q), ("k", y_k))}
    want_q = spec_e4m3((exact["q"] / 0.02).float())
    d = (e4m3_ordinal(q_rot.cpu()) - e4m3_ordinal(want_q)).abs()
    assert d.max() <= 1, f"q_rot (fp8) off by {d.max()} e4m3 steps"
    y64 = torch.from_numpy(to_f64(y_k))
    _assert_close(k_rot, exact["k"], y64, dtype, "k_rot (mRoPE of the normalised head)")
    slots = a["slots"]
    written = slots >= 0
    ws = slots[written]
    k_rows = pool_rows(k_pool, ws.to(kernel_device), "HND").cpu()
    v_rows = pool_rows(v_pool, ws.to(kernel_device), "HND").cpu()
    want_k = spec_e4m3((exact["k"][written] / k_scale).float())
    d = (e4m3_ordinal(k_rows) - e4m3_ordinal(want_k)).abs()
    assert d.max() <= 1, f"k_pool rows off by {d.max()} e4m3 steps"
    want_v = spec_e4m3(a["v"][written].float() / torch.tensor(v_scale, dtype=torch.float32))
    assert torch.equal(v_rows.view(torch.uint8), want_v.view(torch.uint8)), "v_pool rows"
    # every row no token writes keeps its bits (HND: row r of page p is [p, :, r])
    untouched = torch.ones(pages * ps, dtype=torch.bool)
    untouched[ws.long()] = False
    for now, was in ((k_pool, before[0]), (v_pool, before[1])):
        rows_now = now.cpu().view(torch.uint8).permute(0, 2, 1, 3).reshape(pages * ps, Hk, D)
        rows_was = was.permute(0, 2, 1, 3).reshape(pages * ps, Hk, D)
        assert torch.equal(rows_now[untouched], rows_was[untouched]), "an unwritten row changed"
