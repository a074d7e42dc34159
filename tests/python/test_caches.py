"""SPEC §6 from Python: paged pools (kv_layout "NHD"/"HND"), the K/V halves of vLLM's and
FlashInfer's combined caches built as those projects build them, float8_e4m3fn pools with
k_scale/v_scale (floats and tensors read when the kernel runs), fp8 q_rot, the torch op
under torch.compile and CUDA graphs, and the scale messages. Every test that takes
`kernel_device` runs on the CPU and, where a GPU and the CUDA backend are present, on CUDA
(marked `gpu`, run by scripts/gpu_check.sh).

The fp8 rule (SPEC §6): e4m3(x / scale), the division in float32, round to nearest even,
magnitudes beyond 448 (infinities included) saturate to +-448, NaN stays NaN. torch's own
float8_e4m3fn conversion agrees up to 448 and turns larger magnitudes into NaN (checked
below), so the oracle here is `x.clamp(-448, 448).to(torch.float8_e4m3fn)` (clamp keeps NaN).
"""

import math

import numpy as np
import pytest
import torch

import ropepool

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def spec_e4m3(x32):
    """SPEC §6's rule for float32 values already divided by the scale."""
    return x32.clamp(-448.0, 448.0).to(FP8)


def e4m3_ordinal(x):
    """Neighbouring e4m3 values differ by one (+0 and -0 are both 0)."""
    b = x.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b - 128), b)


def rope_exact(x, positions, rope_base, rotary_dim=None, interleaved=False):
    """The rotation in float64 (NeoX or GPT-J pairs, partial rotary)."""
    x = x.detach().cpu().double()
    D = x.shape[-1]
    R = rotary_dim or D
    half = R // 2
    inv_freq = rope_base ** (-2.0 * torch.arange(half, dtype=torch.float64) / R)
    theta = positions.cpu().double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    out = x.clone()
    if interleaved:
        a, b = x[..., 0:R:2], x[..., 1:R:2]
        out[..., 0:R:2] = a * cos - b * sin
        out[..., 1:R:2] = a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half:R]
        out[..., :half] = a * cos - b * sin
        out[..., half:R] = a * sin + b * cos
    return out


def slot_index(slots, page_size):
    """(page, row) of each slot."""
    s = slots.long().cpu()
    return s // page_size, s % page_size


def pool_rows(pool, slots, kv_layout):
    """The pool rows [T, Hk, D] that `slots` address (all slots >= 0)."""
    if kv_layout is None:
        return pool[slots.long()]
    page_size = pool.shape[1] if kv_layout == "NHD" else pool.shape[2]
    page, row = slot_index(slots, page_size)
    page, row = page.to(pool.device), row.to(pool.device)
    if kv_layout == "NHD":
        return pool[page, row]
    return pool[page, :, row]


