"""Shared fixtures: the device grid (CPU always, CUDA when present), per-test random
generators whose seed is printed on failure, and NaN-poisoned output allocation."""

import os
import secrets

# JAX (tests/python/test_jax.py) shares the GPU with torch in this process: without this,
# its first GPU array reserves 75% of the device's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest
import torch

import ropepool
import ropepool._op

HAS_CUDA = torch.cuda.is_available()

# CUDA runs only where a GPU is visible; the `gpu` marker lets CI select or drop them
# (`-m gpu`, `-m "not gpu"`).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    """Every test that takes `device` runs on the CPU and, where a GPU is present, on CUDA."""
    return request.param


@pytest.fixture
def kernel_device(device):
    """A device the op can run on: CUDA tests need a build with the CUDA backend."""
    if device == "cuda" and not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    return device


@pytest.fixture
def rng(request):
    """Fresh random data every run; ROPEPOOL_TEST_SEED=<n> replays a failure (the seed is
    printed in the failure report)."""
    seed = int(os.environ.get("ROPEPOOL_TEST_SEED", secrets.randbits(32)))
    request.node.ropepool_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "ropepool_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("ropepool", f"replay with ROPEPOOL_TEST_SEED={seed}"))


class OutputRecorder:
    """Stands in for the package's q_rot/k_rot allocation: fills them with NaN first, so an
    element the op forgets to write is caught, and keeps them for inspection even when the
    call raises (to prove nothing was written)."""

    def __init__(self):
        self.allocated = []

    def torch_output(self, x):
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
        self.allocated.append(out)
        return out

    def array_output(self, x, name):
        out = np.full(x.shape, np.nan, dtype=x.dtype)
        self.allocated.append(out)
        return out


@pytest.fixture
def poisoned_outputs(monkeypatch):
    recorder = OutputRecorder()
    monkeypatch.setattr(ropepool._op, "_new_torch_output", recorder.torch_output)
    monkeypatch.setattr(ropepool._op, "_new_array_output", recorder.array_output)
    return recorder
