#!/usr/bin/env python3
"""ropepool on a CUDA GPU next to PyTorch eager, torch.compile and a device-to-device copy.

One command, one process, one table:

    python bench/gpu_bench.py                       # default workload, all token counts
    python bench/gpu_bench.py --tokens 1,4096 --json out.json
    python bench/gpu_bench.py --tokens 1 --cache-tokens '' --fusion-tokens 1,4096   # §7 mostly

Workload (Llama-3-8B attention): bfloat16, num_qo_heads 32, num_kv_heads 8, head_dim 128,
rope_base 500000; inputs uniform in [-4, 4); int32 positions random below 2^17; int32
slots: T distinct rows of a 262144-row cache, drawn from a random permutation (none
negative, so the PyTorch contenders need no host sync); T in 1 .. 65536.

Contenders, all computing the same function:
  ropepool   ropepool.rope_pool_fused (one kernel)
  eager      PyTorch: cos/sin of float64 angles, float32 rotation, cast, index_copy_ of k_rot
             and v into the pools (bench/torch_reference.py)
  compile    torch.compile of that same function (fullgraph, dynamic shapes: one compile)
  copy       a device-to-device copy: the ceiling (bytes read + written), 1 GiB and the
             same bytes as one call

Cold inputs: every call reads the next of N input sets, N chosen so that one pass over
them exceeds 4x the GPU's L2 (240 MB on an H200); the pools (2 x 512 MiB) are far larger
than the L2 and every call writes random rows of them. Three modes, every contender:
  per call     CUDA events around each single call
  b2b          back-to-back: events around batches of 20 calls, time / 20
  graph        CUDA graphs of 20 calls on 20 different input sets (as many graphs as the
               cold rotation needs, replayed in turn), replay time / 20
In each mode a GPU spin (torch.cuda._sleep) is queued before the timed region, so the
events time the GPU's work, not the host's enqueueing; samples where the host still fell
behind are retaken and, if that fails, counted and reported. Medians of --samples (>= 50)
samples. An L2-hot per-call figure (one input set, reused) is reported for ropepool,
labelled as such; it is never the headline.

Host time (the Python caller's view, no synchronisation): the wall time of many eager
calls in a row divided by their number, for ropepool and, as a yardstick, one
`torch.ops.aten.index_copy_` on the same pool; then its parts: the call into reused
q_out/k_out, the two output allocations alone, the DLPack export of the nine tensors.

Effective bandwidth counts T * D * elem * (2 * Hq + 5 * Hk) + 8 T index bytes: q, k, v
read, q_rot, k_rot, k_pool and v_pool rows written. Before timing, ropepool's outputs are
checked against eager's (q_rot/k_rot within 2 ulp, pool rows bit-identical to k_rot / v,
nothing else in the pools changed).

Cache formats (SPEC §6, --caches, on by default): the same cold inputs written into the
caches engines deploy, each against the plain bf16 [P, Hk, D] pool in the same run, by
their own bytes (every tensor at its element size): fp8 e4m3 pools with tensor scales,
FlashInfer-style combined paged caches [pages, 2, page_size, Hk, D] (NHD) and
[pages, 2, Hk, page_size, D] (HND) at page sizes 1, 16 and 64, fp8 HND, and fp8 q_rot; two of
them also with return_k_rot=False (no k_rot written or returned: "bf16 [P,Hk,D], no k_rot" and
"fp8 NHD 16, fp8 q, no k_rot", by their bytes without k_rot); PyTorch eager and torch.compile
of the same math (rotation, e4m3 quantisation, paged index_put_) for the fp8 NHD cache. Each
variant is checked against the plain bf16 result first (its pool rows against the plain
call's k_rot even where it writes none, and no pool row the slots do not name may change).

FlashInfer in the cache section (optional: where `import flashinfer` works, else the output
says why and the rest runs as before; --no-flashinfer leaves it out): its compositions that
write the same caches, on the same input sets and slots, after ropepool's variants at each T,
in the three modes, beside the ropepool variant each stands for (the ratio of the times is
the caches issue's target, <= 0.9): its fused rope_quantize_fp8_append_paged_kv_cache (PDL
on; fp8 q_rot, fp8 k/v rows, no k_rot) beside "fp8 NHD 16, fp8 q, no k_rot" (ropepool with
return_k_rot=False: the same outputs, so like for like); apply_rope_with_cos_sin_cache
(bf16 q_rot, k_rot) then that fused kernel with no q heads, beside "fp8 NHD 16";
apply_rope_with_cos_sin_cache then append_paged_kv_cache, beside "NHD page 16". Its float32
cos/sin cache is made from float64 angles for positions below 2^17; page size 16, one request
of one page per token, so that every random slot is exact; one fp8 scale (0.5) for q, k and
v. Checked first like ropepool's variants (FlashInferVariant, check_flashinfer_variant).

Fusions (SPEC §7, --fusion-tokens, on by default; --no-fusion skips them): the same cold
inputs and pools in the workload's shape (Hq 32, Hk 8, D 128 by default: Qwen3-8B's too)
through
  plain              ropepool.rope_pool_fused, no §7 keyword
  qk-norm fused      q_norm_weight and k_norm_weight ("rms", --norm-eps; weights in the
                     input dtype as Qwen3 ships them, or --norm-weight-dtype float32)
  qk-norm unfused    two torch RMSNorm calls (q and k, every head, as transformers'
                     Qwen3RMSNorm computes it), then ropepool's plain call
  qk-norm compile    torch.compile of the unfused math (norm, rotation, index_copy_); dropped
                     with a printed note if it does not compile
  mrope              mrope_section [16, 24, 24] (Qwen2-VL, at D = 128), positions [3, T]
                     random in every row
  mrope interleaved  mrope_interleaved with [24, 20, 20] (Qwen3-VL, at D = 128)
in the three modes above, each by its own bytes: the plain call's, plus 2 D weight
elements for the norm, plus the normalised q and k written and read back once for the
unfused sequence (the least its three calls move), plus two more int32 position rows for
mRoPE. The table gives each variant's share of the copy ceiling over the plain call's at
the same T, and the fused norm's speedup over the unfused sequence and over torch.compile.
Checked first, on input set 0 (pool rows bit-identical to k_rot / v, no other row
changed): plain against eager; the fused norm against the unfused sequence within the
SPEC §7 tolerance; the unfused sequence against the eager norm + rotation; mRoPE with
three equal position rows bit-identical to the plain call, and with random rows against
the eager rotation of each frequency's row. tests/python/test_gpu_bench.py runs these
checks on the CPU.

Writes full results to --json (default $OUT/gpu_bench.json when $OUT is set) and prints a
short table last.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import math
import os
import statistics
import sys
import time

import torch

from torch_reference import make_inv_freq, torch_rms_norm, torch_rope_fp8_paged
from torch_reference import torch_norm_rope_pool as reference_norm_rope_pool
from torch_reference import torch_rope_pool as reference_rope_pool

try:
    import ropepool
except ImportError as e:  # still time the baselines, say why ropepool is missing
    ropepool = None
    ROPEPOOL_IMPORT_ERROR = str(e)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CALLS_PER_BATCH = 20  # back-to-back batches and graphs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,64,256,1024,4096,16384,65536")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--num-qo-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-base", type=float, default=500000.0)
    p.add_argument("--pool-rows", type=int, default=262144, help="rows of each cache pool")
    p.add_argument("--l2-multiple", type=float, default=4.0,
                   help="one pass over the input sets is at least this many L2s")
    p.add_argument("--graph-max-tokens", type=int, default=4096)
    p.add_argument("--samples", type=int, default=60, help="samples per median (>= 50)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    p.add_argument("--cache-tokens", default="1,64,256,4096,65536",
                   help="token counts of the cache-format section ('' to skip it)")
    p.add_argument("--fusion-tokens", default="1,64,256,4096,16384,65536",
                   help="token counts of the SPEC §7 fusion section ('' to skip it)")
    p.add_argument("--no-fusion", action="store_true", help="skip the SPEC §7 fusion section")
    p.add_argument("--no-flashinfer", action="store_true",
                   help="leave FlashInfer out of the cache section even where it imports")
    p.add_argument("--norm-weight-dtype", choices=("input", "float32"), default="input",
                   help="q/k norm weights in the input dtype (as Qwen3 ships them) or float32")
    p.add_argument("--norm-eps", type=float, default=1e-6, help="the norm's eps (Qwen3: 1e-6)")
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.cache_tokens = [int(t) for t in args.cache_tokens.split(",") if t]
    args.fusion_tokens = [int(t) for t in args.fusion_tokens.split(",") if t and not args.no_fusion]
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_bench.json")
    return args


def torch_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64):
    """The eager contender (and what torch.compile compiles): every benchmark slot is >= 0,
    so no boolean mask and no host synchronisation."""
    return reference_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64,
                               skip_negative_slots=False)


def torch_norm_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64, q_norm_weight,
                         k_norm_weight, eps):
    """The torch.compile contender of the fusion section: the unfused QK-norm sequence in
    torch alone, every slot >= 0 (as torch_rope_pool above)."""
    return reference_norm_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64,
                                    q_norm_weight, k_norm_weight, eps, skip_negative_slots=False)


# --- workload ----------------------------------------------------------------------------------

class Workload:
    """N input sets for T tokens in one buffer per argument (set i is rows [iT, (i+1)T)), and
    the two pools every call writes into."""

    def __init__(self, T, args, gen, l2_bytes, min_sets=2, fused_qkv=False, device="cuda"):
        self.T = T
        self.device = device
        self.dtype = DTYPES[args.dtype]
        Hq, Hk, D = args.num_qo_heads, args.num_kv_heads, args.head_dim
        self.shape = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=args.rope_base)
        self.P = args.pool_rows
        if T > self.P:
            raise SystemExit(f"gpu_bench.py: T = {T} exceeds --pool-rows {self.P}")
        es = torch.tensor([], dtype=self.dtype).element_size()
        self.bytes = T * D * es * (2 * Hq + 5 * Hk) + 2 * 4 * T
        set_bytes = T * D * es * (Hq + 2 * Hk) + 2 * 4 * T
        self.n_sets = max(min_sets, math.ceil(args.l2_multiple * l2_bytes / set_bytes))
        self.cold_bytes = self.n_sets * set_bytes
        n, dev = self.n_sets * T, device

        def uniform(*shape):
            return (torch.rand(*shape, generator=gen, device=dev) * 8 - 4).to(self.dtype)

        if fused_qkv:  # views into one fused QKV projection output [nT, (Hq + 2 Hk) D], no copy
            q, k, v = uniform(n, (Hq + 2 * Hk) * D).split([Hq * D, Hk * D, Hk * D], dim=1)
            self.q, self.k, self.v = (x.unflatten(1, (-1, D)) for x in (q, k, v))
        else:
            self.q, self.k, self.v = uniform(n, Hq, D), uniform(n, Hk, D), uniform(n, Hk, D)
        self.positions = torch.randint(0, 1 << 17, (n,), generator=gen, device=dev,
                                       dtype=torch.int32)
        self.slots = distinct_slots(self.P, T, self.n_sets, gen, dev)
        self.k_pool = uniform(self.P, Hk, D)
        self.v_pool = uniform(self.P, Hk, D)
        self.inv_freq64 = make_inv_freq(D, args.rope_base, dev)
        self._sets = [self._views(i) for i in range(self.n_sets)]

    def _views(self, i):
        r = slice(i * self.T, (i + 1) * self.T)
        # mRoPE positions are [sets, 3, T]: every set's [3, T] contiguous, as a model's are
        positions = self.positions[i] if self.positions.dim() == 3 else self.positions[r]
        return (self.q[r], self.k[r], self.v[r], positions, self.slots[r],
                self.k_pool, self.v_pool)

    def with_positions(self, positions):
        """The same input sets and pools with other positions: [sets * T], or [sets, 3, T]
        for mRoPE."""
        other = copy.copy(self)
        other.positions = positions
        other._sets = [other._views(i) for i in range(self.n_sets)]
        return other

    def args_of(self, i):
        return self._sets[i % self.n_sets]


def distinct_slots(pool_rows, T, n_sets, gen, device):
    """int32 slots [n_sets * T]: T distinct rows of the pool per set, consecutive slices of
    random permutations of it."""
    per_perm = pool_rows // T
    perms = [torch.randperm(pool_rows, generator=gen, device=device)[: per_perm * T]
             for _ in range(math.ceil(n_sets / per_perm))]
    return torch.cat(perms)[: n_sets * T].to(torch.int32)


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def pair_sum(x, interleaved=False):
    """|a| + |b| of every element's pair (NeoX halves, or GPT-J neighbours when interleaved), in
    float64: the scale of SPEC §1's float32 term."""
    x = x.double().abs()
    if interleaved:
        return (x[..., 0::2] + x[..., 1::2]).repeat_interleave(2, dim=-1)
    h = x.shape[-1] // 2
    s = x[..., :h] + x[..., h:]
    return torch.cat((s, s), dim=-1)


