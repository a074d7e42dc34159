"""Package surface: version, thread control, signatures and docstrings; and a check that the
accuracy test itself can fail (it rejects plain float32 angles near position 2**20)."""

import inspect
import re

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import assert_within_bound, make_case, rope_exact


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", ropepool.__version__)
    from importlib.metadata import version
    assert version("ropepool") == ropepool.__version__


def test_num_threads_round_trip():
    default = ropepool.get_num_threads()
    assert default >= 1
    try:
        ropepool.set_num_threads(1)
        assert ropepool.get_num_threads() == 1
        ropepool.set_num_threads(3)
        assert ropepool.get_num_threads() == 3
        ropepool.set_num_threads(0)  # back to the default
        assert ropepool.get_num_threads() == default
        with pytest.raises(ValueError, match="n must be >= 0"):
            ropepool.set_num_threads(-2)
    finally:
        ropepool.set_num_threads(0)


def test_signature_is_explicit_and_keyword_only():
    sig = inspect.signature(ropepool.rope_pool_fused)
    positional = [p.name for p in sig.parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword_only = {p.name: p.default for p in sig.parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert positional == ["q", "k", "v", "positions", "slots", "k_pool", "v_pool"]
    empty = inspect.Parameter.empty
    assert keyword_only == {"head_dim": empty, "num_qo_heads": empty, "num_kv_heads": empty,
                            "rope_base": empty, "rotary_dim": None, "interleaved": False,
                            "rope_scaling": None, "max_position_embeddings": None,
                            "original_max_position_embeddings": None, "seq_len": None, "inv_freq": None, "attention_scaling": None,
                            "schedule": None, "inplace": False, "q_out": None,
                            "k_out": None, "check_slots": False,
                            "kv_layout": None, "k_scale": None, "v_scale": None,
                            "q_scale": None, "q_out_dtype": None,
                            # SPEC §7
                            "q_norm_weight": None, "k_norm_weight": None, "norm_eps": None,
                            "norm_style": None, "mrope_section": None,
                            "mrope_interleaved": None,
                            # SPEC §4: no k_rot
                            "return_k_rot": True}
    for fn in (ropepool.rope_pool_fused, ropepool.set_num_threads, ropepool.get_num_threads):
        assert fn.__doc__ and len(fn.__doc__) > 40


def test_the_bound_rejects_float32_angles(rng):
    """The accuracy check has teeth: the seed kernel's float32 `pos * inv_freq` angle,
    evaluated exactly otherwise, fails it near position 2**20 (SPEC §1)."""
    T, D = 64, 128
    case = make_case("numpy", "float32", rng, T=T, Hq=4, Hk=2, D=D, P=T,
                     positions=2**20 - 1 - rng.integers(0, 1024, size=T), rope_base=10000.0)
    x = case.q.astype(np.float64)
    inv_freq = (10000.0 ** (-2.0 * np.arange(D // 2) / D)).astype(np.float32)
    theta = (case.positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    a, b = x[..., : D // 2], x[..., D // 2:]
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
    naive = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(np.float32)
    with pytest.raises(AssertionError, match="outside the SPEC bound"):
        assert_within_bound(naive, case.q, case.positions, case.rope_base, "naive")
    # ... while the exact values rounded once to float32 pass.
    exact = rope_exact(case.q, case.positions, case.rope_base)[0].astype(np.float32)
    assert_within_bound(exact, case.q, case.positions, case.rope_base, "rounded exact")


def test_the_bound_sees_one_ulp(rng):
    """Two units in the last place off in one bfloat16 element is caught."""
    case = make_case("torch", "bfloat16", rng, T=3, Hq=2, Hk=2, D=8, P=3,
                     positions=[5, 6, 7])
    exact, abs_ab = rope_exact(case.q, case.positions, case.rope_base)
    out = torch.from_numpy(exact).to(torch.bfloat16)
    assert_within_bound(out, case.q, case.positions, case.rope_base, "rounded exact")
    # An element that is large next to |a| + |b| (one of each pair is >= (|a| + |b|) / 2),
    # so the bound there is essentially one ulp.
    where = np.unravel_index(np.argmax(np.abs(exact) / abs_ab), exact.shape)
    out.view(torch.int16)[where] += 2  # two ulps further from zero
    with pytest.raises(AssertionError, match="1 of 48 elements"):
        assert_within_bound(out, case.q, case.positions, case.rope_base, "off by 2 ulp")


def test_torch_compat_fallbacks_without_private_names(monkeypatch):
    """Every private torch API the op uses (ropepool._torch_compat) has a public fallback:
    with the private names hidden, the module still imports, and the op run through the
    fallbacks gives the same bits and bumps the same version counters as the normal path."""
    import importlib

    import ropepool._op as op
    import ropepool._torch_compat as compat

    names = ("to_dlpack", "increment_version", "current_raw_stream", "current_device",
             "current_dispatch_mode")
    with monkeypatch.context() as hidden:
        for owner, name in compat.PRIVATE_NAMES:
            if owner is not None:
                hidden.delattr(owner, name, raising=False)
        importlib.reload(compat)  # resolves every name without the private ones
        fallbacks = {name: getattr(compat, name) for name in names}
        missing = compat.missing
    # The private names are back (a public fallback may call one internally, as
    # torch.autograd.graph.increment_version does); reload for the other tests.
    importlib.reload(compat)
    assert set(missing) == {name for _, name in compat.PRIVATE_NAMES}
    assert all(callable(fn) for fn in fallbacks.values())
    assert fallbacks["current_dispatch_mode"]() is not None  # unknown: take the dispatcher

    T, Hq, Hk, D, P = 5, 4, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(T, H, D, generator=gen, dtype=torch.bfloat16) for H in (Hq, Hk, Hk))
    positions = torch.tensor([0, 3, 70000, 9, 1 << 19], dtype=torch.int32)
    slots = torch.tensor([2, -1, 15, 0, 7], dtype=torch.int64)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0)

    def run():
        k_pool = torch.zeros(P, Hk, D, dtype=torch.bfloat16)
        v_pool = torch.zeros_like(k_pool)
        before = k_pool._version
        out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
        assert out[2] is k_pool and k_pool._version > before
        return out

    expected = run()
    called = []

    def spy(name, fn):
        def wrapper(*args):
            called.append(name)
            return fn(*args)
        return wrapper

    for name in names:  # _op.py imports each as `_<name>`, current_dispatch_mode as _dispatch_mode
        global_name = "_dispatch_mode" if name == "current_dispatch_mode" else "_" + name
        monkeypatch.setattr(op, global_name, spy(name, fallbacks[name]))
    got = run()
    # On the CPU the stream getters are not needed; the other three were used.
    assert {"to_dlpack", "increment_version", "current_dispatch_mode"} <= set(called)
    for e, g in zip(expected, got):
        assert torch.equal(e.view(torch.int16), g.view(torch.int16))
