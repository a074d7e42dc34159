"""mla_rope_pool_fused (SPEC §8) against transformers' DeepSeek-V3 code and a float64 reference.

The oracle is transformers' own DeepSeek-V3 module: its rotary-embedding class gives the
schedule (yarn with mscale / mscale_all_dim: inv_freq and the attention factor) and its
`apply_rotary_pos_emb_interleave` the rotation, which returns GPT-J pairs in de-interleaved
order; ropepool's output is compared after that permutation. transformers forms its angles
in float32 (off by up to ~0.06 rad at position 2^20), so for positions up to 2^20 its
rotation function is fed float64 inputs and float64 cos/sin from the schedule (the schedule
itself is checked against transformers' class first); a second test runs transformers'
module end to end, as the model does, at positions where float32 angles are accurate.

Configurations come from the published config.json files: DeepSeek-V3 (128 heads,
qk_rope_head_dim 64, kv_lora_rank 512, rope_theta 10000, yarn factor 40 from 4096, beta_fast
32, beta_slow 1, mscale = mscale_all_dim = 1.0, max_position_embeddings 163840),
DeepSeek-V2-Lite (16 heads, mscale = mscale_all_dim = 0.707) and Kimi K2 (64 heads,
rope_theta 50000, factor 32, beta_fast = beta_slow = 1).
"""

import re

import numpy as np
import pytest
import torch

import ropepool
import ropepool._mla
from rope_testing import raw_bits, to_f64, ulp

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3  # noqa: E402

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