def random_bytes(t, gen):
    """Fills any tensor with random bytes (NaNs included for float dtypes): poison."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen).to(t.device))


def make_inputs(rng, device, dtype, T, Hq, Hk, D, P, *, index_dtype=torch.int32, negative=0.2):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 62)))

    def values(*shape):
        # random signs, exponents 2^-6..2^3, all mantissa bits: exact in the dtype
        mag = torch.exp2(torch.randint(-6, 4, shape, generator=gen).double())
        x = mag * (1 + torch.rand(shape, generator=gen, dtype=torch.float64))
        x = torch.where(torch.rand(shape, generator=gen) < 0.5, -x, x)
        return x.to(dtype).to(device)

    q, k, v = values(T, Hq, D), values(T, Hk, D), values(T, Hk, D)
    positions = torch.randint(0, 1 << 20, (T,), generator=gen).to(index_dtype).to(device)
    perm = torch.randperm(P, generator=gen)[:T]
    slots = perm.clone()
    drop = torch.rand(T, generator=gen) < negative
    slots[drop] = -1
    return q, k, v, positions, slots.to(index_dtype).to(device), gen


# ---- the fp8 rule against torch ----------------------------------------------------------------


def test_torch_float8_conversion_overflows_to_nan():
    """The reason the oracle clamps first: torch makes magnitudes that round beyond 448 NaN
    (SPEC §6 saturates them)."""
    x = torch.tensor([448.0, 463.9, 464.0, 465.0, 1e6, math.inf, -math.inf, -500.0])
    got = x.to(FP8).float()
    assert got[:3].tolist() == [448.0, 448.0, 448.0]
    assert torch.isnan(got[3:]).all(), got
    assert spec_e4m3(x).float().tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0,
                                             -448.0]


@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_v_pool_is_bit_exact_on_every_boundary(kernel_device, scale):
    """v is stored as e4m3(v / v_scale) bit for bit: every code, every midpoint between
    neighbours and the float32 values either side of it, saturation, inf, NaN, subnormals;
    checked against torch's conversion where it agrees and the SPEC's saturation where not."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()
    lo, hi = codes[:-1], codes[1:]
    mid = lo + (hi - lo) / 2
    up = torch.nextafter(mid, torch.full_like(mid, 1e9))
    down = torch.nextafter(mid, torch.zeros_like(mid))
    special = torch.tensor([448.0, 449.0, 464.0, 1e6, math.inf, -math.inf, math.nan, 0.0,
                            -0.0, 2.0**-10, 1.5 * 2.0**-9, 3e38])
    vals = torch.cat([codes, mid, up, down, -mid, -up, -down, special])
    vals = vals * torch.tensor(scale, dtype=torch.float32)  # v / scale lands near the boundary
    D = 16
    n = (vals.numel() + D - 1) // D * D
    vals = torch.cat([vals, torch.ones(n - vals.numel())])
    T = n // D
    v = vals.reshape(T, 1, D).to(kernel_device)
    q = torch.ones(T, 1, D, device=kernel_device)
    k = torch.ones(T, 1, D, device=kernel_device)
    positions = torch.zeros(T, dtype=torch.int32, device=kernel_device)
    slots = torch.randperm(T).to(torch.int32).to(kernel_device)
    k_pool = torch.zeros(T, 1, D, dtype=FP8, device=kernel_device)
    v_pool = torch.zeros(T, 1, D, dtype=FP8, device=kernel_device)
    ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                             num_qo_heads=1, num_kv_heads=1, rope_base=10000.0, v_scale=scale)
    want = spec_e4m3(v.cpu() / torch.tensor(scale, dtype=torch.float32))
    got = v_pool.cpu()[slots.cpu().long()]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # where torch's own conversion is finite, it is the same bits
    plain = (v.cpu() / torch.tensor(scale, dtype=torch.float32)).to(FP8)
    finite = ~torch.isnan(plain.float())
    assert torch.equal(got.view(torch.uint8)[finite], plain.view(torch.uint8)[finite])


# ---- every layout, combined caches as vLLM and FlashInfer build them ---------------------------


def build_cache(kind, layout, pages, page_size, Hk, D, dtype, device, gen):
    """(k_pool, v_pool, the whole allocation, the cache view) for one cache kind, inside a
    larger poisoned allocation (guard regions on both sides)."""
    if kind == "own":
        shape = {None: (pages * page_size, Hk, D), "NHD": (pages, page_size, Hk, D),
                 "HND": (pages, Hk, page_size, D)}[layout]
        n = math.prod(shape)
        arena = torch.empty(2 * n + 3 * 4096, dtype=dtype, device=device)
        random_bytes(arena, gen)
        k_pool = arena[4096:4096 + n].view(shape)
        v_pool = arena[n + 2 * 4096:2 * n + 2 * 4096].view(shape)
        return k_pool, v_pool, arena
    if kind == "layer":
        # layer 1 of a layer-stacked cache [L, 2, P, Hk, D] (one tensor for all layers)
        shape = {None: (3, 2, pages * page_size, Hk, D), "NHD": (3, 2, pages, page_size, Hk, D),
                 "HND": (3, 2, pages, Hk, page_size, D)}[layout]
        n = math.prod(shape)
        arena = torch.empty(n + 2 * 4096, dtype=dtype, device=device)
        random_bytes(arena, gen)
        cache = arena[4096:4096 + n].view(shape)
        return cache[1, 0], cache[1, 1], arena
    if kind == "vllm":
        # vLLM's flash-attention backend: kv_cache [2, num_blocks, block_size, Hk, D];
        # key_cache, value_cache = kv_cache.unbind(0)
        assert layout == "NHD"
        shape = (2, pages, page_size, Hk, D)
        n = math.prod(shape)
        arena = torch.empty(n + 2 * 4096, dtype=dtype, device=device)
        random_bytes(arena, gen)
        cache = arena[4096:4096 + n].view(shape)
        key_cache, value_cache = cache.unbind(0)
        return key_cache, value_cache, arena
    if kind == "flashinfer":
        # FlashInfer's paged KV cache: [max_num_pages, 2, page_size, Hk, D] (NHD) or
        # [max_num_pages, 2, Hk, page_size, D] (HND); K = cache[:, 0], V = cache[:, 1]
        shape = {"NHD": (pages, 2, page_size, Hk, D), "HND": (pages, 2, Hk, page_size, D)}[layout]
        n = math.prod(shape)
        arena = torch.empty(n + 2 * 4096, dtype=dtype, device=device)
        random_bytes(arena, gen)
        cache = arena[4096:4096 + n].view(shape)
        return cache[:, 0], cache[:, 1], arena
    raise AssertionError(kind)


