#!/usr/bin/env python3
"""mla_rope_pool_fused on a CUDA GPU next to PyTorch eager, torch.compile and a device copy.

    python bench/gpu_bench_mla.py                    # DeepSeek-V3 shape, every row
    python bench/gpu_bench_mla.py --tokens 1,4096 --heads 128 --json out.json

Workload (SPEC §8; DeepSeek-V3 config.json: qk_rope_head_dim 64, kv_lora_rank 512,
rope_theta 10000, yarn factor 40 from 4096, beta 32/1, mscale = mscale_all_dim = 1.0):
bfloat16 q [T, H, 192] with q_pe its last 64 columns, kv [T, 576] with kv_c and k_pe its
column slices, H = 128 (one rank of a TP-1 run) and 16 (TP-8), a token cache [262144, 576] in
bfloat16 or float8_e4m3fn (kv_scale 0.5, or --kv-scale); inputs uniform in [-4, 4); int32 positions random
below 2^17; int32 slots: T distinct rows of the cache, slices of a random permutation.

Contenders, all computing the same function:
  ropepool   ropepool.mla_rope_pool_fused (one kernel)
  eager      PyTorch: cos/sin of float64 angles, float32 GPT-J rotation, cast, the cache rows
             written with index_copy_ (fp8: divided by the scale, clamped to +-448, cast)
  compile    torch.compile of that same function (fullgraph, dynamic shapes); dropped, with
             the reason printed, if it does not compile
  copy       a device-to-device copy: the ceiling (bytes read + written), 1 GiB and the same
             bytes as one call

Method: bench/gpu_bench.py's, with its helpers. Cold inputs: every call reads the next of N
input sets (a multiple of 20), N chosen so that one pass over the bytes a call reads exceeds
--l2-multiple (4) L2s; one cursor runs through the sets across every contender and mode, so
no set is read again before all the others have been. Three modes, every contender:
  per call     CUDA events around each single call
  b2b          back-to-back: events around batches of 20 calls, time / 20
  graph        CUDA graphs of 20 calls on 20 different input sets, replay time / 20
with a GPU spin (torch.cuda._sleep) queued before each timed region, so that the events time
the GPU's work, not the host's launches (samples where the host still fell behind are
retaken, then counted); medians of --samples (>= 50).

Effective bandwidth counts T*(2*H*64 + 2*64 + 512)*2 + T*576*cache_elem + 8*T bytes (q_pe,
k_pe, kv_c read; q_pe_rot, k_pe_rot and the cache row written; positions, slots). ropepool
is also timed without k_pe_rot (return_k_rot=False, T*64*2 bytes fewer), in a table of its
own beside the call with it.

FlashInfer (optional: where `import flashinfer` works, else the output says why and the rest
runs as before; --no-flashinfer leaves it out) is timed the same way, as the composition of
its kernels that gives the same result, in MlaWorkload._flashinfer's docstring: its rope
kernel on a float32 cos/sin cache (float64 angles times the YaRN attention scaling, positions
below 2^17), then its MLA cache append (bf16) or its fused rope + fp8 quantise + MLA append
with no q heads (fp8; PDL on), page size 1 so that a random slot is a page. Its table gives
ropepool's time over FlashInfer's in each mode.

Before timing, on input set 0, every contender is checked against independent results:
q_pe_rot/k_pe_rot against eager's within 2 ulp plus SPEC §1's float32 term (eager's own
against ropepool's, through ropepool's check), the cache rows' kv_c part bit for bit against
kv_c (fp8: e4m3(kv_c / kv_scale)), their k_pe part bit for bit against the contender's own
k_pe_rot (fp8: within one e4m3 step of eager's row), every other cache row unchanged; the
call without k_pe_rot, its q_pe_rot and cache rows bit for bit the call's with it.
tests/python/test_gpu_bench_mla.py runs these checks on the CPU.

Writes full results to --json (default $OUT/gpu_bench_mla.json when $OUT is set; '' for
none), one JSON line per row as it goes, and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import ropepool
from gpu_bench import (CALLS_PER_BATCH, MODES, copy_ceiling, copy_seconds, distinct_slots,
                       e4m3_close, finish, flashinfer_cos_sin_cache, import_flashinfer,
                       open_device, rotation_problems, time_back_to_back, time_graph,
                       time_per_call, warm_up)

R, L, NOPE, CACHE_ROWS = 64, 512, 128, 262144
FP8 = torch.float8_e4m3fn
ROPE_SCALING = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
SCHEDULE = ropepool.rope_schedule(head_dim=R, rope_base=10000.0, rope_scaling=ROPE_SCALING,
                                  max_position_embeddings=163840)
CONTENDERS = ("ropepool", "eager", "compile")
SHORT = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}  # the table's cache column


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,256,4096,16384")
    p.add_argument("--heads", default="128,16")
    p.add_argument("--caches", default="bfloat16,float8_e4m3fn",
                   help="cache dtypes, of bfloat16 and float8_e4m3fn")
    p.add_argument("--pool-rows", type=int, default=CACHE_ROWS, help="rows of the cache")
    p.add_argument("--l2-multiple", type=float, default=4.0,
                   help="one pass over the input sets is at least this many L2s")
    p.add_argument("--samples", type=int, default=50, help="samples per median (>= 50)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    p.add_argument("--no-flashinfer", action="store_true",
                   help="leave FlashInfer out even where it imports")
    p.add_argument("--kv-scale", type=float, default=0.5,
                   help="the fp8 cache's scale (default 0.5, a power of two; 0.37 for a scale that "
                   "is not one). FlashInfer quantises with the reciprocal 1 / kv_scale, which for "
                   "such a scale can differ from the division on rare ties: its check reports them")
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.heads = [int(h) for h in args.heads.split(",") if h]
    dtypes = {"bfloat16": torch.bfloat16, "float8_e4m3fn": FP8}
    bad = [c for c in args.caches.split(",") if c not in dtypes]
    if bad:
        p.error(f"--caches: {bad} not among {sorted(dtypes)}")
    args.caches = [dtypes[c] for c in args.caches.split(",")]
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_bench_mla.json")
    return args


def eager(q_pe, k_pe, kv_c, positions, slots, cache, inv_freq64, scale):
    """The same math in PyTorch (and what torch.compile compiles): float64 angles, float32
    rotation of GPT-J pairs, every slot >= 0 (no mask, no host synchronisation)."""
    theta = positions.to(torch.float64)[:, None] * inv_freq64[None, :]
    cos = (torch.cos(theta) * SCHEDULE.attention_scaling).float()
    sin = (torch.sin(theta) * SCHEDULE.attention_scaling).float()

    def rot(x):  # [T, ..., R]
        shape = [x.shape[0]] + [1] * (x.dim() - 2) + [R // 2]
        c, s = cos.view(shape), sin.view(shape)
        a, b = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)

    q_rot32, k_rot32 = rot(q_pe), rot(k_pe)
    q_rot, k_rot = q_rot32.to(q_pe.dtype), k_rot32.to(k_pe.dtype)
    if cache.dtype == FP8:
        row = torch.cat([kv_c.float(), k_rot32], dim=-1) / scale
        row = row.clamp(-448, 448).to(FP8)
        # index_copy_ has no float8 kernel: the same bytes as uint8
        cache.view(torch.uint8).index_copy_(0, slots.long(), row.view(torch.uint8))
    else:
        cache.index_copy_(0, slots.long(), torch.cat([kv_c, k_rot], dim=-1))
    return q_rot, k_rot


class MlaWorkload:
    """N input sets for T tokens in one buffer per argument (set i is rows [iT, (i+1)T)), the
    cache every call writes into, and the cursor: one past the last set handed out."""

    def __init__(self, T, H, cache_dtype, args, gen, l2_bytes, device="cuda"):
        self.T, self.H, self.device = T, H, device
        self.P = args.pool_rows
        if T > self.P:
            raise SystemExit(f"gpu_bench_mla.py: T = {T} exceeds --pool-rows {self.P}")
        ce = 1 if cache_dtype == FP8 else 2
        self.bytes = T * (2 * H * R + 2 * R + L) * 2 + T * (L + R) * ce + 8 * T
        set_bytes = T * (H * R + R + L) * 2 + 8 * T  # what a call reads (not q's nope part)
        self.n_sets = CALLS_PER_BATCH * max(1, math.ceil(
            args.l2_multiple * l2_bytes / set_bytes / CALLS_PER_BATCH))
        self.cold_bytes = self.n_sets * set_bytes
        n = self.n_sets * T

        def uniform(*shape):
            return torch.empty(*shape, dtype=torch.bfloat16, device=device).uniform_(
                -4, 4, generator=gen)

        q, kv = uniform(n, H, NOPE + R), uniform(n, L + R)
        self.q_pe, self.k_pe, self.kv_c = q[..., NOPE:], kv[:, L:], kv[:, :L]
        self.positions = torch.randint(0, 1 << 17, (n,), generator=gen, device=device,
                                       dtype=torch.int32)
        self.slots = distinct_slots(self.P, T, self.n_sets, gen, device)
        self.cache = uniform(self.P, L + R).to(cache_dtype)
        self.scale = args.kv_scale if cache_dtype == FP8 else None
        self.inv_freq64 = torch.tensor(SCHEDULE.inv_freq, dtype=torch.float64, device=device)
        self.cursor = 0

    def args_of(self, i):
        self.cursor = i + 1
        r = slice((i % self.n_sets) * self.T, (i % self.n_sets + 1) * self.T)
        return self.q_pe[r], self.k_pe[r], self.kv_c[r], self.positions[r], self.slots[r]

    def contender(self, name, compiled=None):
        """fn(q_pe, k_pe, kv_c, positions, slots) -> (q_pe_rot, k_pe_rot, ...) into the cache;
        for "flashinfer", `compiled` is the flashinfer module."""
        if name == "flashinfer":
            return self._flashinfer(compiled)
        if name in ("ropepool", "no_k_rot"):
            return lambda *a: ropepool.mla_rope_pool_fused(
                *a, self.cache, rope_base=10000.0, schedule=SCHEDULE, kv_scale=self.scale,
                return_k_rot=name == "ropepool")
        f = eager if name == "eager" else compiled
        return lambda *a: f(*a, self.cache, self.inv_freq64, self.scale or 1.0)

    def _flashinfer(self, fi):
        """FlashInfer's composition of the same result (it has no one call for it: its fused MLA
        kernel quantises q to fp8, q_nope [T, H, 512] included, and writes no k_pe_rot):
        its rope kernel on the cos/sin cache (the op behind apply_rope_with_cos_sin_cache,
        called directly because that wrapper flattens q and q_pe is a strided view), GPT-J
        pairs, giving q_pe_rot and k_pe_rot; then the cache rows, page size 1 (a slot is a
        page: kv_indices = slots, batch_indices = 0..T-1, kv_indptr = 0..T, positions 0),
        ckv and kpe the column views [:, :, :512] and [:, :, 512:] of the cache as
        [P, 1, 576]: bf16 append_paged_mla_kv_cache(kv_c, k_pe_rot); fp8
        rope_quantize_fp8_append_paged_kv_cache with no q heads (q_pe[:, :0]; k_pe rotated
        again from its input, kv_c, kv_scale as the multiplier 1 / kv_scale; PDL on). Its own bytes
        go to self.fi_bytes."""
        T, H, P, dev = self.T, self.H, self.P, self.device
        cos_sin = flashinfer_cos_sin_cache(self.inv_freq64, 1 << 17, SCHEDULE.attention_scaling)
        rows = self.cache.view(P, 1, L + R)
        ckv, kpe = rows[..., :L], rows[..., L:]
        batch = torch.arange(T, dtype=torch.int32, device=dev)
        indptr = torch.arange(T + 1, dtype=torch.int32, device=dev)
        zeros = torch.zeros(T, dtype=torch.int32, device=dev)
        ones = torch.ones(T, dtype=torch.int32, device=dev)
        no_q_nope = torch.empty(T, 0, L, dtype=torch.bfloat16, device=dev)
        ce = self.cache.element_size()
        rope = T * (2 * (H + 1) * R * 2 + R * 4 + 4)  # q_pe, k_pe read, rotated written, cos/sin
        if self.scale is None:  # kv_c, k_pe_rot read, the row written, four index arrays
            self.fi_bytes = rope + T * ((L + R) * 2 + (L + R) * 2 + 16)
        else:  # k_pe, kv_c, cos/sin read, the row written, five index arrays
            self.fi_bytes = rope + T * ((L + R) * 2 + R * 4 + (L + R) * ce + 20)

        def call(q_pe, k_pe, kv_c, positions, slots):
            q_rot = torch.empty(T, H, R, dtype=q_pe.dtype, device=dev)
            k_rot = torch.empty(T, 1, R, dtype=k_pe.dtype, device=dev)
            fi.rope._apply_rope_pos_ids_cos_sin_cache(
                q=q_pe, k=k_pe.unsqueeze(1), q_rope=q_rot, k_rope=k_rot, cos_sin_cache=cos_sin,
                pos_ids=positions, interleave=True)
            if self.scale is None:
                fi.page.append_paged_mla_kv_cache(kv_c, k_rot.view(T, R), batch, zeros, ckv, kpe,
                                                  slots, indptr, ones)
            else:
                fi.rope.rope_quantize_fp8_append_paged_kv_cache(
                    q_pe[:, :0], k_pe, no_q_nope, kv_c, None, cos_sin, positions, (ckv, kpe),
                    slots, indptr, batch, zeros, is_neox=False, quantize_dtype=FP8,
                    quant_scale_q=1.0, quant_scale_kv=1 / self.scale, page_size=1,
                    enable_pdl=True)
            return q_rot, k_rot.view(T, R)
        return call


def call_and_restore(w, fn, a):
    """fn(*a), then the cache put back: (q_rot, k_rot, the rows the slots name as written,
    problems: rows no token names that changed)."""
    before = w.cache.clone()
    q_rot, k_rot = fn(*a)[:2]
    rows = a[4].to(torch.int64)
    written = w.cache[rows]
    untouched = torch.ones(w.P, dtype=torch.bool, device=w.cache.device)
    untouched[rows] = False
    now, then = w.cache.view(torch.uint8), before.view(torch.uint8)
    problems = [] if torch.equal(now[untouched], then[untouched]) else [
        "cache rows no token names changed"]
    w.cache.copy_(before)
    return (q_rot, k_rot, written), problems


def check(w, contenders):
    """Each contender ({name: fn}) on input set 0 against independent results: (problems,
    notes), every problem and note prefixed with the contender's name."""
    a = q_pe, k_pe, kv_c, _, _ = w.args_of(0)
    (eq, ek, erows), _ = call_and_restore(w, w.contender("eager"), a)
    if w.scale is None:
        kv_want = kv_c.contiguous().view(torch.uint8)
    else:
        kv_want = (kv_c.float() / w.scale).clamp(-448, 448).to(FP8).view(torch.uint8)
    problems, notes, ropepool_result = [], [], None
    for name, fn in contenders.items():
        (q, k, rows), p = call_and_restore(w, fn, a)
        if name == "ropepool":
            ropepool_result = q, rows
        if k is None:  # no k_pe_rot: q_pe_rot and every written row bit for bit ropepool's
            if ropepool_result is None:
                p.append("no k_pe_rot: checked only beside the ropepool contender")
            elif not (torch.equal(q.view(torch.uint8), ropepool_result[0].view(torch.uint8)) and
                      torch.equal(rows.view(torch.uint8), ropepool_result[1].view(torch.uint8))):
                p.append("q_pe_rot or the cache rows differ from the call with k_pe_rot")
            problems += [f"{name}: {x}" for x in p]
            continue
        if q.shape != eq.shape or k.shape != ek.shape:
            p.append(f"q_pe_rot/k_pe_rot shapes {list(q.shape)}/{list(k.shape)}, "
                     f"eager's {list(eq.shape)}/{list(ek.shape)}")
        else:
            p += rotation_problems("q_pe_rot vs eager", q, eq, q_pe, interleaved=True)
            p += rotation_problems("k_pe_rot vs eager", k, ek, k_pe, interleaved=True)
            # Inductor may contract into FMAs: informational (the bound above is the check)
            if name == "compile" and not (torch.equal(q, eq) and torch.equal(k, ek)):
                d = max((q.float() - eq.float()).abs().max().item(),
                        (k.float() - ek.float()).abs().max().item())
                notes.append(f"{name}: q_pe_rot/k_pe_rot differ from eager's by up to {d:.3g}")
        if not torch.equal(rows[:, :L].contiguous().view(torch.uint8), kv_want):
            p.append("cache rows' kv_c part is not " +
                     ("kv_c bit for bit" if w.scale is None else "e4m3(kv_c / kv_scale)"))
        if w.scale is None:
            if not torch.equal(rows[:, L:], k.reshape(-1, R)):
                p.append("cache rows' k_pe part is not the call's k_pe_rot bit for bit")
        elif not e4m3_close(rows[:, L:], erows[:, L:]):
            p.append("fp8 cache rows' k_pe part is not within one e4m3 step of eager's")
        problems += [f"{name}: {x}" for x in p]
    return problems, notes


