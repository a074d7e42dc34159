"""Concurrency on the GPU: several streams of one device, and two devices (SPEC §3, §5).

Marked `gpu`; the two-device tests also need two visible CUDA devices. Each concurrent
result is compared bit for bit with the same call made serially on a quiet device (same
kernel, same inputs: the bits must not depend on what else runs), and against the float64
reference within the SPEC §1 bound.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import assert_within_bound, make_case, raw_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(autouse=True)
def cuda_build():
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    for d in range(torch.cuda.device_count()):
        ropepool.cuda_check_slot_errors(d)  # nothing pending from an earlier test
    previous = torch.cuda.current_device()
    yield
    torch.cuda.synchronize()
    torch.cuda.set_device(previous)


def run(case, **extra):
    return ropepool.rope_pool_fused(*case.args(), **case.kwargs(**extra))


def clone_case(case, device=None):
    """The same inputs (fresh copies, pools included), on `device` if given."""
    args = [x.clone() if device is None else x.to(device, copy=True) for x in case.args()]
    return type(case)(*args, case.head_dim, case.num_qo_heads, case.num_kv_heads,
                      case.rope_base).snapshot()


def bits_equal(a, b, what):
    np.testing.assert_array_equal(raw_bits(a), raw_bits(b), err_msg=f"{what} differs")


# ---- several streams of one device ---------------------------------------------------------


def test_streams_separate_pools_equal_serial(rng):
    """Eight calls in flight on eight streams, each with its own pools: bit-identical to the
    same calls made one after the other."""
    cases = [make_case("torch", "bfloat16", rng, T=int(T), Hq=32, Hk=8, D=128, P=8192,
                       device="cuda").snapshot()
             for T in rng.choice([1, 7, 64, 300, 2048], size=8)]
    serial_cases = [clone_case(c) for c in cases]
    serial = [run(c) for c in serial_cases]
    torch.cuda.synchronize()

    streams = [torch.cuda.Stream() for _ in cases]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(3):  # three rounds, so calls of different rounds overlap too
        outs = []
        for case, s in zip(cases, streams):
            with torch.cuda.stream(s):
                outs.append(run(case))
    torch.cuda.synchronize()
    for i, (case, out, ref, ref_case) in enumerate(zip(cases, outs, serial, serial_cases)):
        bits_equal(out[0], ref[0], f"q_rot of call {i}")
        bits_equal(out[1], ref[1], f"k_rot of call {i}")
        bits_equal(case.k_pool, ref_case.k_pool, f"k_pool of call {i}")
        bits_equal(case.v_pool, ref_case.v_pool, f"v_pool of call {i}")
        assert_within_bound(out[0], case.q, case.positions, case.rope_base, f"q_rot {i}")


def test_streams_one_pool_disjoint_slots_equal_serial(rng):
    """Eight streams write disjoint slots of ONE shared pool at once: the pool equals the
    pool written by the same calls in series, and untouched rows keep their bits."""
    n, T, Hk, D, P = 8, 256, 8, 128, 65536
    slots = torch.from_numpy(rng.permutation(P)[: n * T].astype(np.int64)).view(n, T)
    base = make_case("torch", "float16", rng, T=T, Hq=16, Hk=Hk, D=D, P=P, device="cuda")
    k_pool, v_pool = base.k_pool, base.v_pool
    k_pool_serial, v_pool_serial = k_pool.clone(), v_pool.clone()
    cases = []
    for i in range(n):
        c = make_case("torch", "float16", rng, T=T, Hq=16, Hk=Hk, D=D, P=1, device="cuda",
                      slots=slots[i].numpy())
        c.k_pool, c.v_pool = k_pool, v_pool
        cases.append(c)
    serial = []
    for c in cases:
        serial.append(ropepool.rope_pool_fused(c.q, c.k, c.v, c.positions, c.slots,
                                               k_pool_serial, v_pool_serial, **c.kwargs()))
    torch.cuda.synchronize()

    streams = [torch.cuda.Stream() for _ in cases]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for c, s in zip(cases, streams):
        with torch.cuda.stream(s):
            outs.append(run(c))
    torch.cuda.synchronize()
    bits_equal(k_pool, k_pool_serial, "shared k_pool")
    bits_equal(v_pool, v_pool_serial, "shared v_pool")
    for i, (out, ref) in enumerate(zip(outs, serial)):
        bits_equal(out[0], ref[0], f"q_rot of stream {i}")
        bits_equal(out[1], ref[1], f"k_rot of stream {i}")


def test_call_runs_on_the_current_stream(rng):
    """The op is ordered after earlier work on the caller's stream: q is overwritten on a
    side stream behind a long sleep, and the op queued on that stream must see the new q."""
    case = make_case("torch", "bfloat16", rng, T=64, Hq=8, Hk=2, D=128, P=128, device="cuda")
    fresh_q = make_case("torch", "bfloat16", rng, T=64, Hq=8, Hk=2, D=128, P=128,
                        device="cuda").q
    run(clone_case(case))  # warm-up (first-call set-up) outside the timed race
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz: the copy below lands late
        case.q.copy_(fresh_q)
        q_rot, _, _, _ = run(case)
    torch.cuda.synchronize()
    assert_within_bound(q_rot, fresh_q, case.positions, case.rope_base, "q_rot after the copy")


# ---- two devices ---------------------------------------------------------------------------


@two_gpus
@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_other_device_than_current(current, target, rng):
    """A call on cuda:target while cuda:current is the current device: runs on target's
    current stream, leaves the caller's current device as it was, and gives the bits the
    same call gives on `current`."""
    case = make_case("torch", "bfloat16", rng, T=300, Hq=32, Hk=8, D=128, P=1024,
                     device=f"cuda:{target}").snapshot()
    same_on_current = clone_case(case, device=f"cuda:{current}")
    torch.cuda.set_device(current)
    # Work queued on target's current stream first: the op must be ordered after it.
    fresh_q = case.q.clone()
    with torch.cuda.device(target):
        torch.cuda._sleep(50_000_000)
    case.q.copy_(torch.flip(fresh_q, dims=[0]))  # on target's current stream (q's device)
    same_on_current.q.copy_(torch.flip(fresh_q, dims=[0]).to(f"cuda:{current}"))
    q_rot, k_rot, _, _ = run(case)
    assert torch.cuda.current_device() == current
    assert q_rot.device == torch.device(f"cuda:{target}")
    q_ref, k_ref, _, _ = run(same_on_current)
    torch.cuda.synchronize(target)
    torch.cuda.synchronize(current)
    bits_equal(q_rot.cpu(), q_ref.cpu(), "q_rot across devices")
    bits_equal(k_rot.cpu(), k_ref.cpu(), "k_rot across devices")
    bits_equal(case.k_pool.cpu(), same_on_current.k_pool.cpu(), "k_pool across devices")
    bits_equal(case.v_pool.cpu(), same_on_current.v_pool.cpu(), "v_pool across devices")
    assert_within_bound(q_rot.cpu(), case.q.cpu(), case.positions.cpu(), case.rope_base, "q_rot")


@two_gpus
def test_tensors_on_two_devices_rejected(rng, poisoned_outputs):
    case = make_case("torch", "float16", rng, T=4, Hq=2, Hk=1, D=64, P=16,
                     device="cuda:0").snapshot()
    case.v_pool = case.v_pool.to("cuda:1")
    case.before["v_pool"] = raw_bits(case.v_pool)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        run(case)
    case.assert_unchanged()


@two_gpus
def test_slot_errors_are_reported_per_device(rng):
    """An out-of-range slot on cuda:1 is reported on cuda:1 only: calls on cuda:0 go on,
    and the record is kept until cuda:1 reports it."""
    bad = make_case("torch", "bfloat16", rng, T=8, Hq=4, Hk=2, D=128, P=16, device="cuda:1",
                    slots=np.array([0, 1, 2, 99, 4, 5, 6, 7])).snapshot()
    torch.cuda.set_device(0)
    _, k_rot, _, _ = run(bad)  # queued; the kernel skips token 3 and records it
    torch.cuda.synchronize(1)
    good = make_case("torch", "bfloat16", rng, T=8, Hq=4, Hk=2, D=128, P=16, device="cuda:0")
    run(good)  # cuda:0 has nothing pending
    ropepool.cuda_check_slot_errors(0)
    with pytest.raises(RuntimeError, match=r"cuda:1 had slots\[3\] = 99 out of range"):
        ropepool.cuda_check_slot_errors(1)
    ropepool.cuda_check_slot_errors(1)  # reported once, then cleared
    # every other token's rows were written; no other row changed
    k_pool, k_bits = raw_bits(bad.k_pool), raw_bits(k_rot)
    for t, s in enumerate([0, 1, 2, 99, 4, 5, 6, 7]):
        if s < 16:
            np.testing.assert_array_equal(k_pool[s], k_bits[t])
    for s in [3] + list(range(8, 16)):
        np.testing.assert_array_equal(k_pool[s], bad.before["k_pool"][s])


@two_gpus
def test_cuda_graph_on_second_device(rng):
    """Capture and replay on cuda:1 while cuda:0 is the current device outside the capture."""
    T, Hq, Hk, D, P = 32, 16, 4, 128, 256
    case = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P, device="cuda:1",
                     rope_base=500000.0)
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(case)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph's default capture stream lives on whichever device was current
        # when it was first made; a capture on cuda:1 names a cuda:1 stream.
        with torch.cuda.graph(graph, stream=s):
            q_rot, k_rot, _, _ = run(case)
    for _ in range(2):
        fresh = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P,
                          device="cuda:1", rope_base=500000.0)
        case.copy_from(fresh)
        case.snapshot()
        q_rot.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(1)
        assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot (replay)")
        assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot (replay)")
        slots = case.slots.cpu().numpy()
        rows = slots[slots >= 0]
        bits_equal(case.k_pool[torch.from_numpy(rows).to("cuda:1")].cpu(),
                   k_rot[torch.from_numpy(np.nonzero(slots >= 0)[0]).to("cuda:1")].cpu(),
                   "k_pool rows (replay)")
    assert torch.cuda.current_device() == 0


@two_gpus
def test_torch_compile_on_second_device(rng):
    T, Hq, Hk, D, P = 48, 8, 2, 128, 96

    def step(q, k, v, positions, slots, k_pool, v_pool):
        q_rot, k_rot, _, _ = ropepool.rope_pool_fused(
            q * 1.0, k, v, positions, slots, k_pool, v_pool,
            head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=500000.0)
        return q_rot + 0.0, k_rot

    compiled = torch.compile(step, fullgraph=True)
    torch.cuda.set_device(0)
    for _ in range(2):
        case = make_case("torch", "bfloat16", rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P,
                         device="cuda:1", rope_base=500000.0).snapshot()
        reference = clone_case(case)
        q_rot, k_rot = compiled(*case.args())
        q_ref, k_ref, _, _ = run(reference)
        torch.cuda.synchronize(1)
        bits_equal(q_rot, q_ref, "q_rot (compiled on cuda:1)")
        bits_equal(k_rot, k_ref, "k_rot (compiled on cuda:1)")
        bits_equal(case.k_pool, reference.k_pool, "k_pool (compiled on cuda:1)")


@two_gpus
def test_tensor_parallel_two_ranks_equal_one_gpu(tmp_path):
    """torchrun with two ranks and NCCL, each owning half of the heads of one layer: the
    gathered q_rot/k_rot and pools equal a one-GPU run bit for bit (tp_check.py)."""
    script = pathlib.Path(__file__).with_name("tp_check.py")
    env = dict(os.environ)
    # NVLink multicast stays off (it can take a shared host's GPUs out of service).
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "tp_check: bit-identical" in result.stdout, result.stdout[-4000:]
