"""CUDA backend tests (marked `gpu`; skipped without a CUDA device or a CUDA build).

Every test draws fresh random inputs, poisons what the op writes, and checks every element:
against the float64 reference (SPEC §1 bound), and CUDA against the CPU backend on the same
inputs (pool rows and rotated q/k bit-identical or one unit in the last place apart: both
round a float32 result once, from slightly different float32 sin/cos).
"""

import re

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import (
    Case,
    assert_within_bound,
    dtype_name,
    make_case,
    random_positions,
    raw_bits,
    rope_exact,
    to_f64,
    ulp,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(autouse=True)
def cuda_build():
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    ropepool.cuda_check_slot_errors()  # nothing pending from an earlier test
    yield
    torch.cuda.synchronize()


def kwargs(case, **extra):
    return dict(head_dim=case.head_dim, num_qo_heads=case.num_qo_heads,
                num_kv_heads=case.num_kv_heads, rope_base=case.rope_base, **extra)


def run(case, **extra):
    return ropepool.rope_pool_fused(*case.args(), **kwargs(case, **extra))


def to_cpu(case):
    """The same inputs as CPU tensors (a new Case; the pools are copies)."""
    c = type(case)(*(x.cpu().clone() for x in case.args()), case.head_dim, case.num_qo_heads,
                   case.num_kv_heads, case.rope_base)
    return c.snapshot()


def assert_agrees_with_cpu(got, want, x, positions, rope_base, what):
    """CUDA and CPU round the same math once each from float32 with slightly different
    float32 sin/cos, so each lies within the SPEC bound of the exact value and they differ
    by at most the two bounds together: 2 ulp(exact) + 2 * 2^-18 (|a| + |b|). Where the
    result cancels (a cos - b sin ~ 0) that is many ulps of the result; elsewhere it is 1-2."""
    exact, abs_ab = rope_exact(x, positions, rope_base)
    g, w = to_f64(got), to_f64(want)
    bound = 2 * ulp(exact, dtype_name(got)) + 2.0**-17 * abs_ab
    ok = np.abs(g - w) <= bound  # NaN fails
    if not ok.all():
        i = tuple(int(v) for v in np.argwhere(~ok)[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} elements apart by more than both SPEC "
                             f"bounds, first at {i}: CUDA {g[i]!r}, CPU {w[i]!r}, exact {exact[i]!r}")


def assert_rows(case, k_rot, written_tokens):
    """k_pool/v_pool rows of `written_tokens` (token -> slot) hold k_rot / v bit for bit;
    every other row is unchanged."""
    k_pool, v_pool = raw_bits(case.k_pool), raw_bits(case.v_pool)
    k_bits, v_bits = raw_bits(k_rot), case.before["v"]
    rows = np.array(sorted(written_tokens.values()), dtype=np.int64)
    for t, s in written_tokens.items():
        np.testing.assert_array_equal(k_pool[s], k_bits[t], err_msg=f"k_pool[{s}] != k_rot[{t}]")
        np.testing.assert_array_equal(v_pool[s], v_bits[t], err_msg=f"v_pool[{s}] != v[{t}]")
    untouched = np.setdiff1d(np.arange(k_pool.shape[0]), rows)
    np.testing.assert_array_equal(k_pool[untouched], case.before["k_pool"][untouched],
                                  err_msg="a k_pool row without a token changed")
    np.testing.assert_array_equal(v_pool[untouched], case.before["v_pool"][untouched],
                                  err_msg="a v_pool row without a token changed")


def slot_map(case):
    slots = to_f64(case.slots).astype(np.int64)
    P = case.k_pool.shape[0]
    return {t: int(s) for t, s in enumerate(slots) if 0 <= s < P}


# Head sizes: the tuned kernels (64, 96, 128, 256), the generic 16-byte path (80), and sizes
# the 16-byte vectors do not divide in half (72 for 16-bit types, 34): the scalar path.
HEAD_DIMS = [64, 96, 128, 256, 80, 72, 34]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", [(4, 2), (32, 8), (5, 3)])
@pytest.mark.parametrize("T", [1, 7, 300, 1500])
def test_cuda_matches_cpu_and_reference(dtype, head_dim, heads, T, rng):
    """T = 1 writes pool rows directly, 7 deduplicates slots with a shared-memory scan,
    300 and 1500 with per-slot locks (docs/CUDA.md)."""
    Hq, Hk = heads
    if T == 1500 and (head_dim not in (128, 72) or Hq != 32):
        pytest.skip("large T: one tuned and one scalar head size are enough")
    case = make_case("torch", dtype, rng, T=T, Hq=Hq, Hk=Hk, D=head_dim, P=T + 37,
                     device="cuda").snapshot()
    cpu = to_cpu(case)
    q_rot, k_rot, k_pool, v_pool = run(case)
    assert k_pool is case.k_pool and v_pool is case.v_pool  # donated, not copied
    q_cpu, k_cpu, _, _ = run(cpu)
    torch.cuda.synchronize()
    assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot")
    assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot")
    assert_agrees_with_cpu(q_rot, q_cpu, case.q, case.positions, case.rope_base, "q_rot CUDA vs CPU")
    assert_agrees_with_cpu(k_rot, k_cpu, case.k, case.positions, case.rope_base, "k_rot CUDA vs CPU")
    same = (raw_bits(q_rot) == raw_bits(q_cpu)).mean()
    if dtype != "float32":  # one rounding to 8/11 bits from nearly equal floats: mostly equal
        assert same > 0.9, f"only {same:.1%} of q_rot is bit-identical to the CPU backend"
    # Pools: the same rows written on both sides (each bit-identical to its own k_rot),
    # the same v rows, and every other row untouched on both.
    assert_rows(case, k_rot, slot_map(case))
    assert_rows(cpu, k_cpu, slot_map(cpu))
    np.testing.assert_array_equal(raw_bits(case.v_pool), raw_bits(cpu.v_pool))
    case.assert_unchanged("q", "k", "v", "positions", "slots")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accuracy_near_position_2_20(dtype, rng):
    """Every position within 4096 of 2^20, where float32 angles are off by ~0.03 rad."""
    T = 512
    pos = 2**20 - 1 - rng.integers(0, 4096, size=T)
    case = make_case("torch", dtype, rng, T=T, Hq=8, Hk=2, D=128, P=T, device="cuda",
                     positions=pos, rope_base=10000.0).snapshot()
    q_rot, k_rot, _, _ = run(case)
    assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot")
    assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot")


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_negative_slots_and_untouched_rows(index_dtype, rng):
    T, P = 64, 200
    slots = rng.permutation(P)[:T]
    skip = rng.random(T) < 0.4
    slots[skip] = -rng.integers(1, 1000, size=int(skip.sum()))
    case = make_case("torch", "bfloat16", rng, T=T, Hq=8, Hk=4, D=128, P=P, device="cuda",
                     slots=slots, index_dtype=index_dtype).snapshot()
    _, k_rot, _, _ = run(case)
    torch.cuda.synchronize()
    assert_rows(case, k_rot, slot_map(case))


def test_zero_tokens(rng):
    case = make_case("torch", "float16", rng, T=0, Hq=4, Hk=2, D=64, P=8, device="cuda").snapshot()
    q_rot, k_rot, _, _ = run(case)
    assert q_rot.shape == (0, 4, 64) and k_rot.shape == (0, 2, 64)
    assert q_rot.device.type == "cuda"
    case.assert_unchanged()


def test_out_of_range_slot_with_check_slots_writes_nothing(rng, poisoned_outputs):
    T, P = 50, 64
    slots = rng.permutation(P)[:T]
    slots[17], slots[31] = P, P + 5
    case = make_case("torch", "bfloat16", rng, T=T, Hq=4, Hk=2, D=128, P=P, device="cuda",
                     slots=slots).snapshot()
    with pytest.raises(ValueError, match=re.escape(
            f"rope_pool_fused: slots[17] = {P} is out of range for a pool of {P} slots")):
        run(case, check_slots=True)
    torch.cuda.synchronize()
    case.assert_unchanged()
    for out in poisoned_outputs.allocated:  # q_rot / k_rot: not one element written
        assert torch.isnan(out).all()
    ropepool.cuda_check_slot_errors()  # and nothing was recorded for later


def test_duplicate_slot_with_check_slots_writes_nothing(rng):
    T, P = 20, 64
    slots = rng.permutation(P)[:T]
    slots[13] = slots[4]
    case = make_case("torch", "float32", rng, T=T, Hq=4, Hk=2, D=64, P=P, device="cuda",
                     slots=slots).snapshot()
    with pytest.raises(ValueError, match=re.escape(f"slots[13] = {slots[4]} repeats slots[4]")):
        run(case, check_slots=True)
    torch.cuda.synchronize()
    case.assert_unchanged()


@pytest.mark.parametrize("T", [40, 3000])  # scan and lock modes
def test_out_of_range_slot_reported_by_next_call(T, rng):
    """Default (no sync): the bad token's rows are skipped, every other row is written, and
    the next call on the device raises RuntimeError naming the bad slot, then runs normally."""
    P = T + 10
    slots = rng.permutation(P)[:T]
    bad = int(rng.integers(0, T))
    slots[bad] = P + 1000
    case = make_case("torch", "float16", rng, T=T, Hq=4, Hk=2, D=128, P=P, device="cuda",
                     slots=slots).snapshot()
    _, k_rot, _, _ = run(case)  # returns without waiting for the GPU
    torch.cuda.synchronize()
    assert_rows(case, k_rot, slot_map(case))  # only in-range rows written
    nxt = make_case("torch", "float16", rng, T=8, Hq=4, Hk=2, D=128, P=16, device="cuda").snapshot()
    with pytest.raises(RuntimeError, match=re.escape(
            f"slots[{bad}] = {P + 1000} out of range for a pool of {P} slots")):
        run(nxt)
    nxt.assert_unchanged()  # the reporting call did nothing else
    _, k_rot2, _, _ = run(nxt)  # reported once: the next call runs
    torch.cuda.synchronize()
    assert_rows(nxt, k_rot2, slot_map(nxt))


@pytest.mark.parametrize("T", [200, 4096])  # shared-memory scan, per-slot locks
@pytest.mark.parametrize("index_dtype, strided", [("int32", False), ("int64", True)])
def test_duplicate_slots_without_check_keep_whole_rows(T, index_dtype, strided, rng):
    P = 6
    slots = np.arange(T) % 5
    case = make_case("torch", "bfloat16", rng, T=T, Hq=4, Hk=8, D=128, P=P, device="cuda",
                     index_dtype=index_dtype, slots=slots)
    if strided:  # every other element of a [T, 2] tensor: stride 2, no copy
        case.slots = torch.stack([case.slots, torch.full_like(case.slots, 1 << 30)], dim=1)[:, 0]
        assert case.slots.stride() == (2,)
    case.snapshot()
    _, k_rot, _, _ = run(case)
    torch.cuda.synchronize()
    k_pool, v_pool = raw_bits(case.k_pool), raw_bits(case.v_pool)
    k_bits, v_bits = raw_bits(k_rot), case.before["v"]
    for s in range(5):
        owners = [t for t in np.nonzero(slots == s)[0]
                  if (k_pool[s] == k_bits[t]).all() and (v_pool[s] == v_bits[t]).all()]
        assert owners, f"row {s} is not one token's complete k_rot/v row (mixed heads?)"
        if T <= 256:  # the shared-memory scan: the last token with the slot wins, as on the CPU
            assert owners[-1] == np.nonzero(slots == s)[0][-1], f"row {s}: not the last token"
    np.testing.assert_array_equal(k_pool[5], case.before["k_pool"][5])


def test_strided_views_and_misaligned_views(rng):
    """q/k/v as views into one fused QKV output [T, (Hq + 2 Hk) * D] (16-byte path), and
    views one element off a 16-byte boundary (scalar path)."""
    T, Hq, Hk, D, P = 33, 6, 2, 128, 50
    for offset in (0, 1):
        qkv = torch.randn(T * (Hq + 2 * Hk) * D + offset, device="cuda").to(torch.bfloat16)
        fused = qkv[offset:].view(T, (Hq + 2 * Hk) * D)
        q = fused[:, : Hq * D].view(T, Hq, D)
        k = fused[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
        v = fused[:, (Hq + Hk) * D :].view(T, Hk, D)
        k_pool = torch.randn(P * Hk * D + offset, device="cuda").to(torch.bfloat16)[offset:].view(P, Hk, D)
        v_pool = torch.randn(P * Hk * D + offset, device="cuda").to(torch.bfloat16)[offset:].view(P, Hk, D)
        positions = torch.from_numpy(random_positions(rng, T)).to("cuda", torch.int32)
        slots = torch.from_numpy(rng.permutation(P)[:T]).to("cuda", torch.int64)
        case = Case(q, k, v, positions, slots, k_pool, v_pool, D, Hq, Hk, 500000.0).snapshot()
        q_rot, k_rot, _, _ = run(case)
        torch.cuda.synchronize()
        assert_within_bound(q_rot, q, positions, 500000.0, f"q_rot (offset {offset})")
        assert_within_bound(k_rot, k, positions, 500000.0, f"k_rot (offset {offset})")
        assert_rows(case, k_rot, slot_map(case))
        case.assert_unchanged("q", "k", "v")


def test_nan_and_inf_propagate(rng):
    T, P = 16, 32
    case = make_case("torch", "float16", rng, T=T, Hq=4, Hk=2, D=64, P=P, device="cuda",
                     slots=rng.permutation(P)[:T])
    case.q[3, 1, 5] = float("nan")
    case.k[7, 0, 40] = float("inf")
    case.v[9, 1, 2] = float("nan")
    case.snapshot()
    q_rot, k_rot, _, _ = run(case)
    torch.cuda.synchronize()
    assert torch.isnan(q_rot[3, 1, 5]) and torch.isnan(q_rot[3, 1, 5 + 32])  # both of the pair
    assert not torch.isfinite(k_rot[7, 0, 40]) and not torch.isfinite(k_rot[7, 0, 8])
    assert_rows(case, k_rot, slot_map(case))  # every row written as usual, NaN v copied


def test_cuda_graph_capture_and_replay(rng):
    """One call captured; replays with new data in the same buffers give new results."""
    T, Hq, Hk, D, P = 64, 32, 8, 128, 256
    case = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P, device="cuda",
                     rope_base=500000.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(case)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_rot, k_rot, _, _ = run(case)
    for _ in range(2):
        fresh = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P, device="cuda",
                          rope_base=500000.0)
        case.copy_from(fresh)
        case.snapshot()
        q_rot.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot (replay)")
        assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot (replay)")
        assert_rows(case, k_rot, slot_map(case))


def test_two_streams_at_once(rng):
    """Two calls in flight on two streams, each on its own pool: both right."""
    cases = [make_case("torch", "float16", rng, T=2048, Hq=8, Hk=2, D=128, P=4096,
                       device="cuda").snapshot() for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = []
    for case, st in zip(cases, streams):
        with torch.cuda.stream(st):
            outs.append(run(case))
    torch.cuda.synchronize()
    for case, (q_rot, k_rot, _, _) in zip(cases, outs):
        assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot")
        assert_rows(case, k_rot, slot_map(case))


def test_torch_compile_fullgraph(rng):
    T, Hq, Hk, D, P = 48, 8, 2, 128, 96

    def step(q, k, v, positions, slots, k_pool, v_pool):
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
            q * 1.0, k, v, positions, slots, k_pool, v_pool,
            head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=500000.0)
        return q_rot + 0.0, k_rot

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        case = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P, device="cuda",
                         rope_base=500000.0).snapshot()
        q_rot, k_rot = compiled(*case.args())
        torch.cuda.synchronize()
        assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot (compiled)")
        assert_rows(case, k_rot, slot_map(case))


