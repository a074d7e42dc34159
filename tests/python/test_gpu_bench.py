"""bench/gpu_bench.py's SPEC §7 fusion section on the CPU: every variant is built as the GPU
benchmark builds it and passes the check it gets there before timing, and the checks catch a
wrong result. (The timing itself needs CUDA: scripts/gpu_check.sh runs it.)"""

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
