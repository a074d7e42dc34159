"""The MLX front end (SPEC §9): ropepool.mlx.rope_pool_fused as an MLX primitive.

Laziness, mx.compile, donation against copies, the §2 messages, every element equal to the
torch CPU path on fresh random inputs, gradient and slot errors, and the DLPack path's
refusal of MLX arrays.
"""

import re

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed")

import ropepool  # noqa: E402

try:
    import ropepool.mlx as rmlx
except ImportError as e:  # mlx present but this ropepool built without its MLX front end
    pytest.skip(f"ropepool.mlx unavailable: {e}", allow_module_level=True)

from rope_testing import random_positions, random_slots, random_values  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
BITS = {torch.float32: (torch.int32, mx.int32), torch.float16: (torch.int16, mx.int16),
        torch.bfloat16: (torch.int16, mx.int16), torch.int32: (torch.int32, mx.int32),
        torch.int64: (torch.int64, mx.int64), torch.float8_e4m3fn: (torch.uint8, mx.uint8)}


def to_mx(t: torch.Tensor) -> "mx.array":
    """The same bits as an mx.array (through integer views: NumPy has no bfloat16; MLX keeps
    float8 e4m3 in uint8 arrays, as mx.to_fp8 makes them)."""
    it, imx = BITS[t.dtype]
    a = mx.array(t.contiguous().view(it).numpy())
    return a if t.dtype in (torch.int32, torch.int64, torch.float8_e4m3fn) else a.view(
        {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[t.dtype])


def from_mx(a: "mx.array", dtype: torch.dtype) -> torch.Tensor:
    """The bits of an mx.array as a torch tensor of `dtype` (evaluates it)."""
    return torch.from_numpy(bits(a)).view(dtype)


def bits(a: "mx.array") -> np.ndarray:
    """The raw bits of an mx.array (evaluates it)."""
    return np.array(a.view({1: mx.uint8, 2: mx.int16, 4: mx.int32, 8: mx.int64}[a.itemsize]))


def torch_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype][0]).numpy()


def node_outputs(a: "mx.array", label: str, tmp_path) -> int:
    """How many arrays the one node called `label` in a's graph feeds (mx.export_to_dot draws
    every output of a node as an array fed by it)."""
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), a)
    graph = dot.read_text()
    assert graph.count(label) == 1, graph
    node = re.search(rf"(\w+) \[label =\s*\"{label}\"", graph)
    assert node, graph
    return len(re.findall(rf"^\s*{node.group(1)} -> ", graph, re.M))


def address(a: "mx.array") -> int:
    """Where an evaluated array's data lives (the NumPy view is dropped at once, so it holds
    no reference that would stop a donation)."""
    mx.eval(a)
    view = np.asarray(a)
    return view.__array_interface__["data"][0]


KW = dict(head_dim=16, num_qo_heads=4, num_kv_heads=2, rope_base=10000.0)


def small_case(rng, T=5, P=9, dtype="float32"):
    tdt = TORCH_DTYPES[dtype]
    q = torch.from_numpy(random_values(rng, (T, 4, 16))).to(tdt)
    k = torch.from_numpy(random_values(rng, (T, 2, 16))).to(tdt)
    v = torch.from_numpy(random_values(rng, (T, 2, 16))).to(tdt)
    pos = torch.from_numpy(random_positions(rng, T)).to(torch.int32)
    slots = torch.from_numpy(random_slots(rng, T, P)).to(torch.int32)
    slots[0] = 3  # at least one pool write
    kp = torch.from_numpy(random_values(rng, (P, 2, 16))).to(tdt)
    vp = torch.from_numpy(random_values(rng, (P, 2, 16))).to(tdt)
    return q, k, v, pos, slots, kp, vp


def torch_result(args, **kw):
    q, k, v, pos, slots, kp, vp = (a.clone() for a in args)
    return ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, **kw)


def assert_same_bits(got, want, names=("q_rot", "k_rot", "k_pool", "v_pool")):
    """Every element of each MLX result has the bits of the torch front end's."""
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert g.shape == tuple(w.shape), name
        np.testing.assert_array_equal(bits(g), torch_bits(w), err_msg=name)