def check_call(q, k, v, positions, slots, k_pool, v_pool, arena_before, arena, out, *,
               layout, fp8, k_scale, v_scale, rotary_dim=None, interleaved=False,
               rope_base=10000.0, q_fp8=False, q_scale=1.0):
    q_rot, k_rot, kp, vp = out
    assert kp is k_pool and vp is v_pool
    # q_rot / k_rot
    exact_k = rope_exact(k, positions, rope_base, rotary_dim, interleaved)
    exact_q = rope_exact(q, positions, rope_base, rotary_dim, interleaved)
    from rope_testing import ulp
    err = (k_rot.cpu().double() - exact_k).abs()
    name = str(k.dtype).removeprefix("torch.")
    bound = torch.from_numpy(ulp(exact_k.numpy(), name)) + 2.0**-18 * 32
    assert (err <= bound).all(), f"k_rot off by {err.max()}"
    if q_fp8:
        assert q_rot.dtype == FP8
        want = spec_e4m3((exact_q / q_scale).float())
        assert (e4m3_ordinal(q_rot.cpu()) - e4m3_ordinal(want)).abs().max() <= 1
    else:
        err = (q_rot.cpu().double() - exact_q).abs()
        bound = torch.from_numpy(ulp(exact_q.numpy(), name)) + 2.0**-18 * 32
        assert (err <= bound).all(), f"q_rot off by {err.max()}"
    # pool rows
    written = slots.cpu() >= 0
    ws = slots.cpu()[written]
    k_rows = pool_rows(k_pool, ws.to(k_pool.device), layout).cpu()
    v_rows = pool_rows(v_pool, ws.to(v_pool.device), layout).cpu()
    if fp8:
        want_v = spec_e4m3(v.cpu()[written].float() / torch.tensor(v_scale, dtype=torch.float32))
        assert torch.equal(v_rows.view(torch.uint8), want_v.view(torch.uint8)), "v_pool rows"
        want_k = spec_e4m3((exact_k[written] / k_scale).float())
        d = (e4m3_ordinal(k_rows) - e4m3_ordinal(want_k)).abs()
        assert d.max() <= 1, f"k_pool rows off by {d.max()} e4m3 steps"
    else:
        assert torch.equal(k_rows.view(torch.uint8), k_rot.cpu()[written].contiguous().view(torch.uint8))
        assert torch.equal(v_rows.view(torch.uint8), v.cpu()[written].contiguous().view(torch.uint8))
    # every other byte of the allocation unchanged: mark the written rows
    now = arena.cpu().view(torch.uint8).clone()
    before = arena_before.view(torch.uint8)
    mask = torch.zeros_like(now, dtype=torch.bool)
    es = k_pool.element_size()
    base = arena.data_ptr()
    for pool in (k_pool, v_pool):
        for s in ws.tolist():
            ps = 1 if layout is None else (pool.shape[1] if layout == "NHD" else pool.shape[2])
            page, row = divmod(s, ps)
            for h in range(pool.shape[-2] if layout != "HND" else pool.shape[1]):
                if layout is None:
                    off = page * pool.stride(0) + h * pool.stride(1)
                elif layout == "NHD":
                    off = page * pool.stride(0) + row * pool.stride(1) + h * pool.stride(2)
                else:
                    off = page * pool.stride(0) + h * pool.stride(1) + row * pool.stride(2)
                start = pool.data_ptr() - base + off * es
                mask[start:start + pool.shape[-1] * es] = True
    changed = (now != before) & ~mask
    assert not changed.any(), f"{int(changed.sum())} bytes outside the written rows changed"


CACHE_CASES = (
    [("own", None, 1), ("layer", None, 1)]
    + [(kind, layout, ps) for kind in ("own", "layer", "flashinfer") for layout in ("NHD", "HND")
       for ps in (1, 5, 16, 64)]
    + [("vllm", "NHD", ps) for ps in (1, 5, 16, 64)]
)