def rotation_problems(what, got, want, x, slack=0.0, interleaved=False):
    """got within 2 ulp of want, plus 2^-17 (|a| + |b|) of the rotated input x (pairs as
    pair_sum's), plus `slack` (a number, or a tensor like got): a list of one problem, or none."""
    g, e = got.double(), want.double()
    # SPEC §1's float32 term twice over: the eager references round in float32 too
    bound = (2.0 ** (1 - MANTISSA_BITS[want.dtype]) * torch.maximum(g.abs(), e.abs())
             + 2.0 ** -17 * pair_sum(x, interleaved) + slack)
    nbad = int((~((g - e).abs() <= bound)).sum())
    return [f"{what}: {nbad} elements outside the bound"] if nbad else []


def call_and_restore(w, fn, a):
    """fn(*a), then the pools put back as they were: (fn's outputs, problems of its pool
    writes: the rows the slots name hold k_rot / v bit for bit, every other row unchanged)."""
    k0, v0 = w.k_pool.clone(), w.v_pool.clone()
    out = fn(*a)
    rows = a[4].to(torch.int64)
    problems = []
    if not (torch.equal(w.k_pool[rows], out[1]) and torch.equal(w.v_pool[rows], a[2])):
        problems.append("pool rows are not bit-identical to k_rot / v")
    untouched = torch.ones(w.P, dtype=torch.bool, device=w.k_pool.device)
    untouched[rows] = False
    if not (torch.equal(w.k_pool[untouched], k0[untouched])
            and torch.equal(w.v_pool[untouched], v0[untouched])):
        problems.append("pool rows no token names changed")
    w.k_pool.copy_(k0)
    w.v_pool.copy_(v0)
    return out, problems


def check(w, compiled):
    """ropepool vs eager on set 0: returns (problems, notes)."""
    a = w.args_of(0)
    r, problems = call_and_restore(w, lambda *x: ropepool.rope_pool_fused(*x, **w.shape), a)
    problems = [f"ropepool: {p}" for p in problems]
    t, _ = call_and_restore(w, lambda *x: torch_rope_pool(*x, w.inv_freq64), a)
    notes = []
    if compiled is not None:
        # Inductor may contract into FMAs: informational, not a failure of ropepool.
        c, _ = call_and_restore(w, lambda *x: compiled(*x, w.inv_freq64), a)
        if not (torch.equal(c[0], t[0]) and torch.equal(c[1], t[1])):
            d = (c[0].float() - t[0].float()).abs().max().item()
            notes.append(f"torch.compile output differs from eager by up to {d:.3g}")
    problems += rotation_problems("q_rot vs eager", r[0], t[0], a[0])
    problems += rotation_problems("k_rot vs eager", r[1], t[1], a[1])
    return problems, notes


# --- timing ------------------------------------------------------------------------------------

class GpuTimer:
    """CUDA events around enqueued work, with a GPU spin (torch.cuda._sleep) queued first: the
    GPU stays busy while the host enqueues, so the events time the GPU's work and not the
    host's Python/dispatch cost (as nvbench's blocking kernel does). If the GPU reached the
    start event before the host had finished enqueueing, the sample is retaken with twice
    the spin; `host_bound` counts samples that never got there."""

    def __init__(self, spin_seconds=100e-6):
        self.spin_cycles = int(spin_seconds * 2.0e9)  # SM clock <= 2 GHz
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.host_bound = 0

    def __call__(self, enqueue):
        for _ in range(5):
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


def warm_up(fn, w, start=0):
    for i in range(start, start + 3):
        fn(*w.args_of(i))
    torch.cuda.synchronize()