def mlx_message(torch_message: str) -> str:
    """The torch front end's message with shapes as MLX prints them ("(2, 8, 128)")."""
    def as_tuple(m):
        dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
        return "(" + ", ".join(dims) + (",)" if len(dims) == 1 else ")")
    return re.sub(r"torch\.Size\(\[([^\]]*)\]\)", as_tuple, torch_message)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("variant", [
    {},
    {"interleaved": True},
    {"rotary_dim": 8},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"inplace": True},
    {"check_slots": True},
], ids=["default", "interleaved", "rotary_dim", "llama3", "inplace", "check_slots"])
def test_equals_torch_path(rng, dtype, variant):
    """Every element (bits) of the four results equals the torch CPU path's."""
    T, P = 37, 64
    tdt = TORCH_DTYPES[dtype]
    q = torch.from_numpy(random_values(rng, (T, 4, 16))).to(tdt)
    k = torch.from_numpy(random_values(rng, (T, 2, 16))).to(tdt)
    v = torch.from_numpy(random_values(rng, (T, 2, 16))).to(tdt)
    pos = torch.from_numpy(random_positions(rng, T)).to(torch.int64)
    slots = torch.from_numpy(random_slots(rng, T, P)).to(torch.int64)
    kp = torch.from_numpy(random_values(rng, (P, 2, 16))).to(tdt)
    vp = torch.from_numpy(random_values(rng, (P, 2, 16))).to(tdt)
    args = (q, k, v, pos, slots, kp, vp)
    want = torch_result(args, **KW, **variant)
    got = rmlx.rope_pool_fused(*(to_mx(a) for a in args), **KW, **variant)
    assert all(isinstance(g, mx.array) for g in got)
    assert got[0].dtype == MX_DTYPES[dtype] and got[2].shape == (P, 2, 16)
    assert_same_bits(got, want)


def test_strided_views_and_a_layer_of_a_stacked_cache(rng):
    """q/k/v as column slices of one fused projection, transposed inputs (last dimension
    not contiguous), and pools that are layers of a [L, P, H, D] cache: same bits as torch."""
    T, P = 11, 16
    fused = torch.from_numpy(random_values(rng, (T, (4 + 2 + 2) * 16))).float()
    q = fused[:, :64].reshape(T, 4, 16)
    k = fused[:, 64:96].reshape(T, 2, 16)
    v = fused[:, 96:].reshape(T, 2, 16)
    pos = torch.from_numpy(random_positions(rng, T)).to(torch.int32)
    slots = torch.from_numpy(random_slots(rng, T, P)).to(torch.int32)
    cache = torch.from_numpy(random_values(rng, (3, 2, P, 2, 16))).float()
    want = torch_result((q, k, v, pos, slots, cache[1, 0], cache[1, 1]), **KW)

    mfused = to_mx(fused)
    mq = mfused[:, :64].reshape(T, 4, 16)
    mk = mfused[:, 64:96].reshape(T, 2, 16)
    mv = to_mx(v.transpose(1, 2).contiguous()).transpose(0, 2, 1)  # last stride != 1
    mcache = to_mx(cache)
    got = rmlx.rope_pool_fused(mq, mk, mv, to_mx(pos), to_mx(slots), mcache[1, 0], mcache[1, 1],
                               **KW)
    assert_same_bits(got, want)
    np.testing.assert_array_equal(bits(mcache), torch_bits(cache))  # the cache kept its values


def test_lazy_and_old_values_kept(rng):
    """The call is a graph node: a lazy mx.sum(k_pool) taken before it keeps the old value,
    nothing runs until mx.eval (an out-of-range slot raises only there)."""
    args = small_case(rng)
    q, k, v, pos, slots, kp, vp = (to_mx(a) for a in args)
    old_sum = mx.sum(kp.astype(mx.float32))  # lazy, reads k_pool
    old_bits = bits(kp)
    out = rmlx.rope_pool_fused(q, k, v, pos, slots, kp, vp, **KW)
    mx.eval(*out)
    assert not np.array_equal(bits(out[2]), old_bits)  # the new pool has the writes
    np.testing.assert_array_equal(bits(kp), old_bits)  # the old array its old values
    # (the same reduction over a fresh copy of the old values: the same order, exact)
    assert float(old_sum) == float(mx.sum(mx.array(np.array(kp)).astype(mx.float32)))
    assert float(old_sum) != float(mx.sum(out[2].astype(mx.float32)))
    assert_same_bits(out, torch_result(args, **KW))

    bad = mx.array(np.array([3, 40, -1, 0, 1], dtype=np.int32))
    lazy = rmlx.rope_pool_fused(q, k, v, pos, bad, kp, vp, **KW)  # no error yet
    with pytest.raises((RuntimeError, ValueError),
                       match=r"^rope_pool_fused: slots\[1\] = 40 is out of range for a pool "
                             r"of 9 slots$"):
        mx.eval(*lazy)
    np.testing.assert_array_equal(bits(kp), old_bits)  # nothing written


