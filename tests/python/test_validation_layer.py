"""One validation layer (issue #10) and the input defects of issue #9, from Python.

- tests/data/rope_scaling_cases.json: the same messages as the C++ test reads from it;
- a table of invalid calls, each rejected identically by ``validate_rope_pool`` and the op,
  with nothing written, on the CPU and (``gpu``) on CUDA;
- overlapping arguments (SPEC §3), the angle limit (SPEC §1), the precomputed schedule,
  silent defaults (SPEC §4) and messages that name what was received.
"""

import json
import math
import pathlib

import numpy as np
import pytest
import torch

import ropepool

T, HQ, HK, D, P = 5, 4, 2, 16, 12
OVERLAP = ("overlap in memory (they share at least one byte); the result would depend on "
           "the order of reads and writes")
CASES = pathlib.Path(__file__).resolve().parents[1] / "data" / "rope_scaling_cases.json"


# ---- helpers -------------------------------------------------------------------------------

def make_args(framework, device, rng, dtype="float32", index_dtype="int32", T=T, Hq=HQ,
              Hk=HK, D=D, P=P, positions=None):
    def arr(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        if framework == "torch":
            return torch.from_numpy(x).to(getattr(torch, dtype)).to(device)
        return x.astype(dtype)

    pos = np.arange(T) * 7 + 3 if positions is None else np.asarray(positions)
    slots = (np.arange(T) * 5) % P
    if framework == "torch":
        idx = lambda a: torch.from_numpy(np.asarray(a).astype(index_dtype)).to(device)
    else:
        idx = lambda a: np.asarray(a).astype(index_dtype)
    args = dict(q=arr((T, Hq, D)), k=arr((T, Hk, D)), v=arr((T, Hk, D)), positions=idx(pos),
                slots=idx(slots), k_pool=arr((P, Hk, D)), v_pool=arr((P, Hk, D)))
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=10000.0)
    return args, kw


ORDER = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")


def snapshot(args):
    out = []
    for name in ORDER:
        x = args[name]
        out.append(x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x.copy())
    return out


def unchanged(args, before):
    for name, b in zip(ORDER, before):
        x = args[name]
        a = x.detach().cpu() if isinstance(x, torch.Tensor) else x
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                               b.view(torch.uint8) if b.dtype != torch.bool else b), name
        else:
            assert a.tobytes() == b.tobytes(), name


def both_reject(args, kw, message=None, startswith=None, exc=ValueError):
    """validate_rope_pool and the op raise the same error (exact `message`, or starting with
    `startswith`), and nothing is written. Returns the op's exception."""
    before = snapshot(args)
    with pytest.raises(exc) as checked:
        ropepool.validate_rope_pool(*(args[n] for n in ORDER), **kw)
    unchanged(args, before)
    with pytest.raises(exc) as called:
        ropepool.rope_pool_fused(*(args[n] for n in ORDER), **kw)
    if args["q"].__class__ is torch.Tensor and args["q"].is_cuda:
        torch.cuda.synchronize()
    unchanged(args, before)
    assert str(checked.value) == str(called.value)
    assert getattr(checked.value, "__notes__", None) == getattr(called.value, "__notes__", None)
    if message is not None:
        assert str(called.value) == message
    if startswith is not None:
        assert str(called.value).startswith(startswith), str(called.value)
    return called.value


def both_accept(args, kw):
    ropepool.validate_rope_pool(*(args[n] for n in ORDER), **kw)
    return ropepool.rope_pool_fused(*(args[n] for n in ORDER), **kw)


@pytest.fixture(params=["torch", "numpy"])
def framework(request, device):
    if request.param == "numpy" and device != "cpu":
        pytest.skip("NumPy arrays live on the CPU")
    return request.param


# ---- rope_scaling: one data file, C++ and Python -----------------------------------------

def _cases():
    return json.loads(CASES.read_text())["cases"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: (c["message"] or "accepted")[17:60])
def test_rope_scaling_cases_same_message_as_cpp(case):
    kw = dict(head_dim=128, rope_base=10000.0)
    kw.update(case["keywords"])
    if case["message"] is None:
        ropepool.rope_schedule(rope_scaling=case["rope_scaling"], **kw)
        return
    with pytest.raises(ValueError) as e:
        ropepool.rope_schedule(rope_scaling=case["rope_scaling"], **kw)
    assert str(e.value) == case["message"]


