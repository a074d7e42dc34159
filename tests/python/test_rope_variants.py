"""SPEC §4 RoPE variants against an oracle nobody here wrote: transformers.

Its ROPE_INIT_FUNCTIONS give inv_freq and the attention factor for every rope_scaling type;
its models' apply_rotary_pos_emb functions give the rotation (NeoX half-split, GPT-J
interleaved, GLM interleaved + partial). The configs below are copied from published model
configs (no download); each test draws fresh random inputs.
"""

from __future__ import annotations

import copy
import math
import types

import numpy as np
import pytest
import torch

import ropepool

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

# The oracle's API is looked up at run time (hf_schedule): transformers 4.x's
# ROPE_INIT_FUNCTIONS read the config's attributes (rope_theta, rope_scaling) and include
# "default"; 5.x's read config.rope_parameters, which a real config class fills from the same
# config.json keys, and the default schedule is a method of each model's rotary embedding.
HF4 = transformers.__version__.startswith("4.")

# Phi-3-vision-128k-instruct (published config.json; "su" is longrope's old name).
PHI3_LONG = [1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547,
             1.2299998998641968, 1.2299998998641968, 1.2999999523162842, 1.4499999284744263,
             1.5999999046325684, 1.6499998569488525, 1.8999998569488525, 2.859999895095825,
             3.68999981880188, 5.419999599456787, 5.489999771118164, 5.489999771118164,
             9.09000015258789, 11.579999923706055, 15.65999984741211, 15.769999504089355,
             15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055,
             30.009998321533203, 32.35000228881836, 32.590003967285156, 35.56000518798828,
             39.95000457763672, 53.840003967285156, 56.20000457763672, 57.95000457763672,
             59.29000473022461, 59.77000427246094, 59.920005798339844, 61.190006256103516,
             61.96000671386719, 62.50000762939453, 63.3700065612793, 63.48000717163086,
             63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922,
             64.760009765625, 64.80001068115234, 64.81001281738281, 64.81001281738281]
PHI3_SHORT = [1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2500000000000002, 1.2500000000000002,
              1.4000000000000004, 1.4500000000000004, 1.5500000000000005, 1.8500000000000008,
              1.9000000000000008] + [2.000000000000001] * 19 + [
              2.1000000000000005, 2.1000000000000005, 2.2, 2.3499999999999996,
              2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3999999999999995,
              2.3999999999999995, 2.6499999999999986, 2.6999999999999984, 2.8999999999999977,
              2.9499999999999975, 3.049999999999997, 3.049999999999997, 3.049999999999997]

# name: model config fields (as in config.json) + "style": which transformers rotation applies
MODELS = {
    "llama-3.1-8b": dict(
        head_dim=128, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        max_position_embeddings=131072, style="neox",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2.5-7b-yarn": dict(
        head_dim=128, num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
        max_position_embeddings=32768, style="neox",
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "phi-3-vision-128k": dict(
        head_dim=96, num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
        max_position_embeddings=131072, original_max_position_embeddings=4096, style="neox",
        rope_scaling={"type": "longrope", "long_factor": PHI3_LONG, "short_factor": PHI3_SHORT}),
    "vicuna-7b-v1.5-16k-linear": dict(
        head_dim=128, num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
        max_position_embeddings=4096, style="neox",
        rope_scaling={"type": "linear", "factor": 4.0}),
    "gemma-2-9b": dict(
        head_dim=256, num_attention_heads=16, num_key_value_heads=8, rope_theta=10000.0,
        max_position_embeddings=8192, style="neox", rope_scaling=None),
    "gpt-j-6b": dict(
        head_dim=256, num_attention_heads=16, num_key_value_heads=16, rope_theta=10000.0,
        max_position_embeddings=2048, rotary_dim=64, style="gptj", rope_scaling=None),
    "glm-4-9b-chat-hf": dict(
        head_dim=128, num_attention_heads=32, num_key_value_heads=2, rope_theta=10000.0,
        max_position_embeddings=131072, partial_rotary_factor=0.5, style="glm",
        rope_scaling=None),
    "deepseek-v2-lite-yarn-mscale": dict(
        head_dim=64, num_attention_heads=16, num_key_value_heads=1, rope_theta=10000.0,
        max_position_embeddings=163840, style="neox",
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096}),
    "deepseek-v3-yarn-mscale": dict(
        head_dim=64, num_attention_heads=16, num_key_value_heads=1, rope_theta=10000.0,
        max_position_embeddings=163840, style="neox",
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096}),
    "gpt-oss-20b-yarn-untruncated": dict(
        head_dim=64, num_attention_heads=64, num_key_value_heads=8, rope_theta=150000.0,
        max_position_embeddings=131072, style="neox",
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096}),
    "llama-2-7b-dynamic": dict(
        head_dim=128, num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
        max_position_embeddings=4096, style="neox",
        rope_scaling={"type": "dynamic", "factor": 2.0}),
}

