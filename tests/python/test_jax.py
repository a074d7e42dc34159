"""The JAX front end (SPEC §9): ropepool.jax.rope_pool_fused through the XLA FFI.

Every element is compared with the torch path (the same C++ op) on fresh random inputs;
donation is checked by buffer address, the aliasing in the compiled HLO, validation at
trace time by exact message. Skipped where jax is not installed; where it is, a ropepool
build without the JAX front end fails here (requirements-dev.txt installs jax, so a build
that silently lost ropepool.jax must not pass). CUDA cases are marked `gpu`.
"""

import contextlib
import functools
import re

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import dtype_name, make_case, raw_bits
from test_caches import spec_e4m3

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


def test_front_end_built():
    assert ropepool._ropepool.jax_front_end, (
        "jax is installed but this ropepool build has no JAX front end (jaxlib's FFI headers "
        "were not found at build time: pip install --no-build-isolation .)")


rj = pytest.importorskip("ropepool.jax") if ropepool._ropepool.jax_front_end else None
pytestmark = pytest.mark.skipif(rj is None, reason="no JAX front end in this build")


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


CPU = jax.devices("cpu")[0]
GPU = _gpu_devices()[0] if _gpu_devices() else None

PLATFORMS = [
    "cpu",
    pytest.param("gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(GPU is None, reason="no JAX GPU device"),
        pytest.mark.skipif(not ropepool.cuda_backend, reason="no CUDA backend in this build"),
    ]),
]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    if request.param == "gpu":
        ropepool.cuda_check_slot_errors()  # nothing pending from an earlier test
    return request.param


@contextlib.contextmanager
def x64():
    """JAX's x64 mode for the block (int64 positions/slots)."""
    if hasattr(jax, "enable_x64"):
        with jax.enable_x64(True):
            yield
        return
    from jax.experimental import enable_x64  # older JAX
    with enable_x64():
        yield


# torch dtypes that NumPy has only through ml_dtypes (JAX's): moved as raw bits.
_RAW = {torch.bfloat16: (torch.int16, jnp.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, jnp.float8_e4m3fn)}


def to_jax(t, platform):
    """A torch CPU tensor as a committed jax.Array on the platform (bit for bit)."""
    device = CPU if platform == "cpu" else GPU
    t = t.contiguous()
    if t.dtype in _RAW:
        host = t.view(_RAW[t.dtype][0]).numpy().view(_RAW[t.dtype][1])
    else:
        host = t.numpy()
    # A copy made by XLA: an array that device_put made zero-copy over NumPy memory has an
    # external reference, so XLA would copy it rather than take it as donated.
    return jnp.copy(jax.device_put(host, device))


def bits(x):
    return raw_bits(np.asarray(x)) if not isinstance(x, torch.Tensor) else raw_bits(x)


def to_torch(x):
    """A jax.Array as a CPU torch tensor of its dtype (bit for bit)."""
    for t, (raw, j) in _RAW.items():
        if x.dtype == j:
            return torch.from_numpy(bits(x)).view(t)
    return torch.from_numpy(np.array(x))


def keywords(case, **extra):
    return dict(head_dim=case.head_dim, num_qo_heads=case.num_qo_heads,
                num_kv_heads=case.num_kv_heads, rope_base=case.rope_base, **extra)


def torch_result(case, platform, **extra):
    """The torch path on copies of the case's tensors (on CUDA for the gpu platform, where
    the same kernel runs): (q_rot, k_rot, k_pool, v_pool) as CPU tensors."""
    device = "cpu" if platform == "cpu" else "cuda"
    args = [x.clone().to(device) for x in case.args()]
    out = ropepool.rope_pool_fused(*args, **keywords(case, **extra))
    return [o.cpu() for o in out]


def jax_args(case, platform):
    return [to_jax(x, platform) for x in case.args()]


def custom_call_results(compiled, target, dtype="bf16"):
    """The result shapes of the custom call to `target` in compiled HLO text, e.g.
    ["bf16[7,8,128]", ...]."""
    call = next(line for line in compiled.splitlines() if f'custom_call_target="{target}"' in line)
    return re.findall(rf"{dtype}\[[\d,]*\]", call.split("custom-call(")[0])


