"""Per-call host cost of the MLX front end at T = 1 (Llama-3-8B attention: num_qo_heads 32,
num_kv_heads 8, head_dim 128, bfloat16, rope_base 500000, a pool of 65536 rows), next to
the torch CPU eager call on the same shapes. The C++ call of the same workload is
`ropepool bench --tokens 1`.

    .venv/bin/python bench/mlx_overhead.py [--calls N] [--threads N]

Reported (medians over N calls, with p10-p90), per call:
- torch eager: `ropepool.rope_pool_fused` on torch tensors (the kernel runs inside).
- mlx call: `ropepool.mlx.rope_pool_fused` alone (graph construction and validation; no
  work runs).
- mlx call + eval: the call and `mx.eval` of its four results, the pools rebound to the
  results each step as a decode loop does (so they are donated, never copied).
- mlx eval of a trivial op: `mx.eval` of `x + 1` on a 1-element array, MLX's own floor for
  evaluating one graph node.
"""

import argparse
import time

import mlx.core as mx
import numpy as np
import torch

import ropepool
import ropepool.mlx as rmlx

HQ, HK, D, P, BASE = 32, 8, 128, 65536, 500000.0
KW = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HK, rope_base=BASE)


def stats(samples_ns):
    a = np.array(samples_ns) / 1e3
    return f"{np.median(a):8.2f} ({np.percentile(a, 10):.2f}-{np.percentile(a, 90):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        ropepool.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    n = args.calls

    # torch eager
    q = torch.randn(1, HQ, D, dtype=torch.bfloat16)
    k = torch.randn(1, HK, D, dtype=torch.bfloat16)
    v = torch.randn(1, HK, D, dtype=torch.bfloat16)
    kp = torch.randn(P, HK, D, dtype=torch.bfloat16)
    vp = torch.randn(P, HK, D, dtype=torch.bfloat16)
    slots = [torch.tensor([s], dtype=torch.int32) for s in rng.integers(0, P, size=n)]
    pos = [torch.tensor([p], dtype=torch.int32) for p in rng.integers(0, 1 << 17, size=n)]
    for i in range(50):
        ropepool.rope_pool_fused(q, k, v, pos[i], slots[i], kp, vp, **KW)
    t_torch = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        ropepool.rope_pool_fused(q, k, v, pos[i], slots[i], kp, vp, **KW)
        t_torch.append(time.perf_counter_ns() - t0)

    # MLX
    mq = mx.random.normal((1, HQ, D)).astype(mx.bfloat16)
    mk = mx.random.normal((1, HK, D)).astype(mx.bfloat16)
    mv = mx.random.normal((1, HK, D)).astype(mx.bfloat16)
    mkp = mx.random.normal((P, HK, D)).astype(mx.bfloat16)
    mvp = mx.random.normal((P, HK, D)).astype(mx.bfloat16)
    mslots = [mx.array([int(s)], dtype=mx.int32) for s in rng.integers(0, P, size=n)]
    mpos = [mx.array([int(p)], dtype=mx.int32) for p in rng.integers(0, 1 << 17, size=n)]
    mx.eval(mq, mk, mv, mkp, mvp, *mslots, *mpos)
    t_call, t_eval = [], []
    for i in range(n):
        t0 = time.perf_counter_ns()
        out = rmlx.rope_pool_fused(mq, mk, mv, mpos[i], mslots[i], mkp, mvp, **KW)
        t_call.append(time.perf_counter_ns() - t0)
        del out
    for i in range(50):
        _, _, mkp, mvp = rmlx.rope_pool_fused(mq, mk, mv, mpos[i], mslots[i], mkp, mvp, **KW)
        mx.eval(mkp, mvp)
    for i in range(n):
        t0 = time.perf_counter_ns()
        q_rot, k_rot, mkp, mvp = rmlx.rope_pool_fused(mq, mk, mv, mpos[i], mslots[i], mkp, mvp,
                                                      **KW)
        mx.eval(q_rot, k_rot, mkp, mvp)
        t_eval.append(time.perf_counter_ns() - t0)
    x = mx.array([1.0])
    mx.eval(x)
    t_floor = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        mx.eval(x + 1)
        t_floor.append(time.perf_counter_ns() - t0)

    print(f"T = 1, Hq {HQ}, Hk {HK}, D {D}, bfloat16, pool {P} rows, {n} calls; "
          f"ropepool threads {ropepool.get_num_threads()}; mlx {mx.__version__}, torch "
          f"{torch.__version__}")
    print("median µs per call (p10-p90):")
    print(f"  torch eager (ropepool.rope_pool_fused)   {stats(t_torch)}")
    print(f"  mlx call (graph node, no work)           {stats(t_call)}")
    print(f"  mlx call + mx.eval (pools donated)       {stats(t_eval)}")
    print(f"  mlx floor: mx.eval(x + 1)                {stats(t_floor)}")


if __name__ == "__main__":
    main()
