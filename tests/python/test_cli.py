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


@pytest.mark.parametrize("args, message", [
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