CONFIGS = {
    "deepseek-v3": dict(num_attention_heads=128, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        kv_lora_rank=512, rope_theta=10000, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40,
                                      "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                      "mscale_all_dim": 1.0}),
    "deepseek-v2-lite": dict(num_attention_heads=16, qk_rope_head_dim=64, qk_nope_head_dim=128,
                             kv_lora_rank=512, rope_theta=10000, max_position_embeddings=163840,
                             rope_scaling={"type": "yarn", "factor": 40,
                                           "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                           "mscale_all_dim": 0.707}),
    "kimi-k2": dict(num_attention_heads=64, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    kv_lora_rank=512, rope_theta=50000, max_position_embeddings=131072,
                    rope_scaling={"type": "yarn", "factor": 32.0,
                                  "original_max_position_embeddings": 4096,
                                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0}),
}
# Not a published config: mscale != mscale_all_dim, so the attention factor is not 1 and
# must multiply cos and sin as transformers' does.
CONFIGS["yarn-mscale-pair"] = dict(CONFIGS["deepseek-v3"], num_attention_heads=16,
                                   rope_scaling=dict(CONFIGS["deepseek-v3"]["rope_scaling"],
                                                     mscale_all_dim=0.707))


def hf_rotary(name):
    c = CONFIGS[name]
    config = dsv3.DeepseekV3Config(
        hidden_size=256, num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_attention_heads"], qk_rope_head_dim=c["qk_rope_head_dim"],
        qk_nope_head_dim=c["qk_nope_head_dim"], v_head_dim=128, kv_lora_rank=c["kv_lora_rank"],
        rope_theta=c["rope_theta"], max_position_embeddings=c["max_position_embeddings"],
        rope_scaling=dict(c["rope_scaling"]), rope_interleave=True)
    return dsv3.DeepseekV3RotaryEmbedding(config)


def schedule_of(name, **extra):
    c = CONFIGS[name]
    return ropepool.rope_schedule(head_dim=c["qk_rope_head_dim"], rope_base=c["rope_theta"],
                                  rope_scaling=c["rope_scaling"], **extra)


def deinterleave(x):
    """GPT-J order (x0, y0, x1, y1, ...) to transformers' de-interleaved (x0, x1, ..., y0, y1, ...)."""
    *lead, r = x.shape
    return x.reshape(*lead, r // 2, 2).swapaxes(-1, -2).reshape(*lead, r)


def hf_rotation(q_pe, k_pe, positions, schedule):
    """transformers' apply_rotary_pos_emb_interleave in float64 on [T, H, R] / [T, R]."""
    inv_freq = torch.tensor(schedule.inv_freq, dtype=torch.float64)
    pos = torch.from_numpy(to_f64(positions))
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, T, R]
    cos, sin = emb.cos() * schedule.attention_scaling, emb.sin() * schedule.attention_scaling
    q = torch.from_numpy(to_f64(q_pe)).permute(1, 0, 2)[None]  # [1, H, T, R]
    k = torch.from_numpy(to_f64(k_pe)).reshape(k_pe.shape[0], -1)[None, None]  # [1, 1, T, R]
    q_embed, k_embed = dsv3.apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1)
    return q_embed[0].permute(1, 0, 2).numpy(), k_embed[0, 0].numpy()


def pair_sums(x):
    """|a| + |b| of each element's GPT-J pair, in de-interleaved order, for the bound."""
    x = to_f64(x)
    s = np.abs(x[..., 0::2]) + np.abs(x[..., 1::2])
    return np.concatenate([s, s], axis=-1)


def assert_close(got, exact, abs_ab, what):
    """Every element within one ulp + 2^-18 (|a| + |b|) (SPEC §1); NaN (unwritten) fails."""
    got64 = to_f64(got)
    bound = ulp(exact, str(got.dtype).removeprefix("torch.")) + 2.0**-18 * abs_ab
    ok = np.abs(got64 - exact) <= bound
    assert ok.all(), (f"{what}: {int((~ok).sum())} of {ok.size} elements out of bound; first at "
                      f"{np.argwhere(~ok)[0].tolist()}")


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """q_pe_rot/k_pe_rot start as NaN, so an element the op does not write fails."""
    def new(x):
        return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)
    monkeypatch.setattr(ropepool._mla, "_new_output", new)


class Call:
    """One call laid out as DeepSeek's attention produces it: q [T, H, nope + R] with q_pe
    its last R columns, kv_c and k_pe the column slices of one [T, L + R] projection output,
    the cache poisoned with random bits (token [P, L + R] or NHD pages)."""

    def __init__(self, rng, *, dtype, device, T, H, R=64, L=512, nope=128, P=256, page_size=0,
                 index_dtype=torch.int32, cache_dtype=None, positions_max=2**20, k_3d=False):
        tdt = TORCH[dtype]
        self.q = torch.from_numpy(rng.uniform(-4, 4, (T, H, nope + R))).to(tdt).to(device)
        self.q_pe = self.q[..., nope:]
        self.kv = torch.from_numpy(rng.uniform(-4, 4, (T, L + R))).to(tdt).to(device)
        self.kv_c = self.kv[:, :L]
        self.k_pe = self.kv[:, L:].unsqueeze(1) if k_3d else self.kv[:, L:]
        pos = rng.integers(0, positions_max, T)
        pos[:2] = [positions_max - 1, 0][: min(T, 2)]
        self.positions = torch.from_numpy(pos).to(index_dtype).to(device)
        slots = rng.permutation(P)[:T].astype(np.int64)
        slots[rng.random(T) < 0.15] = -1
        self.slots = torch.from_numpy(slots).to(index_dtype).to(device)
        cdt = tdt if cache_dtype is None else cache_dtype
        width = torch.tensor([], dtype=cdt).element_size()
        raw = torch.from_numpy(rng.integers(0, 2**8, (P, L + R), dtype=np.uint8)
                               .repeat(width, axis=1)).to(device)
        cache = raw.view(cdt)
        if cdt.is_floating_point and cdt != torch.float8_e4m3fn:
            cache = torch.where(cache.isfinite(), cache, torch.zeros((), dtype=cdt, device=device) + 3)
        self.page_size = page_size
        self.kv_cache = cache.reshape(P // page_size, page_size, L + R) if page_size else cache
        self.L, self.R, self.P = L, R, P
        self.before = self.kv_cache.clone()
        self.inputs_before = (self.q.clone(), self.kv.clone())

    def args(self):
        return (self.q_pe, self.k_pe, self.kv_c, self.positions, self.slots, self.kv_cache)

    def rows(self, cache):
        return cache.reshape(self.P, self.L + self.R)

    def check_cache(self, k_rot):
        """Named rows = concat(kv_c, k_pe_rot) bit for bit; every other row unchanged."""
        after, before = self.rows(self.kv_cache).cpu(), self.rows(self.before).cpu()
        slots = self.slots.cpu().numpy()
        k2 = k_rot.reshape(k_rot.shape[0], -1).cpu()
        written = np.zeros(self.P, dtype=bool)
        for t, s in enumerate(slots):
            if s >= 0:
                written[s] = True
                want = torch.cat([self.inputs_before[1][t, :self.L].cpu(), k2[t]])
                assert (raw_bits(after[s]) == raw_bits(want)).all(), f"row {s} (token {t})"
        assert (raw_bits(after[~written]) == raw_bits(before[~written])).all(), "an unnamed row changed"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_schedule_is_transformers(name):
    """ropepool's yarn schedule (in float64) is transformers' (float32, a few roundings)."""
    rotary = hf_rotary(name)
    s = schedule_of(name)
    hf = rotary.inv_freq.double().numpy()
    ours = np.array(s.inv_freq)
    assert np.all(np.abs(ours - hf) <= 2.0**-21 * np.abs(hf)), (ours, hf)
    assert s.attention_scaling == pytest.approx(float(rotary.attention_scaling), rel=1e-12)
    assert (s.attention_scaling != 1.0) == (name == "yarn-mscale-pair")


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("page_size", [0, 1, 16, 64])
def test_matches_transformers(kernel_device, rng, name, dtype, page_size):
    c = CONFIGS[name]
    H = c["num_attention_heads"]
    call = Call(rng, dtype=dtype, device=kernel_device, T=7 if H > 64 else 23, H=H,
                page_size=page_size, index_dtype=torch.int64 if page_size == 16 else torch.int32)
    q_rot, k_rot, cache = ropepool.mla_rope_pool_fused(
        *call.args(), rope_base=c["rope_theta"], rope_scaling=c["rope_scaling"],
        kv_layout="NHD" if page_size else None)
    assert cache is call.kv_cache
    assert q_rot.shape == call.q_pe.shape and k_rot.shape == call.k_pe.shape
    q_hf, k_hf = hf_rotation(call.q_pe, call.k_pe, call.positions.cpu(), schedule_of(name))
    assert_close(deinterleave(q_rot.cpu()), q_hf, pair_sums(call.q_pe.cpu()), "q_pe_rot")
    assert_close(deinterleave(k_rot.cpu()), k_hf, pair_sums(call.k_pe.cpu()), "k_pe_rot")
    call.check_cache(k_rot)
    assert torch.equal(call.q, call.inputs_before[0]) and torch.equal(call.kv, call.inputs_before[1])


def test_transformers_module_end_to_end(rng):
    """transformers' rotary module and rotation as the model runs them (float32), at
    positions below 4096 where float32 angles are accurate to ~1e-4 rad."""
    rotary = hf_rotary("deepseek-v3")
    call = Call(rng, dtype="float32", device="cpu", T=16, H=8, positions_max=4096)
    q_rot, k_rot, _ = ropepool.mla_rope_pool_fused(
        *call.args(), rope_base=10000, rope_scaling=CONFIGS["deepseek-v3"]["rope_scaling"],
        max_position_embeddings=163840)
    pos = call.positions.long()[None]
    cos, sin = rotary(call.q_pe, pos)
    q = call.q_pe.permute(1, 0, 2)[None]
    k = call.k_pe[None, None]
    q_embed, k_embed = dsv3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    torch.testing.assert_close(deinterleave(q_rot), q_embed[0].permute(1, 0, 2), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(deinterleave(k_rot), k_embed[0, 0], atol=2e-3, rtol=1e-3)


def e4m3(x):
    """SPEC §6's rule in torch: RNE, saturate to +-448 (torch alone would give NaN there)."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_form", ["none", "float", "tensor"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_cache(kernel_device, rng, scale_form, dtype):
    call = Call(rng, dtype=dtype, device=kernel_device, T=19, H=16, page_size=16,
                cache_dtype=torch.float8_e4m3fn)
    scale = {"none": None, "float": 0.0078125,
             "tensor": torch.tensor([0.375], device=kernel_device)}[scale_form]
    value = {"none": 1.0, "float": 0.0078125, "tensor": 0.375}[scale_form]
    q_rot, k_rot, _ = ropepool.mla_rope_pool_fused(
        *call.args(), rope_base=10000, rope_scaling=CONFIGS["deepseek-v3"]["rope_scaling"],
        kv_layout="NHD", kv_scale=scale)
    after, before = call.rows(call.kv_cache).cpu(), call.rows(call.before).cpu()
    sched = schedule_of("deepseek-v3")
    _, k_exact = hf_rotation(call.q_pe.cpu(), call.k_pe.cpu(), call.positions.cpu(), sched)
    k_exact = torch.from_numpy(k_exact)
    # transformers' order back to GPT-J pairs
    k_exact = k_exact.reshape(-1, 2, 32).swapaxes(-1, -2).reshape(-1, 64)
    written = np.zeros(call.P, dtype=bool)
    for t, s in enumerate(call.slots.cpu().numpy()):
        if s < 0:
            continue
        written[s] = True
        kv = call.kv_c[t].cpu().float() / torch.tensor(value, dtype=torch.float32)
        assert (raw_bits(after[s, :512]) == raw_bits(e4m3(kv))).all(), f"kv_c of row {s}"
        want = raw_bits(e4m3((k_exact[t] / value).float())).astype(np.int64)
        got = raw_bits(after[s, 512:]).astype(np.int64)
        def ordinal(b):
            return np.where(b < 0, -(b & 0x7F), b & 0x7F)  # int8 bits: sign in the top bit
        assert np.all(np.abs(ordinal(got) - ordinal(want)) <= 1), f"k_pe_rot of row {s}"
    assert (raw_bits(after[~written]) == raw_bits(before[~written])).all()


def test_inplace_strided_and_3d_key(kernel_device, rng):
    call = Call(rng, dtype="bfloat16", device=kernel_device, T=11, H=16, k_3d=True)
    q_pe_in, k_pe_in = call.q_pe.clone(), call.k_pe.clone()
    q_rot, k_rot, _ = ropepool.mla_rope_pool_fused(
        *call.args(), rope_base=10000, rope_scaling=CONFIGS["deepseek-v3"]["rope_scaling"],
        inplace=True)
    assert q_rot is call.q_pe and k_rot is call.k_pe and k_rot.shape == (11, 1, 64)
    q_hf, k_hf = hf_rotation(q_pe_in, k_pe_in, call.positions.cpu(), schedule_of("deepseek-v3"))
    assert_close(deinterleave(q_rot.cpu()), q_hf, pair_sums(q_pe_in.cpu()), "q")
    assert_close(deinterleave(k_rot.cpu().reshape(11, 64)), k_hf, pair_sums(k_pe_in.cpu().reshape(11, 64)), "k")
    # the nope columns of q are untouched
    assert torch.equal(call.q[..., :128], call.inputs_before[0][..., :128])
    rows = call.rows(call.kv_cache).cpu()
    for t, s in enumerate(call.slots.cpu().numpy()):
        if s >= 0:
            assert (raw_bits(rows[s, :512]) == raw_bits(call.inputs_before[1][t, :512].cpu())).all()
            assert (raw_bits(rows[s, 512:]) == raw_bits(k_rot[t, 0].cpu())).all()


def test_neox_pairs_and_default_schedule(rng):
    """interleaved=False: half-split pairs, the plain rope_base schedule."""
    call = Call(rng, dtype="float32", device="cpu", T=9, H=4)
    q_rot, k_rot, _ = ropepool.mla_rope_pool_fused(*call.args(), rope_base=10000.0,
                                                   interleaved=False)
    x = to_f64(call.q_pe)
    inv = 10000.0 ** (-np.arange(32) * 2 / 64)
    th = to_f64(call.positions)[:, None, None] * inv
    a, b = x[..., :32], x[..., 32:]
    exact = np.concatenate([a * np.cos(th) - b * np.sin(th), a * np.sin(th) + b * np.cos(th)], -1)
    s = np.abs(a) + np.abs(b)
    assert_close(q_rot, exact, np.concatenate([s, s], -1), "q_pe_rot")
    call.check_cache(k_rot)


def test_rope_scaling_schedule_made_once(rng, monkeypatch):
    """A rope_scaling dict passed on every call (as engines pass config.rope_scaling): the
    first call makes its schedule, later calls with an equal dict reuse it (rope_pool_fused's
    memo), with the bits of schedule=; a changed dict gets its own; a bad one raises each
    time."""
    monkeypatch.setattr(ropepool._op, "_SCALING_SCHEDULES", {})
    c = CONFIGS["deepseek-v3"]
    call = Call(rng, dtype="bfloat16", device="cpu", T=7, H=4)
    made = []
    real = ropepool._mla.rope_schedule
    monkeypatch.setattr(ropepool._mla, "rope_schedule", lambda **kw: made.append(1) or real(**kw))

    def run(**kw):
        cache = call.kv_cache.clone()
        q_rot, k_rot, _ = ropepool.mla_rope_pool_fused(*call.args()[:5], cache,
                                                       rope_base=10000.0, **kw)
        return [raw_bits(x) for x in (q_rot, k_rot, cache)]

    scaling = dict(c["rope_scaling"])
    want = run(schedule=schedule_of("deepseek-v3"))
    for i in range(3):
        for x, y in zip(run(rope_scaling=scaling), want):
            np.testing.assert_array_equal(x, y)
        assert len(made) == 1, f"call {i}: the schedule made again"
    scaling["factor"] = 8
    changed = run(rope_scaling=scaling)
    assert len(made) == 2 and not (changed[0] == want[0]).all()
    for _ in range(2):
        with pytest.raises(ValueError, match="^mla_rope_pool_fused: .*beta_fast"):
            run(rope_scaling=dict(scaling, beta_fast="fast"))
    assert len(made) == 4


MLA_FAST_CALLS = [
    dict(),
    dict(schedule="deepseek-v3"),
    dict(rope_scaling="deepseek-v3"),
    dict(rope_scaling="deepseek-v3", kv_layout="NHD", kv_scale=0.375, cache="fp8"),
    dict(schedule="deepseek-v3", kv_layout="NHD", kv_scale="tensor", cache="fp8",
         return_k_rot=False),
    dict(interleaved=False, inplace=True),
    dict(schedule="deepseek-v3", inplace=True, return_k_rot=False),
]


@pytest.mark.parametrize("case", range(len(MLA_FAST_CALLS)))
def test_eager_fast_path(kernel_device, rng, monkeypatch, case):
    """Eager torch calls whose keywords have the plain Python types take the fast path
    (straight to the op's kernel function): every output bit for bit the keyword machinery's
    (the fast path switched off), the caller's objects returned; a rope_scaling dict once an
    earlier call made its schedule."""
    spec = dict(MLA_FAST_CALLS[case])
    fp8 = spec.pop("cache", None) == "fp8"
    taken = []
    fast = ropepool._mla._fast_scalars
    monkeypatch.setattr(ropepool._mla, "_fast_scalars",
                        lambda *a: taken.append(fast(*a)) or taken[-1])
    call = Call(rng, dtype="bfloat16", device=kernel_device, T=9, H=8,
                page_size=16 if spec.get("kv_layout") else 0,
                cache_dtype=torch.float8_e4m3fn if fp8 else None)

    def run():
        kw = dict(spec)
        if kw.get("schedule"):
            kw["schedule"] = schedule_of(kw["schedule"])
        if kw.get("rope_scaling"):
            kw["rope_scaling"] = dict(CONFIGS[kw["rope_scaling"]]["rope_scaling"])
        if kw.get("kv_scale") == "tensor":
            kw["kv_scale"] = torch.tensor([0.375], device=kernel_device)
        q_pe, k_pe, cache = call.q_pe.clone(), call.k_pe.clone(), call.kv_cache.clone()
        out = ropepool.mla_rope_pool_fused(q_pe, k_pe, *call.args()[2:5], cache,
                                           rope_base=10000.0, **kw)
        assert out[2] is cache
        if kw.get("inplace"):
            assert out[0] is q_pe and out[1] is (k_pe if kw.get("return_k_rot", True) else None)
        assert (out[1] is None) == (kw.get("return_k_rot", True) is False)
        return [None if x is None else raw_bits(x) for x in (*out[:2], cache, k_pe)]

    with monkeypatch.context() as m:
        m.setattr(ropepool._mla, "_FAST_TENSOR", None)
        slow = run()
    assert taken == []
    run()  # a rope_scaling dict: this call makes the schedule the next one reuses
    quick = run()
    assert taken[-1] is not None, "the fast path"
    for name, x, y in zip(("q_pe_rot", "k_pe_rot", "kv_cache", "k_pe"), slow, quick):
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, name)


def test_fast_path_errors_are_the_slow_paths(rng, monkeypatch):
    """Bad values reach the core on the fast path and raise its messages, which are the slow
    path's; keyword types only the slow path checks are its errors, never the fast path's."""
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=4)
    cache8 = call.kv_cache.to(torch.float8_e4m3fn)

    def message(fast_on, cache, **kw):
        with monkeypatch.context() as m:
            if not fast_on:
                m.setattr(ropepool._mla, "_FAST_TENSOR", None)
            before = raw_bits(cache)
            with pytest.raises((ValueError, TypeError)) as info:
                ropepool.mla_rope_pool_fused(*call.args()[:5], cache, **kw)
            np.testing.assert_array_equal(raw_bits(cache), before)
            return type(info.value), str(info.value)

    for cache, kw in [(cache8, dict(rope_base=10000.0, kv_scale=0.0)),
                      (cache8, dict(rope_base=10000.0, kv_scale=torch.tensor([1.0, 2.0]))),
                      (call.kv_cache, dict(rope_base=10000.0, kv_scale=0.5)),
                      (call.kv_cache, dict(rope_base=10000.0, kv_layout="NHD")),
                      (call.kv_cache, dict(rope_base=-1.0)),
                      (call.kv_cache, dict(rope_base=10000.0, kv_layout="HND")),
                      (call.kv_cache, dict(rope_base=True)),
                      (call.kv_cache, dict(rope_base=10000.0, kv_scale="1")),
                      (call.kv_cache, dict(rope_base=10000.0, schedule=schedule_of("kimi-k2")))]:
        assert message(True, cache, **kw) == message(False, cache, **kw), kw


def test_numpy_arrays(rng):
    T, H = 5, 4
    q_pe = rng.uniform(-2, 2, (T, H, 64)).astype(np.float32)
    kv = rng.uniform(-2, 2, (T, 576)).astype(np.float32)
    cache = np.full((16, 576), 7.0, dtype=np.float32)
    positions = np.array([0, 1, 5000, 2**20 - 1, 77], dtype=np.int64)
    slots = np.array([3, -1, 0, 15, 8], dtype=np.int32)
    q_rot, k_rot, out = ropepool.mla_rope_pool_fused(q_pe, kv[:, 512:], kv[:, :512], positions,
                                                     slots, cache, rope_base=10000.0)
    assert out is cache and isinstance(q_rot, np.ndarray)
    q_hf, k_hf = hf_rotation(q_pe, kv[:, 512:], positions,
                             ropepool.rope_schedule(head_dim=64, rope_base=10000.0))
    assert_close(deinterleave(q_rot), q_hf, pair_sums(q_pe), "q")
    for t, s in enumerate(slots):
        if s >= 0:
            assert np.array_equal(cache[s], np.concatenate([kv[t, :512], k_rot[t]]))
    assert (cache[[1, 2, 4]] == 7.0).all()


def test_torch_compile_fullgraph(rng):
    call = Call(rng, dtype="bfloat16", device="cpu", T=6, H=16)
    sched = schedule_of("deepseek-v3")

    @torch.compile(fullgraph=True)
    def step(q_pe, k_pe, kv_c, positions, slots, cache):
        q_rot, k_rot, cache = ropepool.mla_rope_pool_fused(
            q_pe, k_pe, kv_c, positions, slots, cache, rope_base=10000, schedule=sched)
        return q_rot * 1, k_rot

    q_rot, k_rot = step(*call.args())
    q_hf, _ = hf_rotation(call.q_pe, call.k_pe, call.positions, sched)
    assert_close(deinterleave(q_rot), q_hf, pair_sums(call.q_pe), "q")
    call.check_cache(k_rot)


def rejected(call, message, **kw):
    """The call raises ValueError with exactly `message` and writes nothing."""
    kw.setdefault("rope_base", 10000.0)
    before = call.kv_cache.clone()
    q_before = call.q.clone()
    with pytest.raises(ValueError, match="^" + re.escape(message) + r"(\n|$)"):
        ropepool.mla_rope_pool_fused(*call.args(), **kw)
    with pytest.raises(ValueError, match="^" + re.escape(message) + r"(\n|$)"):
        ropepool.validate_mla_rope_pool(*call.args(), **kw)
    assert torch.equal(raw_bits_t(call.kv_cache), raw_bits_t(before))
    assert torch.equal(call.q, q_before)


def raw_bits_t(x):
    return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def test_validation_messages(rng):
    P = "mla_rope_pool_fused: "
    call = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    call.slots[2] = 16
    rejected(call, P + "slots[2] = 16 is out of range for a kv_cache of 16 slots")
    call = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    rejected(call, P + "kv_cache must be 3-D [pages, page_size, kv_lora_rank + rope_dim] with "
             "kv_layout=\"NHD\", got torch.Size([16, 576])", kv_layout="NHD")
    rejected(call, P + "kv_layout must be None (a [P, L + R] cache) or 'NHD' (a [pages, "
             "page_size, L + R] cache), got 'HND'", kv_layout="HND")
    rejected(call, P + "kv_scale is only used with a float8_e4m3fn kv_cache, got a bfloat16 cache",
             kv_scale=0.5)
    # a multimodal schedule (SPEC §7): its sections would be ignored (one position per token)
    multimodal = P + ("the schedule is multimodal (mrope_section = [8, 12, 12]); positions here "
                      "are one per token and the sections would be ignored")
    rejected(call, multimodal, schedule=ropepool.rope_schedule(
        head_dim=64, rope_base=10000.0, mrope_section=[8, 12, 12]))
    for _ in range(2):  # (the second call: a remembered dict's schedule)
        rejected(call, multimodal, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    with pytest.raises(ValueError, match=r"^mla_rope_pool_fused: rope_scaling"):
        ropepool.mla_rope_pool_fused(*call.args(), rope_base=10000.0,
                                     rope_scaling={"type": "yarn", "factor": 40, "bogus": 1})
    bad = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    bad.kv_c = bad.kv[:3, :512]
    rejected(bad, P + "kv_c shape must be [num_tokens, kv_lora_rank] with num_tokens = 4 (from "
             "q_pe), got torch.Size([3, 512])")
    bad = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    bad.k_pe = bad.kv[:, 512:544]
    rejected(bad, P + "k_pe shape must be [num_tokens, rope_dim] = [4, 64] (or [4, 1, 64]) for "
             "q_pe torch.Size([4, 2, 64]), got torch.Size([4, 32])")
    bad = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    bad.kv_cache = bad.kv_cache[:, :570]
    rejected(bad, P + "kv_cache shape must be [num_slots, kv_lora_rank + rope_dim] with "
             "kv_lora_rank + rope_dim = 512 + 64 = 576, got torch.Size([16, 570])")
    bad = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    # an output over an input: the cache over q's memory
    q_as_cache = bad.q.reshape(-1)[: 2 * 576].view(2, 576)
    bad.kv_cache = q_as_cache
    bad.before = q_as_cache.clone()
    bad.slots.fill_(-1)
    with pytest.raises(ValueError, match=re.escape(P + "kv_cache and q_pe overlap in memory")):
        ropepool.mla_rope_pool_fused(*bad.args(), rope_base=10000.0)
    bad = Call(rng, dtype="bfloat16", device="cpu", T=4, H=2, P=16)
    with pytest.raises(ValueError, match=re.escape(P + "positions must be int32 or int64, got float32")):
        ropepool.mla_rope_pool_fused(bad.q_pe, bad.k_pe, bad.kv_c, bad.positions.float(),
                                     bad.slots, bad.kv_cache, rope_base=10000.0)


def test_out_of_range_slot_pages(rng):
    call = Call(rng, dtype="float16", device="cpu", T=5, H=2, P=64, page_size=16)
    call.slots[4] = 64
    rejected(call, "mla_rope_pool_fused: slots[4] = 64 is out of range for a kv_cache of 64 slots",
             kv_layout="NHD")


# --- CUDA: graphs, the slot-error report ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu_and_graph(rng):
    if not ropepool.cuda_backend:
        pytest.skip("no CUDA backend in this build")
    ropepool.cuda_check_slot_errors()
    call = Call(rng, dtype="bfloat16", device="cuda", T=64, H=128, page_size=64, P=1024,
                cache_dtype=torch.float8_e4m3fn)
    cpu = Call(rng, dtype="bfloat16", device="cpu", T=64, H=128, page_size=64, P=1024,
               cache_dtype=torch.float8_e4m3fn)
    for name in ("q", "kv", "positions", "slots"):
        getattr(cpu, name).copy_(getattr(call, name).cpu())
    cpu.kv_cache.copy_(call.before.cpu())
    scale = torch.tensor([0.5], device="cuda")
    kw = dict(rope_base=10000, schedule=schedule_of("deepseek-v3"), kv_layout="NHD")
    q_cpu, k_cpu, _ = ropepool.mla_rope_pool_fused(*cpu.args(), kv_scale=0.5, **kw)
    graph = torch.cuda.CUDAGraph()
    out = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ropepool.mla_rope_pool_fused(*call.args(), kv_scale=scale, **kw)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    call.kv_cache.copy_(call.before)
    with torch.cuda.graph(graph):
        out["q"], out["k"], _ = ropepool.mla_rope_pool_fused(*call.args(), kv_scale=scale, **kw)
    graph.replay()
    torch.cuda.synchronize()
    # Each backend within SPEC §1's bound of the exact rotation (their float32 sin/cos
    # differ, so where a*cos - b*sin cancels the two may be several bf16 units apart).
    q_exact, k_exact = hf_rotation(cpu.q_pe, cpu.k_pe, cpu.positions, schedule_of("deepseek-v3"))
    for got_q, got_k, where in ((out["q"].cpu(), out["k"].cpu(), "cuda"), (q_cpu, k_cpu, "cpu")):
        assert_close(deinterleave(got_q), q_exact, pair_sums(cpu.q_pe), f"q_pe_rot ({where})")
        assert_close(deinterleave(got_k), k_exact, pair_sums(cpu.k_pe), f"k_pe_rot ({where})")
    rows_gpu, rows_cpu = call.rows(call.kv_cache).cpu(), cpu.rows(cpu.kv_cache)
    assert (raw_bits(rows_gpu[:, :512]) == raw_bits(rows_cpu[:, :512])).all()  # kv_c: exact
    # the rotary part: within one e4m3 step of e4m3(exact k_pe_rot / scale) (SPEC §6)
    written = cpu.slots.numpy() >= 0
    want = e4m3(torch.from_numpy(k_exact).reshape(cpu.k_pe.shape[0], -1)[written] / 0.5)
    got = deinterleave(rows_gpu[cpu.slots[written].long(), 512:].float()).to(torch.float8_e4m3fn)

    def ordinal(x):
        b = raw_bits(x).astype(np.int64)
        return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)
    assert np.abs(ordinal(got) - ordinal(want)).max() <= 1
    # the scale tensor is read when the graph runs
    scale.fill_(0.25)
    graph.replay()
    torch.cuda.synchronize()
    t = int(np.flatnonzero(call.slots.cpu().numpy() >= 0)[0])
    want = e4m3(call.kv_c[t].cpu().float() / 0.25)
    row = call.rows(call.kv_cache)[int(call.slots[t]), :512].cpu()
    assert (raw_bits(row) == raw_bits(want)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_bad_slot_reported_not_written(rng):
    if not ropepool.cuda_backend:
        pytest.skip("no CUDA backend in this build")
    ropepool.cuda_check_slot_errors()
    call = Call(rng, dtype="bfloat16", device="cuda", T=8, H=16, P=32)
    call.slots[5] = 32
    ropepool.mla_rope_pool_fused(*call.args(), rope_base=10000.0)
    with pytest.raises(RuntimeError, match=r"slots\[5\] = 32 out of range for a pool of 32 slots"):
        ropepool.cuda_check_slot_errors()
    rows = call.rows(call.kv_cache).cpu()
    # the other tokens' rows were written, nothing past the cache (its rows are all there)
    for t, s in enumerate(call.slots.cpu().numpy()):
        if 0 <= s < 32:
            assert (raw_bits(rows[s, :512]) == raw_bits(call.kv_c[t].cpu())).all()
    with pytest.raises(ValueError, match=re.escape("mla_rope_pool_fused: slots[5] = 32 is out of range")):
        ropepool.mla_rope_pool_fused(*call.args(), rope_base=10000.0, check_slots=True)


def test_custom_op_equals_eager_path_and_empty_call(rng):
    """The registered op (what torch.compile and dispatch modes reach) gives the eager fast
    path's bits; T = 0 returns empty outputs and writes nothing."""
    call = Call(rng, dtype="bfloat16", device="cpu", T=5, H=16)
    sched = schedule_of("deepseek-v3")
    cache_before = call.kv_cache.clone()
    q1, k1, _ = ropepool.mla_rope_pool_fused(*call.args(), rope_base=10000, schedule=sched)
    rows1 = call.kv_cache.clone()
    call.kv_cache.copy_(cache_before)
    q2, k2 = torch.ops.ropepool.mla_rope_pool_fused(
        *call.args(), None, 10000.0, True, list(sched.inv_freq), sched.attention_scaling, False,
        None, False)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(rows1, call.kv_cache)
    empty = Call(rng, dtype="bfloat16", device="cpu", T=0, H=16)
    q, k, cache = ropepool.mla_rope_pool_fused(*empty.args(), rope_base=10000.0)
    assert q.shape == (0, 16, 64) and k.shape == (0, 64)
    assert torch.equal(raw_bits_t(cache), raw_bits_t(empty.before))