def assert_same(got, want, names=("q_rot", "k_rot", "k_pool", "v_pool")):
    """Every result bit for bit the torch path's (jax.Arrays or torch tensors)."""
    for name, g, w in zip(names, got, want, strict=True):
        assert tuple(g.shape) == tuple(w.shape) and dtype_name(g) == dtype_name(w), name
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{name} differs from the torch path")


def new_case(rng, dtype="bfloat16", T=7, Hq=8, Hk=2, D=128, P=32, index_dtype="int32", **kw):
    return make_case("torch", dtype, rng, T=T, Hq=Hq, Hk=Hk, D=D, P=P, index_dtype=index_dtype,
                     **kw).snapshot()


# ---- results: every element equal to the torch path -------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_equals_torch_path(platform, rng, dtype, jit):
    case = new_case(rng, dtype, T=int(rng.integers(1, 40)), Hq=8, Hk=2,
                    D=int(rng.choice([64, 128, 96])), P=64)
    f = functools.partial(rj.rope_pool_fused, **keywords(case))
    got = (jax.jit(f) if jit else f)(*jax_args(case, platform))
    assert_same(got, torch_result(case, platform))


@pytest.mark.parametrize("extra", [
    dict(interleaved=True),
    dict(rotary_dim=64),
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    dict(rope_scaling={"rope_type": "yarn", "factor": 4.0},
         max_position_embeddings=32768),
    dict(attention_scaling=0.75, inv_freq=np.geomspace(1.0, 1e-4, 32).astype(np.float32)),
    dict(check_slots=True),
], ids=["interleaved", "rotary_dim", "llama3", "yarn", "inv_freq", "check_slots"])
def test_keywords_equal_torch_path(platform, rng, extra):
    case = new_case(rng, "float32", D=64 if "inv_freq" in extra else 128)
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, **extra)))
    assert_same(f(*jax_args(case, platform)), torch_result(case, platform, **extra))


@pytest.mark.parametrize("form", ["NHD", "HND", "fp8", "fp8_q_rot"])
def test_cache_keywords_equal_torch_path(platform, rng, form):
    """SPEC §6: paged pools, float8_e4m3fn pools with float scales, an fp8 q_rot."""
    case = new_case(rng, "bfloat16", T=9, P=32)
    if form in ("NHD", "HND"):
        shape = (4, 8, 2, 128) if form == "NHD" else (4, 2, 8, 128)
        case.k_pool, case.v_pool = case.k_pool.reshape(shape), case.v_pool.reshape(shape)
        extra = dict(kv_layout=form)
    else:
        case.k_pool, case.v_pool = (p.to(torch.float8_e4m3fn) for p in (case.k_pool, case.v_pool))
        extra = dict(k_scale=0.5, v_scale=0.25)
    torch_extra = dict(extra)
    if form == "fp8_q_rot":
        extra.update(q_out_dtype=jnp.float8_e4m3fn, q_scale=0.125)
        torch_extra.update(q_out_dtype=torch.float8_e4m3fn, q_scale=0.125)
    case.snapshot()
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, **extra)))
    got = f(*jax_args(case, platform))
    assert_same(got, torch_result(case, platform, **torch_extra))
    # v's rows as SPEC §6 places and stores them
    v_pool = to_torch(got[3])
    for t, s in enumerate(case.slots.tolist()):
        if s < 0:
            continue
        row = {"NHD": lambda p: p[s // 8, s % 8], "HND": lambda p: p[s // 8, :, s % 8]}.get(
            form, lambda p: p[s])(v_pool)
        want = case.v[t] if form in ("NHD", "HND") else spec_e4m3(case.v[t].float() / 0.25)
        np.testing.assert_array_equal(raw_bits(row), raw_bits(want), err_msg=f"v_pool row {s}")


def test_cache_keywords_at_trace_time():
    for layout in ("XYZ", ""):  # ("" is an unset string attribute: still rejected)
        with pytest.raises(ValueError) as info:
            traced(kv_layout=layout)
        assert str(info.value) == \
            f'rope_pool_fused: kv_layout must be None, "NHD" or "HND", got "{layout}"'
    fp8 = ((16, 2, 128), "float8_e4m3fn")
    with pytest.raises(TypeError, match=r"^rope_pool_fused: k_scale must be a Python float in "
                                        r"ropepool\.jax"):
        traced({"k_pool": fp8, "v_pool": fp8}, k_scale=jnp.ones((1,)))
    with pytest.raises(ValueError) as info:
        traced(v_scale=0.5)
    assert str(info.value) == ("rope_pool_fused: v_scale is given but the pools are float32; "
                               "k_scale and v_scale quantise float8_e4m3fn pools only")
    with pytest.raises(ValueError, match=r"^rope_pool_fused: q_out_dtype=float8_e4m3fn cannot be "
                                         r"combined with inplace=True"):
        traced(q_out_dtype=jnp.float8_e4m3fn, inplace=True)
    assert traced(q_out_dtype=jnp.float8_e4m3fn, q_scale=0.5)[0].dtype == jnp.float8_e4m3fn


def test_schedule_keyword(platform, rng):
    case = new_case(rng, "float16")
    schedule = ropepool.rope_schedule(head_dim=128, rope_base=case.rope_base,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, schedule=schedule)))
    assert_same(f(*jax_args(case, platform)), torch_result(case, platform, schedule=schedule))