@pytest.mark.parametrize("kind,layout,page_size", CACHE_CASES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layout(kernel_device, rng, kind, layout, page_size, fp8, dtype):
    T, Hq, Hk, D = 19, 4, 2, 32
    pages = (100 + page_size - 1) // page_size
    P = pages * page_size
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, dtype, T, Hq, Hk, D, P)
    k_pool, v_pool, arena = build_cache(kind, layout, pages, page_size, Hk, D,
                                        FP8 if fp8 else dtype, kernel_device, gen)
    before = arena.cpu().clone()
    extra = dict(k_scale=0.02, v_scale=0.5) if fp8 else {}
    out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                                   num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0,
                                   kv_layout=layout, **extra)
    check_call(q, k, v, positions, slots, k_pool, v_pool, before, arena, out, layout=layout,
               fp8=fp8, k_scale=0.02, v_scale=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_pool", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 24])
def test_fp8_q_rot_and_keywords(kernel_device, rng, dtype, fp8_pool, interleaved, rotary_dim):
    """fp8 q_rot with q_scale, with partial rotary, GPT-J pairs, int64 indices and negative
    slots, on a FlashInfer HND cache."""
    T, Hq, Hk, D, ps = 23, 4, 2, 32, 16
    pages = 4
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, dtype, T, Hq, Hk, D,
                                                 pages * ps, index_dtype=torch.int64)
    k_pool, v_pool, arena = build_cache("flashinfer", "HND", pages, ps, Hk, D,
                                        FP8 if fp8_pool else dtype, kernel_device, gen)
    before = arena.cpu().clone()
    q_scale = torch.tensor([0.03], device=kernel_device)
    extra = dict(k_scale=torch.tensor([0.05], device=kernel_device), v_scale=0.25) if fp8_pool else {}
    out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                                   num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0,
                                   kv_layout="HND", rotary_dim=rotary_dim, interleaved=interleaved,
                                   q_out_dtype=torch.float8_e4m3fn, q_scale=q_scale, **extra)
    assert out[0].dtype == FP8 and out[1].dtype == dtype
    check_call(q, k, v, positions, slots, k_pool, v_pool, before, arena, out, layout="HND",
               fp8=fp8_pool, k_scale=0.05, v_scale=0.25, rotary_dim=rotary_dim,
               interleaved=interleaved, q_fp8=True, q_scale=0.03)


def test_inplace_and_rope_scaling_with_fp8_paged(kernel_device, rng):
    T, Hq, Hk, D, ps = 17, 4, 2, 64, 16
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, torch.bfloat16, T, Hq, Hk,
                                                 D, 64)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=500000.0,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
              kv_layout="NHD", k_scale=0.1, v_scale=0.2)
    pools = [torch.zeros(4, ps, Hk, D, dtype=FP8, device=kernel_device) for _ in range(4)]
    ref = ropepool.rope_pool_fused(q, k, v, positions, slots, pools[0], pools[1], **kw)
    q2, k2 = q.clone(), k.clone()
    out = ropepool.rope_pool_fused(q2, k2, v, positions, slots, pools[2], pools[3], inplace=True, **kw)
    assert out[0] is q2 and out[1] is k2
    assert torch.equal(q2.view(torch.int16), ref[0].view(torch.int16))
    assert torch.equal(k2.view(torch.int16), ref[1].view(torch.int16))
    assert torch.equal(pools[2].view(torch.uint8), pools[0].view(torch.uint8))
    assert torch.equal(pools[3].view(torch.uint8), pools[1].view(torch.uint8))
    with pytest.raises(ValueError, match="cannot be combined with inplace=True"):
        ropepool.rope_pool_fused(q2, k2, v, positions, slots, pools[2], pools[3], inplace=True,
                                 q_out_dtype=FP8, **kw)


def test_out_of_range_slot_writes_nothing(rng):
    T, Hq, Hk, D, ps = 5, 2, 1, 16, 5
    q, k, v, positions, slots, gen = make_inputs(rng, "cpu", torch.float32, T, Hq, Hk, D, 20,
                                                 negative=0)
    k_pool = torch.zeros(4, Hk, ps, D, dtype=FP8)
    v_pool = torch.zeros(4, Hk, ps, D, dtype=FP8)
    random_bytes(k_pool, gen)
    random_bytes(v_pool, gen)
    kb, vb = k_pool.clone(), v_pool.clone()
    slots[3] = 20
    with pytest.raises(ValueError) as info:
        ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                                 num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0,
                                 kv_layout="HND", k_scale=2.0)
    assert str(info.value) == "rope_pool_fused: slots[3] = 20 is out of range for a pool of 20 slots"
    assert torch.equal(k_pool.view(torch.uint8), kb.view(torch.uint8))
    assert torch.equal(v_pool.view(torch.uint8), vb.view(torch.uint8))


# ---- scales read when the kernel runs ---------------------------------------------------------


