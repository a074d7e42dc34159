"""`import ropepool.mlx` where the MLX front end cannot work (no mlx, or a ropepool built
without its extension, like the published wheel): a clear ImportError that says how to get
it, never a half-working module."""

import importlib
import importlib.util
import sys

import pytest


def test_import_works_or_says_how_to_build():
    has_mlx = importlib.util.find_spec("mlx") is not None and \
        importlib.util.find_spec("mlx.core") is not None
    has_ext = importlib.util.find_spec("ropepool._ropepool_mlx") is not None
    sys.modules.pop("ropepool.mlx", None)
    if has_mlx and has_ext:
        module = importlib.import_module("ropepool.mlx")
        assert callable(module.rope_pool_fused)
        return
    with pytest.raises(ImportError) as e:
        importlib.import_module("ropepool.mlx")
    text = str(e.value)
    if not has_mlx:
        assert "ropepool.mlx needs MLX: pip install 'mlx[cpu]'" in text
    else:
        assert "built without its MLX front end" in text
        assert "pip install --no-build-isolation" in text