def bench_row(T, H, cache_dtype, args, gen, l2, copy_bps, compiled, fi=None):
    """One row: checks, then every contender in the three modes (torch.compile's `compiled`
    unless it is None; the row has a compile_error where it failed; FlashInfer's composition
    where `fi`, the flashinfer module, is given)."""
    w = MlaWorkload(T, H, cache_dtype, args, gen, l2)
    row = dict(heads=H, cache=str(cache_dtype).removeprefix("torch."), T=T, bytes=w.bytes,
               input_sets=w.n_sets, cold_MB=w.cold_bytes / 1e6)
    contenders = {name: w.contender(name) for name in ("ropepool", "no_k_rot", "eager")}
    if fi is not None:
        contenders["flashinfer"] = w.contender("flashinfer", fi)
        row["flashinfer_bytes"] = w.fi_bytes
    row["problems"], row["notes"] = check(w, contenders)
    if compiled is not None:
        fn = w.contender("compile", compiled)
        t0 = time.perf_counter()
        try:  # the first call (re)compiles, outside the timings
            problems, notes = check(w, {"compile": fn})
            warm_up(fn, w, start=w.cursor)
        except Exception as e:  # noqa: BLE001 (Inductor on the fp8 view / index_copy_)
            row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"torch.compile contender dropped: {row['compile_error']}", flush=True)
            torch.cuda.synchronize()
        else:
            row["compile_warmup_s"] = time.perf_counter() - t0
            row["problems"] += problems
            row["notes"] += notes
            contenders["compile"] = fn
    for name, fn in contenders.items():
        warm_up(fn, w, start=w.cursor)
        t, row[f"{name}_call_host_bound"] = time_per_call(fn, w, args.samples, start=w.cursor)
        row[f"{name}_call_us"] = t * 1e6
        t, row[f"{name}_b2b_host_bound"] = time_back_to_back(fn, w, args.samples, start=w.cursor)
        row[f"{name}_b2b_us"] = t * 1e6
        t, row[f"{name}_graph_host_bound"], row["graphs"] = time_graph(fn, w, args.samples,
                                                                       start=w.cursor)
        row[f"{name}_graph_us"] = t * 1e6
    row["no_k_rot_bytes"] = w.bytes - T * R * 2  # no k_pe_rot written
    for mode in ("call", "b2b"):
        row[f"ropepool_{mode}_pct_copy"] = 100 * w.bytes / (row[f"ropepool_{mode}_us"] * 1e-6) / copy_bps
        row[f"no_k_rot_{mode}_pct_copy"] = (100 * row["no_k_rot_bytes"] /
                                            (row[f"no_k_rot_{mode}_us"] * 1e-6) / copy_bps)
        if fi is not None:
            row[f"flashinfer_{mode}_pct_copy"] = (100 * w.fi_bytes / (row[f"flashinfer_{mode}_us"]
                                                                      * 1e-6) / copy_bps)
    for mode in MODES if fi is not None else ():
        row[f"ratio_{mode}"] = row[f"ropepool_{mode}_us"] / row[f"flashinfer_{mode}_us"]
    row["copy_same_bytes_us"] = copy_seconds(max(16, w.bytes // 2), reps=20, warmup=3) * 1e6
    del w, contenders
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    args = parse_args(argv)
    props = open_device(args.samples, "gpu_bench_mla.py")
    if not ropepool.cuda_backend:
        sys.exit("gpu_bench_mla.py: ropepool was built without the CUDA backend")
    l2 = props.L2_cache_size
    fi, fi_version = (None, None) if args.no_flashinfer else import_flashinfer()
    if not args.no_flashinfer:
        print(f"FlashInfer {fi_version}: timed beside ropepool" if fi is not None else
              f"FlashInfer: NOT IMPORTABLE ({fi_version}); the benchmark runs without it",
              flush=True)
    copy_bps = copy_ceiling()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows, compile_errors = [], {}  # cache dtype: why torch.compile failed (not retried)
    for H in args.heads:
        for cache_dtype in args.caches:
            # A fresh compile per shape and cache dtype: one function over every (H, dtype, T)
            # reaches Dynamo's recompile limit, which fullgraph=True turns into a failure.
            compiled = None
            if not args.no_compile:
                torch._dynamo.reset()
                compiled = torch.compile(eager, fullgraph=True, dynamic=True)
            for T in args.tokens:
                cache = str(cache_dtype).removeprefix("torch.")
                row = bench_row(T, H, cache_dtype, args, gen, l2, copy_bps,
                                None if cache in compile_errors else compiled, fi)
                if "compile_error" in row:
                    compile_errors[cache] = f"H={H} T={T}: {row['compile_error']}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    problems = [f"H={r['heads']} {r['cache']} T={r['T']}: {p}" for r in rows for p in r["problems"]]
    result = dict(device=props.name, torch=torch.__version__, copy_GBps=copy_bps / 1e9,
                  l2_bytes=l2, pool_rows=args.pool_rows, samples=args.samples,
                  l2_multiple=args.l2_multiple, rows=rows, problems=problems,
                  compile_errors=compile_errors,
                  flashinfer=(fi_version if fi is not None else f"not importable: {fi_version}")
                  if fi_version else None)
    return finish(result, args.json, print_table)


def print_table(r):
    rows = r["rows"]
    print()
    print(f"ropepool GPU bench, MLA (SPEC §8): {r['device']}, DeepSeek-V3 shape (q_pe [T, H, 64] "
          f"of q [T, H, 192], k_pe [T, 64], kv_c [T, 512]); cache {r['pool_rows']} x 576 rows; "
          f"copy ceiling {r['copy_GBps']:.0f} GB/s (read + write)")
    print(f"GPU us per call, cold inputs (> {r['l2_multiple']:g}x L2), random slots, median of "
          f"{r['samples']}; call = one call between events, b2b = batches of 20, graph = graphs "
          "of 20 calls; %copy = ropepool's share of the copy ceiling")
    for cache, why in r["compile_errors"].items():
        print(f"torch.compile dropped for the {cache} cache from {why}")
    print(f"{'':>17}" + "".join(f" | {n + ' (us)':^26}" for n in CONTENDERS) + " |")
    print(f"{'H':>4} {'cache':>5} {'T':>6}" + " | ".join(
        [""] + [" ".join(f"{m:>8}" for m in MODES)] * len(CONTENDERS)) +
        f" | {'%copy call':>10} {'%copy b2b':>9}  check")
    for x in rows:
        line = f"{x['heads']:>4} {SHORT[x['cache']]:>5} {x['T']:>6}"
        for n in CONTENDERS:
            line += " | " + " ".join(
                f"{x[f'{n}_{m}_us']:>8.2f}" if f"{n}_{m}_us" in x else f"{'-':>8}" for m in MODES)
        line += (f" | {x['ropepool_call_pct_copy']:>10.1f} {x['ropepool_b2b_pct_copy']:>9.1f}  "
                 f"{'; '.join(x['problems']) or 'ok'}")
        print(line)
    for x in rows:
        for note in x["notes"]:
            print(f"H={x['heads']} {x['cache']} T={x['T']} note: {note}")
    print_no_k_rot_table(r)
    print_flashinfer_table(r)
    host_bound = [f"H={x['heads']} {x['cache']} T={x['T']} {k[:-len('_host_bound')]}: {x[k]}"
                  for x in rows for k in x if k.endswith("_host_bound") and x[k]]
    if host_bound:
        print("samples where the host fell behind the GPU (they include host time): " +
              ", ".join(host_bound))


def print_no_k_rot_table(r):
    rows = [x for x in r["rows"] if "no_k_rot_call_us" in x]
    if not rows:
        return
    print()
    print("Without k_pe_rot (return_k_rot=False: q_pe_rot and the cache only): GPU us per call "
          "(call / b2b / graph), its % of the copy ceiling by its own bytes, and its time over "
          "the call with k_pe_rot")
    print(f"{'H':>4} {'cache':>5} {'T':>6} | {'with k_pe_rot (us)':^26} | {'without (us)':^26} | "
          f"{'%copy call':>10} {'%copy b2b':>9} | {'without / with':^22}")
    for x in rows:
        print(f"{x['heads']:>4} {SHORT[x['cache']]:>5} {x['T']:>6} | " +
              " ".join(f"{x[f'ropepool_{m}_us']:>8.2f}" for m in MODES) + " | " +
              " ".join(f"{x[f'no_k_rot_{m}_us']:>8.2f}" for m in MODES) +
              f" | {x['no_k_rot_call_pct_copy']:>10.1f} {x['no_k_rot_b2b_pct_copy']:>9.1f} | " +
              " ".join(f"{x[f'no_k_rot_{m}_us'] / x[f'ropepool_{m}_us']:>6.3f}" for m in MODES))


def print_flashinfer_table(r):
    version = r.get("flashinfer")
    if version is None:
        return
    print()
    fi_rows = [x for x in r["rows"] if "flashinfer_call_us" in x]
    if not fi_rows:
        print(f"FlashInfer: NOT MEASURED ({version})")
        return
    print(f"FlashInfer {version} beside ropepool (its rope kernel, then append_paged_mla_kv_cache "
          "(bf16) or its fused rope + fp8 quantise + MLA append with no q heads (fp8); page size "
          "1): GPU us per call (call / b2b / graph), its % of the copy ceiling by its own bytes, "
          "and ropepool's time over FlashInfer's")
    print(f"{'H':>4} {'cache':>5} {'T':>6} | {'ropepool (us)':^26} | {'FlashInfer (us)':^26} | "
          f"{'%copy b2b':>9} | {'ropepool / FlashInfer':^22}")
    for x in fi_rows:
        print(f"{x['heads']:>4} {SHORT[x['cache']]:>5} {x['T']:>6} | " +
              " ".join(f"{x[f'ropepool_{m}_us']:>8.2f}" for m in MODES) + " | " +
              " ".join(f"{x[f'flashinfer_{m}_us']:>8.2f}" for m in MODES) +
              f" | {x['flashinfer_b2b_pct_copy']:>9.1f} | " +
              " ".join(f"{x[f'ratio_{m}']:>6.3f}" for m in MODES))


if __name__ == "__main__":
    sys.exit(main())