def test_int64_indices_with_x64(platform, rng):
    with x64():
        case = new_case(rng, "bfloat16", index_dtype="int64")
        args = jax_args(case, platform)
        assert args[3].dtype == jnp.int64 and args[4].dtype == jnp.int64
        got = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)))(*args)
        assert_same(got, torch_result(case, platform))


def test_zero_tokens(platform, rng):
    case = new_case(rng, "float32", T=0, P=8)
    got = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)))(*jax_args(case, platform))
    assert got[0].shape == (0, 8, 128) and got[1].shape == (0, 2, 128)
    np.testing.assert_array_equal(bits(got[2]), case.before["k_pool"])
    np.testing.assert_array_equal(bits(got[3]), case.before["v_pool"])


def test_empty_pool(platform, rng):
    case = new_case(rng, "float16", T=3, P=0, slots=[-1, -5, -1])
    got = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)),
                  donate_argnums=(5, 6))(*jax_args(case, platform))
    assert got[2].shape == (0, 2, 128)
    assert_same(got, torch_result(case, platform))


# ---- functional semantics: donation, aliasing, the caller's arrays ------------------------

def test_without_donation_caller_keeps_old_values(platform, rng):
    case = new_case(rng, "bfloat16")
    args = jax_args(case, platform)
    got = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)))(*args)
    jax.block_until_ready(got)
    for name, x in zip(("q", "k", "v", "positions", "slots", "k_pool", "v_pool"), args):
        assert not x.is_deleted()
        np.testing.assert_array_equal(bits(x), case.before[name], err_msg=f"{name} changed")
    assert got[2].unsafe_buffer_pointer() != args[5].unsafe_buffer_pointer()
    assert_same(got, torch_result(case, platform))


def test_donated_pools_are_written_in_place(platform, rng):
    case = new_case(rng, "bfloat16")
    args = jax_args(case, platform)
    k_ptr, v_ptr = args[5].unsafe_buffer_pointer(), args[6].unsafe_buffer_pointer()
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)), donate_argnums=(5, 6))
    got = f(*args)
    jax.block_until_ready(got)
    assert got[2].unsafe_buffer_pointer() == k_ptr, "k_pool was copied"
    assert got[3].unsafe_buffer_pointer() == v_ptr, "v_pool was copied"
    assert args[5].is_deleted() and args[6].is_deleted()
    # A decode loop: the returned pools are donated to the next call, still no copy. (Read
    # values only afterwards: np.asarray of a CPU jax.Array keeps a NumPy view of its buffer,
    # and XLA copies a donated buffer that something else references.)
    got2 = f(*args[:5], got[2], got[3])
    jax.block_until_ready(got2)
    assert got2[2].unsafe_buffer_pointer() == k_ptr and got2[3].unsafe_buffer_pointer() == v_ptr
    # The same rows written twice with the same values: one call's result.
    assert_same(got2, torch_result(case, platform))


