"""Property-based fuzzing of the Python front end (issue #9), with hypothesis.

Every example is one call with random shapes, dtypes, keywords, strided views and index
values, over torch CPU tensors or NumPy arrays. q, k, v and the pools are views carved from
ONE buffer, so arguments can alias. The property: either a clean ValueError/TypeError with
every input and pool unchanged bit for bit, or a result that
- shares no byte between an output (the pools; q and k with inplace=True, k only when k_rot
  is returned) and another argument (SPEC §3),
- is within the SPEC §1 bound of a float64 rotation of the inputs as they were,
- wrote each pool row named by a slot with one writer's complete row, bit for bit (without
  k_rot, `return_k_rot=False`: each k pool row within the bound of one writer's rotation),
- left every other element of the buffer unchanged.

Examples per run: ROPEPOOL_FUZZ_EXAMPLES (default 150, the CI budget); not derandomized,
so every run tries new inputs. ROPEPOOL_FUZZ_ALIASING=0 carves every view from its own part
of the buffer; ROPEPOOL_FUZZ_ANGLE_LIMIT=<radians> skips the accuracy check where an angle
exceeds it (as in tests/fuzz: for a library without SPEC §1's angle limit).
"""

import math
import os
from datetime import timedelta

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ropepool  # noqa: E402
from rope_testing import raw_bits, to_f64, ulp  # noqa: E402

EXAMPLES = int(os.environ.get("ROPEPOOL_FUZZ_EXAMPLES", "150"))
ALIASING = os.environ.get("ROPEPOOL_FUZZ_ALIASING", "1") != "0"
ANGLE_LIMIT = float(os.environ.get("ROPEPOOL_FUZZ_ANGLE_LIMIT", "inf"))

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),  # a loaded CI machine is slow; a hang is still caught
    derandomize=False,
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,  # a failure prints the @reproduce_failure line
)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
FLOAT_ARGS = ("q", "k", "v", "k_pool", "v_pool")
MAX_FINITE = {"float32": 3.4028234663852886e38, "float16": 65504.0, "bfloat16": 3.3895313892515355e38}


class Arena:
    """One 1-D buffer of the float dtype; views are (offset, shape, strides) in elements."""

    def __init__(self, framework, dtype, size, values):
        self.framework, self.dtype = framework, dtype
        if framework == "torch":
            self.buf = torch.tensor(values[:size], dtype=torch.float32).to(TORCH_DTYPES[dtype])
        else:
            with np.errstate(over="ignore"):  # 1e30 in float16 is inf, on purpose
                self.buf = np.asarray(values[:size], dtype=NUMPY_DTYPES[dtype])

    def view(self, offset, shape, strides):
        if self.framework == "torch":
            return self.buf.as_strided(shape, strides, offset)
        item = self.buf.itemsize
        return np.lib.stride_tricks.as_strided(self.buf[offset:], shape, [s * item for s in strides])

    def bits(self):
        return raw_bits(self.buf)


def element_offsets(offset, shape, strides):
    """Every element offset a view addresses (empty for an empty view)."""
    if 0 in shape:
        return np.zeros(0, dtype=np.int64)
    grids = np.meshgrid(*[np.arange(n) * s for n, s in zip(shape, strides)], indexing="ij")
    return (offset + sum(grids)).reshape(-1)


