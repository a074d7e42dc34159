#!/usr/bin/env python3
"""mla_rope_pool_fused on a CUDA GPU next to PyTorch eager and a device-to-device copy.

    python bench/gpu_bench_mla.py                    # DeepSeek-V3 shape, every row
    python bench/gpu_bench_mla.py --tokens 1,4096 --json out.json

Workload (DeepSeek-V3 config.json: qk_rope_head_dim 64, kv_lora_rank 512, rope_theta 10000,
yarn factor 40 from 4096, beta 32/1, mscale = mscale_all_dim = 1.0): bfloat16 q [T, H, 192]
with q_pe its last 64 columns, kv [T, 576] with kv_c and k_pe its column slices, H = 128
(one rank of a TP-1 run) and 16 (TP-8), a token cache of 262144 rows in bfloat16 or
float8_e4m3fn (kv_scale 0.5), int32 positions below 2^20, T distinct random slots.

Contenders, the same function:
  ropepool   ropepool.mla_rope_pool_fused (one kernel)
  eager      PyTorch: cos/sin of float64 angles, float32 GPT-J rotation, cast, the cache rows
             written with index_copy_ (fp8: divided by the scale, clamped to +-448, cast)
  copy       a device-to-device copy of the same number of bytes (read + written)

Cold inputs: each call reads the next of N input sets, N such that one pass exceeds 4x the
L2; the cache is far larger than the L2. Modes: b2b (CUDA events around 20 calls on 20
sets, time / 20) and graph (a CUDA graph of those 20 calls, replay time / 20); medians of
--samples. Effective bandwidth counts T*(2*H*64 + 2*64 + 512)*2 + T*576*cache_elem + 8*T
bytes. Before timing, ropepool's outputs are checked against eager's (q_pe_rot/k_pe_rot
within 2 bf16 ulp, cache rows of kv_c bit for bit, k_pe_rot within 2 bf16 ulp or one e4m3
step).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import ropepool

R, L, NOPE, CACHE_ROWS = 64, 512, 128, 262144
ROPE_SCALING = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
SCHEDULE = ropepool.rope_schedule(head_dim=R, rope_base=10000.0, rope_scaling=ROPE_SCALING,
                                  max_position_embeddings=163840)
_INV_FREQ: dict = {}


def eager(q_pe, k_pe, kv_c, positions, slots, cache, scale):
    """The same math in PyTorch: float64 angles, float32 rotation of GPT-J pairs."""
    inv_freq = _INV_FREQ.get(q_pe.device)
    if inv_freq is None:  # made once: a host-to-device copy cannot be captured in a graph
        inv_freq = _INV_FREQ[q_pe.device] = torch.tensor(SCHEDULE.inv_freq, dtype=torch.float64,
                                                         device=q_pe.device)
    theta = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = (torch.cos(theta) * SCHEDULE.attention_scaling).float()
    sin = (torch.sin(theta) * SCHEDULE.attention_scaling).float()

    def rot(x):  # [T, ..., R]
        shape = [x.shape[0]] + [1] * (x.dim() - 2) + [R // 2]
        c, s = cos.view(shape), sin.view(shape)
        a, b = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)

    q_rot32, k_rot32 = rot(q_pe), rot(k_pe)
    q_rot, k_rot = q_rot32.to(q_pe.dtype), k_rot32.to(k_pe.dtype)
    if cache.dtype == torch.float8_e4m3fn:
        row = torch.cat([kv_c.float(), k_rot32], dim=-1) / scale
        row = row.clamp(-448, 448).to(torch.float8_e4m3fn)
        # index_copy_ has no float8 kernel: the same bytes as uint8
        cache.view(torch.uint8).index_copy_(0, slots.long(), row.view(torch.uint8))
    else:
        cache.index_copy_(0, slots.long(), torch.cat([kv_c, k_rot], dim=-1))
    return q_rot, k_rot


def make_sets(n, T, H, device, gen):
    sets = []
    for _ in range(n):
        q = (torch.rand(T, H, NOPE + R, device=device, generator=gen) * 8 - 4).bfloat16()
        kv = (torch.rand(T, L + R, device=device, generator=gen) * 8 - 4).bfloat16()
        pos = torch.randint(0, 2**20, (T,), device=device, generator=gen, dtype=torch.int32)
        slots = torch.randperm(CACHE_ROWS, device=device, generator=gen)[:T].int()
        sets.append((q[..., NOPE:], kv[:, L:], kv[:, :L], pos, slots))
    return sets


def timed(fn, sets, samples, graph):
    """Median seconds per call over batches of 20 calls on consecutive input sets."""
    batches = [[sets[(i + j) % len(sets)] for j in range(20)] for i in range(0, len(sets), 20)]
    runners = []
    for b in batches:
        if graph:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for args in b:
                    fn(*args)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                for args in b:
                    fn(*args)
            runners.append(g.replay)
        else:
            runners.append(lambda b=b: [fn(*args) for args in b])
    for r in runners:
        r()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(samples):
        torch.cuda._sleep(100_000)  # the GPU's work is timed, not the host's enqueueing
        start.record()
        runners[i % len(runners)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / 20)
    return statistics.median(times)


def copy_time(nbytes, samples):
    src = torch.empty(max(nbytes // 2, 16), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), [()] * 20, samples, graph=False)


def check(T, H, cache_dtype, device, gen):
    (q_pe, k_pe, kv_c, pos, slots), = make_sets(1, T, H, device, gen)
    c1 = torch.zeros(CACHE_ROWS, L + R, dtype=torch.bfloat16, device=device).to(cache_dtype)
    c2 = c1.clone()
    scale = 0.5 if cache_dtype == torch.float8_e4m3fn else None
    q1, k1, _ = ropepool.mla_rope_pool_fused(q_pe, k_pe, kv_c, pos, slots, c1, rope_base=10000.0,
                                             schedule=SCHEDULE, kv_scale=scale)
    q2, k2 = eager(q_pe, k_pe, kv_c, pos, slots, c2, scale or 1.0)
    torch.testing.assert_close(q1.float(), q2.float(), atol=2**-6, rtol=2**-7)
    torch.testing.assert_close(k1.float(), k2.float(), atol=2**-6, rtol=2**-7)
    rows1, rows2 = c1[slots.long()], c2[slots.long()]
    assert torch.equal(rows1[:, :L].view(torch.uint8), rows2[:, :L].view(torch.uint8)), "kv_c rows"
    # k_pe_rot in the rows: as close as q/k above (bf16), or one e4m3 step (fp8); a byte-wise
    # comparison would fail where a*cos - b*sin cancels and the two float32 sin/cos differ
    tol = dict(atol=2**-9, rtol=2**-3) if cache_dtype == torch.float8_e4m3fn \
        else dict(atol=2**-6, rtol=2**-7)
    torch.testing.assert_close(rows1[:, L:].float(), rows2[:, L:].float(), **tol)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,16,256,4096,16384")
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(20240601)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"ropepool MLA GPU bench: {torch.cuda.get_device_name(0)}, L2 {l2 >> 20} MiB")
    rows = []
    for H in map(int, a.heads.split(",")):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for T in map(int, a.tokens.split(",")):
                check(T, H, cache_dtype, "cuda", gen)
                ce = 1 if cache_dtype == torch.float8_e4m3fn else 2
                nbytes = T * (2 * H * R + 2 * R + L) * 2 + T * (L + R) * ce + 8 * T
                set_bytes = T * (H * (NOPE + R) + L + R) * 2
                n = max(20, min(400, -(-4 * l2 // max(set_bytes, 1))))
                sets = make_sets(n, T, H, "cuda", gen)
                cache = torch.zeros(CACHE_ROWS, L + R, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
                scale = 0.5 if ce == 1 else None

                def rp(q_pe, k_pe, kv_c, pos, slots, cache=cache, scale=scale):
                    ropepool.mla_rope_pool_fused(q_pe, k_pe, kv_c, pos, slots, cache,
                                                 rope_base=10000.0, schedule=SCHEDULE,
                                                 kv_scale=scale)

                def ea(q_pe, k_pe, kv_c, pos, slots, cache=cache, scale=scale):
                    eager(q_pe, k_pe, kv_c, pos, slots, cache, scale or 1.0)

                copy = copy_time(nbytes, a.samples)
                r = dict(heads=H, cache=str(cache_dtype).removeprefix("torch."), tokens=T,
                         bytes=nbytes, copy_us=copy * 1e6)
                for name, fn in (("ropepool", rp), ("eager", ea)):
                    for mode in ("b2b", "graph"):
                        t = timed(fn, sets, a.samples, graph=mode == "graph")
                        r[f"{name}_{mode}_us"] = t * 1e6
                rows.append(r)
                print(f"H={H:4d} {r['cache']:>14} T={T:6d}: ropepool b2b "
                      f"{r['ropepool_b2b_us']:8.2f} us ({nbytes / r['ropepool_b2b_us'] * 1e-3:7.1f} GB/s, "
                      f"{100 * copy * 1e6 / r['ropepool_b2b_us']:5.1f}% of copy), graph "
                      f"{r['ropepool_graph_us']:8.2f} us; eager b2b {r['eager_b2b_us']:9.2f} us; "
                      f"copy {copy * 1e6:8.2f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