def test_inplace_aliases_q_and_k(platform, rng):
    case = new_case(rng, "float16")
    args = jax_args(case, platform)
    q_ptr, k_ptr = args[0].unsafe_buffer_pointer(), args[1].unsafe_buffer_pointer()
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, inplace=True)),
                donate_argnums=(0, 1, 5, 6))
    got = f(*args)
    jax.block_until_ready(got)
    assert got[0].unsafe_buffer_pointer() == q_ptr and got[1].unsafe_buffer_pointer() == k_ptr
    assert_same(got, torch_result(case, platform))
    # Without donation, q and k keep their values.
    args = jax_args(case, platform)
    got = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, inplace=True)))(*args)
    np.testing.assert_array_equal(bits(args[0]), case.before["q"])
    np.testing.assert_array_equal(bits(args[1]), case.before["k"])
    assert_same(got, torch_result(case, platform))


def test_hlo_shows_the_pool_aliases(rng):
    case = new_case(rng, "bfloat16")
    args = jax_args(case, "cpu")
    f = functools.partial(rj.rope_pool_fused, **keywords(case))
    lowered = jax.jit(f).lower(*args)
    assert re.search(r"stablehlo\.custom_call @ropepool_rope_pool_fused", lowered.as_text())
    compiled = lowered.compile().as_text()
    assert "output_to_operand_aliasing={{2}: (5, {}), {3}: (6, {})}" in compiled
    donated = jax.jit(f, donate_argnums=(5, 6)).lower(*args).compile().as_text()
    assert re.search(r"input_output_alias=\{ \{2\}: \(5, \{\}, [\w-]+\), \{3\}: \(6, \{\}, [\w-]+\) \}",
                     donated), donated.splitlines()[0]


# ---- return_k_rot=False (SPEC §4): no k_rot result, the pools as with it -------------------

def skip_and_write_slots(rng, T, P):
    """Distinct pool rows, about a quarter of the tokens (the first always) given a negative
    slot (no pool write); the second token always writes."""
    slots = rng.permutation(P)[:T].astype(np.int64)
    skip = rng.random(T) < 0.25
    skip[0], skip[1] = True, False
    return np.where(skip, -rng.integers(1, 2**20, size=T), slots)


def no_k_rot_case(rng, dtype, layout):
    T, P = int(rng.integers(2, 40)), 64
    case = new_case(rng, dtype, T=T, D=int(rng.choice([64, 128])), P=P,
                    slots=skip_and_write_slots(rng, T, P))
    if layout == "NHD":  # 8 pages of 8 rows
        shape = (8, 8, case.num_kv_heads, case.head_dim)
        case.k_pool, case.v_pool = case.k_pool.reshape(shape), case.v_pool.reshape(shape)
        case.snapshot()
    return case