def test_pool_over_4_gib(rng):
    """Rows whose byte offset is past 2^32: bf16 [2^21 + 64, 8, 128] pools, 4.3 GB each."""
    Hk, D = 8, 128
    P = 2**21 + 64
    need = 2 * P * Hk * D * 2
    free, _ = torch.cuda.mem_get_info()
    if free < need + 2**30:
        pytest.skip(f"needs {need / 1e9:.1f} GB of free GPU memory")
    k_pool = torch.empty((P, Hk, D), dtype=torch.bfloat16, device="cuda")
    v_pool = torch.empty_like(k_pool)
    k_pool.view(torch.int16).fill_(0x1111)
    v_pool.view(torch.int16).fill_(0x2222)
    slots = np.array([P - 1, P - 3, 2**21, 5])
    assert slots[0] * Hk * D * 2 > 2**32
    case = make_case("torch", "bfloat16", rng, T=4, Hq=2, Hk=Hk, D=D, P=8, device="cuda",
                     slots=slots)
    case.k_pool, case.v_pool = k_pool, v_pool
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(*case.args(), **kwargs(case))
    torch.cuda.synchronize()
    for t, s in enumerate(slots):
        assert torch.equal(k_pool[s].view(torch.int16), k_rot[t].view(torch.int16))
        assert torch.equal(v_pool[s].view(torch.int16), case.v[t].view(torch.int16))
    for s in (P - 2, P - 4, 2**21 - 1, 2**21 + 1, 0):
        assert (k_pool[s].view(torch.int16) == 0x1111).all()
        assert (v_pool[s].view(torch.int16) == 0x2222).all()