def test_out_of_range_slot_under_check_slots_and_repeats(rng):
    args = small_case(rng)
    q, k, v, pos, _, kp, vp = (to_mx(a) for a in args)
    old = bits(kp), bits(vp)
    rep = mx.array(np.array([3, 4, -1, 3, 1], dtype=np.int64))
    out = rmlx.rope_pool_fused(q, k, v, pos, rep, kp, vp, **KW, check_slots=True)
    with pytest.raises((RuntimeError, ValueError), match=r"slots\[3\] = 3 repeats slots\[0\]"):
        mx.eval(*out)
    np.testing.assert_array_equal(bits(kp), old[0])
    np.testing.assert_array_equal(bits(vp), old[1])


def test_donation_without_other_references(rng):
    """Pools nothing else references give their buffers to the results (no copy); with a
    reference held, the results are copies and the old arrays keep their values."""
    args = small_case(rng, T=4, P=4096)
    q, k, v, pos, slots, kp, vp = (to_mx(a) for a in args)
    mx.eval(q, k, v, pos, slots, kp, vp)
    kp_at, vp_at = address(kp), address(vp)
    _, _, kp2, vp2 = rmlx.rope_pool_fused(q, k, v, pos, slots, kp, vp, **KW)
    del kp, vp  # the caller rebinds its cache: no other reference at evaluation time
    mx.eval(kp2, vp2)
    assert (address(kp2), address(vp2)) == (kp_at, vp_at)
    want = torch_result(args, **KW)
    np.testing.assert_array_equal(bits(kp2), torch_bits(want[2]))
    np.testing.assert_array_equal(bits(vp2), torch_bits(want[3]))

    # inplace=True: q_rot/k_rot take over q's and k's buffers the same way
    q_at, k_at = address(q), address(k)
    q_rot, k_rot, _, _ = rmlx.rope_pool_fused(q, k, v, pos, slots, kp2, vp2, **KW, inplace=True)
    del q, k
    mx.eval(q_rot, k_rot)
    assert (address(q_rot), address(k_rot)) == (q_at, k_at)
    np.testing.assert_array_equal(bits(q_rot), torch_bits(want[0]))


def test_reference_held_means_copy(rng):
    args = small_case(rng, T=4, P=4096)
    q, k, v, pos, slots, kp, vp = (to_mx(a) for a in args)
    mx.eval(q, k, v, pos, slots, kp, vp)
    old = bits(kp), bits(vp)
    out = rmlx.rope_pool_fused(q, k, v, pos, slots, kp, vp, **KW, inplace=True)
    mx.eval(*out)
    assert address(out[2]) != address(kp) and address(out[3]) != address(vp)
    assert address(out[0]) != address(q)
    np.testing.assert_array_equal(bits(kp), old[0])
    np.testing.assert_array_equal(bits(vp), old[1])
    np.testing.assert_array_equal(bits(q), torch_bits(args[0]))
    assert_same_bits(out, torch_result(args, **KW))


def test_mx_compile(rng):
    """Under mx.compile: the same bits as eager (and as torch), a decode-like loop that
    feeds the pools back in, and slot errors at evaluation."""
    args = small_case(rng, T=5, P=32)
    mq, mk, mv, mpos, mslots, mkp, mvp = (to_mx(a) for a in args)

    @mx.compile
    def step(q, k, v, pos, slots, kp, vp):
        q_rot, k_rot, kp, vp = rmlx.rope_pool_fused(q, k, v, pos, slots, kp, vp, **KW)
        return q_rot * 2, k_rot, kp, vp

    got = step(mq, mk, mv, mpos, mslots, mkp, mvp)
    want = torch_result(args, **KW)
    np.testing.assert_array_equal(np.array(got[0].astype(mx.float32)),
                                  (want[0] * 2).float().numpy())
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(bits(g), torch_bits(w))
    # a second step on the returned pools, other slots: the compiled graph is reused
    slots2 = torch.tensor([7, 8, -1, 9, 10], dtype=torch.int32)
    got2 = step(mq, mk, mv, mpos, to_mx(slots2), got[2], got[3])
    want2 = torch_result((args[0], args[1], args[2], args[3], slots2, want[2], want[3]), **KW)
    for g, w in zip(got2[2:], want2[2:]):
        np.testing.assert_array_equal(bits(g), torch_bits(w))
    bad = step(mq, mk, mv, mpos, mx.array(np.array([0, 1, 2, 3, 32], np.int32)), mkp, mvp)
    with pytest.raises((RuntimeError, ValueError), match=r"slots\[4\] = 32 is out of range"):
        mx.eval(*bad)