@st.composite
def calls(draw):
    framework = draw(st.sampled_from(["torch", "numpy"]))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"] if framework == "torch"
                                 else ["float32", "float16"]))
    T = draw(st.integers(0, 5))
    Hq, Hk = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    D = draw(st.sampled_from([2, 4, 6, 8, 8, 8, 16, 16, 16, 3]))
    P = draw(st.integers(0, 6))
    shapes = {"q": [T, Hq, D], "k": [T, Hk, D], "v": [T, Hk, D], "k_pool": [P, Hk, D],
              "v_pool": [P, Hk, D]}
    if draw(st.integers(0, 11)) == 0:  # one dimension off (a shape error)
        name = draw(st.sampled_from(FLOAT_ARGS))
        shapes[name][draw(st.integers(0, 2))] = draw(st.integers(0, 4))
    aliasing = ALIASING and draw(st.booleans())

    arena_size = 4096
    layout = {}
    next_free = 0
    for name in FLOAT_ARGS:
        shape = shapes[name]
        style = draw(st.sampled_from(["contiguous", "contiguous", "padded", "heads_outer",
                                      "broadcast"]))
        if style == "padded":
            pad = draw(st.integers(1, 4))
            strides = [shape[1] * (shape[2] + pad), shape[2] + pad, 1]
        elif style == "heads_outer":  # a transposed [H, T, D] buffer
            strides = [shape[2], shape[2] * max(shape[0], 1), 1]
        elif style == "broadcast" and name in ("q", "k", "v"):  # stride 0 (an expanded input)
            strides = [0, shape[2], 1]
        else:
            strides = [shape[1] * shape[2], shape[2], 1]
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if 0 not in shape else 0
        mode = draw(st.sampled_from(["own", "random", "same"])) if aliasing else "own"
        if mode == "same" and layout:
            offset = layout[draw(st.sampled_from(sorted(layout)))][0]
        elif mode == "random":
            offset = draw(st.integers(0, arena_size - 1))
        else:
            offset = next_free
            next_free += span + draw(st.integers(0, 3))
        offset = max(0, min(offset, arena_size - span))
        layout[name] = (offset, shape, strides)

    values = draw(st.lists(st.floats(-4, 4, width=32), min_size=64, max_size=64))
    values = (values * (arena_size // 64 + 1))[:arena_size]
    if draw(st.integers(0, 5)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            values[draw(st.integers(0, arena_size - 1))] = draw(
                st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -60000.0]))

    index_dtype = draw(st.sampled_from(["int32", "int64"]))
    n_idx = T if draw(st.integers(0, 15)) else draw(st.integers(0, 6))
    # Mostly valid indices; one example in ~6 gets special positions / slots.
    special_pos = st.sampled_from([-1, 2**20 - 1, 2**24, 2**31 - 1])
    positions = draw(st.lists(st.integers(0, 300) if draw(st.integers(0, 5)) else
                              st.one_of(st.integers(0, 300), special_pos),
                              min_size=n_idx, max_size=n_idx))
    bad_slot = st.sampled_from([-2, P, P + 5, 2**31 - 1, -(2**31)])
    slots = draw(st.lists(st.integers(-1, max(P - 1, 0)) if draw(st.integers(0, 5)) else
                          st.one_of(st.integers(-1, max(P - 1, 0)), bad_slot),
                          min_size=n_idx, max_size=n_idx))

    kwargs = {"head_dim": D, "num_qo_heads": Hq, "num_kv_heads": Hk}
    kwargs["rope_base"] = draw(st.sampled_from([10000.0] * 10 + [500000.0, 1.5, 1e-30, 0.0,
                                                                  -1.0, math.nan]))
    if draw(st.integers(0, 2)) == 0:
        kwargs["rotary_dim"] = draw(st.integers(1, D // 2)) * 2 if draw(st.integers(0, 3)) else draw(st.integers(0, D + 2))
    kwargs["interleaved"] = draw(st.booleans())
    R = kwargs.get("rotary_dim") or D
    scaling = draw(st.sampled_from(["none"] * 3 + ["default", "linear", "linear", "inv_freq",
                                                    "inv_freq", "bad"]))
    if scaling == "default":
        kwargs["rope_scaling"] = {"rope_type": "default"}
    elif scaling == "linear":
        kwargs["rope_scaling"] = {"rope_type": "linear",
                                  "factor": draw(st.sampled_from([2.0, 0.5, 8.0, 8.0, 0.0, -1.0]))}
    elif scaling == "inv_freq":
        n = max(R // 2 + draw(st.sampled_from([0, 0, 0, 1])), 0)
        scale = draw(st.sampled_from([1.0, 1.0, 1e-3, 1e25, -1.0]))
        with np.errstate(over="ignore"):
            kwargs["inv_freq"] = (scale * 10000.0 ** (-2.0 * np.arange(n) / max(R, 2))).astype(np.float32)
    elif scaling == "bad":
        kwargs["rope_scaling"] = draw(st.sampled_from([{"rope_type": "nope"}, {"factor": 2.0},
                                                       "linear", {"rope_type": "linear"}]))
    if draw(st.integers(0, 4)) == 0:
        kwargs["attention_scaling"] = draw(st.sampled_from([1.0, 0.5, 2.0, 0.0, -1.0, math.nan]))
    kwargs["inplace"] = draw(st.booleans())
    kwargs["check_slots"] = draw(st.booleans())
    kwargs["return_k_rot"] = draw(st.sampled_from([True, True, True, False]))
    return framework, dtype, arena_size, values, layout, index_dtype, positions, slots, kwargs


def index_array(framework, dtype, values):
    if framework == "torch":
        return torch.tensor(values, dtype=getattr(torch, dtype))
    return np.asarray(values, dtype=dtype)


def check_rotation(name, got, x64, pos, inv_freq, attention, R, interleaved, dtype):
    """got within ulp(exact) + 2**-18 * |attention| * (|a| + |b|) of the float64 rotation."""
    exact, pair = x64.copy(), np.zeros_like(x64)
    theta = pos[:, None] * inv_freq[None, :]  # [T, R/2]
    cos = (np.cos(theta) * attention)[:, None, :]
    sin = (np.sin(theta) * attention)[:, None, :]
    lo, hi = (slice(0, R, 2), slice(1, R, 2)) if interleaved else (slice(0, R // 2), slice(R // 2, R))
    a, b = x64[..., lo], x64[..., hi]
    with np.errstate(all="ignore"):
        exact[..., lo], exact[..., hi] = a * cos - b * sin, a * sin + b * cos
        pair[..., lo] = pair[..., hi] = np.abs(a) + np.abs(b)
        bound = ulp(exact, dtype) + 2.0**-18 * max(1.0, abs(attention)) * pair
        got = to_f64(got)
        ok = np.where(np.isnan(exact), np.isnan(got),
                      np.where(np.isinf(exact), got == exact, np.abs(got - exact) <= bound))
        # an exact value beyond the dtype's range may round to infinity (SPEC §1)
        ok |= np.isinf(got) & (np.sign(got) == np.sign(exact)) & (np.abs(exact) + bound >= MAX_FINITE[dtype])
    if not ok.all():
        t, h, d = np.argwhere(~ok)[0]
        raise AssertionError(f"{name}[{t}, {h}, {d}] = {got[t, h, d]!r}, exact {exact[t, h, d]!r} "
                             f"(bound {bound[t, h, d]:.3g}), position {pos[t]}")


def rotation_holds(*args):
    try:
        check_rotation("k_pool row", *args)
    except AssertionError:
        return False
    return True


@FUZZ_SETTINGS
@given(calls())
def test_fuzz_rope_pool_fused(call):
    framework, dtype, arena_size, values, layout, index_dtype, positions, slots, kwargs = call
    arena = Arena(framework, dtype, arena_size, values)
    views = {name: arena.view(*layout[name]) for name in FLOAT_ARGS}
    pos = index_array(framework, index_dtype, positions)
    slt = index_array(framework, index_dtype, slots)
    before = arena.bits()
    pos_before, slots_before = raw_bits(pos), raw_bits(slt)
    inputs64 = {name: to_f64(views[name]).copy() for name in ("q", "k", "v")}
    v_bits = raw_bits(views["v"])

    try:
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
            views["q"], views["k"], views["v"], pos, slt, views["k_pool"], views["v_pool"], **kwargs)
    except (ValueError, TypeError) as e:
        event(f"rejected: {type(e).__name__}: {str(e)[:40]}")
        np.testing.assert_array_equal(arena.bits(), before, "a rejected call changed the buffer")
        np.testing.assert_array_equal(raw_bits(pos), pos_before)
        np.testing.assert_array_equal(raw_bits(slt), slots_before)
        return

    event("accepted" if kwargs["return_k_rot"] else "accepted, no k_rot")
    assert k_pool is views["k_pool"] and v_pool is views["v_pool"]
    np.testing.assert_array_equal(raw_bits(pos), pos_before)
    np.testing.assert_array_equal(raw_bits(slt), slots_before)
    inplace, with_k_rot = kwargs["inplace"], kwargs["return_k_rot"]
    if not with_k_rot:
        assert k_rot is None
    if inplace:
        assert q_rot is views["q"] and (k_rot is views["k"] or not with_k_rot)

    # SPEC §3: no output shares an element with another argument.
    covered = {name: set(element_offsets(*layout[name]).tolist()) for name in FLOAT_ARGS}
    outputs = ["k_pool", "v_pool"] + (["q"] if inplace else []) + (
        ["k"] if inplace and with_k_rot else [])
    for out in outputs:
        for other in FLOAT_ARGS:
            if other != out and covered[out] & covered[other]:
                raise AssertionError(f"accepted a call where {out} and {other} share memory "
                                     f"(layout {layout})")

    # Which elements of the buffer the call may write.
    T, P = len(positions), layout["k_pool"][1][0]
    writers = {}
    for t, s in enumerate(slots):
        assert s < P, f"accepted slots[{t}] = {s} with a pool of {P}"
        if s >= 0:
            writers.setdefault(s, []).append(t)
    if kwargs["check_slots"]:
        assert all(len(w) == 1 for w in writers.values()), "check_slots accepted a repeated slot"
    may_write = set()
    for name in ("k_pool", "v_pool"):
        offset, shape, strides = layout[name]
        for s in writers:
            may_write |= set(element_offsets(offset + s * strides[0], [1] + shape[1:], strides).tolist())
    if inplace:
        may_write |= covered["q"] | (covered["k"] if with_k_rot else set())
    after = arena.bits()
    changed = np.nonzero(after != before)[0]
    stray = sorted(set(changed.tolist()) - may_write)
    assert not stray, f"elements {stray[:5]} of the buffer changed outside the outputs"

    if T == 0:
        return
    schedule = ropepool.rope_schedule(
        head_dim=kwargs["head_dim"], rope_base=kwargs["rope_base"],
        rotary_dim=kwargs.get("rotary_dim"), rope_scaling=kwargs.get("rope_scaling"),
        inv_freq=kwargs.get("inv_freq"), attention_scaling=kwargs.get("attention_scaling"))
    inv_freq = np.asarray(schedule.inv_freq, dtype=np.float64)
    pos64 = np.asarray(positions, dtype=np.float64)
    angle = np.max(np.abs(pos64[:, None] * inv_freq[None, :])) if inv_freq.size else 0.0
    rotation = (inv_freq, schedule.attention_scaling, schedule.rotary_dim, kwargs["interleaved"],
                dtype)
    if not angle > ANGLE_LIMIT:
        for name, got in (("q_rot", q_rot), ("k_rot", k_rot)):
            if got is not None:
                check_rotation(name, got, inputs64[name[0]], pos64, *rotation)

    k_pool_bits, v_pool_bits = raw_bits(k_pool), raw_bits(v_pool)
    for s, tokens in writers.items():
        if with_k_rot:
            k_rot_bits = raw_bits(k_rot)
            assert any((k_pool_bits[s] == k_rot_bits[t]).all() for t in tokens), \
                f"k_pool row {s} is not a complete k_rot row of a token that writes it"
        elif not angle > ANGLE_LIMIT:  # no k_rot to compare with: the rotation itself
            assert any(rotation_holds(k_pool[s:s + 1], inputs64["k"][t:t + 1], pos64[t:t + 1],
                                      *rotation) for t in tokens), \
                f"k_pool row {s} is not the rotated k row of a token that writes it"
        assert any((v_pool_bits[s] == v_bits[t]).all() for t in tokens), \
            f"v_pool row {s} is not a complete v row of a token that writes it"
