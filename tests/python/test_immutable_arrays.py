"""The DLPack path (ropepool.rope_pool_fused, validate_rope_pool) refuses arrays of
frameworks that treat them as immutable (JAX, MLX), naming the front end to use, before
anything is converted (SPEC §9). MLX's own case is in test_mlx.py."""

import importlib.util

import numpy as np
import pytest

import ropepool

KW = dict(head_dim=16, num_qo_heads=4, num_kv_heads=2, rope_base=10000.0)


def numpy_args():
    return [np.zeros((2, 4, 16), np.float32), np.zeros((2, 2, 16), np.float32),
            np.zeros((2, 2, 16), np.float32), np.zeros(2, np.int32), np.zeros(2, np.int32),
            np.zeros((8, 2, 16), np.float32), np.zeros((8, 2, 16), np.float32)]


# A stand-in with the type identity of jax.Array's implementation (jaxlib._jax.ArrayImpl),
# so the refusal is tested where JAX is not installed; the real thing below where it is.
FakeJaxArray = type("ArrayImpl", (), {"__module__": "jaxlib._jax", "shape": (8, 2, 16),
                                      "dtype": np.dtype(np.float32)})


@pytest.mark.parametrize("entry", [ropepool.rope_pool_fused, ropepool.validate_rope_pool])
def test_jax_arrays_are_refused_naming_the_jax_front_end(entry):
    args = numpy_args()
    args[5] = FakeJaxArray()
    with pytest.raises(TypeError, match=r"^rope_pool_fused: k_pool is a jax.Array, which "
                                        r"ropepool.rope_pool_fused cannot write \(it is "
                                        r"immutable\); use ropepool.jax.rope_pool_fused"):
        entry(*args, **KW)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_real_jax_arrays_are_refused():
    import jax.numpy as jnp

    args = numpy_args()
    args[0] = jnp.zeros((2, 4, 16), jnp.float32)
    with pytest.raises(TypeError, match=r"q is a jax.Array.*ropepool.jax.rope_pool_fused"):
        ropepool.rope_pool_fused(*args, **KW)


MLA_NAMES = ("q_pe", "k_pe", "kv_c", "positions", "slots", "kv_cache")


def mla_numpy_args(rng):
    T, H, R, L, P = 2, 4, 16, 32, 8
    return [rng.standard_normal((T, H, R), dtype=np.float32),
            rng.standard_normal((T, R), dtype=np.float32),
            rng.standard_normal((T, L), dtype=np.float32),
            rng.integers(0, 1000, T).astype(np.int32), np.array([3, 5], np.int32),
            rng.standard_normal((P, L + R), dtype=np.float32)]


@pytest.mark.parametrize("index", range(len(MLA_NAMES)))
def test_mla_refuses_jax_arrays_naming_its_jax_front_end(index):
    rng = np.random.default_rng()
    args = mla_numpy_args(rng)
    before = [np.array(a, copy=True) for a in args]
    args[index] = FakeJaxArray()
    with pytest.raises(TypeError, match=rf"^mla_rope_pool_fused: {MLA_NAMES[index]} is a "
                                        r"jax.Array, which ropepool.mla_rope_pool_fused cannot "
                                        r"write \(it is immutable\); use "
                                        r"ropepool.jax.mla_rope_pool_fused"):
        ropepool.mla_rope_pool_fused(*args, rope_base=10000.0)
    for i, (a, b) in enumerate(zip(args, before)):
        if i != index:
            np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_mla_refuses_real_mlx_arrays():
    import mlx.core as mx

    args = mla_numpy_args(np.random.default_rng())
    args[5] = mx.array(args[5])
    with pytest.raises(TypeError, match=r"kv_cache is an mlx.core.array.*"
                                        r"ropepool.mlx.mla_rope_pool_fused"):
        ropepool.mla_rope_pool_fused(*args, rope_base=10000.0)
