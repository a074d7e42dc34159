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
