"""Test helpers: random inputs in torch or NumPy, the float64 reference of SPEC §1 and its
accuracy bound, raw-bit views."""

from dataclasses import dataclass, field

import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}

# (significand bits incl. the implicit one, minimum normal exponent) of each dtype.
_FORMAT = {"float32": (24, -126), "float16": (11, -14), "bfloat16": (8, -126)}


def dtype_name(x):
    return str(x.dtype).removeprefix("torch.")


def to_f64(x):
    """The values as read, exactly, in float64 NumPy."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def raw_bits(x):
    """A NumPy copy of the raw bits (integers of the element width): comparisons see
    -0.0 vs 0.0 and NaN payloads, which value comparisons would not."""
    if isinstance(x, torch.Tensor):
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.detach().cpu().contiguous().view(width).numpy().copy()
    x = np.ascontiguousarray(x)
    return x.view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[x.itemsize]).copy()


def ulp(exact, dtype):
    """One unit in the last place of `exact` (float64) in `dtype`, subnormals included."""
    precision, emin = _FORMAT[dtype]
    _, exponent = np.frexp(np.abs(exact))  # |x| = m * 2**exponent, m in [0.5, 1)
    exponent = np.where(exact == 0, emin, exponent)
    return np.ldexp(1.0, np.maximum(exponent - precision, emin - precision + 1))


def rope_exact(x, positions, rope_base):
    """SPEC §1 in float64 for x [T, H, D] (NeoX half-split pairs, R = D).
    Returns the exact rotation and, per element, |a| + |b| of its pair."""
    x = to_f64(x)
    D = x.shape[-1]
    half = D // 2
    inv_freq = float(rope_base) ** (-2.0 * np.arange(half, dtype=np.float64) / D)
    theta = to_f64(positions)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    exact = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    abs_ab = np.abs(a) + np.abs(b)
    return exact, np.concatenate([abs_ab, abs_ab], axis=-1)


def assert_within_bound(out, x, positions, rope_base, what):
    """Every element of `out` within ulp(exact) + 2**-18 * (|a| + |b|) (SPEC §1)."""
    exact, abs_ab = rope_exact(x, positions, rope_base)
    got = to_f64(out)
    assert got.shape == exact.shape, f"{what}: shape {got.shape} != {exact.shape}"
    bound = ulp(exact, dtype_name(out)) + 2.0**-18 * abs_ab
    err = np.abs(got - exact)
    ok = err <= bound  # NaN (an unwritten, poisoned element) fails
    if not ok.all():
        bad = np.argwhere(~ok)
        t, h, d = bad[0]
        raise AssertionError(
            f"{what}: {len(bad)} of {ok.size} elements outside the SPEC bound; first at "
            f"[{t}, {h}, {d}] (position {int(to_f64(positions)[t])}): got {got[t, h, d]!r}, "
            f"exact {exact[t, h, d]!r}, bound {bound[t, h, d]:.3g}"
        )


@dataclass
class Case:
    """One call's arguments, kept with bit snapshots taken before the call."""
    q: object
    k: object
    v: object
    positions: object
    slots: object
    k_pool: object
    v_pool: object
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    rope_base: float
    before: dict = field(default_factory=dict)

    def args(self):
        return (self.q, self.k, self.v, self.positions, self.slots, self.k_pool, self.v_pool)

    def kwargs(self, **extra):
        return dict(head_dim=self.head_dim, num_qo_heads=self.num_qo_heads,
                    num_kv_heads=self.num_kv_heads, rope_base=self.rope_base, **extra)

    ARGS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")

    def snapshot(self):
        self.before = {name: raw_bits(getattr(self, name)) for name in self.ARGS}
        return self

    def copy_from(self, other):
        """Every argument's contents replaced by other's, in place (torch): the buffers a
        captured CUDA graph reads stay the same."""
        for name in self.ARGS:
            getattr(self, name).copy_(getattr(other, name))

    def assert_unchanged(self, *names):
        for name in names or self.before:
            np.testing.assert_array_equal(raw_bits(getattr(self, name)), self.before[name],
                                          err_msg=f"{name} was modified")


def random_values(rng, shape):
    """Normal values spread over a few binades (so relative accuracy is exercised at
    several magnitudes); never zeros."""
    return rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, size=shape))