@pytest.mark.parametrize("inplace", [False, True], ids=["fresh", "inplace"])
@pytest.mark.parametrize("layout", [None, "NHD"], ids=["3d_pool", "NHD_pool"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_k_rot_equals_with_it(platform, rng, dtype, layout, inplace):
    """Under jax.jit: k_rot is None, q_rot and every element of both pools bit for bit the
    same call's with k_rot; the caller's arrays (not donated) keep their values."""
    case = no_k_rot_case(rng, dtype, layout)
    kw = keywords(case, kv_layout=layout, inplace=inplace)
    want = jax.jit(functools.partial(rj.rope_pool_fused, **kw))(*jax_args(case, platform))
    args = jax_args(case, platform)
    got = jax.jit(functools.partial(rj.rope_pool_fused, **kw, return_k_rot=False))(*args)
    assert len(got) == 4 and got[1] is None
    assert_same([got[i] for i in (0, 2, 3)], [want[i] for i in (0, 2, 3)],
                names=("q_rot", "k_pool", "v_pool"))
    assert not np.array_equal(bits(got[2]), case.before["k_pool"])  # (the pools were written)
    for name, x in zip(("q", "k", "v", "positions", "slots", "k_pool", "v_pool"), args):
        np.testing.assert_array_equal(bits(x), case.before[name], err_msg=f"{name} changed")


def test_without_k_rot_donation_and_hlo(rng):
    """The call without k_rot is its own custom call with three results (q_rot and the
    aliased pools: no k_rot buffer); with inplace=True q is aliased to q_rot and k is only
    read, so donating q and the pools writes the caller's buffers and k keeps its values."""
    case = no_k_rot_case(rng, "bfloat16", None)
    T, D = case.q.shape[0], case.head_dim
    args = jax_args(case, "cpu")
    f = functools.partial(rj.rope_pool_fused, **keywords(case, inplace=True), return_k_rot=False)
    lowered = jax.jit(f).lower(*args)
    assert re.search(r"stablehlo\.custom_call @ropepool_rope_pool_fused_no_k_rot\(",
                     lowered.as_text())
    compiled = lowered.compile().as_text()
    assert "output_to_operand_aliasing={{0}: (0, {}), {1}: (5, {}), {2}: (6, {})}" in compiled
    assert custom_call_results(compiled, "ropepool_rope_pool_fused_no_k_rot") == [
        f"bf16[{T},8,{D}]", f"bf16[64,2,{D}]", f"bf16[64,2,{D}]"], compiled
    with pytest.warns(UserWarning, match="donated buffers were not usable"):
        # (k donated too: XLA has no result for it, so it is not taken)
        jax.jit(f, donate_argnums=(1,)).lower(*args).compile()

    want = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, inplace=True)))(
        *jax_args(case, "cpu"))
    ptrs = [args[i].unsafe_buffer_pointer() for i in (0, 5, 6)]
    got = jax.jit(f, donate_argnums=(0, 5, 6))(*args)
    jax.block_until_ready(got)
    assert got[1] is None
    assert [got[i].unsafe_buffer_pointer() for i in (0, 2, 3)] == ptrs, "a buffer was copied"
    assert args[0].is_deleted() and args[5].is_deleted() and args[6].is_deleted()
    np.testing.assert_array_equal(bits(args[1]), case.before["k"], err_msg="k changed")
    assert_same([got[i] for i in (0, 2, 3)], [want[i] for i in (0, 2, 3)],
                names=("q_rot", "k_pool", "v_pool"))


def test_without_k_rot_at_trace_time():
    """k is still validated (it is read); the traced result has no k_rot; JAX has no k_out
    keyword, so nothing conflicts with return_k_rot=False."""
    out = traced(return_k_rot=False)
    assert out[1] is None and out[0].shape == (2, 8, 128) and out[2].shape == (16, 2, 128)
    for changes in ({"k": ((2, 3, 128), "float32")}, {"k": ((2, 2, 128), "float16")}):
        with pytest.raises(ValueError) as want:
            traced(changes)
        with pytest.raises(ValueError) as got:
            traced(changes, return_k_rot=False)
        assert str(got.value) == str(want.value)


# ---- validation at trace time (SPEC §2) ------------------------------------------------------

def spec(shape, dtype="float32"):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


BASE = dict(q=((2, 8, 128), "float32"), k=((2, 2, 128), "float32"), v=((2, 2, 128), "float32"),
            positions=((2,), "int32"), slots=((2,), "int32"), k_pool=((16, 2, 128), "float32"),
            v_pool=((16, 2, 128), "float32"))
KW = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=10000.0)


def traced(changes=(), **kw):
    """Traces (never runs) a call on abstract arrays: BASE with `changes` applied."""
    args = dict(BASE, **dict(changes))
    f = functools.partial(rj.rope_pool_fused, **dict(KW, **kw))
    return jax.eval_shape(f, *(spec(*args[n]) for n in BASE))


