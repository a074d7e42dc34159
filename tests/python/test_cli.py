"""`python -m ropepool` runs the command-line tool installed inside the package, with its
arguments and exit status."""

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
