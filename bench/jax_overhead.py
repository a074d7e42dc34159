"""Host cost of one decode-step call (T = 1, Llama-3-8B: Hq = 32, Hk = 8, D = 128, bfloat16)
through the JAX front end under jax.jit vs the torch path called eagerly, on one device.

    python bench/jax_overhead.py [--device cpu|cuda] [--calls 2000] [--repeats 15]

Each figure is the median over `repeats` runs of `calls` calls, in microseconds per call:
- back to back: the calls issued in a loop, one wait at the end (what a decode loop sees;
  JAX's calls each take the pools the previous one returned, donated, so nothing is copied);
- synchronous: a wait after every call (jax.block_until_ready / torch.cuda.synchronize).
Anchors from the same run: JAX's own floor (a jitted function of the same seven arguments
that returns the donated pools untouched, no custom call) and, for torch, an empty
`torch.empty_like(q)` (the cheapest torch op). The kernel itself is in every ropepool
figure (about a microsecond at T = 1 on either device).
"""

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import ropepool  # noqa: E402
import ropepool.jax  # noqa: E402

HQ, HK, D, POOL = 32, 8, 128, 4096
KW = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HK, rope_base=500000.0)


def median_us(run, calls, repeats):
    run(calls)  # warm-up (compilation, first allocations)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(calls)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()

    rng = np.random.default_rng(0)
    host = {n: rng.standard_normal(s).astype(np.float32) for n, s in
            dict(q=(1, HQ, D), k=(1, HK, D), v=(1, HK, D), k_pool=(POOL, HK, D),
                 v_pool=(POOL, HK, D)).items()}
    positions, slots = np.array([1234], np.int32), np.array([77], np.int32)

    # torch, eager
    tdev = a.device
    t = {n: torch.from_numpy(x).to(torch.bfloat16).to(tdev) for n, x in host.items()}
    tpos, tslots = torch.from_numpy(positions).to(tdev), torch.from_numpy(slots).to(tdev)
    sync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)

    def torch_loop(n, each=False):
        for _ in range(n):
            ropepool.rope_pool_fused(t["q"], t["k"], t["v"], tpos, tslots, t["k_pool"],
                                     t["v_pool"], **KW)
            if each:
                sync()
        sync()

    def torch_empty(n):
        for _ in range(n):
            torch.empty_like(t["q"])
        sync()

    # JAX, jitted, pools donated
    jdev = jax.devices("cpu" if a.device == "cpu" else "gpu")[0]
    j = {n: jnp.copy(jax.device_put(x.astype(jnp.bfloat16), jdev)) for n, x in host.items()}
    jpos, jslots = (jnp.copy(jax.device_put(x, jdev)) for x in (positions, slots))
    step = jax.jit(functools.partial(ropepool.jax.rope_pool_fused, **KW), donate_argnums=(5, 6))
    floor = jax.jit(lambda q, k, v, p, s, kp, vp: (q, k, kp, vp), donate_argnums=(5, 6))
    state = {"k_pool": j["k_pool"], "v_pool": j["v_pool"]}

    def jax_loop(fn, n, each=False):
        kp, vp = state["k_pool"], state["v_pool"]
        out = None
        for _ in range(n):
            out = fn(j["q"], j["k"], j["v"], jpos, jslots, kp, vp)
            kp, vp = out[2], out[3]
            if each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        state["k_pool"], state["v_pool"] = kp, vp

    ptr = state["k_pool"].unsafe_buffer_pointer()
    rows = [
        ("torch eager, back to back", lambda n: torch_loop(n)),
        ("torch eager, synchronous", lambda n: torch_loop(n, True)),
        ("torch.empty_like(q) (anchor)", torch_empty),
        ("jax.jit, back to back", lambda n: jax_loop(step, n)),
        ("jax.jit, synchronous", lambda n: jax_loop(step, n, True)),
        ("jax.jit floor, no custom call (anchor)", lambda n: jax_loop(floor, n)),
    ]
    print(f"ropepool host overhead, T = 1, Hq = {HQ}, Hk = {HK}, D = {D}, bfloat16, "
          f"pool {POOL} rows, device {a.device}; jax {jax.__version__}, torch "
          f"{torch.__version__}, ropepool {ropepool.__version__}, "
          f"{ropepool.get_num_threads()} CPU threads")
    print(f"{'':42s} {'median':>8s} {'min':>8s} {'max':>8s}  us per call "
          f"({a.repeats} runs of {a.calls} calls)")
    for name, run in rows:
        med, lo, hi = median_us(run, a.calls, a.repeats)
        print(f"{name:42s} {med:8.2f} {lo:8.2f} {hi:8.2f}")
    assert state["k_pool"].unsafe_buffer_pointer() == ptr, "a donated pool was copied"


if __name__ == "__main__":
    main()
