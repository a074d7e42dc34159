"""`python -m ropepool` runs the command-line tool installed inside the package, with its
arguments and exit status."""

import json
import subprocess
import sys

import pytest


def run_module(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ropepool", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help():
    r = run_module("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ropepool <command>")
    assert "verify" in r.stdout and "bench" in r.stdout


def test_version_matches_the_package():
    import ropepool
    r = run_module("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ropepool {ropepool.__version__}"


@pytest.mark.parametrize("args, status", [((), 2), (("frobnicate",), 2),
                                          (("verify", "--threads", "0"), 2)])
def test_exit_status_passes_through(args, status):
    r = run_module(*args)
    assert r.returncode == status
    assert "ropepool" in r.stderr


def test_verify():
    r = run_module("verify", "--threads", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " passed, 0 failed" in r.stdout


def test_bench_times_every_cache_format_in_one_run(tmp_path):
    out = tmp_path / "bench.json"
    r = run_module("bench", "--threads", "2", "--tokens", "1,3", "--iters", "6", "--copy-mib", "1",
                   "--rotate-mib", "1", "--pool-slots", "64", "--pool-dtype", "same,fp8", "--kv-layout", "none,HND",
                   "--page-size", "16", "--rounds", "2", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())["results"]
    # per T: pools x layouts, in the order of the lists; a 3-D pool has page size 1
    formats = [(pool, layout, page) for pool in ("bfloat16", "float8_e4m3fn")
               for layout, page in (("none", 1), ("HND", 16))]
    assert [(x["tokens"], x["pool_dtype"], x["kv_layout"], x["page_size"]) for x in results] == \
        [(t, *f) for t in (1, 3) for f in formats]
    assert all(x["verified"] and x["q_out_dtype"] == "bfloat16" for x in results)
    assert all(x["calls"] == 6 for x in results)  # 3 calls in each of the 2 rounds
    rows = [line for line in r.stdout.splitlines() if line.startswith(("bfloat16 ", "float8_e4m3fn "))]
    assert len(rows) == 8 and sum("the first format's share" in line for line in rows) == 6


def test_bench_gptj_pairs(tmp_path):
    # --interleaved: the kernel rotates GPT-J pairs and the bench checks them as such (fp8 rows
    # of bfloat16 heads take their own path)
    out = tmp_path / "bench.json"
    r = run_module("bench", "--threads", "2", "--tokens", "3", "--iters", "4", "--copy-mib", "1",
                   "--rotate-mib", "1", "--pool-slots", "64", "--pool-dtype", "same,fp8",
                   "--q-out-dtype", "fp8", "--interleaved", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPT-J pairs" in r.stdout
    data = json.loads(out.read_text())
    assert data["interleaved"] is True
    assert len(data["results"]) == 2 and all(x["verified"] for x in data["results"])


def test_bench_times_calls_without_k_rot(tmp_path):
    # --k-rot yes,no: each format with and without k_rot (SPEC §4 return_k_rot=False), the
    # rows without it verified (q_rot, the pools against a call with k_rot) and counted
    # without the k_rot write
    out = tmp_path / "bench.json"
    r = run_module("bench", "--threads", "2", "--tokens", "3", "--iters", "4", "--copy-mib", "1",
                   "--rotate-mib", "1", "--pool-slots", "64", "--pool-dtype", "same,fp8",
                   "--q-out-dtype", "fp8", "--kv-layout", "NHD", "--k-rot", "yes,no",
                   "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())["results"]
    assert [(x["pool_dtype"], x["k_rot"]) for x in results] == \
        [(pool, k_rot) for pool in ("bfloat16", "float8_e4m3fn") for k_rot in (True, False)]
    assert all(x["verified"] and x["calls"] == 4 for x in results)
    T, Hk, D = 3, 8, 128
    for with_k_rot, without in zip(results[::2], results[1::2]):
        assert with_k_rot["bytes_per_call"] - without["bytes_per_call"] == T * Hk * D * 2
    rows = [line.split() for line in r.stdout.splitlines()
            if line.startswith(("bfloat16 ", "float8_e4m3fn "))]
    assert [row[2] for row in rows] == ["yes", "no", "yes", "no"]  # the k_rot column
    # one format: the header says it
    r = run_module("bench", "--threads", "2", "--tokens", "3", "--iters", "2", "--copy-mib", "1",
                   "--rotate-mib", "1", "--pool-slots", "64", "--k-rot", "no")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "; no k_rot (return_k_rot=False)" in r.stdout


def test_bench_times_the_fusions_in_one_run(tmp_path):
    # --fusion: SPEC §7's variants as formats of one run, outermost, each verified and given
    # its share over the first (plain) call's against the same memcpy anchor
    out = tmp_path / "bench.json"
    r = run_module("bench", "--threads", "2", "--tokens", "3", "--iters", "4", "--copy-mib", "1",
                   "--rotate-mib", "1", "--pool-slots", "64", "--fusion", "none,qk-norm,mrope,qk-norm+mrope",
                   "--kv-layout", "none,NHD", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())["results"]
    fusions = ("none", "qk-norm", "mrope", "qk-norm+mrope")
    assert [(x["fusion"], x["kv_layout"]) for x in results] == \
        [(f, layout) for f in fusions for layout in ("none", "NHD")]
    assert all(x["verified"] and x["calls"] == 4 for x in results)
    T, D, es = 3, 128, 2
    plain, norm, mrope = results[0], results[2], results[4]
    assert norm["bytes_per_call"] - plain["bytes_per_call"] == 2 * D * es  # the two weights
    assert mrope["bytes_per_call"] - plain["bytes_per_call"] == 2 * T * 4  # two more int32 rows
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(fusions)]
    assert [row[0] for row in rows] == [f for f in fusions for _ in range(2)]  # the fusion column
    assert sum("the first format's share" in " ".join(row) for row in rows) == 7
    assert "fusion: QK norm" in r.stdout and "fusion: mRoPE" in r.stdout


@pytest.mark.parametrize("args, message", [
    (("--fusion", "none,qknorm"),
     "--fusion must be none, qk-norm, mrope or qk-norm+mrope (or a list of them), got 'qknorm'"),
    (("--fusion", "none", "--mrope"), "--fusion replaces --qk-norm and --mrope: give one or the other"),
    (("--fusion", "none,qk-norm", "--q-out-dtype", "fp8"),
     "the QK norm (--qk-norm, --fusion qk-norm) with fp8 pools or q_rot: the bench cannot verify that yet"),
    (("--k-rot", "yes,none"), "--k-rot must be yes or no (or a list of them), got 'none'"),
    (("--pool-dtype", "same,fp8,"), "--pool-dtype expects a comma-separated list, got 'same,fp8,'"),
    (("--kv-layout", "none,nhd"), "--kv-layout must be none, NHD or HND (or a list of them), got 'nhd'"),
    (("--kv-layout", "none", "--page-size", "1,16"), "--page-size needs --kv-layout NHD or HND"),
    (("--pool-dtype", "same,same", "--fp8-scale", "0.5"),
     "--fp8-scale needs --pool-dtype fp8 or --q-out-dtype fp8"),
    (("--rounds", "0"), "--rounds expects an integer >= 1, got '0'"),
])
def test_bench_format_lists_are_checked(args, message):
    r = run_module("bench", *args)
    assert r.returncode == 2
    assert message in r.stderr