# Sequence lengths that select different schedules where the type depends on one.
SEQ_LENS = {"dynamic": [1000, 4096, 12000], "longrope": [1000, 4096, 4097, 100000]}


def rope_type(cfg):
    rs = cfg["rope_scaling"]
    if rs is None:
        return "default"
    return rs.get("rope_type", rs.get("type"))


def rotary_dim_of(cfg):
    if "rotary_dim" in cfg:
        return cfg["rotary_dim"]
    return int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))


def hf_config(cfg):
    """A config object with the attributes transformers' rope init functions read."""
    fields = {k: v for k, v in cfg.items() if k not in ("style", "rotary_dim")}
    fields["hidden_size"] = cfg["head_dim"] * cfg["num_attention_heads"]
    if "rotary_dim" in cfg:  # GPT-J's rotary_dim expressed the way the init functions read it
        fields["partial_rotary_factor"] = cfg["rotary_dim"] / cfg["head_dim"]
    return types.SimpleNamespace(**fields)


def hf_schedule(cfg, seq_len=None):
    if HF4:
        inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type(cfg)](hf_config(cfg), "cpu", seq_len)
        return inv_freq, float(attention)
    # 5.x: a config class built from the config.json fields (a deep copy: it standardises the
    # rope_scaling dict it is given in place). GLM's default schedule reads
    # partial_rotary_factor (Llama's does not), so every model gives it explicitly.
    fields = copy.deepcopy(vars(hf_config(cfg)))
    fields.setdefault("partial_rotary_factor", 1.0)
    if rope_type(cfg) == "default":
        config = transformers.GlmConfig(**fields)
        inv_freq, attention = modeling_glm.GlmRotaryEmbedding.compute_default_rope_parameters(
            config, device="cpu", seq_len=seq_len)
    else:
        config = transformers.LlamaConfig(**fields)
        inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type(cfg)](config, "cpu", seq_len)
    return inv_freq, float(attention)


