"""examples/decode.py, the engine example (prefill + greedy decode of two sequences with
ropepool's RoPE and KV-pool writes), matches transformers' generate() and forward on the
CPU; and its check fails when ropepool is given the wrong RoPE schedule."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "decode.py"


def test_example_matches_transformers():
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("MATCH") == 2 and "MISMATCH" not in r.stdout, r.stdout
    assert "[llama3]" in r.stdout and "[rope_theta]" in r.stdout


@pytest.fixture(scope="module")
def decode():
    spec = importlib.util.spec_from_file_location("decode_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_the_check_can_fail(decode):
    """llama3 scaling left out of ropepool's schedule: the example reports a mismatch."""
    result = decode.run_case("llama3", rope_override={"rope_scaling": None}, verbose=False)
    assert not result["ok"]
    assert result["step_err"] > 100 * decode.TOLERANCE
