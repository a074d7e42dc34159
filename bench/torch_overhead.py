"""Host cost per call of `ropepool.rope_pool_fused` on torch tensors at T = 1, by the keywords
the call passes (Llama-3-8B attention: num_qo_heads 32, num_kv_heads 8, head_dim 128,
bfloat16, rope_base 500000; and `mla_rope_pool_fused` with DeepSeek-V3's yarn schedule at 16
heads), next to the binding's call (`_ropepool.rope_pool_fused_into`
with the same arrays and preallocated outputs: validation, and the kernel or its launch) and,
on CUDA where FlashInfer imports, FlashInfer's fused fp8 kernel writing the same outputs.

    .venv/bin/python bench/torch_overhead.py [--device cpu|cuda] [--calls N] [--rounds R]
                                             [--threads N]

Each row times R rounds of N back-to-back calls (the rows take turns, round by round) and
reports the median round's µs per call (p10-p90 over the rounds), and the time above the
binding's call of the same row family.
On the CPU the kernel runs inside each call (T = 1, inputs in cache); on CUDA a call is the
host's work up to the launch (the GPU runs each kernel in about 2-3 µs, so the host sets
the pace; the queue is drained between rounds, outside the timing). The first call of each
row is not timed (it makes the schedule and registers the geometry, as a model's first
decode step does).
"""

import argparse
import statistics
import time

import torch

import ropepool
from ropepool import _ropepool
from ropepool._torch_compat import current_raw_stream, to_dlpack

HQ, HK, D, BASE = 32, 8, 128, 500000.0
KW = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HK, rope_base=BASE)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
FP8 = torch.float8_e4m3fn
QWEN2_VL = {"type": "mrope", "mrope_section": [16, 24, 24]}  # Qwen2-VL's config.json
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's config.json


