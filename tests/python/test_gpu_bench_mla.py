"""bench/gpu_bench_mla.py's checks on the CPU: every contender, built as the GPU benchmark
builds it, passes the check it gets there before timing, and the check catches a wrong
result. (The timing itself needs CUDA: scripts/gpu_check.sh runs it.)"""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import gpu_bench_mla  # noqa: E402

CACHES = [torch.bfloat16, torch.float8_e4m3fn]


def _workload(cache_dtype, T=7, H=4):
    args = gpu_bench_mla.parse_args(["--pool-rows", "64"])
    gen = torch.Generator().manual_seed(20240601)
    return gpu_bench_mla.MlaWorkload(T, H, cache_dtype, args, gen, l2_bytes=0, device="cpu")


@pytest.mark.parametrize("cache_dtype", CACHES)
def test_every_contender_passes_its_check(cache_dtype):
    w = _workload(cache_dtype)
    assert w.n_sets == 20 and w.q_pe.shape == (20 * 7, 4, 64) and w.q_pe.stride(1) == 192
    contenders = {name: w.contender(name) for name in ("ropepool", "no_k_rot", "eager")}
    problems, _ = gpu_bench_mla.check(w, contenders)
    assert problems == []
    assert w.contender("no_k_rot")(*w.args_of(1))[1] is None
    # the compile contender with the eager function in torch.compile's place: its plumbing
    assert gpu_bench_mla.check(w, {"compile": w.contender("compile", gpu_bench_mla.eager)}) == ([], [])
    # the cursor: one past the last set handed out, sets taken modulo their number
    assert w.cursor == 1
    assert w.args_of(23)[3].equal(w.positions[3 * 7:4 * 7]) and w.cursor == 24


@pytest.mark.parametrize("cache_dtype", CACHES)
def test_the_check_catches_a_wrong_result(cache_dtype):
    w = _workload(cache_dtype)
    mla = gpu_bench_mla.ropepool.mla_rope_pool_fused

    def stray_row(*a):  # eager, and one row no token names
        out = gpu_bench_mla.eager(*a, w.cache, w.inv_freq64, w.scale or 1.0)
        unnamed = sorted(set(range(w.P)) - set(a[4].tolist()))[0]
        w.cache.view(torch.uint8)[unnamed] ^= 1
        return out

    wrong = {
        # no YaRN schedule: DeepSeek's plain 10000 base
        "schedule": (lambda *a: mla(*a, w.cache, rope_base=10000.0, kv_scale=w.scale), "q_pe_rot"),
        # NeoX pairs instead of GPT-J's
        "pairs": (lambda *a: mla(*a, w.cache, rope_base=10000.0, schedule=gpu_bench_mla.SCHEDULE,
                                 kv_scale=w.scale, interleaved=False), "k_pe_rot"),
        "stray row": (stray_row, "no token names"),
    }
    if cache_dtype == torch.float8_e4m3fn:
        wrong["scale"] = (lambda *a: mla(*a, w.cache, rope_base=10000.0,
                                         schedule=gpu_bench_mla.SCHEDULE, kv_scale=0.25), "kv_c")
    for name, (fn, what) in wrong.items():
        problems, _ = gpu_bench_mla.check(w, {name: fn})
        assert any(p.startswith(f"{name}: ") and what in p for p in problems), (name, problems)


@pytest.mark.parametrize("cache_dtype", CACHES)
def test_the_check_catches_a_wrong_call_without_k_rot(cache_dtype):
    w = _workload(cache_dtype)
    mla = gpu_bench_mla.ropepool.mla_rope_pool_fused

    def no_k_rot_neox(*a):  # NeoX pairs: every q_pe_rot and row differs from the call's
        return mla(*a, w.cache, rope_base=10000.0, schedule=gpu_bench_mla.SCHEDULE,
                   kv_scale=w.scale, interleaved=False, return_k_rot=False)

    contenders = {"ropepool": w.contender("ropepool"), "no_k_rot": no_k_rot_neox}
    problems, _ = gpu_bench_mla.check(w, contenders)
    assert problems == ["no_k_rot: q_pe_rot or the cache rows differ from the call with k_pe_rot"]
    problems, _ = gpu_bench_mla.check(w, {"no_k_rot": w.contender("no_k_rot")})
    assert problems == ["no_k_rot: no k_pe_rot: checked only beside the ropepool contender"]