def test_tensor_scale_is_read_each_call(kernel_device, rng):
    T, Hq, Hk, D = 8, 2, 2, 32
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, torch.float16, T, Hq, Hk, D,
                                                 T, negative=0)
    k_scale = torch.tensor([0.5], device=kernel_device)
    v_scale = torch.tensor(0.25, device=kernel_device)  # 0-d: one element too
    k_pool = torch.empty(T, Hk, D, dtype=FP8, device=kernel_device)
    v_pool = torch.empty(T, Hk, D, dtype=FP8, device=kernel_device)
    for ks, vs in ((0.5, 0.25), (3.0, 0.0625)):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                                       num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0,
                                       k_scale=k_scale, v_scale=v_scale)
        want_v = spec_e4m3(v.cpu().float() / vs)
        assert torch.equal(v_pool.cpu()[slots.cpu().long()].view(torch.uint8), want_v.view(torch.uint8))
        exact = rope_exact(k, positions, 10000.0)
        want_k = spec_e4m3((exact / ks).float())
        assert (e4m3_ordinal(k_pool.cpu()[slots.cpu().long()]) - e4m3_ordinal(want_k)).abs().max() <= 1
        assert out[2] is k_pool


def test_opcheck_with_cache_keywords(kernel_device, rng):
    """torch.library.opcheck with fp8 paged pools, tensor and float scales and an fp8 q_rot:
    schema (the pools mutated, the scales only read), fake implementation, autograd
    registration."""
    T, Hq, Hk, D, ps = 5, 2, 1, 32, 4
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, torch.float16, T, Hq, Hk, D,
                                                 8, negative=0)
    k_pool = torch.zeros(2, Hk, ps, D, dtype=FP8, device=kernel_device)
    v_pool = torch.zeros(2, Hk, ps, D, dtype=FP8, device=kernel_device)
    scale = torch.tensor([0.5], device=kernel_device)
    args = (q, k, v, positions, slots, k_pool, v_pool, D, Hq, Hk, 10000.0, False, 0, False, None,
            1.0, "HND", scale, None, None, 0.25, scale, None, True)
    # torch's schema check compares outputs with arithmetic it lacks for float8 tensors
    # ("mul_cpu_reduced_float" not implemented): with fp8 the other checks, and the schema
    # check on the same call with pools and q_rot in q's dtype
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused.default, args,
                          test_utils=("test_faketensor", "test_autograd_registration"))
    plain = (q, k, v, positions, slots, torch.zeros(2, Hk, ps, D, dtype=q.dtype, device=kernel_device),
             torch.zeros(2, Hk, ps, D, dtype=q.dtype, device=kernel_device), D, Hq, Hk, 10000.0,
             False, 0, False, None, 1.0, "HND", None, None, None, None, None, None, False)
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused.default, plain)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_with_tensor_scales(kernel_device, rng, backend):
    torch._dynamo.reset()
    T, Hq, Hk, D, ps = 9, 4, 2, 32, 16
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, torch.bfloat16, T, Hq, Hk,
                                                 D, 32, negative=0)
    k_scale = torch.tensor([0.25], device=kernel_device)
    v_scale = torch.tensor([0.5], device=kernel_device)
    q_scale = torch.tensor([0.125], device=kernel_device)

    def step(q, k, v, positions, slots, k_pool, v_pool, k_scale, v_scale, q_scale):
        q_rot, k_rot, _, _ = ropepool.rope_pool_fused(
            q, k, v, positions, slots, k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
            num_kv_heads=Hk, rope_base=10000.0, kv_layout="HND", k_scale=k_scale,
            v_scale=v_scale, q_scale=q_scale, q_out_dtype=torch.float8_e4m3fn)
        return q_rot, k_rot

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    pools = [torch.zeros(2, Hk, ps, D, dtype=FP8, device=kernel_device) for _ in range(4)]
    for scale in (0.25, 2.0):
        k_scale.fill_(scale)
        got = compiled(q, k, v, positions, slots, pools[0], pools[1], k_scale, v_scale, q_scale)
        want = step(q, k, v, positions, slots, pools[2], pools[3], k_scale, v_scale, q_scale)
        assert got[0].dtype == FP8
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
        assert torch.equal(pools[0].view(torch.uint8), pools[2].view(torch.uint8))
        assert torch.equal(pools[1].view(torch.uint8), pools[3].view(torch.uint8))


def test_fake_impl_returns_fp8_q_rot():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 4, 16, dtype=torch.bfloat16)
        k = torch.empty(3, 2, 16, dtype=torch.bfloat16)
        pool = torch.empty(2, 8, 2, 16, dtype=FP8)
        pos = torch.empty(3, dtype=torch.int32)
        q_rot, k_rot, _, _ = ropepool.rope_pool_fused(
            q, k, k, pos, pos, pool, torch.empty_like(pool), head_dim=16, num_qo_heads=4,
            num_kv_heads=2, rope_base=10000.0, kv_layout="NHD", q_out_dtype="float8_e4m3fn")
        assert q_rot.dtype == FP8 and q_rot.shape == q.shape
        assert k_rot.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_replay_reads_changed_scale(rng):
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    T, Hq, Hk, D, ps = 16, 4, 2, 64, 16
    q, k, v, positions, slots, gen = make_inputs(rng, "cuda", torch.bfloat16, T, Hq, Hk, D, 64,
                                                 negative=0)
    k_scale = torch.tensor([0.5], device="cuda")
    v_scale = torch.tensor([0.5], device="cuda")
    k_pool = torch.zeros(4, ps, Hk, D, dtype=FP8, device="cuda")
    v_pool = torch.zeros(4, ps, Hk, D, dtype=FP8, device="cuda")
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0, kv_layout="NHD",
              k_scale=k_scale, v_scale=v_scale)
    ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    for vs in (0.5, 0.125, 4.0):
        v_scale.fill_(vs)
        graph.replay()
        torch.cuda.synchronize()
        want = spec_e4m3(v.cpu().float() / vs)
        got = pool_rows(v_pool, slots, "NHD").cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), vs


