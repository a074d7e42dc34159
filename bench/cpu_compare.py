#!/usr/bin/env python3
"""ropepool vs PyTorch eager and torch.compile on the CPU: the same work, back to back, in
one process, beside the machine's copy bandwidth measured in the same run.

PyTorch eager is what a model would do without the fused op: NeoX (half-split) rotation of q
and k in float32 with cos/sin of float64 angles, cast back to the dtype, then
``index_copy_`` of k_rot and v into the pools for the tokens with a non-negative slot.

Workload (same as ``ropepool bench``): Llama-3-8B attention (num_qo_heads 32, num_kv_heads 8,
head_dim 128, rope_base 500000), bfloat16, T in 1, 16, 256, 4096, 32768, a pool of
max(65536, 4T) slots, distinct random slots with ~5% set to -1, random positions below 2^17,
int32 positions/slots. Every contender runs with the same thread count (torch.set_num_threads
and ropepool.set_num_threads). ``torch.compile`` compiles the eager function in two parts,
as a model would have it: the rotation (``fullgraph=True, dynamic=True``, one compilation
for every T), then the pool write of the tokens with a slot >= 0 in eager mode (its boolean
mask has a data-dependent shape, which a compiled graph breaks at). The copy ceiling is
``Tensor.copy_`` of a 512 MiB buffer with the same threads (read + written bytes, the median
of 7, before and after the token counts; the faster counts); ``%copy`` is ropepool's default
call against it. Small T rotate among several input sets (2x the L3, within 256..1024 MiB)
so caches do not flatter any side. Calls rotate among the contenders (ropepool, torch,
ropepool out=, compile; torch, ropepool out=, compile, ropepool; ...) so drift in machine
load hits all alike. The speedup compares the default calls (both allocate their outputs).
Two columns show what the output allocation costs: ``out_us`` times ropepool with
``q_out=``/``k_out=`` buffers allocated once and reused every call (in the same rotation as the default call; ``alloc/out`` is the
default call's median over this one), and a last column times ``inplace=True`` (q_rot/k_rot
written into q/k), after the others because it overwrites q and k.

Before timing, both results are compared: q_rot/k_rot within 2 units in the last place of
the dtype (each side rounds once from float32, with different float32 sin/cos), every pool
row the same on both sides (written rows as close as k_rot, v rows and untouched rows
bit-identical), ropepool's written k_pool rows bit-identical to its own k_rot, and the
out= call's q_out/k_out bit-identical to the default call's q_rot/k_rot.

    .venv/bin/python bench/cpu_compare.py                 # default workload, all threads
    .venv/bin/python bench/cpu_compare.py --threads 2 --tokens 256,4096 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

from torch_reference import make_inv_freq, torch_rope_f32
from torch_reference import torch_rope_pool as torch_eager

try:
    import ropepool
except ImportError as e:  # pragma: no cover - a set-up problem, not a benchmark result
    sys.exit(
        f"cpu_compare.py: cannot import ropepool ({e}); build it first: "
        "`.venv/bin/pip install --no-build-isolation .`"
    )

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0,
                   help="threads for both (default: ropepool's default, ROPEPOOL_NUM_THREADS or all hardware threads)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tokens", default="1,16,256,4096,32768", help="comma-separated token counts")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="timing budget per token count, both sides together (default 2)")
    p.add_argument("--min-calls", type=int, default=5, help="at least this many timed calls per side (default 5)")
    p.add_argument("--rotate-mib", type=int, default=0,
                   help="input bytes to rotate among for small T (default: 2 x the L3, within "
                        "256..1024 MiB, as `ropepool bench`)")
    p.add_argument("--num-qo-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-base", type=float, default=500000.0)
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens expects a comma-separated list of integers, got {args.tokens!r}")
    if any(t < 0 for t in args.tokens):
        p.error("--tokens must be >= 0")
    if args.threads < 0 or args.head_dim <= 0 or args.head_dim % 2:
        p.error("--threads must be >= 0 and --head-dim even and > 0")
    return args


# --- the two contenders -----------------------------------------------------------------

def ropepool_call(q, k, v, positions, slots, k_pool, v_pool, shape, inplace=False, out=None):
    if inplace:
        shape = dict(shape, inplace=True)
    if out is not None:  # caller-provided q_rot/k_rot buffers
        shape = dict(shape, q_out=out[0], k_out=out[1])
    return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **shape)


# --- workload --------------------------------------------------------------------------

def make_set(T, args, dtype, pool_slots, gen):
    Hq, Hk, D = args.num_qo_heads, args.num_kv_heads, args.head_dim

    def uniform(*shape):
        return (torch.rand(*shape, generator=gen, dtype=torch.float32) * 8 - 4).to(dtype)

    positions = torch.randint(0, 1 << 17, (T,), generator=gen, dtype=torch.int32)
    slots = torch.randperm(pool_slots, generator=gen)[:T].to(torch.int32)  # distinct
    slots[torch.rand(T, generator=gen) < 0.05] = -1
    return dict(q=uniform(T, Hq, D), k=uniform(T, Hk, D), v=uniform(T, Hk, D),
                positions=positions, slots=slots)


def ulp_close(a, b, dtype, scale):
    """|a - b| <= 2 ulp(dtype) of max(|a|, |b|) + a float32-rounding allowance of scale."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    rel = 2.0 ** (1 - MANTISSA_BITS[dtype])
    bound = rel * torch.maximum(a64.abs(), b64.abs()) + 2.0 ** -17 * scale
    bad = ~((a64 - b64).abs() <= bound)
    return int(bad.sum()), bad