def time_per_call(fn, w, samples, start=0):
    """Median GPU seconds of one call, each call (a retaken sample too) on the next input
    set, so no call finds its inputs in the L2."""
    timer, out, i = GpuTimer(), [], start

    def one():
        nonlocal i
        fn(*w.args_of(i))
        i += 1

    for _ in range(samples):
        out.append(timer(one))
    return statistics.median(out), timer.host_bound


def time_back_to_back(fn, w, samples, start=0):
    """Median GPU seconds per call of batches of 20 calls back to back, inputs rotating."""
    timer, out, i = GpuTimer(), [], start

    def batch():
        nonlocal i
        for _ in range(CALLS_PER_BATCH):
            fn(*w.args_of(i))
            i += 1

    for _ in range(samples):
        out.append(timer(batch) / CALLS_PER_BATCH)
    return statistics.median(out), timer.host_bound


def time_graph(fn, w, samples, start=0):
    """Median GPU seconds per call of CUDA graphs of 20 calls on 20 different input sets, from
    set `start` on; as many graphs as the cold rotation needs, but no more than are replayed
    (one memory pool, replayed in capture order)."""
    replays = 3 + max(samples, 3)
    n_graphs = max(1, min(w.n_sets // CALLS_PER_BATCH, replays))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(start, start + 3):
            fn(*w.args_of(i))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for g_i in range(n_graphs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=s):
            for c in range(CALLS_PER_BATCH):
                fn(*w.args_of(start + g_i * CALLS_PER_BATCH + c))
        graphs.append(g)
    for g in graphs[: min(3, n_graphs)]:
        g.replay()
    torch.cuda.synchronize()
    timer, out = GpuTimer(), []
    for k in range(max(samples, 3)):
        out.append(timer(graphs[(3 + k) % n_graphs].replay) / CALLS_PER_BATCH)
    del graphs
    return statistics.median(out), timer.host_bound, n_graphs


def host_us_per_call(fn, args, calls=400):
    """Wall microseconds per call of `calls` calls in a row, no synchronisation in between
    (what an eager Python caller pays on the host)."""
    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def copy_seconds(n, reps, warmup):
    """Median seconds of a device-to-device torch copy of n bytes (events around each copy)."""
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


# --- cache formats (SPEC §6) -------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
# name, kv_layout, page_size, fp8 pools, fp8 q_rot[, (k_scale, v_scale, q_scale) or None[,
# k_rot]]: the fp8 scales are 0.5 / 0.25 / 0.5 (powers of two, as FlashInfer's rows beside them
# take 0.5) unless given; the last two rows time the same formats with scales that are not
# powers of two, whose division takes two Newton steps more per element. k_rot False: the call
# passes return_k_rot=False (SPEC §4: k_rot neither written nor returned), each such row after
# the same format with k_rot; "fp8 NHD 16, fp8 q, no k_rot" writes what FlashInfer's fused
# kernel writes (its peer in FLASHINFER_VARIANTS).
CACHE_VARIANTS = (
    ("bf16 [P,Hk,D]", None, 1, False, False),
    ("bf16 [P,Hk,D], no k_rot", None, 1, False, False, None, False),
    ("fp8 [P,Hk,D]", None, 1, True, False),
    ("NHD page 1", "NHD", 1, False, False),
    ("NHD page 16", "NHD", 16, False, False),
    ("NHD page 64", "NHD", 64, False, False),
    ("HND page 16", "HND", 16, False, False),
    ("HND page 64", "HND", 64, False, False),
    ("fp8 NHD 16", "NHD", 16, True, False),
    ("fp8 HND 16", "HND", 16, True, False),
    ("fp8 NHD 16, fp8 q", "NHD", 16, True, True),
    ("fp8 NHD 16, fp8 q, no k_rot", "NHD", 16, True, True, None, False),
    ("fp8 NHD 16, scales 0.37", "NHD", 16, True, False, (0.37, 0.37, 0.37)),
    ("fp8 NHD 16, fp8 q, scales 0.37", "NHD", 16, True, True, (0.37, 0.37, 0.37)),
)


class CacheVariant:
    """The pools of one cache format over the workload's P slots: a plain [P, Hk, D] pair, or
    the K and V halves of one FlashInfer-style combined paged cache; k_rot False: calls with
    return_k_rot=False."""

    def __init__(self, spec, w, gen):
        self.name, self.layout, self.page_size, self.fp8, self.q8 = spec[:5]
        scales = spec[5] if len(spec) > 5 else None
        k_scale, v_scale, q_scale = scales if scales is not None else (0.5, 0.25, 0.5)
        self.k_rot = spec[6] if len(spec) > 6 else True
        P, Hk, D = w.P, w.shape["num_kv_heads"], w.shape["head_dim"]
        pool_dtype = FP8 if self.fp8 else w.dtype
        dev = w.device

        def fill(*shape):
            return (torch.rand(*shape, generator=gen, device=dev) * 8 - 4).to(pool_dtype)

        pages, ps = P // self.page_size, self.page_size
        if self.layout is None:
            self.k_pool, self.v_pool = fill(P, Hk, D), fill(P, Hk, D)
        elif self.layout == "NHD":
            cache = fill(pages, 2, ps, Hk, D)
            self.k_pool, self.v_pool = cache[:, 0], cache[:, 1]
        else:
            cache = fill(pages, 2, Hk, ps, D)
            self.k_pool, self.v_pool = cache[:, 0], cache[:, 1]
        self.kwargs = dict(w.shape)
        if self.layout is not None:
            self.kwargs["kv_layout"] = self.layout
        if self.fp8:
            self.k_scale = torch.tensor([k_scale], device=dev)
            self.v_scale = torch.tensor([v_scale], device=dev)
            self.kwargs.update(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.q8:
            self.q_scale = torch.tensor([q_scale], device=dev)
            self.kwargs.update(q_out_dtype=FP8, q_scale=self.q_scale)
        if not self.k_rot:
            self.kwargs["return_k_rot"] = False
        es = torch.tensor([], dtype=w.dtype).element_size()
        Hq, T = w.shape["num_qo_heads"], w.T
        pool_es, q_out_es = (1 if self.fp8 else es), (1 if self.q8 else es)
        k_rot_es = es if self.k_rot else 0
        # q, k, v read; q_rot, k_rot (with k_rot) written; a k and a v pool row written per token
        self.bytes = (T * D * (es * (Hq + 2 * Hk) + q_out_es * Hq + k_rot_es * Hk + 2 * pool_es * Hk)
                      + 8 * T)

    def call(self, q, k, v, positions, slots, *_pools):
        return ropepool.rope_pool_fused(q, k, v, positions, slots, self.k_pool, self.v_pool,
                                        **self.kwargs)

    def rows(self, slots):
        """The k and v pool rows of `slots`, [T, Hk, D] each."""
        s = slots.to(torch.int64)
        if self.layout is None:
            return self.k_pool[s], self.v_pool[s]
        page, row = s // self.page_size, s % self.page_size
        if self.layout == "NHD":
            return self.k_pool[page, row], self.v_pool[page, row]
        return self.k_pool[page, :, row], self.v_pool[page, :, row]  # advanced dims first


def e4m3_close(a, b):
    """Within one e4m3 ulp (values as float32, same scale)."""
    a, b = a.float(), b.float()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -6))) - 3)
    return bool(((a - b).abs() <= ulp).all())


def other_rows(var, slots):
    """The k and v rows (as bytes) of every slot of var's pools that `slots` does not name."""
    keep = torch.ones(var.k_pool.shape[0] * var.page_size if var.layout else var.k_pool.shape[0],
                      dtype=torch.bool, device=slots.device)
    keep[slots.to(torch.int64)] = False
    k, v = var.rows(torch.nonzero(keep).flatten())
    return k.view(torch.uint8), v.view(torch.uint8)


def other_rows_problems(var, slots, before):
    """[a problem] when a row of var's pools that `slots` does not name differs from `before`
    (other_rows taken before the call)."""
    if all(torch.equal(x, y) for x, y in zip(before, other_rows(var, slots))):
        return []
    return ["pool rows no token names changed"]


def fp8_q_problems(q_rot, q_ref, scale):
    """[a problem] unless q_rot is fp8 within one e4m3 step of e4m3(q_ref / scale)."""
    if q_rot.dtype == FP8 and e4m3_close(q_rot, (q_ref.float() / scale).to(FP8)):
        return []
    return ["fp8 q_rot is not within one e4m3 step of e4m3(q_rot / q_scale)"]