# ---- return_k_rot=False (SPEC §4): no k_rot output, the pools as with it -------------------

def skip_and_write_slots(rng, T, P):
    """Distinct pool rows, about a quarter of the tokens (the first always) given a negative
    slot (no pool write); the second token always writes."""
    slots = rng.permutation(P)[:T].astype(np.int64)
    skip = rng.random(T) < 0.25
    skip[0], skip[1] = True, False
    return torch.from_numpy(np.where(skip, -rng.integers(1, 2**20, size=T), slots))


def no_k_rot_case(rng, dtype, layout):
    T, P = int(rng.integers(2, 40)), 64
    tdt = TORCH_DTYPES[dtype]
    q = torch.from_numpy(random_values(rng, (T, 4, 16))).to(tdt)
    k = torch.from_numpy(random_values(rng, (T, 2, 16))).to(tdt)
    v = torch.from_numpy(random_values(rng, (T, 2, 16))).to(tdt)
    pos = torch.from_numpy(random_positions(rng, T)).to(torch.int32)
    slots = skip_and_write_slots(rng, T, P).to(torch.int32)
    pool = (P, 2, 16) if layout is None else (8, 8, 2, 16)  # NHD: 8 pages of 8 rows
    kp = torch.from_numpy(random_values(rng, pool)).to(tdt)
    vp = torch.from_numpy(random_values(rng, pool)).to(tdt)
    return q, k, v, pos, slots, kp, vp


@pytest.mark.parametrize("inplace", [False, True], ids=["fresh", "inplace"])
@pytest.mark.parametrize("layout", [None, "NHD"], ids=["3d_pool", "NHD_pool"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_k_rot_equals_with_it(rng, dtype, layout, inplace):
    """k_rot is None; q_rot and every element of both pools have the bits of the same call
    with k_rot. Each call gets arrays nothing else references (donated pools, and q and k
    with inplace) except k, which keeps its values."""
    args = no_k_rot_case(rng, dtype, layout)
    kw = dict(KW, kv_layout=layout, inplace=inplace)
    want = rmlx.rope_pool_fused(*(to_mx(a) for a in args), **kw)
    mx.eval(*want)
    mk = to_mx(args[1])
    mx.eval(mk)
    k_at = address(mk.view({2: mx.int16, 4: mx.int32}[mk.itemsize]))  # (no bfloat16 in NumPy)
    got = rmlx.rope_pool_fused(*(to_mx(a) if i != 1 else mk for i, a in enumerate(args)), **kw,
                               return_k_rot=False)
    assert len(got) == 4 and got[1] is None
    mx.eval(got[0], got[2], got[3])
    for name, g, w in zip(("q_rot", "k_pool", "v_pool"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)
    assert not np.array_equal(bits(got[2]), torch_bits(args[5]))  # (the pools were written)
    np.testing.assert_array_equal(bits(mk), torch_bits(args[1]), err_msg="k changed")
    assert address(mk.view({2: mx.int16, 4: mx.int32}[mk.itemsize])) == k_at


def test_without_k_rot_donation_and_outputs(rng, tmp_path):
    """The primitive has three outputs (q_rot and the pools: no k_rot array); with
    inplace=True q_rot takes over q's buffer and the pools theirs, k is never given away."""
    args = no_k_rot_case(rng, "float16", None)
    want = rmlx.rope_pool_fused(*(to_mx(a) for a in args), **KW, inplace=True)
    mx.eval(*want)
    q, k, v, pos, slots, kp, vp = (to_mx(a) for a in args)
    mx.eval(q, k, v, pos, slots, kp, vp)
    at = address(q), address(kp), address(vp)
    q_rot, none, kp2, vp2 = rmlx.rope_pool_fused(q, k, v, pos, slots, kp, vp, **KW, inplace=True,
                                                 return_k_rot=False)
    assert none is None
    assert node_outputs(q_rot, "RopePoolFused", tmp_path) == 3  # three outputs, not four
    del q, kp, vp
    mx.eval(q_rot, kp2, vp2)
    assert (address(q_rot), address(kp2), address(vp2)) == at
    for name, g, w in zip(("q_rot", "k_pool", "v_pool"), (q_rot, kp2, vp2), (want[0], *want[2:])):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)
    np.testing.assert_array_equal(bits(k), torch_bits(args[1]), err_msg="k changed")


def test_without_k_rot_under_mx_compile(rng):
    """mx.compile traces the three-output primitive: the same bits as eager."""
    args = no_k_rot_case(rng, "float32", "NHD")

    @mx.compile
    def step(q, k, v, pos, slots, kp, vp):
        q_rot, none, kp, vp = rmlx.rope_pool_fused(q, k, v, pos, slots, kp, vp, **KW,
                                                   kv_layout="NHD", return_k_rot=False)
        assert none is None
        return q_rot * 2, kp, vp

    got = step(*(to_mx(a) for a in args))
    want = rmlx.rope_pool_fused(*(to_mx(a) for a in args), **KW, kv_layout="NHD")
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0] * 2))
    np.testing.assert_array_equal(bits(got[1]), bits(want[2]))
    np.testing.assert_array_equal(bits(got[2]), bits(want[3]))