def check_agreement(s, r_out, t_out, k_pool0, v_pool0):
    """Returns a list of problems (empty when both sides agree)."""
    problems = []
    dtype = s["q"].dtype
    for name, a, b in (("q_rot", r_out[0], t_out[0]), ("k_rot", r_out[1], t_out[1])):
        nbad, bad = ulp_close(a, b, dtype, scale=8.0)
        if nbad:
            idx = tuple(int(i) for i in bad.nonzero()[0])
            problems.append(f"{name}: {nbad} of {a.numel()} elements differ by more than 2 ulp, "
                            f"first at {idx}: ropepool {float(a[idx])} vs torch {float(b[idx])}")
    slots = s["slots"].to(torch.int64)
    written = slots >= 0
    rows = slots[written]
    r_kp, r_vp, t_kp, t_vp = r_out[2], r_out[3], t_out[2], t_out[3]
    if not torch.equal(r_kp[rows], r_out[1][written]):
        problems.append("ropepool k_pool rows are not bit-identical to its k_rot")
    if not torch.equal(r_vp[rows], s["v"][written]) or not torch.equal(t_vp[rows], s["v"][written]):
        problems.append("v_pool rows are not bit-identical to v")
    untouched = torch.ones(r_kp.shape[0], dtype=torch.bool)
    untouched[rows] = False
    for name, pool, pool0 in (("ropepool k_pool", r_kp, k_pool0), ("ropepool v_pool", r_vp, v_pool0),
                              ("torch k_pool", t_kp, k_pool0), ("torch v_pool", t_vp, v_pool0)):
        if not torch.equal(pool[untouched], pool0[untouched]):
            problems.append(f"{name}: rows that are no slot changed")
    nbad, _ = ulp_close(r_kp[rows], t_kp[rows], dtype, scale=8.0)
    if nbad:
        problems.append(f"k_pool written rows: {nbad} elements differ by more than 2 ulp")
    return problems


def percentile(sorted_values, q):
    return sorted_values[int(math.floor(q * (len(sorted_values) - 1)))]


def summarize(samples):
    v = sorted(samples)
    return dict(median_us=statistics.median(v) * 1e6, p10_us=percentile(v, 0.1) * 1e6,
                p90_us=percentile(v, 0.9) * 1e6, calls=len(v))


def bytes_per_call(T, args, dtype):
    es = torch.tensor([], dtype=dtype).element_size()
    return T * args.head_dim * es * (2 * args.num_qo_heads + 5 * args.num_kv_heads) + T * 2 * 4


