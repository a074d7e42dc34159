"""The CPU thread count under concurrency (issue #9)."""

import sys
import threading
import time

import numpy as np
import torch

import ropepool


def _small_call_args(T=16, Hq=4, Hk=2, D=64):
    rng = np.random.default_rng(9)
    q = torch.from_numpy(rng.standard_normal((T, Hq, D), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((T, Hk, D), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((T, Hk, D), dtype=np.float32))
    positions = torch.arange(T, dtype=torch.int32)
    slots = torch.arange(T, dtype=torch.int32)
    pools = torch.zeros(2 * T, Hk, D), torch.zeros(2 * T, Hk, D)
    kwargs = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0)
    return (q, k, v, positions, slots, *pools), kwargs


def test_set_num_threads_in_a_loop_does_not_stall_other_threads():
    """Another thread calling set_num_threads in a loop must not stall calls. It did, ~300x
    on the 2-vCPU development VM: set_num_threads held the GIL, so a call coming back from
    the kernel (which runs without the GIL) waited a whole switch interval for it, on every
    call. The interval is raised to 50 ms to make a stall unmistakable: 100 calls of a few
    microseconds each then took seconds; now they take milliseconds."""
    args, kwargs = _small_call_args()
    ropepool.rope_pool_fused(*args, **kwargs)  # warm-up
    before, interval = ropepool.get_num_threads(), sys.getswitchinterval()
    stop = threading.Event()

    def resize():
        i = 0
        while not stop.is_set():
            ropepool.set_num_threads(1 + i % 64)
            i += 1

    resizer = threading.Thread(target=resize)
    sys.setswitchinterval(0.05)
    resizer.start()
    try:
        start = time.perf_counter()
        for _ in range(100):
            ropepool.rope_pool_fused(*args, **kwargs)
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        resizer.join()
        sys.setswitchinterval(interval)
        ropepool.set_num_threads(before)
    print(f"100 calls with the resizer: {elapsed:.4f} s")
    assert elapsed < 1.0, f"100 calls took {elapsed:.2f} s while another thread set the thread count"


def test_huge_thread_count_is_clamped():
    before = ropepool.get_num_threads()
    try:
        ropepool.set_num_threads(10**6)
        clamped = ropepool.get_num_threads()
        assert 8 <= clamped < 10**6
        args, kwargs = _small_call_args(T=512)
        ropepool.rope_pool_fused(*args, **kwargs)
    finally:
        ropepool.set_num_threads(before)