# ---- the eager fast path -----------------------------------------------------------------------


FAST_CACHE_CALLS = [
    dict(kv_layout="NHD", k_scale=0.5, v_scale="tensor"),
    dict(kv_layout="NHD", k_scale="tensor", v_scale=0.25, q_out_dtype=FP8, q_scale=0.75),
    dict(kv_layout="NHD", k_scale=0.5, v_scale=0.25, q_out_dtype=FP8, q_scale="tensor",
         return_k_rot=False),
    dict(kv_layout="NHD", k_scale=0.5, v_scale=0.25, q_out_dtype=FP8, q_scale=0.75,
         q_out="fp8"),
    dict(kv_layout="NHD", k_scale=0.5, v_scale=0.25, k_out="k"),
    dict(kv_layout="NHD", k_scale=0.5, v_scale=0.25, inplace=True),
    dict(kv_layout="NHD", k_scale=0.5, v_scale=0.25, inplace=True, return_k_rot=False),
    dict(kv_layout="HND", k_scale=0.5, v_scale=0.25, return_k_rot=False, pool="bf16"),
]


@pytest.mark.parametrize("call", range(len(FAST_CACHE_CALLS)))
def test_eager_fast_path_with_cache_keywords(kernel_device, rng, monkeypatch, call):
    """Once the geometry is known, eager calls with SPEC §6's keywords (a layout, float and
    tensor scales, an fp8 q_rot, return_k_rot=False, q_out/k_out, inplace) take the fast
    path: the same bits as the keyword machinery (the first call of the geometry), every
    byte of the cache allocation, the caller's objects returned, their versions bumped."""
    import ropepool._op as op
    spec = dict(FAST_CACHE_CALLS[call])
    T, Hq, Hk, D, ps, pages = 9, 4, 2, 64, 4, 6
    pool_dtype = torch.bfloat16 if spec.pop("pool", None) == "bf16" else FP8
    if pool_dtype is not FP8:
        del spec["k_scale"], spec["v_scale"]
    q, k, v, positions, slots, gen = make_inputs(rng, kernel_device, torch.bfloat16, T, Hq, Hk,
                                                 D, pages * ps)
    taken = []
    fast = op._fast_keyword_call
    monkeypatch.setattr(op, "_fast_keyword_call", lambda *a: taken.append(1) or fast(*a))
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=float(rng.integers(1, 10**6)))
    runs = []
    for fast_path in (False, True):  # the first call registers the geometry
        if not fast_path:
            monkeypatch.setattr(op, "_FAST_GEOMETRIES", set())
        k_pool, v_pool, arena = build_cache("flashinfer", spec["kv_layout"], pages, ps, Hk, D,
                                            pool_dtype, kernel_device,
                                            torch.Generator().manual_seed(7))
        extra = {}
        for name, value in spec.items():
            if value == "tensor":  # a fresh one-element tensor per run
                value = torch.tensor([0.375], device=kernel_device)
            elif name == "q_out":
                value = torch.empty(q.shape, dtype=FP8, device=kernel_device)
                random_bytes(value, gen)
            elif name == "k_out":
                value = torch.empty_like(k)
                random_bytes(value, gen)
            extra[name] = value
        qi, ki = q.clone(), k.clone()
        mutated = [x for x in (extra.get("q_out"), extra.get("k_out"), k_pool, v_pool)
                   if x is not None]
        if spec.get("inplace"):
            mutated.append(qi)
        versions = [x._version for x in mutated]
        n = len(taken)
        out = ropepool.rope_pool_fused(qi, ki, v, positions, slots, k_pool, v_pool, **kw,
                                       **extra)
        assert len(taken) == n + fast_path, "the fast path taken on the second call only"
        assert out[2] is k_pool and out[3] is v_pool
        if spec.get("inplace"):
            assert out[0] is qi and out[1] is (ki if spec.get("return_k_rot", True) else None)
        if "q_out" in extra:
            assert out[0] is extra["q_out"]
        if "k_out" in extra:
            assert out[1] is extra["k_out"]
        if spec.get("return_k_rot", True) is False:
            assert out[1] is None
            assert torch.equal(ki.view(torch.int16), k.view(torch.int16)), "k written"
        assert out[0].dtype == (FP8 if "q_out_dtype" in spec else torch.bfloat16)
        assert all(x._version > b for x, b in zip(mutated, versions))
        runs.append([None if x is None else x.cpu().view(torch.uint8).clone()
                     for x in (out[0], out[1], arena)])
    for name, slow, quick in zip(("q_rot", "k_rot", "the cache allocation"), *runs):
        assert (slow is None) == (quick is None), name
        assert slow is None or torch.equal(slow, quick), name