def random_positions(rng, T, near_limit=True):
    """Half of the positions just below 2**20 (where float32 angles go wrong), the rest
    anywhere in [0, 2**20)."""
    pos = rng.integers(0, 2**20, size=T)
    if near_limit:
        near = rng.random(T) < 0.5
        pos[near] = 2**20 - 1 - rng.integers(0, 4096, size=int(near.sum()))
    return pos


def random_slots(rng, T, P, skip_fraction=0.25):
    """Distinct pool rows, with about `skip_fraction` of the tokens given a negative slot
    (no pool write); negative values other than -1 too."""
    assert T <= P
    slots = rng.permutation(P)[:T].astype(np.int64)
    skip = rng.random(T) < skip_fraction
    slots[skip] = -rng.integers(1, 2**20, size=int(skip.sum()))
    return slots


def make_case(framework, dtype, rng, *, T, Hq, Hk, D, P, device="cpu", index_dtype="int32",
              positions=None, slots=None, rope_base=None):
    """Random inputs in `framework` ("torch" or "numpy")."""
    if rope_base is None:
        rope_base = float(rng.choice([10000.0, 500000.0, 1e6]))
    arrays = {
        "q": random_values(rng, (T, Hq, D)),
        "k": random_values(rng, (T, Hk, D)),
        "v": random_values(rng, (T, Hk, D)),
        "k_pool": random_values(rng, (P, Hk, D)),
        "v_pool": random_values(rng, (P, Hk, D)),
    }
    idx = {
        "positions": random_positions(rng, T) if positions is None else np.asarray(positions),
        "slots": random_slots(rng, T, P) if slots is None else np.asarray(slots),
    }
    if framework == "torch":
        f = {n: torch.from_numpy(a).to(TORCH_DTYPES[dtype]).to(device) for n, a in arrays.items()}
        i = {n: torch.from_numpy(a.astype(index_dtype)).to(device) for n, a in idx.items()}
    else:
        assert device == "cpu"
        f = {n: a.astype(NUMPY_DTYPES[dtype]) for n, a in arrays.items()}
        i = {n: a.astype(index_dtype) for n, a in idx.items()}
    return Case(**f, **i, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=rope_base)


def copy_pools(case):
    """Private copies of the case's pools (torch or NumPy)."""
    if isinstance(case.k_pool, np.ndarray):
        return case.k_pool.copy(), case.v_pool.copy()
    return case.k_pool.clone(), case.v_pool.clone()


def assert_same_bits(got, want, what):
    np.testing.assert_array_equal(raw_bits(got), raw_bits(want), err_msg=what)


def default_call(case, **kw):
    """The default call (fresh outputs) on private copies of the pools: (q_rot, k_rot,
    k_pool, v_pool)."""
    import ropepool

    k_pool, v_pool = copy_pools(case)
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(*case.args()[:5], k_pool, v_pool,
                                                  **case.kwargs(**kw))
    return q_rot, k_rot, k_pool, v_pool


def capture_graph(call, warmups=2):
    """call() run `warmups` times on a side stream, then captured there in a CUDA graph:
    (the graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):  # outside capture
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = call()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def assert_pool_writes(case, k_rot):
    """Rows named by non-negative slots hold k_rot / v bit for bit (slots distinct); every
    other row is bit-identical to before."""
    slots = to_f64(case.slots).astype(np.int64)
    P = case.before["k_pool"].shape[0]
    k_pool, v_pool = raw_bits(case.k_pool), raw_bits(case.v_pool)
    k_rot_bits, v_bits = raw_bits(k_rot), case.before["v"]
    tokens = np.nonzero(slots >= 0)[0]
    rows = slots[tokens]
    assert len(set(rows.tolist())) == len(rows), "assert_pool_writes expects distinct slots"
    np.testing.assert_array_equal(k_pool[rows], k_rot_bits[tokens], err_msg="k_pool rows != k_rot")
    np.testing.assert_array_equal(v_pool[rows], v_bits[tokens], err_msg="v_pool rows != v")
    untouched = np.setdiff1d(np.arange(P), rows)
    np.testing.assert_array_equal(k_pool[untouched], case.before["k_pool"][untouched],
                                  err_msg="k_pool row without a token changed")
    np.testing.assert_array_equal(v_pool[untouched], case.before["v_pool"][untouched],
                                  err_msg="v_pool row without a token changed")