def our_kwargs(cfg, seq_len=None):
    kw = dict(rope_base=cfg["rope_theta"], rotary_dim=rotary_dim_of(cfg),
              interleaved=cfg["style"] in ("gptj", "glm"))
    if cfg["rope_scaling"] is not None:
        kw["rope_scaling"] = dict(cfg["rope_scaling"])
        # Only the keywords the type reads (SPEC §4: any other one is an error).
        if rope_type(cfg) in ("dynamic", "yarn", "longrope"):
            kw["max_position_embeddings"] = cfg["max_position_embeddings"]
        if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it at the top level
            kw["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        if rope_type(cfg) in SEQ_LENS:
            kw["seq_len"] = seq_len
    return kw


def schedule_cases():
    for name, cfg in MODELS.items():
        for seq_len in SEQ_LENS.get(rope_type(cfg), [None]):
            yield pytest.param(name, seq_len, id=f"{name}-{seq_len}" if seq_len else name)


@pytest.mark.parametrize("name,seq_len", list(schedule_cases()))
def test_schedule_matches_transformers(name, seq_len):
    cfg = MODELS[name]
    hf_inv_freq, hf_attention = hf_schedule(cfg, seq_len)
    kw = our_kwargs(cfg, seq_len)
    kw.pop("interleaved")
    ours = ropepool.rope_schedule(head_dim=cfg["head_dim"], **kw)
    assert ours.rotary_dim == rotary_dim_of(cfg)
    inv_freq = np.asarray(ours.inv_freq, dtype=np.float64)
    assert inv_freq.shape == (rotary_dim_of(cfg) // 2,)
    # transformers evaluates in float32; ours is double: agree to float32 rounding
    np.testing.assert_allclose(inv_freq, hf_inv_freq.double().numpy(), rtol=4e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(hf_attention, rel=1e-12)


def devices():
    out = ["cpu"]
    if torch.cuda.is_available() and ropepool.cuda_backend:
        out.append("cuda")
    return out


def hf_rotate(cfg, x, positions, inv_freq, attention):
    """transformers' own rotation of x [T, H, D] (float64) at positions, with its schedule."""
    R = rotary_dim_of(cfg)
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, R/2]
    style = cfg["style"]
    if style == "gptj":
        # GPT-J: sin/cos [B, T, R/2], tensor [B, T, H, R]; rotates the first rotary_dim
        sin, cos = freqs.sin()[None] * attention, freqs.cos()[None] * attention
        rot = modeling_gptj.apply_rotary_pos_emb(x[None, :, :, :R], sin, cos)[0]
        return torch.cat([rot, x[:, :, R:]], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # [1, T, R]
    cos, sin = emb.cos() * attention, emb.sin() * attention
    xh = x.permute(1, 0, 2)[None]  # [1, H, T, D]
    if style == "glm":
        out, _ = modeling_glm.apply_rotary_pos_emb(xh, xh, cos, sin)
    else:  # NeoX half-split on the first R elements, the rest passed through
        rot, _ = modeling_llama.apply_rotary_pos_emb(xh[..., :R], xh[..., :R], cos, sin)
        out = torch.cat([rot, xh[..., R:]], dim=-1)
    return out[0].permute(1, 0, 2)


def ref_rotate(cfg, x, positions, inv_freq, attention):
    """SPEC §1 in float64, written out here (no transformers): pairs (i, i + R/2), or
    (2i, 2i + 1) when interleaved; elements past rotary_dim copied."""
    R = rotary_dim_of(cfg)
    theta = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    c, s = theta.cos() * attention, theta.sin() * attention
    out = x.clone()
    if cfg["style"] in ("gptj", "glm"):
        a, b = x[..., 0:R:2], x[..., 1:R:2]
        out[..., 0:R:2], out[..., 1:R:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., : R // 2], x[..., R // 2 : R]
        out[..., : R // 2], out[..., R // 2 : R] = a * c - b * s, a * s + b * c
    return out


def ulp(x, dtype):
    """One unit in the last place of |x| in dtype (float64 tensor in, float64 out)."""
    info = torch.finfo(dtype)
    mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    e = torch.floor(torch.log2(x.abs().clamp_min(info.tiny)))
    return torch.exp2(e - mant)


def spec_bound(exact, x, cfg, dtype):
    """SPEC §1: 1 ulp of the exact value + 2^-18 (|a| + |b|), (a, b) the element's pair."""
    R = rotary_dim_of(cfg)
    partner = x.clone()
    if cfg["style"] in ("gptj", "glm"):
        partner[..., 0:R:2], partner[..., 1:R:2] = x[..., 1:R:2], x[..., 0:R:2]
    else:
        partner[..., : R // 2], partner[..., R // 2 : R] = x[..., R // 2 : R], x[..., : R // 2]
    pair = x.abs() + partner.abs()
    pair[..., R:] = 0
    return ulp(exact, dtype) + pair * 2.0**-18


def random_case(cfg, T, dtype, device, max_position, gen):
    Hq, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = torch.randn(T, Hq, D, generator=gen).to(dtype).to(device)
    k = torch.randn(T, Hk, D, generator=gen).to(dtype).to(device)
    v = torch.randn(T, Hk, D, generator=gen).to(dtype).to(device)
    P = 2 * T + 3
    k_pool = torch.randn(P, Hk, D, generator=gen).to(dtype).to(device)
    v_pool = torch.randn(P, Hk, D, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, max_position, (T,), generator=gen, dtype=torch.int64)
    positions[0] = max_position - 1
    slots = torch.randperm(P, generator=gen)[:T].to(torch.int32)
    return q, k, v, positions.to(device), slots.to(device), k_pool, v_pool


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MODELS))
def test_rotation_matches_transformers(name, dtype, device):
    """transformers' schedule (float32 inv_freq, passed through the inv_freq escape hatch)
    and transformers' rotation in float64: ropepool within the SPEC bound, up to 2^20."""
    cfg = MODELS[name]
    seq_len = SEQ_LENS.get(rope_type(cfg), [None])[-1]
    hf_inv_freq, hf_attention = hf_schedule(cfg, seq_len)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, positions, slots, k_pool, v_pool = random_case(cfg, 9, dtype, device, 2**20, gen)
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=cfg["head_dim"], num_qo_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], rope_base=cfg["rope_theta"],
        rotary_dim=rotary_dim_of(cfg), interleaved=cfg["style"] in ("gptj", "glm"),
        inv_freq=hf_inv_freq.float(), attention_scaling=hf_attention)
    for x, out in ((q, q_rot), (k, k_rot)):
        x64 = x.cpu().double()
        exact = hf_rotate(cfg, x64, positions.cpu(), hf_inv_freq, hf_attention)
        err = (out.cpu().double() - exact).abs()
        bound = spec_bound(exact, x64, cfg, dtype)
        assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_rope_scaling_dict_path(name, dtype, device):
    """The rope_scaling dict itself: within the SPEC bound of a float64 evaluation of the same
    schedule up to 2^20, and (at positions where transformers' float32 inv_freq is still
    exact enough) equal to transformers' rotation; the pool rows hold k_rot and v."""
    cfg = MODELS[name]
    seq_len = SEQ_LENS.get(rope_type(cfg), [None])[-1]
    kw = our_kwargs(cfg, seq_len)
    sched = ropepool.rope_schedule(head_dim=cfg["head_dim"], **{
        k: v for k, v in kw.items() if k != "interleaved"})
    inv_freq64 = torch.tensor(np.asarray(sched.inv_freq), dtype=torch.float64)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for max_position in (2**20, 2048):
        q, k, v, positions, slots, k_pool, v_pool = random_case(cfg, 7, dtype, device,
                                                                max_position, gen)
        k_pool_before = k_pool.clone()
        q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
            q, k, v, positions, slots, k_pool, v_pool,
            head_dim=cfg["head_dim"], num_qo_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"], **kw)
        assert kp is k_pool and vp is v_pool
        for x, out in ((q, q_rot), (k, k_rot)):
            x64 = x.cpu().double()
            exact = ref_rotate(cfg, x64, positions.cpu(), inv_freq64, sched.attention_scaling)
            err = (out.cpu().double() - exact).abs()
            assert torch.all(err <= spec_bound(exact, x64, cfg, dtype))
            if max_position == 2048:
                hf_inv_freq, hf_attention = hf_schedule(cfg, seq_len)
                hf = hf_rotate(cfg, x64, positions.cpu(), hf_inv_freq, hf_attention)
                torch.testing.assert_close(out.cpu().double(), hf, rtol=0.02, atol=0.02)
        written = slots.long().cpu()
        assert torch.equal(k_pool.cpu()[written].view(torch.int8), k_rot.cpu().view(torch.int8))
        assert torch.equal(v_pool.cpu()[written].view(torch.int8), v.cpu().view(torch.int8))
        untouched = torch.ones(k_pool.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(k_pool.cpu()[untouched].view(torch.int8),
                           k_pool_before.cpu()[untouched].view(torch.int8))


def _call(q, k, v, positions, slots, k_pool, v_pool, cfg, **extra):
    return ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=cfg["head_dim"],
        num_qo_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        **{**our_kwargs(cfg, SEQ_LENS.get(rope_type(cfg), [None])[-1]), **extra})


def _bits(x):
    return x.detach().cpu().contiguous().view(torch.int8)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama-3.1-8b", "gpt-j-6b", "glm-4-9b-chat-hf",
                                  "phi-3-vision-128k"])