def test_fast_path_cache_errors_and_slow_path_checks(monkeypatch):
    """With the geometry known: the core's messages for bad cache keyword values (nothing
    written), and what only the keyword machinery checks still checked there (it is never
    the fast path's)."""
    import ropepool._op as op
    taken = []
    fast = op._fast_keyword_call
    monkeypatch.setattr(op, "_fast_keyword_call", lambda *a: taken.append(1) or fast(*a))
    args, kw = small(layout="NHD")
    kw["rope_base"] = 4242.0
    ropepool.rope_pool_fused(*args, **kw)  # registers the geometry
    before = [a.clone() for a in args[5:]]
    for change, message in [
        (dict(k_scale=0.0), "rope_pool_fused: k_scale must be finite and > 0, got 0.0"),
        (dict(v_scale=torch.tensor([1.0], dtype=torch.float64)),
         "rope_pool_fused: v_scale must be a float32 tensor, got float64"),
        (dict(kv_layout="nhd"), 'rope_pool_fused: kv_layout must be None, "NHD" or "HND", got "nhd"'),
        (dict(q_scale=2.0), "rope_pool_fused: q_scale is given but q_rot is float32; q_scale "
                            "quantises a float8_e4m3fn q_rot only"),
    ]:
        n = len(taken)
        with pytest.raises(ValueError) as info:
            ropepool.rope_pool_fused(*args, **{**kw, **change})
        assert str(info.value) == message
        assert len(taken) == n + 1, change
    for change, exc, match in [
        (dict(k_scale=True), TypeError, "k_scale must be a float or a one-element float32 "
                                        "tensor, got bool"),
        (dict(q_out_dtype=torch.float16), ValueError, "q_out_dtype must be None or float8_e4m3fn"),
        (dict(q_out_dtype=FP8, inplace=True), ValueError, "cannot be combined with inplace=True"),
        (dict(return_k_rot=False, k_out=args[1].clone()), ValueError,
         "k_out cannot be combined with return_k_rot=False"),
        (dict(q_out=torch.empty(args[0].shape, dtype=FP8)), ValueError,
         "q_out is float8_e4m3fn but q_out_dtype is None"),
        (dict(q_out_dtype=FP8, q_out=torch.empty_like(args[0])), ValueError,
         "q_out must be float8_e4m3fn"),
    ]:
        n = len(taken)
        with pytest.raises(exc, match=match):
            ropepool.rope_pool_fused(*args, **{**kw, **change})
        assert len(taken) == n, change
    for a, b in zip(args[5:], before):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # other Python types of good values: the slow path, the same result
    n = len(taken)
    out_int = ropepool.rope_pool_fused(*args, **kw, k_scale=2, q_out_dtype="float8_e4m3fn")
    assert len(taken) == n
    k_pool = args[5].clone()
    out = ropepool.rope_pool_fused(*args[:5], k_pool, args[6], **kw, k_scale=2.0,
                                   q_out_dtype=FP8)
    assert len(taken) == n + 1
    assert torch.equal(out[0].view(torch.uint8), out_int[0].view(torch.uint8))
    assert torch.equal(k_pool.view(torch.uint8), args[5].view(torch.uint8))


# ---- validation ---------------------------------------------------------------------------------


def small(device="cpu", pool_dtype=FP8, layout=None):
    T, Hq, Hk, D = 3, 2, 1, 16
    q = torch.randn(T, Hq, D, device=device)
    k = torch.randn(T, Hk, D, device=device)
    shape = {None: (8, Hk, D), "NHD": (2, 4, Hk, D), "HND": (2, Hk, 4, D)}[layout]
    pools = (torch.zeros(shape, dtype=pool_dtype, device=device),
             torch.zeros(shape, dtype=pool_dtype, device=device))
    idx = torch.arange(T, dtype=torch.int32, device=device)
    return (q, k, k.clone(), idx, idx, *pools), dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk,
                                                     rope_base=10000.0, kv_layout=layout)


