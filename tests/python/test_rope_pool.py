"""rope_pool_fused against the float64 reference (SPEC §1) and its pool contract (§1, §3):
every element within the SPEC bound, pool rows bit for bit, nothing else touched."""

import re

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import (Case, assert_pool_writes, assert_within_bound, make_case, raw_bits,
                          to_f64)

HEAD_DIMS = [2, 64, 96, 128, 256]
HEADS = [pytest.param((8, 2), id="gqa"), pytest.param((4, 4), id="mha")]
FRAMEWORK_DTYPES = [("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
                    ("numpy", "float32"), ("numpy", "float16")]


def run(case, **extra):
    return ropepool.rope_pool_fused(*case.args(), **case.kwargs(**extra))


def check_result(case, result):
    q_rot, k_rot, k_pool, v_pool = result
    assert k_pool is case.k_pool and v_pool is case.v_pool, "pools must be the objects passed in"
    for out, x in ((q_rot, case.q), (k_rot, case.k)):
        assert type(out) is type(x)
        assert out.shape == x.shape and out.dtype == x.dtype
        if isinstance(x, torch.Tensor):
            assert out.device == x.device and out.is_contiguous()
        else:
            assert out.flags.c_contiguous
    assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot")
    assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot")
    assert_pool_writes(case, k_rot)
    case.assert_unchanged("q", "k", "v", "positions", "slots")


def framework_device(framework, device):
    if framework == "numpy" and device != "cpu":
        pytest.skip("NumPy arrays live on the CPU")
    return device


@pytest.mark.parametrize("framework,dtype", FRAMEWORK_DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_reference(framework, dtype, heads, head_dim, kernel_device, rng,
                           poisoned_outputs):
    device = framework_device(framework, kernel_device)
    Hq, Hk = heads
    T = int(rng.integers(1, 40))
    case = make_case(framework, dtype, rng, T=T, Hq=Hq, Hk=Hk, D=head_dim, P=T + 23,
                     device=device, index_dtype=str(rng.choice(["int32", "int64"]))).snapshot()
    result = run(case)
    assert len(poisoned_outputs.allocated) == 2  # q_rot/k_rot came NaN-filled
    check_result(case, result)


@pytest.mark.parametrize("framework,dtype", FRAMEWORK_DTYPES)
def test_many_tokens_and_thread_counts(framework, dtype, kernel_device, rng, poisoned_outputs):
    """Enough tokens to be split across worker threads; the result must not depend on the
    thread count (the op is element-wise)."""
    device = framework_device(framework, kernel_device)
    case = make_case(framework, dtype, rng, T=1500, Hq=8, Hk=2, D=128, P=3000,
                     device=device).snapshot()
    before = ropepool.get_num_threads()
    try:
        ropepool.set_num_threads(1)
        single = Case(*case.args(), case.head_dim, case.num_qo_heads, case.num_kv_heads,
                      case.rope_base)
        # Same inputs, private pool copies, one thread.
        single.k_pool, single.v_pool = _copy(case.k_pool), _copy(case.v_pool)
        q1, k1, _, _ = run(single)
        ropepool.set_num_threads(2)
        result = run(case)
    finally:
        ropepool.set_num_threads(before)
    check_result(case, result)
    np.testing.assert_array_equal(raw_bits(result[0]), raw_bits(q1))
    np.testing.assert_array_equal(raw_bits(result[1]), raw_bits(k1))
    np.testing.assert_array_equal(raw_bits(case.k_pool), raw_bits(single.k_pool))
    np.testing.assert_array_equal(raw_bits(case.v_pool), raw_bits(single.v_pool))


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x.copy()


@pytest.mark.parametrize("framework,dtype", FRAMEWORK_DTYPES)
def test_positions_at_the_accuracy_limit(framework, dtype, kernel_device, rng):
    """The largest positions the bound covers, 2**20 - 1 and just below, plus small and
    negative ones (|positions| < 2**20)."""
    device = framework_device(framework, kernel_device)
    T = 64
    positions = np.concatenate([
        [2**20 - 1, 2**20 - 2, 0, 1],
        2**20 - 1 - rng.integers(0, 64, size=T - 8),
        -rng.integers(1, 2**20, size=4),
    ])
    case = make_case(framework, dtype, rng, T=T, Hq=4, Hk=2, D=128, P=T, device=device,
                     positions=positions, index_dtype="int64").snapshot()
    check_result(case, run(case))


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_zero_tokens(framework, kernel_device, rng, poisoned_outputs):
    device = framework_device(framework, kernel_device)
    case = make_case(framework, "float32", rng, T=0, Hq=8, Hk=2, D=64, P=16,
                     device=device).snapshot()
    q_rot, k_rot, k_pool, v_pool = run(case)
    assert tuple(q_rot.shape) == (0, 8, 64) and tuple(k_rot.shape) == (0, 2, 64)
    assert k_pool is case.k_pool and v_pool is case.v_pool
    case.assert_unchanged()


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_all_slots_negative(framework, kernel_device, rng):
    device = framework_device(framework, kernel_device)
    T = 12
    slots = -rng.integers(1, 1000, size=T)
    case = make_case(framework, "float32", rng, T=T, Hq=4, Hk=2, D=64, P=8, device=device,
                     slots=slots).snapshot()
    result = run(case)
    check_result(case, result)
    case.assert_unchanged("k_pool", "v_pool")


@pytest.mark.parametrize("check_slots", [False, True])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_out_of_range_slot_writes_nothing(framework, check_slots, kernel_device, rng,
                                          poisoned_outputs):
    """SPEC §3: a slot >= P raises, names the first bad token and P, and writes nothing:
    not q_rot/k_rot, not the pools; q/k/v stay as they were."""
    device = framework_device(framework, kernel_device)
    if device == "cuda" and not check_slots:
        pytest.skip("CUDA reports it later: test_cuda_out_of_range_slot_is_reported_later")
    T, P = 20, 32
    slots = rng.permutation(P)[:T]
    first_bad = int(rng.integers(0, T - 1))
    slots[first_bad] = P + int(rng.integers(0, 5))
    slots[-1] = P + 1000  # a later bad token: the message must name the first one
    case = make_case(framework, "float32", rng, T=T, Hq=4, Hk=2, D=64, P=P, device=device,
                     slots=slots).snapshot()
    message = (f"rope_pool_fused: slots[{first_bad}] = {slots[first_bad]} is out of range "
               f"for a pool of {P} slots")
    with pytest.raises(ValueError) as info:
        run(case, check_slots=check_slots)
    assert str(info.value) == message
    case.assert_unchanged()
    assert len(poisoned_outputs.allocated) == 2
    for out in poisoned_outputs.allocated:
        assert np.isnan(to_f64(out)).all(), "q_rot/k_rot were written before the error"


@pytest.mark.parametrize("framework,dtype", [("torch", "bfloat16"), ("numpy", "float16")])
def test_duplicate_slot_without_check_holds_one_tokens_row(framework, dtype, kernel_device, rng):
    """SPEC §3: without check_slots, a slot written by several tokens ends up holding one
    of those tokens' complete rows (all heads from one token, in each pool)."""
    device = framework_device(framework, kernel_device)
    T, P, Hk = 600, 40, 4
    slots = rng.integers(0, P // 2, size=T)  # every used row written by many tokens
    slots[rng.random(T) < 0.1] = -1
    case = make_case(framework, dtype, rng, T=T, Hq=4, Hk=Hk, D=64, P=P, device=device,
                     slots=slots).snapshot()
    q_rot, k_rot, k_pool, v_pool = run(case)
    assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot")
    k_bits, v_bits = raw_bits(k_pool), raw_bits(v_pool)
    k_rot_bits, v_in = raw_bits(k_rot), case.before["v"]
    for row in range(P):
        writers = np.nonzero(slots == row)[0]
        if len(writers) == 0:
            np.testing.assert_array_equal(k_bits[row], case.before["k_pool"][row])
            np.testing.assert_array_equal(v_bits[row], case.before["v_pool"][row])
            continue
        assert any((k_bits[row] == k_rot_bits[t]).all() for t in writers), \
            f"k_pool row {row} is not one token's complete k_rot row"
        assert any((v_bits[row] == v_in[t]).all() for t in writers), \
            f"v_pool row {row} is not one token's complete v row"


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_check_slots_rejects_duplicates_and_writes_nothing(framework, kernel_device, rng):
    device = framework_device(framework, kernel_device)
    T, P = 16, 32
    slots = rng.permutation(P)[:T]
    first, second = sorted(rng.choice(T, size=2, replace=False).tolist())
    slots[second] = slots[first]
    case = make_case(framework, "float32", rng, T=T, Hq=4, Hk=2, D=64, P=P, device=device,
                     slots=slots).snapshot()
    message = (f"rope_pool_fused: slots[{second}] = {slots[first]} repeats slots[{first}]; "
               "with check_slots each slot may be written once per call")
    with pytest.raises(ValueError) as info:
        run(case, check_slots=True)
    assert str(info.value) == message
    case.assert_unchanged()
    # Negative slots may repeat freely: they write nothing.
    slots[second] = -1
    slots[first] = -1
    case = make_case(framework, "float32", rng, T=T, Hq=4, Hk=2, D=64, P=P, device=device,
                     slots=slots).snapshot()
    check_result(case, run(case, check_slots=True))


def test_strided_views_into_fused_qkv_and_a_stacked_cache(kernel_device, rng, poisoned_outputs):
    """SPEC §4: q/k/v as views into one fused projection output [T, (Hq + 2 Hk) * D] and
    pools as one layer of a layer-stacked cache: used in place, no hidden copy."""
    T, Hq, Hk, D, P, layers = 33, 8, 2, 128, 64, 3
    base = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P, device=kernel_device)
    qkv = torch.cat([base.q.reshape(T, -1), base.k.reshape(T, -1), base.v.reshape(T, -1)], dim=1)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D:].view(T, Hk, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    cache = torch.from_numpy(rng.standard_normal((2, layers, P, Hk, D))).to(torch.bfloat16)
    cache = cache.to(kernel_device)
    layer = int(rng.integers(0, layers))
    case = Case(q, k, v, base.positions, base.slots, cache[0, layer], cache[1, layer],
                D, Hq, Hk, base.rope_base).snapshot()
    cache_before = raw_bits(cache)
    check_result(case, run(case))
    # Only the chosen layer's rows may change.
    cache_after = raw_bits(cache)
    others = [l for l in range(layers) if l != layer]
    np.testing.assert_array_equal(cache_after[:, others], cache_before[:, others])


@pytest.mark.parametrize("framework,dtype", [("torch", "float16"), ("numpy", "float32")])
def test_nan_and_inf_propagate_without_changing_rows(framework, dtype, kernel_device, rng):
    """SPEC §3: NaN/Inf in q/k/v go through the math like in the reference and never change
    which rows are written."""
    device = framework_device(framework, kernel_device)
    T, Hk, D, P = 8, 2, 64, 16
    case = make_case(framework, dtype, rng, T=T, Hq=4, Hk=Hk, D=D, P=P, device=device)
    special = [float("nan"), float("inf"), -float("inf")]
    for t in range(3):
        case.k[t, 0, int(rng.integers(0, D))] = special[t]
        case.v[t, 1, int(rng.integers(0, D))] = special[t]
    case.snapshot()
    q_rot, k_rot, _, _ = run(case)
    exact_nan = np.isnan(_exact_k(case))
    assert (np.isnan(to_f64(k_rot)) == exact_nan).all()
    assert_pool_writes(case, k_rot)


def _exact_k(case):
    from rope_testing import rope_exact
    return rope_exact(case.k, case.positions, case.rope_base)[0]


def test_inference_mode_and_no_grad(rng):
    """The usual serving contexts: tensors made under inference_mode, calls under no_grad."""
    with torch.inference_mode():
        case = make_case("torch", "bfloat16", rng, T=9, Hq=4, Hk=2, D=64, P=16).snapshot()
        check_result(case, run(case))
    case = make_case("torch", "float32", rng, T=9, Hq=4, Hk=2, D=64, P=16).snapshot()
    with torch.no_grad():
        check_result(case, run(case))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_out_of_range_slot_is_reported_later(rng):
    """SPEC §3 on CUDA without check_slots: the call does not wait for the GPU; the kernel
    skips the bad token's pool rows (never writes out of bounds) and the error comes from
    cuda_check_slot_errors (or the next call on the device) as RuntimeError."""
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    ropepool.cuda_check_slot_errors()  # nothing pending from earlier tests
    T, P = 24, 40
    slots = rng.permutation(P)[:T]
    bad = int(rng.integers(0, T))
    slots[bad] = P + 3
    case = make_case("torch", "float16", rng, T=T, Hq=4, Hk=2, D=128, P=P, device="cuda",
                     slots=slots).snapshot()
    q_rot, k_rot, _, _ = run(case)
    with pytest.raises(RuntimeError, match=re.escape(
            f"had slots[{bad}] = {P + 3} out of range for a pool of {P} slots")):
        ropepool.cuda_check_slot_errors(case.q.device)
    ropepool.cuda_check_slot_errors()  # reporting cleared it
    assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot")
    good = np.arange(T) != bad
    written = Case(case.q, case.k[good], case.v[good], case.positions[good], case.slots[good],
                   case.k_pool, case.v_pool, case.head_dim, case.num_qo_heads,
                   case.num_kv_heads, case.rope_base)
    written.before = dict(case.before, v=case.before["v"][good])
    assert_pool_writes(written, k_rot[good])