def test_fused_qkv_views_and_inplace_are_bit_identical(name, dtype, device):
    """q/k/v as strided views into one fused QKV buffer [T, (Hq + 2 Hk) * D] (read directly,
    no copy) and inplace=True give the same bits as contiguous inputs; int64 and mixed
    int32/int64 indices too."""
    cfg = MODELS[name]
    Hq, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T = 11
    fused = torch.randn(T, (Hq + 2 * Hk) * D, generator=gen).to(dtype).to(device)
    q, k, v = (x.unflatten(1, (-1, D)) for x in fused.split([Hq * D, Hk * D, Hk * D], dim=1))
    assert not q.is_contiguous() and q.data_ptr() == fused.data_ptr()
    P = 3 * T
    k_pool = torch.randn(P, Hk, D, generator=gen).to(dtype).to(device)
    v_pool = torch.randn(P, Hk, D, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 2**20, (T,), generator=gen).to(device)
    slots = torch.randperm(P, generator=gen)[:T].to(device)
    slots[3] = -1

    ref_pools = (k_pool.clone(), v_pool.clone())
    ref = _call(q.contiguous(), k.contiguous(), v.contiguous(), positions.int(), slots.int(),
                *ref_pools, cfg)
    for pos, sl in ((positions, slots), (positions.int(), slots), (positions, slots.int())):
        pools = (k_pool.clone(), v_pool.clone())
        out = _call(q, k, v, pos, sl, *pools, cfg)
        for a, b in zip(out, ref):
            assert torch.equal(_bits(a), _bits(b))
    fused_before = fused.clone()
    pools = (k_pool.clone(), v_pool.clone())
    q_rot, k_rot, kp, vp = _call(q, k, v, positions, slots, *pools, cfg, inplace=True)
    assert q_rot is q and k_rot is k and kp is pools[0] and vp is pools[1]
    for a, b in zip((q, k, *pools), ref):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(v.flatten(1)), _bits(fused_before[:, (Hq + Hk) * D:]))  # v: read only