def test_arguments(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = gpu_bench_mla.parse_args([])
    assert (a.tokens, a.heads, a.caches, a.samples, a.json) == (
        [1, 16, 256, 4096, 16384], [128, 16], CACHES, 50, None)
    monkeypatch.setenv("OUT", "/tmp/out")
    assert gpu_bench_mla.parse_args([]).json == "/tmp/out/gpu_bench_mla.json"
    assert gpu_bench_mla.parse_args(["--json", ""]).json == ""  # none written
    assert gpu_bench_mla.parse_args(["--caches", "float8_e4m3fn"]).caches == CACHES[1:]
    with pytest.raises(SystemExit):
        gpu_bench_mla.parse_args(["--caches", "float16"])


def test_the_table(capsys):
    row = dict(heads=128, cache="float8_e4m3fn", T=4096, problems=[], notes=["compile: x"],
               ropepool_call_pct_copy=90.0, ropepool_b2b_pct_copy=95.5, eager_b2b_host_bound=2)
    for i, name in enumerate(("ropepool", "eager")):
        row.update({f"{name}_{m}_us": 10.0 * (i + 1) for m in gpu_bench_mla.MODES})
    row.update({f"no_k_rot_{m}_us": 9.0 for m in gpu_bench_mla.MODES})
    row.update(no_k_rot_call_pct_copy=98.0, no_k_rot_b2b_pct_copy=99.5)
    result = dict(device="GPU", copy_GBps=4000.0, pool_rows=262144, samples=50, l2_multiple=4.0,
                  rows=[row, dict(row, cache="bfloat16", problems=["ropepool: wrong"], notes=[])],
                  problems=["H=128 bfloat16 T=4096: ropepool: wrong"],
                  compile_errors={"float8_e4m3fn": "H=128 T=1: E: no"})
    assert gpu_bench_mla.finish(result, "", gpu_bench_mla.print_table) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("ropepool GPU bench, MLA")  # where gpu_check.sh's summary starts
    table = [line for line in out if line.startswith(" 128 ")]
    assert table[0].split() == ["128", "fp8", "4096", "|", "10.00", "10.00", "10.00", "|",
                                "20.00", "20.00", "20.00", "|", "-", "-", "-", "|", "90.0",
                                "95.5", "ok"]
    assert table[1].endswith("ropepool: wrong")
    assert any(line.startswith("Without k_pe_rot") for line in out)
    assert table[2].split() == ["128", "fp8", "4096", "|", "10.00", "10.00", "10.00", "|", "9.00",
                                "9.00", "9.00", "|", "98.0", "99.5", "|", "0.900", "0.900",
                                "0.900"]
    assert "torch.compile dropped for the float8_e4m3fn cache from H=128 T=1: E: no" in out
    assert any("eager_b2b: 2" in line for line in out) and "CHECK FAILED:" in out


def test_flashinfer_is_optional_and_said(monkeypatch, capsys):
    """FlashInfer (a benchmark peer): a failed import is a reason, never an error, and the
    tables say whether it was measured."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # so import flashinfer fails
    fi, why = gpu_bench_mla.import_flashinfer()
    assert fi is None and why.startswith("ModuleNotFoundError")
    row = dict(heads=16, cache="bfloat16", T=4096, problems=[], notes=[],
               ropepool_call_pct_copy=50.0, ropepool_b2b_pct_copy=60.0,
               flashinfer_b2b_pct_copy=40.0)
    for name, t in (("ropepool", 8.0), ("eager", 100.0), ("flashinfer", 10.0)):
        row.update({f"{name}_{m}_us": t for m in gpu_bench_mla.MODES})
    row.update({f"ratio_{m}": 0.8 for m in gpu_bench_mla.MODES})
    result = dict(device="GPU", copy_GBps=4000.0, pool_rows=262144, samples=50, l2_multiple=4.0,
                  rows=[row], problems=[], compile_errors={}, flashinfer="0.7.2.post1")
    gpu_bench_mla.print_table(result)
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("FlashInfer 0.7.2.post1 beside ropepool") for line in out)
    assert out[-1].split() == ["16", "bf16", "4096", "|", "8.00", "8.00", "8.00", "|", "10.00",
                               "10.00", "10.00", "|", "40.0", "|", "0.800", "0.800", "0.800"]
    gpu_bench_mla.print_table(dict(result, flashinfer=f"not importable: {why}",
                                   rows=[{k: v for k, v in row.items()
                                          if not k.startswith(("flashinfer", "ratio"))}]))
    assert capsys.readouterr().out.splitlines()[-1] == f"FlashInfer: NOT MEASURED (not importable: {why})"