def test_without_k_rot_validates_k():
    """k is still validated (it is read), with the same messages; MLX has no k_out keyword,
    so nothing conflicts with return_k_rot=False."""
    for i, bad in ((1, mx.zeros((2, 3, 16))), (1, mx.zeros((2, 2, 16), dtype=mx.float16))):
        a = _args()
        a[i] = bad
        with pytest.raises(ValueError) as want:
            rmlx.rope_pool_fused(*a, **KW)
        with pytest.raises(ValueError) as got:
            rmlx.rope_pool_fused(*a, **KW, return_k_rot=False)
        assert str(got.value) == str(want.value)


def test_gradients_raise():
    q = mx.ones((1, 4, 16))
    k = mx.ones((1, 2, 16))
    pos = mx.array([3], dtype=mx.int32)
    kp = mx.zeros((4, 2, 16))

    def f(x):
        return rmlx.rope_pool_fused(x, k, k, pos, pos, kp, kp, **KW)[0].sum()

    with pytest.raises(NotImplementedError, match=r"vjp \(gradient\) is not implemented"):
        mx.grad(f)(q)
    with pytest.raises(NotImplementedError, match=r"jvp .* is not implemented"):
        mx.jvp(lambda x: rmlx.rope_pool_fused(x, k, k, pos, pos, kp, kp, **KW)[:1], [q], [q])
    with pytest.raises(NotImplementedError, match=r"vmap is not implemented"):
        mx.vmap(lambda x: rmlx.rope_pool_fused(x, k, k, pos, pos, kp, kp, **KW)[0])(q[None])


def _args(T=2, Hq=4, Hk=2, D=16, P=8, dtype=mx.float32, idx=mx.int32):
    return [mx.zeros((T, Hq, D), dtype), mx.zeros((T, Hk, D), dtype), mx.zeros((T, Hk, D), dtype),
            mx.zeros((T,), idx), mx.zeros((T,), idx), mx.zeros((P, Hk, D), dtype),
            mx.zeros((P, Hk, D), dtype)]


def _with(i, x):
    a = _args()
    a[i] = x
    return a