def rows(device, pool_rows=65536):
    """(name, family, call) for every row; family names the binding row it is compared with.
    The pools have pool_rows rows (the paged caches as many, in pages of 16)."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    q, k, v = (torch.randn(1, h, D, **bf16) for h in (HQ, HK, HK))
    positions = torch.tensor([70000], dtype=torch.int32, device=device)
    positions3 = torch.tensor([[70000], [312], [517]], dtype=torch.int32, device=device)
    slot = pool_rows // 2 + 3
    slots = torch.tensor([slot], dtype=torch.int32, device=device)
    k_pool, v_pool = torch.randn(pool_rows, HK, D, **bf16), torch.randn(pool_rows, HK, D, **bf16)
    # FlashInfer's [pages, 2, 16, Hk, D]
    paged = torch.randn(pool_rows // 16, 2, 16, HK, D, **bf16)
    paged8 = paged.to(FP8)
    paged, paged8 = (paged[:, 0], paged[:, 1]), (paged8[:, 0], paged8[:, 1])  # the K, V halves
    scale = {n: torch.tensor([0.5], device=device) for n in ("k", "v", "q")}
    weight = torch.rand(D, **bf16) + 0.5
    schedule = ropepool.rope_schedule(head_dim=D, rope_base=BASE, rope_scaling=LLAMA3)
    ins = (q, k, v, positions, slots)
    fp8 = dict(kv_layout="NHD", k_scale=scale["k"], v_scale=scale["v"])
    q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
    q_rot8 = torch.empty_like(q, dtype=FP8)

    def stream():
        return current_raw_stream(q.device.index) if q.is_cuda else 0

    def op(pools, **extra):
        return lambda: ropepool.rope_pool_fused(*ins, *pools, **KW, **extra)

    table = [
        ("binding: plain", "plain", lambda: _ropepool.rope_pool_fused_into(
            *ins, k_pool, v_pool, q_rot, k_rot, **KW, stream=stream(), exporter=to_dlpack)),
        ("plain [P, Hk, D]", "plain", op((k_pool, v_pool))),
        ("NHD page 16", "plain", op(paged, kv_layout="NHD")),
        ("QK norm (weights in bf16)", "plain",
         op((k_pool, v_pool), q_norm_weight=weight, k_norm_weight=weight, norm_eps=1e-6)),
        ("llama3 rope_scaling dict", "plain", op((k_pool, v_pool), rope_scaling=LLAMA3)),
        ("llama3 schedule=", "plain", op((k_pool, v_pool), schedule=schedule)),
        ("Qwen2-VL mRoPE rope_scaling dict", "plain", lambda: ropepool.rope_pool_fused(
            q, k, v, positions3, slots, k_pool, v_pool, **KW, rope_scaling=QWEN2_VL)),
        ("binding: fp8 NHD 16, fp8 q, no k_rot", "fp8", lambda: _ropepool.rope_pool_fused_into(
            *ins, *paged8, q_rot8, None, **KW, stream=stream(),
            exporter=to_dlpack, kv_layout="NHD", k_scale_tensor=scale["k"],
            v_scale_tensor=scale["v"], q_scale_tensor=scale["q"])),
        ("fp8 NHD 16, tensor scales", "fp8", op(paged8, **fp8)),
        ("fp8 NHD 16, fp8 q, no k_rot", "fp8",
         op(paged8, **fp8, q_out_dtype=FP8, q_scale=scale["q"],
            return_k_rot=False)),
    ]
    # DeepSeek-V3's MLA at 16 heads per rank (TP-8): q_pe a view of q [T, 16, 192], k_pe and
    # kv_c column slices of one [T, 576] projection output, a [P, 576] latent cache
    qm = torch.randn(1, 16, 192, **bf16)
    kv = torch.randn(1, 576, **bf16)
    mla_in = (qm[..., 128:], kv[:, 512:], kv[:, :512], positions, slots)
    latent = torch.randn(pool_rows, 576, **bf16)
    mla_sched = ropepool.rope_schedule(head_dim=64, rope_base=10000.0, rope_scaling=YARN)
    q_pe_rot, k_pe_rot = torch.empty_like(mla_in[0]), torch.empty_like(mla_in[1])
    table += [
        ("binding: MLA", "mla", lambda: _ropepool.mla_rope_pool_fused_into(
            *mla_in, latent, q_pe_rot, k_pe_rot, rope_base=10000.0, interleaved=True,
            inv_freq=mla_sched.inv_freq, attention_scaling=mla_sched.attention_scaling,
            nhd=False, kv_scale=None, kv_scale_tensor=None, check_slots=False,
            exporter=to_dlpack, stream=stream())),
        ("MLA yarn rope_scaling dict", "mla", lambda: ropepool.mla_rope_pool_fused(
            *mla_in, latent, rope_base=10000.0, rope_scaling=YARN)),
        ("MLA schedule=", "mla", lambda: ropepool.mla_rope_pool_fused(
            *mla_in, latent, rope_base=10000.0, schedule=mla_sched)),
    ]
    fi = flashinfer() if q.is_cuda else None
    if fi is not None:
        # FlashInfer's fused kernel writing the same outputs (fp8 q_rot, fp8 NHD 16 rows of
        # FlashInfer's own cache, no k_rot), its page tables for a one-token request, PDL on
        inv_freq = BASE ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
        theta = torch.arange(1 << 17, dtype=torch.float64, device=device)[:, None] * inv_freq
        cos_sin = torch.cat([torch.cos(theta), torch.sin(theta)], dim=1).float()
        i32 = dict(dtype=torch.int32, device=device)
        page, in_page = torch.tensor([slot // 16], **i32), torch.tensor([slot % 16], **i32)
        indptr, batch = torch.tensor([0, 1], **i32), torch.tensor([0], **i32)
        table.append((f"FlashInfer {fi.__version__} fused: fp8 NHD 16, fp8 q, no k_rot", "fp8",
                      lambda: fi.rope.rope_quantize_fp8_append_paged_kv_cache(
                          q, k, None, None, v, cos_sin, positions, paged8, page, indptr, batch,
                          in_page, is_neox=True, quantize_dtype=FP8, quant_scale_q=2.0,
                          quant_scale_kv=2.0, page_size=16, kv_layout="NHD", enable_pdl=True)))
    return table


def flashinfer():
    """FlashInfer where it imports (a peer's host cost beside ropepool's), else None."""
    try:
        import flashinfer as fi
        import flashinfer.rope  # noqa: F401
        return fi
    except Exception:  # not installed, or its JIT unavailable: the row is left out
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="ropepool CPU threads")
    ap.add_argument("--pool-rows", type=int, default=65536)
    args = ap.parse_args(argv)
    ropepool.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    table = rows(args.device, args.pool_rows)
    for _, _, call in table:  # schedules made, geometries registered
        call()
    sync()
    # Rows take turns round by round, so that a slow stretch of the host lands on all rows.
    samples = {name: [] for name, _, _ in table}
    for _ in range(args.rounds):
        for name, _, call in table:
            sync()
            t0 = time.perf_counter_ns()
            for _ in range(args.calls):
                call()
            samples[name].append((time.perf_counter_ns() - t0) / args.calls / 1e3)
    sync()
    results = {}
    for name, family, _ in table:
        per_round = sorted(samples[name])
        results[name] = (family, statistics.median(per_round),
                         per_round[len(per_round) // 10], per_round[(9 * len(per_round)) // 10])
    base = {family: t for name, (family, t, _, _) in results.items() if name.startswith("binding")}
    print(f"host µs per call at T = 1, {args.device}, torch {torch.__version__}, "
          f"{args.rounds} rounds of {args.calls} calls")
    print(f"| call | µs per call (p10-p90) | above the binding |\n|---|---:|---:|")
    for name, (family, t, lo, hi) in results.items():
        own = not name.startswith(("binding", "FlashInfer"))
        above = f"{t - base[family]:+.2f}" if own else ""
        print(f"| {name} | {t:.2f} ({lo:.2f}-{hi:.2f}) | {above} |")


if __name__ == "__main__":
    main()