def written_rows_problems(k_rows, v_rows, k_want, v, fp8_scales=None):
    """The pool rows the slots name: with fp8_scales = (k_scale, v_scale), v rows
    e4m3(v / v_scale) bit for bit and k rows within one e4m3 step of e4m3(k_want / k_scale);
    without, k_want / v bit for bit."""
    problems = []
    if fp8_scales is not None:
        k_scale, v_scale = fp8_scales
        v_want = (v.float() / v_scale).to(FP8)
        if not torch.equal(v_rows.view(torch.uint8), v_want.view(torch.uint8)):
            problems.append("fp8 v rows are not e4m3(v / v_scale) bit for bit")
        if not e4m3_close(k_rows, (k_want.float() / k_scale).to(FP8)):
            problems.append("fp8 k rows are not within one e4m3 step of e4m3(k_rot / k_scale)")
    elif not (torch.equal(k_rows, k_want) and torch.equal(v_rows, v)):
        problems.append("pool rows are not bit-identical to k_rot / v")
    return problems


def check_cache_variant(var, w):
    """The variant's outputs on set 0 against the plain bf16 call's: problems (a list). Without
    k_rot (return_k_rot=False) the result's k_rot must be None, and the pool rows are checked
    against the plain call's k_rot all the same (SPEC §4: the pools receive what they do with
    k_rot)."""
    a = w.args_of(0)
    q_ref, k_ref = ropepool.rope_pool_fused(*a, **w.shape)[:2]
    before = other_rows(var, a[4])
    q_rot, k_rot = var.call(*a)[:2]
    k_rows, v_rows = var.rows(a[4])
    problems = other_rows_problems(var, a[4], before)
    if not var.k_rot:
        if k_rot is not None:
            problems.append("a k_rot returned with return_k_rot=False")
    elif not torch.equal(k_rot, k_ref):
        problems.append("k_rot differs from the plain call's")
    if var.q8:
        problems += fp8_q_problems(q_rot, q_ref, var.q_scale)
    elif not torch.equal(q_rot, q_ref):
        problems.append("q_rot differs from the plain call's")
    scales = (var.k_scale, var.v_scale) if var.fp8 else None
    return problems + written_rows_problems(k_rows, v_rows, k_ref, a[2], scales)


def cache_formats(args, gen, l2, copy_bps, compiled_fp8, fi=None, fi_rows=None):
    """Every CACHE_VARIANTS entry at each --cache-tokens T, on the same cold input sets; with
    FlashInfer (`fi`, the module), each FLASHINFER_VARIANTS entry after them on the same sets,
    its rows appended to `fi_rows`."""
    out = []
    for T in args.cache_tokens:
        with_graph = T <= args.graph_max_tokens
        w = Workload(T, args, gen, l2, min_sets=CALLS_PER_BATCH if with_graph else 2)
        for spec in CACHE_VARIANTS:
            var = CacheVariant(spec, w, gen)
            row = dict(T=T, variant=var.name, bytes=var.bytes, problems=check_cache_variant(var, w))
            contenders = {"ropepool": var.call}
            if spec == ("fp8 NHD 16", "NHD", 16, True, False):
                def eager(q, k, v, positions, slots, *_pools, var=var):
                    return torch_rope_fp8_paged(q, k, v, positions, slots, var.k_pool, var.v_pool,
                                                w.inv_freq64, var.k_scale, var.v_scale, 16)
                contenders["eager"] = eager
                if compiled_fp8 is not None:
                    contenders["compile"] = lambda *a, var=var: compiled_fp8(
                        *a[:5], var.k_pool, var.v_pool, w.inv_freq64, var.k_scale, var.v_scale,
                        16)
            for name, fn in contenders.items():
                try:
                    warm_up(fn, w)
                except Exception as e:  # noqa: BLE001 (torch.compile of the paged fp8 math)
                    if name != "compile":
                        raise
                    row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    compiled_fp8 = None  # not retried at the next T
                    print(f"torch.compile contender dropped: {row['compile_error']}", flush=True)
                    torch.cuda.synchronize()
                    continue
                row[f"{name}_call_us"] = time_per_call(fn, w, args.samples, start=3)[0] * 1e6
                row[f"{name}_b2b_us"] = time_back_to_back(fn, w, args.samples)[0] * 1e6
                if with_graph:
                    row[f"{name}_graph_us"] = time_graph(fn, w, args.samples)[0] * 1e6
            for mode in ("call", "b2b"):
                row[f"pct_copy_{mode}"] = 100 * var.bytes / (row[f"ropepool_{mode}_us"] * 1e-6) / copy_bps
            out.append(row)
            print(json.dumps(row), flush=True)
            del var, contenders
            torch.cuda.empty_cache()
        if fi is not None:
            cos_sin = flashinfer_cos_sin_cache(w.inv_freq64, 1 << 17)
            ours = {r["variant"]: r for r in out if r["T"] == T}
            for spec in FLASHINFER_VARIANTS:
                var = FlashInferVariant(spec, w, gen, fi, cos_sin)
                row = dict(T=T, variant=var.name, peer=var.peer, bytes=var.bytes,
                           problems=check_flashinfer_variant(var, w))
                warm_up(var.call, w)
                row["flashinfer_call_us"] = time_per_call(var.call, w, args.samples, start=3)[0] * 1e6
                row["flashinfer_b2b_us"] = time_back_to_back(var.call, w, args.samples)[0] * 1e6
                if with_graph:
                    row["flashinfer_graph_us"] = time_graph(var.call, w, args.samples)[0] * 1e6
                for mode in ("call", "b2b"):
                    row[f"pct_copy_{mode}"] = (100 * var.bytes / (row[f"flashinfer_{mode}_us"] * 1e-6)
                                               / copy_bps)
                for mode in MODES:  # the caches issue's target: ropepool / FlashInfer <= 0.9
                    theirs, mine = row.get(f"flashinfer_{mode}_us"), ours.get(var.peer, {})
                    if theirs and f"ropepool_{mode}_us" in mine:
                        row[f"ropepool_{mode}_us"] = mine[f"ropepool_{mode}_us"]
                        row[f"ratio_{mode}"] = mine[f"ropepool_{mode}_us"] / theirs
                fi_rows.append(row)
                print(json.dumps(row), flush=True)
                del var
                torch.cuda.empty_cache()
            del cos_sin
        del w
        torch.cuda.empty_cache()
    return out


# --- FlashInfer, an optional peer of the cache section -----------------------------------------

def import_flashinfer():
    """FlashInfer, a benchmark peer (never a dependency of ropepool): (the module with its rope
    and page submodules imported, its version), or (None, why it is not importable)."""
    try:
        import flashinfer
        import flashinfer.page  # noqa: F401
        import flashinfer.rope  # noqa: F401
    except Exception as e:  # noqa: BLE001 (ImportError, or an error of one of its imports)
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    return flashinfer, flashinfer.__version__


def flashinfer_cos_sin_cache(inv_freq64, rows, attention_scaling=1.0):
    """FlashInfer's float32 cos/sin cache [rows, rotary_dim]: cos of every frequency at every
    position in the first half of a row, sin in the second, from float64 angles (times the
    attention scaling) rounded once to float32. Positions stay below `rows` (2^17 here), where
    float32 cos/sin are within 2^-24 relative of the exact values: the rotation check's bound
    (2 ulp of the output dtype plus 2^-17 (|a| + |b|)) holds for them."""
    pos = torch.arange(rows, dtype=torch.float64, device=inv_freq64.device)
    theta = pos[:, None] * inv_freq64[None, :]
    return (torch.cat([torch.cos(theta), torch.sin(theta)], dim=1) * attention_scaling).float()


# name, what runs, the CACHE_VARIANTS entry it stands beside. FlashInfer 0.7's fused kernel
# (rope_quantize_fp8_append_paged_kv_cache) writes q_rot in fp8 only and no k_rot:
#   "fused"        that one call (PDL on): fp8 q_rot, fp8 k and v rows, no k_rot; beside
#                  ropepool's return_k_rot=False row, which writes exactly these (the same data
#                  bytes: FlashInfer's count adds only its cos/sin rows and page tables)
#   "rope+fused"   apply_rope_with_cos_sin_cache (bf16 q_rot, k_rot), then the fused kernel with
#                  no q heads (q[:, :0]; PDL on) for the fp8 k and v rows: ropepool's outputs
#   "rope+append"  apply_rope_with_cos_sin_cache, then append_paged_kv_cache (bf16 cache)
FLASHINFER_VARIANTS = (
    ("FlashInfer NHD 16", "rope+append", "NHD page 16"),
    ("FlashInfer fp8 NHD 16", "rope+fused", "fp8 NHD 16"),
    ("FlashInfer fp8 NHD 16, fp8 q", "fused", "fp8 NHD 16, fp8 q, no k_rot"),
)