@pytest.mark.parametrize("changes,message", [
    ({"q": ((2, 8, 128, 1), "float32")}, "rope_pool_fused expects q/k/v to be 3-D"),
    ({"slots": ((2, 1), "int32")}, "rope_pool_fused expects positions/slots to be 1-D"),
    ({"k_pool": ((1, 16, 2, 128), "float32")}, "rope_pool_fused expects pool tensors to be 3-D"),
    ({"q": ((2, 9, 128), "float32")},
     "q shape must be [num_tokens, num_qo_heads, head_dim], got (2, 9, 128)"),
    ({"k": ((2, 3, 128), "float32")},
     "k shape must be [num_tokens, num_kv_heads, head_dim], got (2, 3, 128)"),
    ({"v": ((2, 2, 64), "float32")}, "v shape must match k shape, got (2, 2, 64) vs (2, 2, 128)"),
    ({"positions": ((3,), "int32")}, "positions/slots must have one entry per token"),
    ({"k_pool": ((16, 128, 2), "float32")}, "k_pool has incompatible shape (16, 128, 2)"),
    ({"v_pool": ((15, 2, 128), "float32")},
     "v_pool shape must match k_pool shape, got (15, 2, 128) vs (16, 2, 128)"),
    ({"k": ((2, 2, 128), "float16")}, "q/k/v dtypes must match"),
    ({"v_pool": ((16, 2, 128), "bfloat16")}, "pool dtypes must match q/k/v dtype"),
    ({"positions": ((2,), "float32")}, "rope_pool_fused: positions must be int32 or int64, got float32"),
    ({"slots": ((2,), "uint32")}, "rope_pool_fused: slots must be int32 or int64, got uint32"),
    ({n: ((s[0], 8 if n == "q" else 2, 128), "int8") for n, s in
      (("q", (2,)), ("k", (2,)), ("v", (2,)), ("k_pool", (16,)), ("v_pool", (16,)))},
     "rope_pool_fused: unsupported dtype int8 for q/k/v/pools; expected float32, float16 or bfloat16"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 40 else None)
def test_trace_time_messages(changes, message):
    with pytest.raises(ValueError) as info:
        traced(changes)
    assert str(info.value) == message  # exactly (JAX adds its traceback note to __notes__)


def test_trace_time_hint_and_keywords():
    with pytest.raises(ValueError) as info:
        traced({"k": ((2, 3, 128), "float32")})
    assert "num_kv_heads = 2 but k.shape[1] = 3" in info.value.__notes__
    with pytest.raises(ValueError, match=r"^rope_pool_fused: rope_base must be finite and > 0"):
        traced(rope_base=-1.0)
    with pytest.raises(ValueError, match=re.escape("rotary_dim")):
        traced(rotary_dim=0)
    with pytest.raises(ValueError, match=re.escape("rope_scaling type 'linear' needs 'factor'")):
        traced(rope_scaling={"rope_type": "linear"})
    with pytest.raises(TypeError, match=r"^rope_pool_fused: slots must be an array"):
        rj.rope_pool_fused(*(jnp.zeros(BASE[n][0], BASE[n][1]) for n in list(BASE)[:4]), [0, 1],
                           *(jnp.zeros(BASE[n][0]) for n in ("k_pool", "v_pool")), **KW)


def test_validation_runs_when_traced_not_when_run(rng):
    """jax.jit(...).lower() raises the shape error: nothing is compiled or run."""
    case = new_case(rng, "float32")
    args = jax_args(case, "cpu")
    f = jax.jit(functools.partial(rj.rope_pool_fused, **dict(keywords(case), num_kv_heads=4)))
    with pytest.raises(ValueError, match=r"^k shape must be \[num_tokens, num_kv_heads, head_dim\], "
                                         r"got \(7, 2, 128\)\n"):
        f.lower(*args)


# ---- data errors when the computation runs (SPEC §3, §9) ------------------------------------

def test_out_of_range_slot_fails_the_run(rng):
    case = new_case(rng, "bfloat16", T=5, P=16)
    case.slots[3] = 16
    case.snapshot()
    args = jax_args(case, "cpu")
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)))
    lowered = f.lower(*args)  # traced and compiled without complaint: slots are data
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=re.escape("rope_pool_fused: slots[3] = 16 is out of range for a "
                                       "pool of 16 slots")):
        jax.block_until_ready(lowered.compile()(*args))
    for name, x in zip(("k_pool", "v_pool"), args[5:]):
        np.testing.assert_array_equal(bits(x), case.before[name], err_msg=f"{name} changed")
    # The op is usable afterwards.
    case.slots[3] = -1
    case.snapshot()
    assert_same(f(*jax_args(case, "cpu")), torch_result(case, "cpu"))