@pytest.mark.parametrize("change,message", [
    (dict(k_scale=0.0), "rope_pool_fused: k_scale must be finite and > 0, got 0.0"),
    (dict(v_scale=-2.0), "rope_pool_fused: v_scale must be finite and > 0, got -2.0"),
    (dict(k_scale=math.nan), "rope_pool_fused: k_scale must be finite and > 0, got nan"),
    (dict(k_scale=1e-60), "rope_pool_fused: k_scale must be finite and > 0, got 1e-60 (0.0 as float32)"),
    (dict(k_scale=torch.tensor([1.0, 2.0])),
     "rope_pool_fused: k_scale must be a number or a one-element float32 tensor, got shape torch.Size([2])"),
    (dict(k_scale=torch.tensor([1.0], dtype=torch.float64)),
     "rope_pool_fused: k_scale must be a float32 tensor, got float64"),
    (dict(v_scale=torch.tensor([0.0])),
     "rope_pool_fused: v_scale must be finite and > 0, got 0.0 (the tensor's value)"),
    (dict(q_scale=2.0), "rope_pool_fused: q_scale is given but q_rot is float32; q_scale "
                        "quantises a float8_e4m3fn q_rot only"),
    (dict(kv_layout="nhd"), 'rope_pool_fused: kv_layout must be None, "NHD" or "HND", got "nhd"'),
    (dict(kv_layout="NHD"), 'rope_pool_fused: kv_layout "NHD" expects 4-D pools [pages, '
                            'page_size, num_kv_heads = 1, head_dim = 16], got k_pool '
                            'torch.Size([8, 1, 16])'),
])
def test_scale_and_layout_messages(change, message):
    args, kw = small()
    kw.update(change)
    before = [a.clone() for a in args[5:]]
    for fn in (ropepool.rope_pool_fused, ropepool.validate_rope_pool):
        with pytest.raises(ValueError) as info:
            fn(*args, **kw)
        assert str(info.value) == message
    for a, b in zip(args[5:], before):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_scale_with_non_fp8_pool_and_type_errors():
    args, kw = small(pool_dtype=torch.float32)
    with pytest.raises(ValueError, match="k_scale is given but the pools are float32"):
        ropepool.rope_pool_fused(*args, **kw, k_scale=1.0)
    args, kw = small()
    with pytest.raises(TypeError, match="k_scale must be a float or a one-element float32 tensor, got bool"):
        ropepool.rope_pool_fused(*args, **kw, k_scale=True)
    with pytest.raises(TypeError, match="got str"):
        ropepool.rope_pool_fused(*args, **kw, v_scale="1.0")
    with pytest.raises(ValueError, match="q_out_dtype must be None or float8_e4m3fn"):
        ropepool.rope_pool_fused(*args, **kw, q_out_dtype=torch.float16)


def test_4d_pool_without_kv_layout_keeps_the_seed_message():
    args, kw = small(layout="NHD")
    kw["kv_layout"] = None
    with pytest.raises(ValueError) as info:
        ropepool.rope_pool_fused(*args, **kw)
    assert str(info.value) == "rope_pool_fused expects pool tensors to be 3-D"
    assert "kv_layout" in info.value.__notes__[0]


def test_numpy_fp8_is_a_clear_error():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    T, H, D = 2, 1, 8
    q = np.ones((T, H, D), np.float32)
    idx = np.arange(T, dtype=np.int32)
    pool = np.zeros((4, H, D), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="NumPy cannot export float8"):
        ropepool.rope_pool_fused(q, q.copy(), q.copy(), idx, idx, pool, pool.copy(), head_dim=D,
                                 num_qo_heads=H, num_kv_heads=H, rope_base=10000.0)


def test_numpy_paged_pools(rng):
    """NumPy (DLPack) with an NHD pool: same bits as torch."""
    T, Hq, Hk, D, ps = 6, 2, 1, 16, 4
    q, k, v, positions, slots, gen = make_inputs(rng, "cpu", torch.float32, T, Hq, Hk, D, 8,
                                                 negative=0.3)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0, kv_layout="NHD")
    tk, tv = torch.zeros(2, ps, Hk, D), torch.zeros(2, ps, Hk, D)
    ropepool.rope_pool_fused(q, k, v, positions, slots, tk, tv, **kw)
    nk, nv = np.zeros((2, ps, Hk, D), np.float32), np.zeros((2, ps, Hk, D), np.float32)
    out = ropepool.rope_pool_fused(q.numpy(), k.numpy(), v.numpy(), positions.numpy(),
                                   slots.numpy(), nk, nv, **kw)
    assert out[2] is nk
    assert np.array_equal(nk.view(np.int32), tk.numpy().view(np.int32))
    assert np.array_equal(nv.view(np.int32), tv.numpy().view(np.int32))