class FlashInferVariant:
    """A FlashInfer composition writing FlashInfer's combined cache [pages, 2, 16, Hk, D] (NHD,
    page size 16) over the workload's P slots, with the same random slots: every token is a
    request of its own with one page, so that any slot is exact (batch_indices[t] = t,
    kv_indptr = 0..T, kv_indices[t] = slots[t] // 16, positions[t] = slots[t] % 16: a decode
    batch's page tables). fp8: one scale 0.5 for k and v (FlashInfer has one kv scale) and
    for q, passed as FlashInfer's multipliers 1 / 0.5 (exact: a power of two)."""

    page_size, layout, scale = 16, "NHD", 0.5

    def __init__(self, spec, w, gen, fi, cos_sin):
        self.name, self.kind, self.peer = spec
        self.fi, self.cos_sin, self.T = fi, cos_sin, w.T
        P, Hq, Hk, D = w.P, w.shape["num_qo_heads"], w.shape["num_kv_heads"], w.shape["head_dim"]
        self.D = D
        self.fp8, self.q8 = self.kind != "rope+append", self.kind == "fused"
        dtype = FP8 if self.fp8 else w.dtype
        ps = self.page_size
        self.cache = (torch.rand(P // ps, 2, ps, Hk, D, generator=gen, device=w.device) * 8 - 4).to(dtype)
        self.k_pool, self.v_pool = self.cache[:, 0], self.cache[:, 1]
        slots = w.slots.to(torch.int64)
        self.pages, self.in_page = (slots // ps).to(torch.int32), (slots % ps).to(torch.int32)
        self.base, self.es = w.slots.data_ptr(), w.slots.element_size()
        T = w.T
        self.batch = torch.arange(T, dtype=torch.int32, device=w.device)
        self.indptr = torch.arange(T + 1, dtype=torch.int32, device=w.device)
        self.last_page_len = torch.ones(T, dtype=torch.int32, device=w.device)
        es = torch.tensor([], dtype=w.dtype).element_size()
        # its own traffic: every kernel's reads and writes (the cos/sin rows, float32, and the
        # index arrays: pos_ids, batch_indices, positions, kv_indices, kv_indptr)
        rope = T * D * (2 * es * (Hq + Hk) + 4) + 4 * T  # q, k read; q_rot, k_rot written
        if self.kind == "fused":
            self.bytes = T * D * (es * (Hq + 2 * Hk) + Hq + 2 * Hk + 4) + 20 * T
        elif self.kind == "rope+fused":
            self.bytes = rope + T * D * (2 * es * Hk + 2 * Hk + 4) + 20 * T
        else:
            self.bytes = rope + T * D * 4 * es * Hk + 16 * T

    def _tables(self, slots):
        i = (slots.data_ptr() - self.base) // self.es  # which input set: its slice of the tables
        return self.pages[i:i + self.T], self.in_page[i:i + self.T]

    def _fused(self, q_rope, k, v, positions, pages, in_page):
        return self.fi.rope.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k, None, None, v, self.cos_sin, positions, (self.k_pool, self.v_pool), pages,
            self.indptr, self.batch, in_page, is_neox=True, quantize_dtype=FP8,
            quant_scale_q=1 / self.scale, quant_scale_kv=1 / self.scale,
            page_size=self.page_size, kv_layout=self.layout, enable_pdl=True)

    def call(self, q, k, v, positions, slots, *_pools):
        pages, in_page = self._tables(slots)
        if self.kind == "fused":
            return self._fused(q, k, v, positions, pages, in_page)[0], None
        q_rot, k_rot = self.fi.rope.apply_rope_with_cos_sin_cache(
            positions, q, k, self.D, self.cos_sin, is_neox=True)
        if self.kind == "rope+fused":
            self._fused(q[:, :0], k, v, positions, pages, in_page)
        else:
            self.fi.page.append_paged_kv_cache(k_rot, v, self.batch, in_page, self.cache, pages,
                                               self.indptr, self.last_page_len,
                                               kv_layout=self.layout)
        return q_rot, k_rot

    def rows(self, slots):
        s = slots.to(torch.int64)
        page, row = s // self.page_size, s % self.page_size
        return self.k_pool[page, row], self.v_pool[page, row]


def check_flashinfer_variant(var, w):
    """The FlashInfer variant's outputs on set 0 against independent results: q_rot and k_rot
    against eager's within the rotation bound (fp8 q_rot within one e4m3 step of
    e4m3(q_rot / 0.5)); k rows bit for bit its own k_rot (fp8: within one e4m3 step of
    e4m3(k_rot / 0.5)), v rows bit for bit v (fp8: e4m3(v / 0.5)); no other row changed."""
    a = w.args_of(0)
    (q_ref, k_ref, *_), _ = call_and_restore(w, lambda *x: torch_rope_pool(*x, w.inv_freq64), a)
    before = other_rows(var, a[4])
    q_rot, k_rot = var.call(*a)
    k_rows, v_rows = var.rows(a[4])
    problems = other_rows_problems(var, a[4], before)
    if var.q8:
        problems += fp8_q_problems(q_rot, q_ref, var.scale)
    else:
        problems += rotation_problems("q_rot vs eager", q_rot, q_ref, a[0])
        problems += rotation_problems("k_rot vs eager", k_rot, k_ref, a[1])
    # fp8 rows against eager's k (the fused kind returns no k_rot); bf16 rows against its own k_rot
    k_want = k_ref if var.fp8 else k_rot
    scales = (var.scale, var.scale) if var.fp8 else None
    return problems + written_rows_problems(k_rows, v_rows, k_want, a[2], scales)


def print_flashinfer_table(rows, version):
    if version is None:
        return
    print()
    if not rows:
        print(f"FlashInfer: NOT MEASURED ({version})")
        return
    print(f"FlashInfer {version} beside ropepool (the cache section's inputs and slots, NHD page 16; "
          "fp8 scales 0.5): GPU us per call (call / b2b / graph), % of the copy ceiling by its own "
          "bytes, and ropepool's time over FlashInfer's (the caches issue's target: <= 0.9)")
    print(f"{'T':>6} {'FlashInfer':<30} {'call':>8} {'b2b':>8} {'graph':>8} {'%copy b2b':>9} | "
          f"{'ropepool':<28} {'call':>8} {'b2b':>8} {'graph':>8} | {'ratio call / b2b / graph':>24}  check")
    for r in rows:
        def f(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if key in r else "-"
        ratio = " / ".join(f(f"ratio_{m}") for m in MODES)
        print(f"{r['T']:>6} {r['variant']:<30} {f('flashinfer_call_us'):>8} {f('flashinfer_b2b_us'):>8} "
              f"{f('flashinfer_graph_us'):>8} {f('pct_copy_b2b', '{:.1f}'):>9} | {r['peer']:<28} "
              f"{f('ropepool_call_us'):>8} {f('ropepool_b2b_us'):>8} {f('ropepool_graph_us'):>8} | "
              f"{ratio:>24}  {'; '.join(r['problems']) or 'ok'}")


def print_cache_table(rows):
    if not rows:
        return
    print()
    print("cache formats (SPEC §6): GPU us per call (call / b2b / graph), % of the copy ceiling "
          "by each format's own bytes, and that share over the plain bf16 pool's at the same T")
    print(f"{'T':>6} {'format':<30} {'call':>8} {'b2b':>8} {'graph':>8} {'%copy call':>10} "
          f"{'%copy b2b':>9} {'share/plain':>11}  check")
    plain = {r["T"]: r for r in rows if r["variant"] == CACHE_VARIANTS[0][0]}
    for r in rows:
        base = plain.get(r["T"])
        share = r["pct_copy_b2b"] / base["pct_copy_b2b"] if base else float("nan")
        g = r.get("ropepool_graph_us")
        print(f"{r['T']:>6} {r['variant']:<30} {r['ropepool_call_us']:>8.2f} {r['ropepool_b2b_us']:>8.2f} "
              f"{(f'{g:.2f}' if g is not None else '-'):>8} {r['pct_copy_call']:>10.1f} "
              f"{r['pct_copy_b2b']:>9.1f} {share:>11.3f}  {'; '.join(r['problems']) or 'ok'}")
        if "compile_error" in r:
            print(f"{'':>6}   torch.compile: {r['compile_error']}")
        for name in ("eager", "compile"):
            if f"{name}_call_us" in r:
                g = r.get(f"{name}_graph_us")
                print(f"{'':>6}   torch {name:<10} {r[f'{name}_call_us']:>8.2f} "
                      f"{r[f'{name}_b2b_us']:>8.2f} {(f'{g:.2f}' if g is not None else '-'):>8}")


# --- fusions (SPEC §7) ------------------------------------------------------------------------

# name, what runs ("ropepool": one call with the variant's keywords; "unfused": torch RMSNorm of
# q and of k, then ropepool's plain call; "compile": torch.compile of the unfused math), QK norm,
# mRoPE (None, or the model whose sections it takes)
FUSION_VARIANTS = (
    ("plain", "ropepool", False, None),
    ("qk-norm fused", "ropepool", True, None),
    ("qk-norm unfused", "unfused", True, None),
    ("qk-norm compile", "compile", True, None),
    ("mrope", "ropepool", False, "qwen2-vl"),
    ("mrope interleaved", "ropepool", False, "qwen3-vl"),
)


def mrope_section(model, rotary_dim):
    """The model's mrope_section: Qwen2-VL [16, 24, 24] and Qwen3-VL (interleaved) [24, 20, 20]
    at rotary_dim 128, in the same proportions at another head size."""
    half = rotary_dim // 2
    s_hw = (half - half // 4) // 2 if model == "qwen2-vl" else 5 * half // 16
    return [half - 2 * s_hw, s_hw, s_hw]


class FusionVariant:
    """One row of the fusion section: its call on the workload's input sets (`self.w`, the
    workload itself or, for mRoPE, the same sets with random [3, T] positions) and its own
    bytes."""

    def __init__(self, spec, w, gen, args, compiled_norm=None):
        self.name, self.kind, norm, self.mrope = spec
        Hq, Hk, D = (w.shape[n] for n in ("num_qo_heads", "num_kv_heads", "head_dim"))
        T = w.T
        self.w, self.bytes, self.kwargs = w, w.bytes, dict(w.shape)
        self.compiled_norm = compiled_norm
        if norm:
            w_dtype = w.dtype if args.norm_weight_dtype == "input" else torch.float32
            # learned norm weights scatter about 1
            self.q_norm_weight, self.k_norm_weight = (
                (torch.rand(D, generator=gen, device=w.device) + 0.5).to(w_dtype) for _ in range(2))
            self.norm_eps = args.norm_eps
            self.bytes += 2 * D * self.q_norm_weight.element_size()
            if self.kind == "ropepool":
                self.kwargs.update(q_norm_weight=self.q_norm_weight,
                                   k_norm_weight=self.k_norm_weight, norm_eps=self.norm_eps)
            elif self.kind == "unfused":  # the normalised q and k, written and read back once
                self.bytes += 2 * T * (Hq + Hk) * D * w.q.element_size()
        if self.mrope:
            self.section = mrope_section(self.mrope, D)
            self.interleaved = self.mrope == "qwen3-vl"
            self.kwargs.update(mrope_section=self.section, mrope_interleaved=self.interleaved)
            self.w = w.with_positions(torch.randint(0, 1 << 17, (w.n_sets, 3, T), generator=gen,
                                                    device=w.device, dtype=torch.int32))
            self.bytes += 2 * 4 * T  # two more int32 position rows
        self.call = {"ropepool": self._ropepool, "unfused": self._unfused,
                     "compile": self._compiled}[self.kind]

    def _ropepool(self, *a):
        return ropepool.rope_pool_fused(*a, **self.kwargs)

    def _unfused(self, q, k, v, positions, slots, k_pool, v_pool):
        return ropepool.rope_pool_fused(torch_rms_norm(q, self.q_norm_weight, self.norm_eps),
                                        torch_rms_norm(k, self.k_norm_weight, self.norm_eps),
                                        v, positions, slots, k_pool, v_pool, **self.kwargs)

    def _compiled(self, *a):
        return self.compiled_norm(*a, self.w.inv_freq64, self.q_norm_weight, self.k_norm_weight,
                                  self.norm_eps)

    def eager_norm(self, *a):
        """The torch reference of the norm variants: norm, rotation, index_copy_."""
        return reference_norm_rope_pool(*a, self.w.inv_freq64, self.q_norm_weight,
                                        self.k_norm_weight, self.norm_eps)


def check_fusion_variant(var):
    """The variant on input set 0 against an independent result: (problems, notes)."""
    w = var.w
    a = w.args_of(0)
    out, problems = call_and_restore(w, var.call, a)
    notes = []
    if var.kind == "compile":
        # Inductor may contract into FMAs: informational, not a failure of ropepool.
        want, _ = call_and_restore(w, var.eager_norm, a)
        for i, what in ((0, "q_rot"), (1, "k_rot")):
            if not torch.equal(out[i], want[i]):
                d = (out[i].float() - want[i].float()).abs().max().item()
                notes.append(f"torch.compile {what} differs from eager by up to {d:.3g}")
        return [], notes + [f"torch.compile: {p}" for p in problems]
    if var.mrope:
        # SPEC §7: three equal position rows give exactly the bits of the plain call.
        p1 = a[3][0]
        equal_rows = a[:3] + (p1.expand(3, -1).contiguous(),) + a[4:]
        got, pool_problems = call_and_restore(w, var.call, equal_rows)
        plain, _ = call_and_restore(w, lambda *x: ropepool.rope_pool_fused(*x, **w.shape),
                                    a[:3] + (p1,) + a[4:])
        problems += pool_problems
        if not (torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])):
            problems.append("three equal position rows are not bit-identical to the plain call")
        want, _ = call_and_restore(w, lambda *x: reference_rope_pool(
            *x, w.inv_freq64, mrope_section=var.section, mrope_interleaved=var.interleaved), a)
        x = a[0], a[1]
        slack = 0.0
    elif var.kind == "unfused":
        want, _ = call_and_restore(w, var.eager_norm, a)
        x = (torch_rms_norm(a[0], var.q_norm_weight, var.norm_eps),
             torch_rms_norm(a[1], var.k_norm_weight, var.norm_eps))
        slack = 0.0
    elif "q_norm_weight" in var.kwargs:  # fused against the unfused sequence
        unfused = copy.copy(var)  # the same weights, the plain call's keywords
        unfused.kwargs = dict(w.shape)
        want, _ = call_and_restore(w, unfused._unfused, a)
        x = (torch_rms_norm(a[0], var.q_norm_weight, var.norm_eps),
             torch_rms_norm(a[1], var.k_norm_weight, var.norm_eps))
        # SPEC §7: where the float32 mean (its summation order) moves x * rsqrt(...) across a
        # rounding midpoint, the normalised value differs by one ulp, which w scales and the
        # rotation carries into both elements of the pair (float32: 2^-20 relative on every
        # element); on CUDA the norm kernel may contract the rotation into FMAs unlike the
        # plain kernel: one float32 ulp of the products, at most twice the head's largest value.
        mant = MANTISSA_BITS[w.dtype]
        norm_rel = 2.0 ** (1 - mant) if mant < 23 else 2.0 ** -19
        slack = [norm_rel * pair_sum(y) + 2.0 ** -22 * y.double().abs().amax(-1, keepdim=True)
                 for y in x]
    else:  # plain
        want, _ = call_and_restore(w, lambda *x: torch_rope_pool(*x, w.inv_freq64), a)
        x = a[0], a[1]
        slack = 0.0
    reference = "the unfused sequence" if "q_norm_weight" in var.kwargs else "eager"
    for i, what in ((0, "q_rot"), (1, "k_rot")):
        problems += rotation_problems(f"{what} vs {reference}", out[i], want[i], x[i],
                                      slack[i] if isinstance(slack, list) else slack)
        differ = int((out[i] != want[i]).sum())
        if differ and reference != "eager":  # how often the norm's rounding moved (SPEC §7)
            notes.append(f"{what}: {differ} of {out[i].numel()} elements differ from {reference}")
    return problems, notes


def fusion_section(args, gen, l2, copy_bps, compiled_norm):
    """Every FUSION_VARIANTS entry at each --fusion-tokens T, on the same cold input sets."""
    out = []
    for T in args.fusion_tokens:
        with_graph = T <= args.graph_max_tokens
        w = Workload(T, args, gen, l2, min_sets=CALLS_PER_BATCH if with_graph else 2)
        at_T = {}
        for spec in FUSION_VARIANTS:
            if spec[1] == "compile" and compiled_norm is None:
                continue
            var = FusionVariant(spec, w, gen, args, compiled_norm)
            row = dict(T=T, variant=var.name, bytes=var.bytes)
            t0 = time.perf_counter()
            try:
                row["problems"], row["notes"] = check_fusion_variant(var)
                warm_up(var.call, var.w)
            except Exception as e:  # noqa: BLE001 (torch.compile of the unfused math)
                if var.kind != "compile":
                    raise
                row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                compiled_norm = None  # not retried at the next T
                print(f"torch.compile contender dropped: {row['compile_error']}", flush=True)
                torch.cuda.synchronize()
                out.append(row)
                continue
            if var.kind == "compile":
                row["compile_warmup_s"] = time.perf_counter() - t0
            t, row["call_host_bound"] = time_per_call(var.call, var.w, args.samples, start=3)
            row["call_us"] = t * 1e6
            t, row["b2b_host_bound"] = time_back_to_back(var.call, var.w, args.samples)
            row["b2b_us"] = t * 1e6
            if with_graph:
                t, row["graph_host_bound"], _ = time_graph(var.call, var.w, args.samples)
                row["graph_us"] = t * 1e6
            for mode in ("call", "b2b"):
                row[f"pct_copy_{mode}"] = 100 * var.bytes / (row[f"{mode}_us"] * 1e-6) / copy_bps
            at_T[var.name] = row
            out.append(row)
            print(json.dumps(row), flush=True)
            del var
            torch.cuda.empty_cache()
        # the targets: each share of the copy ceiling over the plain call's, and the
        # fused norm's speedup over the unfused sequence (and torch.compile of it)
        plain, fused = at_T.get("plain"), at_T.get("qk-norm fused")
        for row in at_T.values() if plain is not None else ():
            for mode in ("call", "b2b"):
                row[f"share_vs_plain_{mode}"] = row[f"pct_copy_{mode}"] / plain[f"pct_copy_{mode}"]
        for other, key in (("qk-norm unfused", "unfused"), ("qk-norm compile", "compile")):
            theirs = at_T.get(other, {})
            for mode in MODES:
                if fused is not None and f"{mode}_us" in theirs:
                    fused[f"speedup_vs_{key}_{mode}"] = theirs[f"{mode}_us"] / fused[f"{mode}_us"]
        del w
        torch.cuda.empty_cache()
    return out


def print_fusion_table(rows):
    if not rows:
        return
    print()
    print("fusions (SPEC §7): GPU us per call (call / b2b / graph), % of the copy ceiling by each "
          "variant's own bytes, that share over the plain call's at the same T (call / b2b), and "
          "the fused norm's speedup over the unfused sequence and torch.compile of it")
    print(f"{'T':>6} {'variant':<18} {'call':>8} {'b2b':>8} {'graph':>8} {'%copy call':>10} "
          f"{'%copy b2b':>9} {'share/plain':>13}  check")
    for r in rows:
        if "call_us" not in r:
            print(f"{r['T']:>6} {r['variant']:<30} dropped: {r.get('compile_error', '')}")
            continue
        g = r.get("graph_us")
        share = (f"{r['share_vs_plain_call']:.3f} / {r['share_vs_plain_b2b']:.3f}"
                 if "share_vs_plain_b2b" in r else "-")
        print(f"{r['T']:>6} {r['variant']:<30} {r['call_us']:>8.2f} {r['b2b_us']:>8.2f} "
              f"{(f'{g:.2f}' if g is not None else '-'):>8} {r['pct_copy_call']:>10.1f} "
              f"{r['pct_copy_b2b']:>9.1f} {share:>13}  {'; '.join(r['problems']) or 'ok'}")
        for key in ("unfused", "compile"):
            speedups = [f"{r[f'speedup_vs_{key}_{m}']:.2f}x {m}" for m in MODES
                        if f"speedup_vs_{key}_{m}" in r]
            if speedups:
                print(f"{'':>6}   fused vs {key}: {', '.join(speedups)}")
        for note in r["notes"]:
            print(f"{'':>6}   note: {note}")


# --- main --------------------------------------------------------------------------------------

MODES = ("call", "b2b", "graph")


def open_device(samples, script):
    """The start of a GPU benchmark (this one and gpu_bench_mla.py): --samples checked, the
    watchdog started, the CUDA device's properties printed and returned. A run that hangs
    says where: every thread's stack, then exit, after $ROPEPOOL_BENCH_WATCHDOG_S seconds
    (scripts/gpu_check.sh sets it below its own kill)."""
    if samples < 50:
        sys.exit(f"{script}: --samples must be >= 50 (medians of at least 50)")
    watchdog_s = float(os.environ.get("ROPEPOOL_BENCH_WATCHDOG_S", "0"))
    if watchdog_s > 0:
        faulthandler.dump_traceback_later(watchdog_s, exit=True)
    if not torch.cuda.is_available():
        sys.exit(f"{script}: no CUDA device")
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 "
          f"{props.L2_cache_size / 1e6:.0f} MB; torch {torch.__version__}", flush=True)
    return props


def copy_ceiling():
    """Bytes per second (read + write) of a 1 GiB device-to-device copy, printed."""
    bps = 2 * (1 << 30) / copy_seconds(1 << 30, reps=12, warmup=2)
    print(f"device-to-device copy (1 GiB): {bps / 1e9:.0f} GB/s counting read + write", flush=True)
    return bps


def main(argv=None):
    args = parse_args(argv)
    props = open_device(args.samples, "gpu_bench.py")
    l2 = props.L2_cache_size
    if ropepool is None:
        print(f"ropepool: NOT IMPORTABLE ({ROPEPOOL_IMPORT_ERROR}); timing the baselines only")
    elif not ropepool.cuda_backend:
        print("ropepool: built without the CUDA backend; timing the baselines only")
    have_ropepool = ropepool is not None and ropepool.cuda_backend
    fi_module, fi_version = None, None
    if args.cache_tokens and not args.no_flashinfer:
        fi_module, fi_version = import_flashinfer()
        print(f"FlashInfer {fi_version}: timed in the cache section" if fi_module is not None else
              f"FlashInfer: NOT IMPORTABLE ({fi_version}); the cache section runs without it",
              flush=True)
    copy_bps = copy_ceiling()

    # The floor of each mode: one empty kernel (a zero-cycle spin) timed the same way.
    floor = {"call": statistics.median(GpuTimer()(lambda: torch.cuda._sleep(0))
                                       for _ in range(args.samples)) * 1e6,
             "b2b": statistics.median(
                 GpuTimer()(lambda: [torch.cuda._sleep(0) for _ in range(CALLS_PER_BATCH)])
                 for _ in range(args.samples)) * 1e6 / CALLS_PER_BATCH}
    print("empty kernel (the floor): " + ", ".join(f"{m} {t:.2f} us" for m, t in floor.items()),
          flush=True)

    compiled = None
    if not args.no_compile:
        compiled = torch.compile(torch_rope_pool, fullgraph=True, dynamic=True)

    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    rows, problems_all = [], []
    for T in args.tokens:
        with_graph = T <= args.graph_max_tokens
        w = Workload(T, args, gen, l2, min_sets=CALLS_PER_BATCH if with_graph else 2)
        row = dict(T=T, bytes=w.bytes, input_sets=w.n_sets, cold_MB=w.cold_bytes / 1e6)
        contenders = {}
        if have_ropepool:
            problems, notes = check(w, compiled)
            row["problems"], row["notes"] = problems, notes
            problems_all += [f"T={T}: {p}" for p in problems]
            contenders["ropepool"] = lambda *a: ropepool.rope_pool_fused(*a, **w.shape)
        contenders["eager"] = lambda *a: torch_rope_pool(*a, w.inv_freq64)
        if compiled is not None:
            t0 = time.perf_counter()
            compiled(*w.args_of(0), w.inv_freq64)  # (re)compile outside the timings
            torch.cuda.synchronize()
            row["compile_warmup_s"] = time.perf_counter() - t0
            contenders["compile"] = lambda *a: compiled(*a, w.inv_freq64)
        for name, fn in contenders.items():
            warm_up(fn, w)
            t, hb = time_per_call(fn, w, args.samples, start=3)
            row[f"{name}_call_us"], row[f"{name}_call_host_bound"] = t * 1e6, hb
            t, hb = time_back_to_back(fn, w, args.samples, start=3 + args.samples)
            row[f"{name}_b2b_us"], row[f"{name}_b2b_host_bound"] = t * 1e6, hb
            if with_graph:
                t, hb, n_graphs = time_graph(fn, w, args.samples)
                row[f"{name}_graph_us"], row[f"{name}_graph_host_bound"] = t * 1e6, hb
                row["graphs"] = n_graphs
        if have_ropepool:
            rp = contenders["ropepool"]
            hot = w.args_of(0)
            row["ropepool_call_l2hot_us"] = statistics.median(
                GpuTimer()(lambda: rp(*hot)) for _ in range(args.samples)) * 1e6
            row["ropepool_host_us"] = host_us_per_call(rp, hot)
            # Where the host time goes: the call into reused q_out/k_out (no allocation),
            # the two output allocations alone, and the DLPack export of the nine tensors
            # the binding imports (torch._C._to_dlpack, what the fast path hands it).
            outs = dict(q_out=torch.empty_like(hot[0]), k_out=torch.empty_like(hot[1]))
            row["ropepool_out_host_us"] = host_us_per_call(
                lambda: ropepool.rope_pool_fused(*hot, **w.shape, **outs), ())
            row["alloc_host_us"] = host_us_per_call(
                lambda: (torch.empty_like(hot[0]), torch.empty_like(hot[1])), ())
            nine = (*hot, outs["q_out"], outs["k_out"])
            row["dlpack_host_us"] = host_us_per_call(
                lambda: [torch._C._to_dlpack(x) for x in nine], ())
            rows64 = hot[4].to(torch.int64)
            row["index_copy_host_us"] = host_us_per_call(
                lambda: torch.ops.aten.index_copy_(w.v_pool, 0, rows64, hot[2]), ())
            for mode in ("call", "b2b"):
                row[f"ropepool_{mode}_pct_copy"] = (
                    100 * w.bytes / (row[f"ropepool_{mode}_us"] * 1e-6) / copy_bps)
        row["copy_same_bytes_us"] = copy_seconds(max(16, w.bytes // 2), reps=20, warmup=3) * 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
        del w, contenders
        torch.cuda.empty_cache()

    # SPEC §4: q/k/v as strided views into a fused QKV buffer against contiguous inputs.
    layout_rows = []
    for T in [t for t in args.tokens if t in (1, 4096, 65536)] if have_ropepool else []:
        times = {}
        for fused in (False, True):
            w = Workload(T, args, gen, l2, fused_qkv=fused)
            rp = lambda *a: ropepool.rope_pool_fused(*a, **w.shape)  # noqa: E731
            warm_up(rp, w)
            times[fused] = time_back_to_back(rp, w, args.samples)[0] * 1e6
            del w
            torch.cuda.empty_cache()
        layout_rows.append(dict(T=T, contiguous_b2b_us=times[False], fused_qkv_b2b_us=times[True]))
        print(json.dumps(layout_rows[-1]), flush=True)

    cache_rows, fi_rows = [], []
    if have_ropepool and args.cache_tokens:
        compiled_fp8 = None if args.no_compile else torch.compile(
            torch_rope_fp8_paged, fullgraph=True, dynamic=True)
        cache_rows = cache_formats(args, gen, l2, copy_bps, compiled_fp8, fi_module, fi_rows)
        problems_all += [f"T={r['T']} {r['variant']}: {p}" for r in cache_rows + fi_rows
                         for p in r["problems"]]

    fusion_rows = []
    if have_ropepool and args.fusion_tokens:
        compiled_norm = None if args.no_compile else torch.compile(
            torch_norm_rope_pool, fullgraph=True, dynamic=True)
        fusion_rows = fusion_section(args, gen, l2, copy_bps, compiled_norm)
        problems_all += [f"T={r['T']} {r['variant']}: {p}" for r in fusion_rows
                         for p in r.get("problems", [])]

    result = dict(device=props.name, torch=torch.__version__, copy_GBps=copy_bps / 1e9,
                  floor_us=floor, l2_bytes=l2, dtype=args.dtype, num_qo_heads=args.num_qo_heads,
                  num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                  rope_base=args.rope_base, pool_rows=args.pool_rows, samples=args.samples,
                  rows=rows, problems=problems_all, ropepool=have_ropepool, layouts=layout_rows,
                  caches=cache_rows, flashinfer_caches=fi_rows,
                  flashinfer=(fi_version if fi_module is not None else f"not importable: {fi_version}")
                  if fi_version else None, fusions=fusion_rows, norm_eps=args.norm_eps,
                  norm_weight_dtype=args.norm_weight_dtype)
    return finish(result, args.json, print_table) or (0 if have_ropepool else 2)


def finish(result, path, table):
    """The end of a GPU benchmark (this one and gpu_bench_mla.py): the results written to
    `path` (none when it is empty), table(result) printed, then the checks' problems: the exit
    status, 1 when a check failed, else 0."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    table(result)
    if result["problems"]:
        print("CHECK FAILED:\n  " + "\n  ".join(result["problems"]))
        return 1
    return 0


def print_table(r):
    def f(x, fmt="{:.2f}"):
        return fmt.format(x) if x is not None else "-"

    rows = r["rows"]
    print()
    print(f"ropepool GPU bench: {r['device']}, {r['dtype']}, Hq {r['num_qo_heads']}, "
          f"Hk {r['num_kv_heads']}, D {r['head_dim']}; pool {r['pool_rows']} rows; "
          f"copy ceiling {r['copy_GBps']:.0f} GB/s (read + write)")
    print(f"GPU us per call, cold inputs (> 4x L2), random slots, median of {r['samples']}; "
          "call = one call between events, b2b = batches of 20, graph = graphs of 20 calls; "
          "an empty kernel takes " + ", ".join(f"{t:.2f} us ({m})" for m, t in r["floor_us"].items()))
    names = [n for n in ("ropepool", "eager", "compile") if f"{n}_call_us" in rows[0]]
    head = f"{'T':>6}"
    for n in names:
        head += " | " + " ".join(f"{n[:8] + ' ' + m:>14}" for m in MODES)
    print(head + f" | {'%copy call':>10} {'%copy b2b':>9}")
    for row in rows:
        line = f"{row['T']:>6}"
        for n in names:
            line += " | " + " ".join(f"{f(row.get(f'{n}_{m}_us')):>14}" for m in MODES)
        line += (f" | {f(row.get('ropepool_call_pct_copy'), '{:.1f}'):>10} "
                 f"{f(row.get('ropepool_b2b_pct_copy'), '{:.1f}'):>9}")
        print(line)
    if "ropepool_call_l2hot_us" in rows[0]:
        print("ropepool per call with ONE input set reused (L2-hot, not the headline): " +
              ", ".join(f"T={x['T']} {x['ropepool_call_l2hot_us']:.2f}" for x in rows))
        print("host us per eager Python call, no sync (ropepool / aten.index_copy_ yardstick): " +
              ", ".join(f"T={x['T']} {x['ropepool_host_us']:.1f}/{x['index_copy_host_us']:.1f}"
                        for x in rows))
        print("of which (us): the call into reused q_out/k_out, the two output allocations, "
              "DLPack export of the nine tensors: " +
              ", ".join(f"T={x['T']} {x['ropepool_out_host_us']:.1f}, {x['alloc_host_us']:.1f}, "
                        f"{x['dlpack_host_us']:.1f}" for x in rows))
    for x in r["layouts"]:
        print(f"T={x['T']} b2b: contiguous q/k/v {x['contiguous_b2b_us']:.2f} us, views into a "
              f"fused QKV buffer {x['fused_qkv_b2b_us']:.2f} us")
    print_cache_table(r.get("caches", []))
    print_flashinfer_table(r.get("flashinfer_caches", []), r.get("flashinfer"))
    print_fusion_table(r.get("fusions", []))
    host_bound = [f"T={x['T']} {k[:-len('_host_bound')]}: {x[k]}" for x in rows for k in x
                  if k.endswith("_host_bound") and x[k]]
    if host_bound:
        print("samples where the host fell behind the GPU (they include host time): " +
              ", ".join(host_bound))


if __name__ == "__main__":
    sys.exit(main())