@pytest.mark.parametrize("device", devices())
def test_schedule_object_and_escape_hatch(device):
    """A schedule made once (rope_schedule) gives the bits of the per-call dict, and the
    float32 inv_freq escape hatch with attention_scaling is used as given."""
    cfg = MODELS["qwen2.5-7b-yarn"]
    kw = our_kwargs(cfg)
    sched = ropepool.rope_schedule(head_dim=cfg["head_dim"], rope_base=kw["rope_base"],
                                   rope_scaling=kw["rope_scaling"],
                                   max_position_embeddings=kw["max_position_embeddings"])
    assert sched.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-15)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = random_case(cfg, 5, torch.float32, device, 2**20, gen)
    a = _call(*case[:5], case[5].clone(), case[6].clone(), cfg)
    b = ropepool.rope_pool_fused(*case[:5], case[5].clone(), case[6].clone(),
                                 head_dim=cfg["head_dim"], num_qo_heads=cfg["num_attention_heads"],
                                 num_kv_heads=cfg["num_key_value_heads"],
                                 rope_base=kw["rope_base"], schedule=sched)
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y))
    table = torch.rand(cfg["head_dim"] // 2, generator=gen, dtype=torch.float32)
    hatch = ropepool.rope_schedule(head_dim=cfg["head_dim"], rope_base=10000.0,
                                   inv_freq=table, attention_scaling=0.5)
    assert hatch.inv_freq == tuple(float(x) for x in table) and hatch.attention_scaling == 0.5


@pytest.mark.parametrize("rope_scaling,extra,message", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, {},
     "rope_pool_fused: unknown rope_scaling type 'ntk-by-parts'; expected one of default, "
     "linear, dynamic, yarn, llama3, longrope"),
    ({"rope_type": "llama3", "factor": 8.0}, {},
     "rope_pool_fused: rope_scaling type 'llama3' needs 'low_freq_factor', 'high_freq_factor', "
     "'original_max_position_embeddings'"),
    ({"type": "yarn", "factor": 4.0, "mrope_sections": [16, 24, 24]}, {},
     "rope_pool_fused: rope_scaling type 'yarn' does not use 'mrope_sections'; accepted keys: "
     "attention_factor, beta_fast, beta_slow, factor, mrope_interleaved, mrope_section, mscale, "
     "mscale_all_dim, original_max_position_embeddings, rope_theta, rope_type, truncate, type"),
    ({"type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 4096},
     "rope_pool_fused: rope_scaling 'dynamic' needs seq_len"),
    ({"type": "yarn", "factor": 4.0}, {},
     "rope_pool_fused: rope_scaling 'yarn' needs original_max_position_embeddings"),
    ({"type": "linear", "factor": -1.0}, {},
     "rope_pool_fused: rope_scaling 'linear' needs factor > 0, got -1"),
    ({"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3},
     {"max_position_embeddings": 8192, "original_max_position_embeddings": 4096, "seq_len": 10},
     "rope_pool_fused: rope_scaling 'longrope' needs short_factor with rotary_dim/2 = 64 "
     "entries, got 3"),
])
def test_bad_rope_scaling_is_rejected_before_any_write(rope_scaling, extra, message):
    cfg = MODELS["llama-3.1-8b"]
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = random_case(cfg, 4, torch.float32, "cpu", 4096, gen)
    before = [x.clone() for x in case]
    with pytest.raises(ValueError) as e:
        ropepool.rope_pool_fused(*case, head_dim=128, num_qo_heads=32, num_kv_heads=8,
                                 rope_base=500000.0, rope_scaling=rope_scaling, **extra)
    assert str(e.value) == message
    for x, y in zip(case, before):
        assert torch.equal(_bits(x), _bits(y))
