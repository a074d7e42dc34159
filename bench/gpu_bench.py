#!/usr/bin/env python3
"""ropepool on a CUDA GPU next to PyTorch eager, torch.compile and a device-to-device copy.

One command, one process, one table:

    python bench/gpu_bench.py                       # default workload, all token counts
    python bench/gpu_bench.py --tokens 1,4096 --json out.json

Workload (Llama-3-8B attention): bfloat16, num_qo_heads 32, num_kv_heads 8, head_dim 128,
rope_base 500000, int32 positions (random below 2^17) and slots (distinct random rows of a
pool of max(65536, 4T) slots; none negative, so the PyTorch baselines need no host sync),
T in 1, 16, 64, 256, 1024, 4096, 16384, 65536.

Contenders, all computing the same function:
  ropepool   ropepool.rope_pool_fused (one kernel)
  eager      PyTorch: cos/sin of float64 angles, float32 rotation, cast, index_copy_ of k_rot
             and v into the pools
  compile    torch.compile of that same function (fullgraph, dynamic shapes: one compile)
  copy       torch copy_ of a 1 GiB buffer: the bandwidth ceiling (bytes read + written)

Before timing, ropepool's outputs are checked against eager's (q_rot/k_rot within 2 ulp,
pool rows bit-identical to k_rot / v, nothing else in the pools changed).

Timing: plain stream: median GPU time per call over batches of back-to-back calls timed with
CUDA events, a GPU spin queued before each batch so the host's enqueueing does not show
(GpuTimer; samples where the host still fell behind are counted and reported), inputs
rotated among several input sets so the 60 MB L2 does not hold them all (a decode step reads
its inputs from L2 in practice, so small T may still hit L2); "call us": the wall time of one
Python call with the host included (batches of 20 calls ended by a synchronisation); CUDA
graph (T <= 256): 20 calls over rotating sets captured once, the median GPU time of a replay
divided by 20 (the headline figure); for ropepool also the marginal cost of a call, from
graphs of 20 and 60 calls: (60 * t60 - 20 * t20) / 40.
Effective bandwidth counts T * D * elem * (2 * Hq + 5 * Hk) + index bytes: q, k, v read,
q_rot, k_rot, k_pool and v_pool rows written.

Writes full results to --json (default $OUT/gpu_bench.json when $OUT is set) and prints a
short table last.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import statistics
import sys
import time

import torch

from torch_reference import make_inv_freq
from torch_reference import torch_rope_pool as reference_rope_pool

try:
    import ropepool
except ImportError as e:  # still time the baselines, say why ropepool is missing
    ropepool = None
    ROPEPOOL_IMPORT_ERROR = str(e)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,64,256,1024,4096,16384,65536")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--num-qo-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-base", type=float, default=500000.0)
    p.add_argument("--graph-max-tokens", type=int, default=256)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--seconds", type=float, default=0.4, help="timing budget per contender and T")
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_bench.json")
    return args


# --- the contenders ---------------------------------------------------------------------------

def torch_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64):
    """The eager contender (and what torch.compile compiles): every benchmark slot is >= 0,
    so no boolean mask and no host synchronisation."""
    return reference_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64,
                               skip_negative_slots=False)


# --- workload ----------------------------------------------------------------------------------

class Workload:
    def __init__(self, T, args, gen, fused_qkv=False):
        self.T = T
        self.dtype = DTYPES[args.dtype]
        Hq, Hk, D = args.num_qo_heads, args.num_kv_heads, args.head_dim
        self.shape = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=args.rope_base)
        self.P = max(65536, 4 * T)
        es = torch.tensor([], dtype=self.dtype).element_size()
        self.bytes = T * D * es * (2 * Hq + 5 * Hk) + 2 * 4 * T
        set_bytes = max(1, T * D * es * (Hq + 2 * Hk))
        # Rotate among enough input sets that one round exceeds the L2 several times over.
        n_sets = int(min(64, max(2, math.ceil(256e6 / set_bytes))))
        dev = "cuda"

        def uniform(*shape):
            return (torch.rand(*shape, generator=gen, device=dev) * 8 - 4).to(self.dtype)

        def qkv():
            if not fused_qkv:
                return dict(q=uniform(T, Hq, D), k=uniform(T, Hk, D), v=uniform(T, Hk, D))
            # views into one fused QKV projection output [T, (Hq + 2 Hk) * D], no copy
            fused = uniform(T, (Hq + 2 * Hk) * D)
            q, k, v = fused.split([Hq * D, Hk * D, Hk * D], dim=1)
            return dict(q=q.unflatten(1, (Hq, D)), k=k.unflatten(1, (Hk, D)),
                        v=v.unflatten(1, (Hk, D)))

        self.sets = []
        for _ in range(n_sets):
            self.sets.append(dict(
                **qkv(),
                positions=torch.randint(0, 1 << 17, (T,), generator=gen, device=dev, dtype=torch.int32),
                slots=torch.randperm(self.P, generator=gen, device=dev)[:T].to(torch.int32)))
        self.k_pool = uniform(self.P, Hk, D)
        self.v_pool = uniform(self.P, Hk, D)
        self.inv_freq64 = make_inv_freq(D, args.rope_base, dev)

    def args_of(self, i):
        s = self.sets[i % len(self.sets)]
        return (s["q"], s["k"], s["v"], s["positions"], s["slots"], self.k_pool, self.v_pool)


def check(w, compiled):
    """ropepool vs eager on set 0: returns (problems, notes)."""
    problems = []
    a = w.args_of(0)
    k0, v0 = w.k_pool.clone(), w.v_pool.clone()
    r = ropepool.rope_pool_fused(*a, **w.shape)
    r_kp, r_vp = w.k_pool.clone(), w.v_pool.clone()
    w.k_pool.copy_(k0)
    w.v_pool.copy_(v0)
    t = torch_rope_pool(*a, w.inv_freq64)
    t_kp, t_vp = w.k_pool.clone(), w.v_pool.clone()
    w.k_pool.copy_(k0)
    w.v_pool.copy_(v0)
    notes = []
    if compiled is not None:
        # Inductor may contract into FMAs: informational, not a failure of ropepool.
        c = compiled(*a, w.inv_freq64)
        if not (torch.equal(c[0], t[0]) and torch.equal(c[1], t[1])):
            d = (c[0].float() - t[0].float()).abs().max().item()
            notes.append(f"torch.compile output differs from eager by up to {d:.3g}")
        w.k_pool.copy_(k0)
        w.v_pool.copy_(v0)
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[w.dtype]
    for name, x, y in (("q_rot", r[0], t[0]), ("k_rot", r[1], t[1])):
        x64, y64 = x.double(), y.double()
        bound = 2.0 ** (1 - mant) * torch.maximum(x64.abs(), y64.abs()) + 2.0 ** -17 * 8
        nbad = int((~((x64 - y64).abs() <= bound)).sum())
        if nbad:
            problems.append(f"{name}: {nbad} elements differ from eager by more than 2 ulp")
    rows = a[4].to(torch.int64)
    if not torch.equal(r_kp[rows], r[1]) or not torch.equal(r_vp[rows], a[2]):
        problems.append("ropepool pool rows are not bit-identical to k_rot / v")
    untouched = torch.ones(w.P, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    if not (torch.equal(r_kp[untouched], k0[untouched]) and torch.equal(r_vp[untouched], v0[untouched])):
        problems.append("ropepool changed pool rows no token names")
    if not torch.equal(t_vp, r_vp):
        problems.append("v_pool differs between ropepool and eager")
    return problems, notes


# --- timing ------------------------------------------------------------------------------------

class GpuTimer:
    """CUDA events around a batch of enqueued work, with a GPU spin (torch.cuda._sleep) queued
    first: the GPU stays busy while the host enqueues the batch, so the events time the GPU's
    work and not the host's Python/dispatch cost (as nvbench's blocking kernel does). If the
    GPU reached the first event before the host had finished enqueueing, the sample is
    retaken with twice the spin; `host_bound` counts samples that never got there."""

    def __init__(self, spin_seconds):
        self.spin_cycles = int(max(spin_seconds, 20e-6) * 2.0e9)  # SM clock <= 2 GHz
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.host_bound = 0

    def __call__(self, enqueue):
        for attempt in range(5):
            torch.cuda._sleep(self.spin_cycles)
            self.start.record()
            enqueue()
            self.end.record()
            kept_up = not self.start.query()
            self.end.synchronize()
            if kept_up:
                break
            self.spin_cycles *= 2
        else:
            self.host_bound += 1
        return self.start.elapsed_time(self.end) * 1e-3


def time_stream(fn, w, seconds):
    """Median GPU seconds per call over batches of back-to-back calls, inputs rotating; and
    the number of samples where the host could not keep ahead of the GPU."""
    i = 0
    for _ in range(3):
        fn(*w.args_of(i))
        i += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*w.args_of(i))
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)  # host + GPU: an upper bound of either
    per_batch = int(min(50, max(1, 0.01 / one)))
    batches = int(min(40, max(5, seconds / (one * per_batch))))
    timer = GpuTimer(1.5 * one * per_batch)
    samples = []

    def batch():
        nonlocal i
        for _ in range(per_batch):
            fn(*w.args_of(i))
            i += 1

    for _ in range(batches):
        samples.append(timer(batch) / per_batch)
    return statistics.median(samples), timer.host_bound


def time_call(fn, w, calls=200):
    """Median wall seconds per call as a Python caller sees it (host dispatch included):
    batches of 20 calls, each batch ended by a synchronisation."""
    i = 0
    for _ in range(3):
        fn(*w.args_of(i))
        i += 1
    samples = []
    for _ in range(max(1, calls // 20)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn(*w.args_of(i))
            i += 1
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / 20)
    return statistics.median(samples)


def time_graph(fn, w, calls=20, replays=30):
    """Median GPU seconds per call of a CUDA graph of `calls` calls over rotating input sets
    (the replay's host submission hidden behind a spin, as in time_stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(*w.args_of(i))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(*w.args_of(i))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    timer = GpuTimer(100e-6)
    samples = [timer(g.replay) / calls for _ in range(replays)]
    del g
    return statistics.median(samples)


def copy_seconds(n, reps, warmup):
    """Median seconds of a device-to-device torch copy of n bytes (CUDA events around each of
    `reps` copies, the first `warmup` not counted)."""
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for r in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if r >= warmup:
            samples.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(samples)


def copy_bandwidth(nbytes=1 << 30):
    """The ceiling: bytes read + written per second by a copy of nbytes."""
    return 2 * nbytes / copy_seconds(nbytes, reps=12, warmup=2)


def copy_same_bytes(nbytes):
    """Seconds to copy nbytes/2 (read + write = nbytes): the per-size ceiling."""
    return copy_seconds(max(16, nbytes // 2), reps=20, warmup=3)


# --- main --------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    # A run that hangs says where: every thread's stack, then exit (scripts/gpu_check.sh sets
    # this below its own kill timeout).
    watchdog_s = float(os.environ.get("ROPEPOOL_BENCH_WATCHDOG_S", "0"))
    if watchdog_s > 0:
        faulthandler.dump_traceback_later(watchdog_s, exit=True)
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device")
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}", flush=True)
    if ropepool is None:
        print(f"ropepool: NOT IMPORTABLE ({ROPEPOOL_IMPORT_ERROR}); timing the baselines only")
    elif not ropepool.cuda_backend:
        print("ropepool: built without the CUDA backend; timing the baselines only")
    have_ropepool = ropepool is not None and ropepool.cuda_backend
    copy_bps = copy_bandwidth()
    print(f"device-to-device copy (1 GiB): {copy_bps / 1e9:.0f} GB/s counting read + write", flush=True)

    compiled = None
    if not args.no_compile:
        compiled = torch.compile(torch_rope_pool, fullgraph=True, dynamic=True)

    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    rows, problems_all = [], []
    for T in args.tokens:
        w = Workload(T, args, gen)
        row = dict(T=T, bytes=w.bytes, input_sets=len(w.sets))
        t_compile0 = time.perf_counter()
        if compiled is not None:
            compiled(*w.args_of(0), w.inv_freq64)  # (re)compile outside the timings
            torch.cuda.synchronize()
        row["compile_warmup_s"] = time.perf_counter() - t_compile0
        if have_ropepool:
            problems, notes = check(w, compiled) if T > 0 else ([], [])
            row["problems"], row["notes"] = problems, notes
            problems_all += [f"T={T}: {p}" for p in problems]
            rp = lambda *a: ropepool.rope_pool_fused(*a, **w.shape)  # noqa: E731
            t, row["ropepool_host_bound_samples"] = time_stream(rp, w, args.seconds)
            row["ropepool_us"] = t * 1e6
            row["ropepool_call_us"] = time_call(rp, w) * 1e6
        eager = lambda *a: torch_rope_pool(*a, w.inv_freq64)  # noqa: E731
        t, row["eager_host_bound_samples"] = time_stream(eager, w, args.seconds)
        row["eager_us"] = t * 1e6
        if compiled is not None:
            comp = lambda *a: compiled(*a, w.inv_freq64)  # noqa: E731
            t, row["compile_host_bound_samples"] = time_stream(comp, w, args.seconds)
            row["compile_us"] = t * 1e6
        row["copy_same_bytes_us"] = copy_same_bytes(w.bytes) * 1e6
        if T <= args.graph_max_tokens:
            if have_ropepool:
                row["ropepool_graph_us"] = time_graph(rp, w) * 1e6
                # The cost of one more call in a longer graph (an engine's decode graph holds
                # hundreds of kernels): the graph's own start is not spread over the calls.
                t60 = time_graph(rp, w, calls=60) * 1e6
                row["ropepool_graph_marginal_us"] = (60 * t60 - 20 * row["ropepool_graph_us"]) / 40
            row["eager_graph_us"] = time_graph(eager, w) * 1e6
            if compiled is not None:
                row["compile_graph_us"] = time_graph(comp, w) * 1e6
        if have_ropepool:
            row["ropepool_GBps"] = w.bytes / (row["ropepool_us"] * 1e-6) / 1e9
            row["ropepool_pct_copy"] = 100 * w.bytes / (row["ropepool_us"] * 1e-6) / copy_bps
        rows.append(row)
        print(json.dumps(row), flush=True)
        del w
        torch.cuda.empty_cache()

    # SPEC §4: q/k/v as strided views into a fused QKV buffer against contiguous inputs.
    layout_rows = []
    for T in [t for t in args.tokens if t in (1, 4096, 65536)] if have_ropepool else []:
        times = {}
        for fused in (False, True):
            w = Workload(T, args, gen, fused_qkv=fused)
            rp = lambda *a: ropepool.rope_pool_fused(*a, **w.shape)  # noqa: E731
            times[fused] = time_stream(rp, w, args.seconds)[0] * 1e6
            del w
            torch.cuda.empty_cache()
        layout_rows.append(dict(T=T, contiguous_us=times[False], fused_qkv_us=times[True]))
        print(json.dumps(layout_rows[-1]), flush=True)

    result = dict(device=props.name, torch=torch.__version__, copy_GBps=copy_bps / 1e9,
                  dtype=args.dtype, num_qo_heads=args.num_qo_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, rope_base=args.rope_base, rows=rows,
                  problems=problems_all, ropepool=have_ropepool, layouts=layout_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    def f(x, fmt="{:.2f}"):
        return fmt.format(x) if x is not None else "-"

    print()
    print(f"ropepool GPU bench: {props.name}, {args.dtype}, Hq {args.num_qo_heads}, Hk {args.num_kv_heads}, "
          f"D {args.head_dim}; copy ceiling {copy_bps / 1e9:.0f} GB/s (read + write)")
    print("GPU us per call (host enqueueing hidden; 'call us': wall time of a Python call, host included)")
    print(f"{'T':>6} {'ropepool us':>11} {'GB/s':>6} {'%copy':>6} {'call us':>8} {'eager us':>9} {'compile us':>10} "
          f"{'x compile':>9} | {'graph: ropepool':>15} {'eager':>7} {'compile':>8}")
    for r in rows:
        speedup = r["compile_us"] / r["ropepool_us"] if "compile_us" in r and "ropepool_us" in r else None
        print(f"{r['T']:>6} {f(r.get('ropepool_us')):>11} {f(r.get('ropepool_GBps'), '{:.0f}'):>6} "
              f"{f(r.get('ropepool_pct_copy'), '{:.1f}'):>6} {f(r.get('ropepool_call_us')):>8} {f(r['eager_us']):>9} {f(r.get('compile_us')):>10} "
              f"{f(speedup, '{:.1f}x'):>9} | {f(r.get('ropepool_graph_us')):>15} {f(r.get('eager_graph_us')):>7} "
              f"{f(r.get('compile_graph_us')):>8}")
    for r in layout_rows:
        print(f"T={r['T']}: contiguous q/k/v {r['contiguous_us']:.2f} us, views into a fused QKV "
              f"buffer {r['fused_qkv_us']:.2f} us")
    host_bound = [f"T={r['T']} {k.split('_')[0]}: {r[k]}" for r in rows for k in r
                  if k.endswith("host_bound_samples") and r[k]]
    if host_bound:
        print("samples where the host fell behind the GPU (timings include host time): " + ", ".join(host_bound))
    marginal = [f"T={r['T']} {r['ropepool_graph_marginal_us']:.2f}" for r in rows
                if "ropepool_graph_marginal_us" in r]
    if marginal:
        print("ropepool graph replay, marginal us per call (graphs of 20 and 60 calls): " + ", ".join(marginal))
    if problems_all:
        print("CHECK FAILED:\n  " + "\n  ".join(problems_all))
        return 1
    return 0 if have_ropepool else 2


if __name__ == "__main__":
    sys.exit(main())
