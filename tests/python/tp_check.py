"""Tensor parallelism over two GPUs (run by test_cuda_multi.py through torchrun).

Each rank owns half of the query heads and half of the key/value heads of one attention
layer, with its own KV-cache pools for those heads, as a tensor-parallel engine shards
them. Every rank calls rope_pool_fused on its shard; the shards of q_rot, k_rot and both
pools are gathered over NCCL and rank 0 compares them, bit for bit, with one call on the
whole layer on one GPU.

    torchrun --standalone --nproc-per-node 2 tests/python/tp_check.py
"""

import os
import sys

import torch
import torch.distributed as dist

import ropepool


def full_problem(seed, T=512, Hq=32, Hk=8, D=128, P=4096):
    """The whole layer's inputs, the same on every rank (drawn on the CPU from one seed)."""
    g = torch.Generator().manual_seed(seed)
    def values(*shape):
        return (torch.randn(*shape, generator=g) * 2.0).to(torch.bfloat16)
    positions = torch.randint(0, 2**20, (T,), generator=g, dtype=torch.int64)
    slots = torch.randperm(P, generator=g)[:T].to(torch.int32)
    slots[torch.rand(T, generator=g) < 0.2] = -1
    return dict(q=values(T, Hq, D), k=values(T, Hk, D), v=values(T, Hk, D),
                positions=positions, slots=slots, k_pool=values(P, Hk, D),
                v_pool=values(P, Hk, D), Hq=Hq, Hk=Hk, D=D)


def call(q, k, v, positions, slots, k_pool, v_pool, D):
    return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                                    num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
                                    rope_base=500000.0)


def gather_heads(x, world):
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def main():
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        sys.exit("tp_check: NCCL_NVLS_ENABLE=0 is required (NVLink multicast stays off)")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    p = full_problem(seed=20261201)
    hq, hk = p["Hq"] // world, p["Hk"] // world
    shard = lambda x, h: x[:, rank * h:(rank + 1) * h].contiguous().to(device)
    q_rot, k_rot, k_pool, v_pool = call(
        shard(p["q"], hq), shard(p["k"], hk), shard(p["v"], hk), p["positions"].to(device),
        p["slots"].to(device), shard(p["k_pool"], hk), shard(p["v_pool"], hk), p["D"])
    gathered = [gather_heads(x, world) for x in (q_rot, k_rot, k_pool, v_pool)]
    ropepool.cuda_check_slot_errors(rank)

    ok = torch.ones(1, device=device)
    if rank == 0:
        whole = call(*(p[n].to(device) for n in ("q", "k", "v", "positions", "slots",
                                                 "k_pool", "v_pool")), p["D"])
        for name, got, want in zip(("q_rot", "k_rot", "k_pool", "v_pool"), gathered, whole):
            same = torch.equal(got.view(torch.int16), want.view(torch.int16))
            print(f"tp_check: {name} {'bit-identical' if same else 'DIFFERS'} "
                  f"{tuple(got.shape)}", flush=True)
            if not same:
                ok.zero_()
        # the pools were really written (not a vacuous comparison)
        written = p["slots"] >= 0
        rows = p["slots"][written].long()
        k_rows = gathered[2][rows.to(device)].view(torch.int16)
        assert torch.equal(k_rows, gathered[1][written.to(device)].view(torch.int16))
        assert not torch.equal(gathered[2].cpu().view(torch.int16), p["k_pool"].view(torch.int16))
    dist.broadcast(ok, src=0)
    dist.destroy_process_group()
    if rank == 0:
        print("tp_check: bit-identical" if ok.item() else "tp_check: FAILED", flush=True)
    sys.exit(0 if ok.item() else 1)


if __name__ == "__main__":
    main()