@pytest.mark.parametrize("args, message", [
    (_with(0, mx.zeros((2, 64))), "rope_pool_fused expects q/k/v to be 3-D"),
    (_with(3, mx.zeros((2, 1), mx.int32)), "rope_pool_fused expects positions/slots to be 1-D"),
    (_with(5, mx.zeros((3, 8, 2, 16))), "rope_pool_fused expects pool tensors to be 3-D"),
    (_with(0, mx.zeros((2, 3, 16))),
     "q shape must be [num_tokens, num_qo_heads, head_dim], got (2, 3, 16)"),
    (_with(1, mx.zeros((3, 2, 16))),
     "k shape must be [num_tokens, num_kv_heads, head_dim], got (3, 2, 16)"),
    (_with(2, mx.zeros((2, 2, 8))), "v shape must match k shape, got (2, 2, 8) vs (2, 2, 16)"),
    (_with(4, mx.zeros((3,), mx.int32)), "positions/slots must have one entry per token"),
    (_with(5, mx.zeros((8, 1, 32))), "k_pool has incompatible shape (8, 1, 32)"),
    (_with(6, mx.zeros((9, 2, 16))),
     "v_pool shape must match k_pool shape, got (9, 2, 16) vs (8, 2, 16)"),
    (_with(1, mx.zeros((2, 2, 16), mx.float16)), "q/k/v dtypes must match"),
    (_with(6, mx.zeros((8, 2, 16), mx.bfloat16)), "pool dtypes must match q/k/v dtype"),
    (_with(4, mx.zeros((2,), mx.uint32)), "rope_pool_fused: slots must be int32 or int64, got uint32"),
    (_args(dtype=mx.float64) if hasattr(mx, "float64") else _args(),
     "rope_pool_fused: unsupported dtype float64 for q/k/v/pools; expected float32, float16 "
     "or bfloat16"),
], ids=lambda x: None if isinstance(x, list) else x[:40])
def test_messages_at_call_time(args, message):
    """SPEC §2's exact messages, raised by the call itself (not at evaluation), with shapes
    as MLX prints them."""
    with pytest.raises(ValueError) as e:
        rmlx.rope_pool_fused(*args, **KW)
    assert str(e.value) == message


def test_keyword_messages_are_the_torch_paths():
    """Keyword rules live in one place (ropepool._op._fused_scalars and the C++ schedule)."""
    t_args = [torch.zeros(2, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16),
              torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
              torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)]
    for bad in ({"rope_base": -1.0}, {"rotary_dim": 0}, {"rotary_dim": 7},
                {"rope_scaling": {"rope_type": "linear"}}, {"seq_len": 5},
                {"head_dim": True}):
        kw = {**KW, **bad}
        with pytest.raises((ValueError, TypeError)) as want:
            ropepool.rope_pool_fused(*t_args, **kw)
        with pytest.raises(type(want.value)) as got:
            rmlx.rope_pool_fused(*_args(), **kw)
        assert str(got.value) == str(want.value), bad


def test_non_arrays_and_gpu_stream_are_refused():
    a = _args()
    a[2] = np.zeros((2, 2, 16), np.float32)
    with pytest.raises(TypeError, match=r"^rope_pool_fused: v must be an mlx.core.array, got ndarray$"):
        rmlx.rope_pool_fused(*a, **KW)
    with pytest.raises(ValueError, match=r"runs on MLX's CPU stream only.*stream=mx.cpu"):
        rmlx.rope_pool_fused(*_args(), **KW, stream=mx.gpu)
    out = rmlx.rope_pool_fused(*_args(), **KW, stream=mx.cpu)
    mx.eval(*out)


def test_dlpack_path_refuses_mlx_arrays():
    """ropepool.rope_pool_fused would write into MLX's immutable buffers: refused, naming
    the MLX front end, before anything is converted."""
    with pytest.raises(TypeError, match=r"^rope_pool_fused: q is an mlx.core.array, which "
                                        r"ropepool.rope_pool_fused cannot write \(it is "
                                        r"immutable\); use ropepool.mlx.rope_pool_fused"):
        ropepool.rope_pool_fused(*_args(), **KW)
    mixed = [torch.zeros(2, 4, 16)] + _args()[1:]
    with pytest.raises(TypeError, match=r"k is an mlx.core.array.*ropepool.mlx.rope_pool_fused"):
        ropepool.rope_pool_fused(*mixed, **KW)


def test_empty_call(rng):
    """T = 0: empty q_rot/k_rot, the pools unchanged."""
    args = _args(T=0)
    args[5] = mx.array(random_values(rng, (8, 2, 16)).astype(np.float32))
    old = bits(args[5])
    out = rmlx.rope_pool_fused(*args, **KW)
    mx.eval(*out)
    assert out[0].shape == (0, 4, 16) and out[1].shape == (0, 2, 16)
    np.testing.assert_array_equal(bits(out[2]), old)


def test_validate_rope_pool_refuses_mlx_arrays():
    with pytest.raises(TypeError, match=r"^rope_pool_fused: q is an mlx.core.array, which "
                                        r"ropepool.rope_pool_fused cannot write"):
        ropepool.validate_rope_pool(*_args(), **KW)