def test_angle_limit_fails_the_run(rng):
    with x64():
        case = new_case(rng, "float32", T=3, index_dtype="int64", positions=[1, 2**33, 3],
                        rope_base=10000.0)
        f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)))
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=re.escape("rope_pool_fused: positions[1] = 8589934592 times "
                                           "inv_freq[0] = 1.0 is an angle of")):
            jax.block_until_ready(f(*jax_args(case, "cpu")))


# ---- transformations the op does not support: errors, never silent results ------------------

def test_grad_is_an_error(rng):
    case = new_case(rng, "float32")
    args = jax_args(case, "cpu")
    f = functools.partial(rj.rope_pool_fused, **keywords(case))
    with pytest.raises(ValueError, match=r"^rope_pool_fused has no derivative"):
        jax.grad(lambda q: f(q, *args[1:])[0].sum())(args[0])
    with pytest.raises(ValueError, match=r"^rope_pool_fused has no derivative"):
        jax.jvp(lambda kp: f(*args[:5], kp, args[6])[2], (args[5],), (jnp.ones_like(args[5]),))
    # Inputs without a tangent are fine: the rotation is a constant for jax.grad.
    g = jax.grad(lambda q: f(jax.lax.stop_gradient(q), *args[1:])[0].sum() + (q * 2).sum())(args[0])
    np.testing.assert_array_equal(np.asarray(g), 2)


def test_vmap_is_an_error(rng):
    case = new_case(rng, "float32")
    args = jax_args(case, "cpu")
    f = functools.partial(rj.rope_pool_fused, **keywords(case))
    with pytest.raises(ValueError, match=r"^rope_pool_fused does not support jax\.vmap"):
        jax.vmap(f)(*(x[None] for x in args))
    with pytest.raises(ValueError, match=r"^rope_pool_fused does not support jax\.vmap"):
        jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, 0, None, None)))(
            *(x[None] for x in args[:5]), *args[5:])


# ---- CUDA: slot errors without and with check_slots ------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason="no JAX GPU device")
@pytest.mark.skipif(not ropepool.cuda_backend, reason="no CUDA backend in this build")
def test_cuda_out_of_range_slot(rng):
    ropepool.cuda_check_slot_errors()
    case = new_case(rng, "bfloat16", T=6, P=16)
    case.slots[2] = 40
    case.snapshot()
    # check_slots: the handler copies the slots to the host and fails before writing.
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case, check_slots=True)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=re.escape("rope_pool_fused: slots[2] = 40 is out of range")):
        jax.block_until_ready(f(*jax_args(case, "gpu")))
    # Without it the kernel skips that token's row (SPEC §3) and the error is reported later.
    f = jax.jit(functools.partial(rj.rope_pool_fused, **keywords(case)))
    got = jax.block_until_ready(f(*jax_args(case, "gpu")))
    with pytest.raises(RuntimeError, match=re.escape("had slots[2] = 40 out of range for a pool of 16")):
        ropepool.cuda_check_slot_errors(GPU.id)
    good = case.slots.clone()
    good[2] = -1
    want = torch_result(type(case)(*case.args()[:4], good, *case.args()[5:], case.head_dim,
                                   case.num_qo_heads, case.num_kv_heads, case.rope_base), "gpu")
    assert_same(got, want)