def test_rope_scaling_python_only_types():
    """What only Python can tell apart: bools are not numbers, numpy scalars are."""
    with pytest.raises(ValueError, match=r"rope_scaling\['factor'\] must be a number, got a bool"):
        ropepool.rope_schedule(head_dim=8, rope_base=1e4, rope_scaling={"type": "linear",
                                                                        "factor": np.bool_(True)})
    s = ropepool.rope_schedule(head_dim=8, rope_base=1e4,
                               rope_scaling={"type": "linear", "factor": np.float32(2.0)})
    assert s.inv_freq[0] == 0.5
    with pytest.raises(ValueError, match=r"must be a number, got a dict"):
        ropepool.rope_schedule(head_dim=8, rope_base=1e4,
                               rope_scaling={"type": "linear", "factor": {}})
    with pytest.raises(TypeError, match="rope_scaling keys must be strings"):
        ropepool.rope_schedule(head_dim=8, rope_base=1e4, rope_scaling={1: 2.0})


# ---- the table: validate_rope_pool rejects exactly what the op rejects ---------------------

def _q_into_k_pool(a, kw):
    a["q"] = a["k_pool"].reshape(-1, D)[:T * HQ].reshape(T, HQ, D)


TABLE = [
    ("qkv_rank", lambda a, kw: a.update(q=a["q"][:, 0]), "rope_pool_fused expects q/k/v to be 3-D"),
    ("k_heads", lambda a, kw: kw.update(num_kv_heads=3),
     "k shape must be [num_tokens, num_kv_heads, head_dim], got {k_shape}"),
    ("positions_length", lambda a, kw: a.update(positions=a["positions"][:-1]),
     "positions/slots must have one entry per token"),
    ("rope_base_zero", lambda a, kw: kw.update(rope_base=0.0), None),
    ("rotary_dim_too_big", lambda a, kw: kw.update(rotary_dim=D + 2),
     f"rope_pool_fused: rotary_dim must be even and in (0, head_dim = {D}], got {D + 2}"),
    ("rotary_dim_zero", lambda a, kw: kw.update(rotary_dim=0),
     f"rope_pool_fused: rotary_dim must be even and in (0, head_dim = {D}], got 0"),
    ("bad_rope_scaling", lambda a, kw: kw.update(rope_scaling={"type": "linear", "factor": "2"}),
     "rope_pool_fused: rope_scaling['factor'] must be a number, got a string ('2')"),
    ("schedule_for_other_head_dim",
     lambda a, kw: kw.update(schedule=ropepool.rope_schedule(head_dim=2 * D, rope_base=1e4)),
     f"rope_pool_fused: the precomputed schedule is for rotary_dim {2 * D} with {D} "
     f"frequencies, but this call rotates {D} elements"),
    ("schedule_other_base",
     lambda a, kw: kw.update(schedule=ropepool.rope_schedule(head_dim=D, rope_base=5e5)),
     "rope_pool_fused: rope_base = 10000.0 disagrees with the schedule, made for "
     "rope_base = 500000.0"),
    ("k_pool_is_v_pool", lambda a, kw: a.update(v_pool=a["k_pool"]),
     f"rope_pool_fused: k_pool and v_pool {OVERLAP}"),
    ("q_into_k_pool", _q_into_k_pool, f"rope_pool_fused: k_pool and q {OVERLAP}"),
    ("inplace_v_is_k", lambda a, kw: (a.update(v=a["k"]), kw.update(inplace=True)),
     f"rope_pool_fused: k (rotated in place) and v {OVERLAP}"),
    ("huge_inv_freq",
     lambda a, kw: kw.update(inv_freq=np.array([1e25] + [1.0] * (D // 2 - 1), np.float32)),
     None),
    ("tiny_rope_base", lambda a, kw: kw.update(rope_base=1e-30), None),
]


@pytest.mark.parametrize("name,mutate,message", TABLE, ids=[t[0] for t in TABLE])
def test_rejection_table(name, mutate, message, framework, kernel_device, rng):
    args, kw = make_args(framework, kernel_device, rng)
    if framework == "torch" and "inv_freq" in name:
        pass  # inv_freq stays a NumPy (host) array: the CPU schedule table of SPEC §4
    k_shape = str(args["k"].shape)
    mutate(args, kw)
    if message is not None:
        message = message.format(k_shape=k_shape)
    both_reject(args, kw, message=message, startswith="" if message else None)


# ---- B1: overlapping arguments (SPEC §3) ------------------------------------------------

def _strided(x, shape, strides, offset):
    """A view of x's storage (element strides), in x's framework."""
    if isinstance(x, torch.Tensor):
        return torch.as_strided(x, shape, strides, x.storage_offset() + offset)
    es = x.itemsize
    base = x.reshape(-1)
    return np.lib.stride_tricks.as_strided(base[offset:], shape, tuple(s * es for s in strides))


def test_overlap_inplace_q_and_k_share(framework, kernel_device, rng):
    args, kw = make_args(framework, kernel_device, rng)
    # k = q's first Hk heads
    args["k"] = _strided(args["q"], (T, HK, D), (HQ * D, D, 1), 0)
    both_reject(args, dict(kw, inplace=True),
                message=f"rope_pool_fused: q (rotated in place) and k {OVERLAP}")


def test_overlap_pools_one_row_apart(framework, kernel_device, rng):
    args, kw = make_args(framework, kernel_device, rng, P=P + 1)
    buf = args["k_pool"]
    args["k_pool"], args["v_pool"] = buf[:P], buf[1:]
    both_reject(args, kw, message=f"rope_pool_fused: k_pool and v_pool {OVERLAP}")


def test_overlap_output_and_index(framework, kernel_device, rng):
    """positions stored inside v_pool's memory (an int32 view of the pool's bytes)."""
    args, kw = make_args(framework, kernel_device, rng)
    pool = args["v_pool"]
    if framework == "torch":
        ints = pool.view(torch.int32).reshape(-1)
        ints[:T] = torch.arange(T, dtype=torch.int32, device=pool.device)
    else:
        ints = pool.view(np.int32).reshape(-1)
        ints[:T] = np.arange(T, dtype=np.int32)
    args["positions"] = ints[:T]
    both_reject(args, kw, message=f"rope_pool_fused: v_pool and positions {OVERLAP}")


def test_fused_qkv_in_place_and_k_is_v_still_work(framework, kernel_device, rng):
    """sglang's layout: q/k/v as column views of one [T, (Hq + 2 Hk) * D] buffer, in place;
    and one tensor read twice (k is v) without in-place rotation."""
    args, kw = make_args(framework, kernel_device, rng)
    W = (HQ + 2 * HK) * D
    if framework == "torch":
        fused = torch.cat([args["q"].reshape(T, -1), args["k"].reshape(T, -1),
                           args["v"].reshape(T, -1)], dim=1).contiguous()
    else:
        fused = np.ascontiguousarray(np.concatenate(
            [args["q"].reshape(T, -1), args["k"].reshape(T, -1), args["v"].reshape(T, -1)], 1))
    ref_pools = (args["k_pool"], args["v_pool"])
    copy = (lambda x: x.clone()) if framework == "torch" else (lambda x: x.copy())
    expect_q, expect_k, _, _ = ropepool.rope_pool_fused(
        args["q"], args["k"], args["v"], args["positions"], args["slots"],
        copy(ref_pools[0]), copy(ref_pools[1]), **kw)
    fa = dict(args, q=_strided(fused, (T, HQ, D), (W, D, 1), 0),
              k=_strided(fused, (T, HK, D), (W, D, 1), HQ * D),
              v=_strided(fused, (T, HK, D), (W, D, 1), (HQ + HK) * D),
              k_pool=copy(ref_pools[0]), v_pool=copy(ref_pools[1]))
    q_rot, k_rot, _, _ = both_accept(fa, dict(kw, inplace=True))
    to_np = (lambda x: x.cpu().numpy()) if framework == "torch" else np.asarray
    assert np.array_equal(to_np(q_rot), to_np(expect_q))
    assert np.array_equal(to_np(k_rot), to_np(expect_k))
    both_accept(dict(args, v=args["k"]), kw)


# ---- B2: the angle limit (SPEC §1) ---------------------------------------------------------

LIMIT = "the limit of 2^32 = 4294967296 rad that the angle reduction handles"


def test_angle_limit_cpu_exact_positions(framework, rng):
    """CPU: the actual positions decide. 2^32 rad is accepted (and accurate: C++
    test_limits), one position more is rejected naming the limit."""
    args, kw = make_args(framework, "cpu", rng, index_dtype="int64",
                         positions=[0, 1, 2**32, -(2**32), 5])
    both_accept(args, kw)
    args, kw = make_args(framework, "cpu", rng, index_dtype="int64",
                         positions=[0, 1, 2**32 + 1, 3, 5])
    both_reject(args, kw, message=f"rope_pool_fused: positions[2] = 4294967297 times "
                                  f"inv_freq[0] = 1.0 is an angle of 4294967297.0 rad, beyond "
                                  f"{LIMIT}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_angle_limit_cuda_uses_the_index_range(index_dtype, rng):
    """CUDA: positions stay on the device, so the bound is |pos| <= 2^31 times the largest
    inv_freq (SPEC §1): inv_freq up to 2 is accepted, above it rejected by both entries."""
    if not ropepool.cuda_backend:
        pytest.skip("no CUDA backend")
    args, kw = make_args("torch", "cuda", rng, index_dtype=index_dtype)
    ok = np.array([2.0] + [0.5] * (D // 2 - 1), np.float32)
    both_accept(args, dict(kw, inv_freq=ok))
    bad = np.array([2.5] + [0.5] * (D // 2 - 1), np.float32)
    both_reject(args, dict(kw, inv_freq=bad),
                message="rope_pool_fused: positions up to 2^31 in magnitude times "
                        "inv_freq[0] = 2.5 give angles up to 5368709120.0 rad, beyond "
                        f"{LIMIT} on the cuda backend")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_backend_limits_checked_by_validation(rng):
    """The CUDA planner's limits are validation's: rotary_dim > 512 is rejected by
    validate_rope_pool with the same message as the op (the CPU runs it)."""
    if not ropepool.cuda_backend:
        pytest.skip("no CUDA backend")
    args, kw = make_args("torch", "cuda", rng, Hq=1, Hk=1, D=1024, P=8)
    both_reject(args, kw, message="rope_pool_fused: rotary_dim = 1024 exceeds the limit of 512 "
                                  "on the cuda backend")
    args, kw = make_args("torch", "cpu", rng, Hq=1, Hk=1, D=1024, P=8)
    both_accept(args, kw)
    # num_qo_heads * head_dim beyond 2^24 - 129 (item indices are int in the kernel)
    args, kw = make_args("torch", "cuda", rng, T=1, Hq=2**17, Hk=1, D=128, P=2)
    both_reject(args, kw, message="rope_pool_fused: num_qo_heads * head_dim = 16777216 exceeds "
                                  "the limit of 16777087 on the cuda backend")


# ---- B3/B4: schedules and silent defaults --------------------------------------------------

def test_schedule_keywords_that_would_be_ignored(rng):
    args, kw = make_args("torch", "cpu", rng)
    sched = ropepool.rope_schedule(head_dim=D, rope_base=1e4)
    both_reject(args, dict(kw, schedule=sched, rope_scaling={"type": "linear", "factor": 2.0}),
                message="rope_pool_fused: schedule replaces rope_scaling; pass them to "
                        "rope_schedule, or drop schedule")
    both_accept(args, dict(kw, schedule=sched))
    assert sched.rope_base == 1e4


@pytest.mark.parametrize("extra", [{"seq_len": 5}, {"rope_scaling": {"type": "linear",
                                                                   "factor": 2.0}}])
def test_inv_freq_replaces_rope_scaling(extra):
    with pytest.raises(ValueError, match="^rope_pool_fused: inv_freq replaces rope_scaling"):
        ropepool.rope_schedule(head_dim=8, rope_base=1e4, inv_freq=np.ones(4, np.float32),
                               **extra)


def test_phi3_longrope_needs_original_max_position_embeddings():
    """transformers 4.57 reads Phi-3's top-level original_max_position_embeddings: attention
    factor sqrt(1 + ln(32) / ln(4096)) ~ 1.19 and long factors past 4096."""
    rs = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    with pytest.raises(ValueError, match="longrope' needs original_max_position_embeddings") as e:
        ropepool.rope_schedule(head_dim=96, rope_base=1e4, rope_scaling=rs,
                               max_position_embeddings=131072, seq_len=5000)
    assert any("config.original_max_position_embeddings" in n for n in e.value.__notes__)
    s = ropepool.rope_schedule(head_dim=96, rope_base=1e4, rope_scaling=rs,
                               max_position_embeddings=131072,
                               original_max_position_embeddings=4096, seq_len=5000)
    assert s.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert s.attention_scaling == pytest.approx(1.19, abs=0.01)
    assert s.inv_freq[1] == pytest.approx(10000 ** (-2 / 96) / 2.0)  # long factors


def test_bools_are_not_numbers(rng):
    args, kw = make_args("torch", "cpu", rng)
    with pytest.raises(TypeError, match="rope_base must be a real number, got bool"):
        ropepool.rope_pool_fused(*(args[n] for n in ORDER), **dict(kw, rope_base=True))
    with pytest.raises(TypeError, match="head_dim must be an integer, got bool"):
        ropepool.rope_schedule(head_dim=True, rope_base=1e4)


# ---- B5: messages that name what was received ----------------------------------------------

@pytest.mark.parametrize("what,dtype,message", [
    ("qkv", "float64", "rope_pool_fused: unsupported dtype float64 for q/k/v/pools; expected "
                       "float32, float16 or bfloat16"),
    ("positions", "int16", "rope_pool_fused: positions must be int32 or int64, got int16"),
    ("slots", "uint32", "rope_pool_fused: slots must be int32 or int64, got uint32"),
])
def test_dtypes_are_named(what, dtype, message, rng):
    args, kw = make_args("numpy", "cpu", rng)
    if what == "qkv":
        for n in ("q", "k", "v", "k_pool", "v_pool"):
            args[n] = args[n].astype(dtype)
    else:
        args[what] = args[what].astype(dtype)
    both_reject(args, kw, message=message)


def test_torch_float64_is_named(kernel_device, rng):
    args, kw = make_args("torch", kernel_device, rng)
    for n in ("q", "k", "v", "k_pool", "v_pool"):
        args[n] = args[n].double()
    both_reject(args, kw, startswith="rope_pool_fused: unsupported dtype float64")


def test_hints_name_received_values(framework, kernel_device, rng):
    args, kw = make_args(framework, kernel_device, rng)
    e = both_reject(args, dict(kw, num_kv_heads=3),
                    message="k shape must be [num_tokens, num_kv_heads, head_dim], got "
                            + str(args["k"].shape))
    assert e.__notes__ == [f"num_kv_heads = 3 but k.shape[1] = {HK}"]
    half = args["v"].half() if framework == "torch" else args["v"].astype(np.float16)
    e = both_reject(dict(args, v=half), kw, message="q/k/v dtypes must match")
    assert e.__notes__ == ["got q float32, k float32, v float16"]


def test_meta_tensor_is_named(rng):
    args, kw = make_args("torch", "cpu", rng)
    args["q"] = torch.empty((T, HQ, D), device="meta")
    with pytest.raises(ValueError, match="q is on the meta device"):
        ropepool.rope_pool_fused(*(args[n] for n in ORDER), **kw)


def test_numpy_dtype_without_dlpack_is_named(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    args, kw = make_args("numpy", "cpu", rng)
    for n in ("q", "k", "v", "k_pool", "v_pool"):
        args[n] = args[n].astype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="of dtype bfloat16.*cannot be exported"):
        ropepool.rope_pool_fused(*(args[n] for n in ORDER), **kw)


def test_accuracy_near_the_angle_limit(kernel_device, rng):
    """Angles up to 2^32 rad meet SPEC §1's bound: int32 positions near +-2^31 times
    inv_freq up to 2 (the largest CUDA accepts), against an exact reference (the product
    and the reduction in x87 long double, 64-bit significand: exact for a 31-bit position
    times a 24-bit float)."""
    if np.finfo(np.longdouble).nmant < 63:
        pytest.skip("needs an 80-bit long double for the exact reference")
    n, Hq, Hk, Dd = 16, 2, 1, 16
    pos = np.concatenate([2**31 - 1 - rng.integers(0, 2**20, n // 2),
                          -(2**31) + rng.integers(0, 2**20, n // 2)]).astype(np.int32)
    freqs = np.array([2.0, 1.9999998807907104, 1.5, 1.0, 0.75, 1 / 3, 1e-3, 1e-6],
                     np.float32)
    args, kw = make_args("torch", kernel_device, rng, T=n, Hq=Hq, Hk=Hk, D=Dd, P=n,
                         positions=pos)
    q_rot, k_rot, _, _ = both_accept(args, dict(kw, inv_freq=freqs))
    two_pi = np.longdouble(2) * np.longdouble("3.14159265358979323846264338327950288")
    theta = pos.astype(np.longdouble)[:, None] * freqs.astype(np.longdouble)[None, :]
    r = theta - np.rint(theta / two_pi) * two_pi
    cos, sin = np.cos(r).astype(np.float64), np.sin(r).astype(np.float64)
    for x, out in ((args["q"], q_rot), (args["k"], k_rot)):
        x = x.cpu().double().numpy()
        a, b = x[..., :Dd // 2], x[..., Dd // 2:]
        exact = np.concatenate([a * cos[:, None] - b * sin[:, None],
                                a * sin[:, None] + b * cos[:, None]], axis=-1)
        got = out.cpu().double().numpy()
        ab = np.concatenate([np.abs(a) + np.abs(b)] * 2, axis=-1)
        ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
        err = np.abs(got - exact)
        assert np.all(err <= ulp + ab * 2.0**-18), float(np.max(err / (ulp + ab * 2.0**-18)))
