"""bench/gpu_bench.py's SPEC §6 cache and SPEC §7 fusion sections on the CPU: every variant is
built as the GPU benchmark builds it and passes the check it gets there before timing, and the
checks catch a wrong result; FlashInfer's fused kernel stands beside the ropepool row that
writes what it writes. (The timing itself needs CUDA: scripts/gpu_check.sh runs it.)"""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import gpu_bench  # noqa: E402


def _workload(*argv, T=7):
    args = gpu_bench.parse_args(["--pool-rows", "64", "--num-qo-heads", "4",
                                 "--num-kv-heads", "2", *argv])
    gen = torch.Generator().manual_seed(20240601)
    return args, gen, gpu_bench.Workload(T, args, gen, l2_bytes=0, device="cpu")


@pytest.mark.parametrize("weights", ["input", "float32"])
def test_every_fusion_variant_passes_its_check(weights):
    args, gen, w = _workload("--norm-weight-dtype", weights)
    assert gpu_bench.check(w, None) == ([], [])
    # the compile variant with the eager function in torch.compile's place: its plumbing
    for spec in gpu_bench.FUSION_VARIANTS:
        var = gpu_bench.FusionVariant(spec, w, gen, args, gpu_bench.torch_norm_rope_pool)
        problems, notes = gpu_bench.check_fusion_variant(var)
        assert problems == [], (spec[0], problems)
        if spec[1] == "compile":
            assert notes == [], notes
    assert args.fusion_tokens == [1, 64, 256, 4096, 16384, 65536]
    assert gpu_bench.parse_args(["--no-fusion"]).fusion_tokens == []


def test_the_checks_catch_a_wrong_result():
    args, gen, w = _workload()
    variants = {spec[0]: gpu_bench.FusionVariant(spec, w, gen, args)
                for spec in gpu_bench.FUSION_VARIANTS if spec[1] != "compile"}
    variants["qk-norm fused"].kwargs["norm_eps"] = 0.5  # the unfused sequence keeps 1e-6
    variants["mrope"].kwargs["mrope_interleaved"] = True  # the reference keeps Qwen2-VL's
    variants["plain"].kwargs["rope_base"] = 10000.0  # eager keeps the workload's 500000
    for name in ("qk-norm fused", "mrope", "plain"):
        problems = gpu_bench.check_fusion_variant(variants[name])[0]
        assert any("q_rot" in p for p in problems), (name, problems)


def test_every_cache_variant_passes_its_check():
    args, gen, w = _workload()
    for spec in gpu_bench.CACHE_VARIANTS:
        var = gpu_bench.CacheVariant(spec, w, gen)
        assert gpu_bench.check_cache_variant(var, w) == [], spec[0]
        # the result of a call without k_rot has none, and the bytes leave it out
        assert (var.call(*w.args_of(1))[1] is None) == (not var.k_rot), spec[0]
    names = [spec[0] for spec in gpu_bench.CACHE_VARIANTS]
    for name in ("bf16 [P,Hk,D], no k_rot", "fp8 NHD 16, fp8 q, no k_rot"):
        with_k_rot = name.removesuffix(", no k_rot")
        pair = [gpu_bench.CacheVariant(gpu_bench.CACHE_VARIANTS[names.index(n)], w, gen)
                for n in (with_k_rot, name)]
        assert [v.k_rot for v in pair] == [True, False]
        T, Hk, D = w.T, args.num_kv_heads, args.head_dim
        assert pair[0].bytes - pair[1].bytes == T * Hk * D * 2  # the bf16 k_rot


def test_the_cache_checks_catch_a_wrong_result():
    args, gen, w = _workload()
    specs = {spec[0]: spec for spec in gpu_bench.CACHE_VARIANTS}
    for name in ("bf16 [P,Hk,D], no k_rot", "fp8 NHD 16, fp8 q, no k_rot"):
        var = gpu_bench.CacheVariant(specs[name], w, gen)
        var.kwargs["return_k_rot"] = True  # a k_rot where none is asked for
        assert any("k_rot returned" in p for p in gpu_bench.check_cache_variant(var, w)), name
        var = gpu_bench.CacheVariant(specs[name], w, gen)
        var.kwargs["rope_base"] = 10000.0  # q_rot and the k pool rows rotated wrongly
        problems = gpu_bench.check_cache_variant(var, w)
        assert any("q_rot" in p for p in problems), (name, problems)
        assert any("k rows" in p or "bit-identical" in p for p in problems), (name, problems)


def test_flashinfer_variants_stand_beside_a_ropepool_row_of_the_same_work():
    # FlashInfer's variants built without FlashInfer (their tables and bytes need none of it)
    args, gen, w = _workload()
    specs = {spec[0]: spec for spec in gpu_bench.CACHE_VARIANTS}
    peers = {spec[1]: spec[2] for spec in gpu_bench.FLASHINFER_VARIANTS}
    assert set(peers.values()) <= set(specs)
    # the fused kernel writes fp8 q_rot and the fp8 cache, no k_rot: the return_k_rot=False row
    assert peers["fused"] == "fp8 NHD 16, fp8 q, no k_rot"
    fused = next(gpu_bench.FlashInferVariant(spec, w, gen, None, None)
                 for spec in gpu_bench.FLASHINFER_VARIANTS if spec[1] == "fused")
    ours = gpu_bench.CacheVariant(specs[fused.peer], w, gen)
    assert (ours.layout, ours.page_size, ours.fp8, ours.q8, ours.k_rot) == \
        (fused.layout, fused.page_size, True, True, False)
    # the same data bytes: FlashInfer's count adds a float32 cos/sin row (4 D bytes) and five
    # int32 index entries per token, ropepool's two (positions, slots)
    T, D = w.T, args.head_dim
    assert fused.bytes - (4 * D * T + 20 * T) == ours.bytes - 8 * T