def l3_bytes():
    """The L3 size sysfs reports for cpu0 (0 when unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            with open(f"{base}/{entry}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 0


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _rotation(q, k, positions, inv_freq64):
    q_f, k_f = torch_rope_f32(q, k, positions, inv_freq64)
    return q_f.to(q.dtype), k_f.to(k.dtype)


def compiled_contender():
    """torch.compile of the eager contender's math: the rotation compiled, the masked pool
    write (what torch_reference.torch_rope_pool does after it) eager."""
    rotation = torch.compile(_rotation, fullgraph=True, dynamic=True)

    def call(q, k, v, positions, slots, k_pool, v_pool, inv_freq64):
        q_rot, k_rot = rotation(q, k, positions, inv_freq64)
        written = slots >= 0
        rows = slots[written].to(torch.int64)
        k_pool.index_copy_(0, rows, k_rot[written])
        v_pool.index_copy_(0, rows, v[written])
        return q_rot, k_rot, k_pool, v_pool

    return call


def copy_gbps(nbytes=512 << 20, reps=7):
    """Read + written GB/s of one Tensor.copy_ of nbytes (torch's threads), median of reps."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) * 1e-9


def run_tokens(T, args, dtype, threads, log, compiled):
    Hq, Hk, D = args.num_qo_heads, args.num_kv_heads, args.head_dim
    shape = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=args.rope_base)
    pool_slots = max(65536, 4 * T)
    es = torch.tensor([], dtype=dtype).element_size()
    set_bytes = max(1, T * D * es * (Hq + 2 * Hk))
    n_sets = 1 if T == 0 else max(1, min(512, -(-args.rotate_mib * 2**20 // set_bytes)))
    gen = torch.Generator().manual_seed(args.seed + T)
    log(f"T={T}: {n_sets} input set(s), pool of {pool_slots} slots")
    k_pool0 = (torch.rand(pool_slots, Hk, D, generator=gen) * 8 - 4).to(dtype)
    v_pool0 = (torch.rand(pool_slots, Hk, D, generator=gen) * 8 - 4).to(dtype)
    r_pools = (k_pool0.clone(), v_pool0.clone())
    t_pools = (k_pool0.clone(), v_pool0.clone())
    c_pools = (k_pool0.clone(), v_pool0.clone())
    sets = [make_set(T, args, dtype, pool_slots, gen) for _ in range(n_sets)]
    inv_freq64 = make_inv_freq(D, args.rope_base)

    def run_ropepool(s):
        return ropepool_call(s["q"], s["k"], s["v"], s["positions"], s["slots"], *r_pools, shape)

    def run_torch(s):
        return torch_eager(s["q"], s["k"], s["v"], s["positions"], s["slots"], *t_pools, inv_freq64)

    def run_compiled(s):
        return compiled(s["q"], s["k"], s["v"], s["positions"], s["slots"], *c_pools, inv_freq64)

    # q_out/k_out: allocated once (and touched once, by the agreement check), reused by
    # every call, as an engine that keeps its q_rot/k_rot buffers would.
    out_buffers = (torch.empty(T, Hq, D, dtype=dtype), torch.empty(T, Hk, D, dtype=dtype))

    def run_ropepool_out(s):
        return ropepool_call(s["q"], s["k"], s["v"], s["positions"], s["slots"], *r_pools, shape,
                             out=out_buffers)

    def run_ropepool_inplace(s):
        # q/k are overwritten with their rotation: timing only (each call rotates again)
        return ropepool_call(s["q"], s["k"], s["v"], s["positions"], s["slots"], *r_pools, shape,
                             inplace=True)

    # Agreement on the first set, before either side has touched the pools.
    log(f"T={T}: checking that ropepool and torch eager agree")
    r_out = run_ropepool(sets[0])
    t_out = run_torch(sets[0])
    problems = check_agreement(sets[0], r_out, t_out, k_pool0, v_pool0)
    if compiled is not None:
        log(f"T={T}: torch.compile (the first T compiles)")
        problems += [f"torch.compile: {p}" for p in
                     check_agreement(sets[0], run_compiled(sets[0]), t_out, k_pool0, v_pool0)]
    del k_pool0, v_pool0, t_out
    o_out = run_ropepool_out(sets[0])
    if not (o_out[0] is out_buffers[0] and o_out[1] is out_buffers[1]):
        problems.append("ropepool with q_out/k_out did not return those buffers")
    for name, a, b in (("q_rot", r_out[0], out_buffers[0]), ("k_rot", r_out[1], out_buffers[1])):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):  # bits, NaN included
            problems.append(f"{name}: the out= call differs from the default call")
    del r_out, o_out
    if problems:
        return dict(tokens=T, agree=False, problems=problems)

    log(f"T={T}: timing")
    contenders = (run_ropepool, run_torch, run_ropepool_out) + (
        (run_compiled,) if compiled is not None else ())
    for s in sets[:3]:  # warm-up
        for fn in contenders:
            fn(s)
    samples = {fn: [] for fn in contenders}
    start = time.perf_counter()
    i = 0
    while len(samples[run_ropepool]) < args.min_calls or time.perf_counter() - start < args.seconds:
        s = sets[i % n_sets]
        k = i % len(contenders)
        order = contenders[k:] + contenders[:k]
        for fn in order:
            t0 = time.perf_counter()
            fn(s)
            samples[fn].append(time.perf_counter() - t0)
        i += 1
        if len(samples[run_ropepool]) >= 200000:
            break
    # Then ropepool with inplace=True (no q_rot/k_rot allocation): after the comparison,
    # because it overwrites q and k.
    inplace_samples = []
    for j in range(len(samples[run_ropepool])):
        s = sets[j % n_sets]
        t0 = time.perf_counter()
        run_ropepool_inplace(s)
        inplace_samples.append(time.perf_counter() - t0)
    nbytes = bytes_per_call(T, args, dtype)

    def with_gbps(stats):
        return dict(stats, gbps=nbytes / (stats["median_us"] * 1e-6) * 1e-9 if stats["median_us"] else 0.0)

    r, t = with_gbps(summarize(samples[run_ropepool])), with_gbps(summarize(samples[run_torch]))
    o = with_gbps(summarize(samples[run_ropepool_out]))
    c = with_gbps(summarize(samples[run_compiled])) if compiled is not None else None
    return dict(tokens=T, pool_slots=pool_slots, input_sets=n_sets, agree=True, bytes_per_call=nbytes,
                ropepool=r, torch_eager=t, ropepool_out=o, torch_compile=c,
                ropepool_inplace=with_gbps(summarize(inplace_samples)),
                speedup=t["median_us"] / r["median_us"] if r["median_us"] else float("nan"),
                alloc_over_out=r["median_us"] / o["median_us"] if o["median_us"] else float("nan"))


def main(argv=None):
    args = parse_args(argv)
    if not args.rotate_mib:  # beyond the last-level cache, as ropepool bench
        args.rotate_mib = min(1024, max(256, 2 * l3_bytes() >> 20))
    dtype = DTYPES[args.dtype]
    if args.threads:
        ropepool.set_num_threads(args.threads)
    threads = ropepool.get_num_threads()
    torch.set_num_threads(threads)

    def log(msg):
        print(f"[cpu_compare] {msg}", file=sys.stderr, flush=True)

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    print(f"ropepool {ropepool.__version__} vs PyTorch {torch.__version__} eager and "
          f"torch.compile, CPU, {date}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} hardware threads; threads: ropepool {threads}, "
          f"torch {torch.get_num_threads()}")
    print(f"workload: {args.dtype}, num_qo_heads {args.num_qo_heads}, num_kv_heads {args.num_kv_heads}, "
          f"head_dim {args.head_dim}, rope_base {args.rope_base:g}, int32 positions below 2^17 and slots, "
          f"~5% slots -1", flush=True)
    copy_before = copy_gbps()
    print(f"copy ceiling (Tensor.copy_ of 512 MiB, {threads} thread(s), read + written): "
          f"{copy_before:.2f} GB/s before", flush=True)
    compiled = None if args.no_compile else compiled_contender()
    header = (f"{'tokens':>7} {'sets':>5} {'calls':>7}  {'ropepool_us':>12} {'(p10-p90)':>19}  "
              f"{'torch_us':>12} {'(p10-p90)':>21}  {'rp GB/s':>8} {'pt GB/s':>8}  {'speedup':>8}  "
              f"{'out_us':>11} {'(p10-p90)':>19} {'alloc/out':>9}  {'inplace_us':>11} {'GB/s':>6}  "
              f"{'compile_us':>11}")
    print(header, flush=True)

    results = []
    ok = True
    for T in args.tokens:
        res = run_tokens(T, args, dtype, threads, log, compiled)
        results.append(res)
        if not res["agree"]:
            ok = False
            print(f"{T:>7}  DISAGREE:")
            for p in res["problems"]:
                print(f"         {p}")
            continue
        r, t, o = res["ropepool"], res["torch_eager"], res["ropepool_out"]
        print(f"{T:>7} {res['input_sets']:>5} {r['calls']:>7}  {r['median_us']:>12.2f} "
              f"({r['p10_us']:>8.2f}-{r['p90_us']:>8.2f})  {t['median_us']:>12.2f} "
              f"({t['p10_us']:>9.2f}-{t['p90_us']:>9.2f})  {r['gbps']:>8.2f} {t['gbps']:>8.2f}  "
              f"{res['speedup']:>7.2f}x  {o['median_us']:>11.2f} "
              f"({o['p10_us']:>8.2f}-{o['p90_us']:>8.2f}) {res['alloc_over_out']:>8.2f}x  "
              f"{res['ropepool_inplace']['median_us']:>11.2f} "
              f"{res['ropepool_inplace']['gbps']:>6.2f}  "
              f"{res['torch_compile']['median_us'] if res['torch_compile'] else float('nan'):>11.2f}",
              flush=True)
    copy_after = copy_gbps()
    ceiling = max(copy_before, copy_after)
    print(f"copy ceiling after: {copy_after:.2f} GB/s; ropepool's default call, % of the faster "
          f"({ceiling:.2f} GB/s): " + ", ".join(
              f"T={x['tokens']} {100 * x['ropepool']['gbps'] / ceiling:.0f}%"
              for x in results if x["agree"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=date, cpu=cpu_model(), threads=threads, dtype=args.dtype,
                           copy_gbps=ceiling, copy_gbps_before=copy_before,
                           copy_gbps_after=copy_after,
                           ropepool_version=ropepool.__version__, torch_version=torch.__version__,
                           num_qo_heads=args.num_qo_heads, num_kv_heads=args.num_kv_heads,
                           head_dim=args.head_dim, rope_base=args.rope_base, results=results), f, indent=2)
    if not ok:
        print("\nropepool and torch eager DISAGREE: see above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
