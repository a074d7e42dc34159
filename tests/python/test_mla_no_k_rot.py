"""`return_k_rot=False` for mla_rope_pool_fused (SPEC §8): no k_pe_rot is written or
returned; q_pe_rot and the whole cache are bit for bit those of the same call with k_pe_rot,
and k_pe is only read (with ``inplace`` too). Through the eager kernel functions, the custom
ops (`ropepool::mla_rope_pool_fused_no_k_rot` and the in-place `..._no_k_rot_`: opcheck,
torch.compile(fullgraph=True), CUDA graph capture), NumPy, validate_mla_rope_pool, and a
rejected call, which writes nothing. Every call here runs on fresh random inputs with its
q_pe_rot allocation poisoned (NaN), so an element the op leaves unwritten fails."""

import re

import numpy as np
import pytest
import torch

import ropepool
import ropepool._mla
from rope_testing import assert_same_bits, capture_graph

FP8 = torch.float8_e4m3fn
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# DeepSeek-V3's config.json
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(autouse=True)
def allocated(monkeypatch):
    """q_pe_rot/k_pe_rot (torch and NumPy) start as NaN; the list of the shapes allocated."""
    shapes = []

    def torch_output(x):
        shapes.append(tuple(x.shape))
        return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)

    def array_output(x, name):
        shapes.append(tuple(x.shape))
        return np.full(x.shape, np.nan, dtype=x.dtype)
    monkeypatch.setattr(ropepool._mla, "_new_output", torch_output)
    monkeypatch.setattr(ropepool._mla, "_new_array_output", array_output)
    return shapes


class MlaCall:
    """One call laid out as DeepSeek's attention makes it: q [T, H, nope + R] with q_pe its
    last R columns, kv_c and k_pe column slices of one [T, L + R] projection output; about
    15% negative slots; the cache random bits (token [P, L + R] or NHD pages, q's dtype or
    float8_e4m3fn). torch tensors on `device`, or NumPy arrays."""

    def __init__(self, rng, *, dtype, T, H, framework="torch", device="cpu", R=64, L=512,
                 nope=128, P=128, page_size=0, cache_dtype=None, k_3d=False,
                 index_dtype=torch.int32):
        self.framework, self.device, self.L, self.R, self.P = framework, device, L, R, P
        self.page_size, self.nope, self.k_3d = page_size, nope, k_3d
        q = rng.uniform(-4, 4, (T, H, nope + R))
        kv = rng.uniform(-4, 4, (T, L + R))
        pos = rng.integers(0, 2**20, T)
        pos[:2] = [2**20 - 1, 0][: min(T, 2)]
        slots = rng.permutation(P)[:T].astype(np.int64)
        slots[rng.random(T) < 0.15] = -1
        cdt = TORCH[dtype] if cache_dtype is None else cache_dtype
        width = torch.tensor([], dtype=cdt).element_size()
        raw = rng.integers(0, 2**8, (P, (L + R) * width), dtype=np.uint8)
        if framework == "numpy":
            self.q, self.kv = q.astype(dtype), kv.astype(dtype)
            self.positions, self.slots = pos, slots.astype(np.int32)
            cache = raw.view(dtype)
            cache = np.where(np.isfinite(cache), cache, np.asarray(3, dtype=dtype))
        else:
            self.q = torch.from_numpy(q).to(TORCH[dtype]).to(device)
            self.kv = torch.from_numpy(kv).to(TORCH[dtype]).to(device)
            self.positions = torch.from_numpy(pos).to(index_dtype).to(device)
            self.slots = torch.from_numpy(slots).to(index_dtype).to(device)
            cache = torch.from_numpy(raw).view(cdt)
            if cdt != FP8:  # no NaN/Inf (bits compare anyway; finite keeps reports readable)
                cache = torch.where(cache.isfinite(), cache, torch.full((), 3, dtype=cdt))
            cache = cache.to(device)
        self.kv_cache = cache.reshape(P // page_size, page_size, L + R) if page_size else cache

    def args(self):
        q_pe = self.q[..., self.nope:]
        k_pe = self.kv[:, self.L:]
        if self.k_3d:
            k_pe = k_pe[:, None]
        return (q_pe, k_pe, self.kv[:, :self.L], self.positions, self.slots, self.kv_cache)

    def clone(self):
        """A copy with buffers of its own (the same views of them)."""
        other = MlaCall.__new__(MlaCall)
        other.__dict__.update(self.__dict__)
        copy = (lambda x: x.copy()) if self.framework == "numpy" else (lambda x: x.clone())
        for name in ("q", "kv", "positions", "slots", "kv_cache"):
            setattr(other, name, copy(getattr(self, name)))
        return other


def with_k_rot(call, **kw):
    """The same call with k_pe_rot, on copies: (q_pe_rot, k_pe_rot, the copy)."""
    ref = call.clone()
    q_rot, k_rot, cache = ropepool.mla_rope_pool_fused(*ref.args(), **kw)
    assert cache is ref.kv_cache and k_rot is not None
    return q_rot, k_rot, ref


def assert_same_call(call, ref, what=""):
    """Every buffer of `call` (q with q_pe, kv with k_pe and kv_c, positions, slots, the
    whole cache) holds the bits of `ref`'s."""
    for name in ("q", "kv", "positions", "slots", "kv_cache"):
        assert_same_bits(getattr(call, name), getattr(ref, name), f"{what}{name}")


# Keyword sets (and case layouts) the call without k_pe_rot must give the same bits for.
VARIANTS = {
    "token_yarn": ({}, dict(rope_base=10000, rope_scaling=YARN)),
    "nhd16": ({"page_size": 16}, dict(rope_base=10000, rope_scaling=YARN, kv_layout="NHD")),
    "neox_default": ({}, dict(rope_base=10000.0, interleaved=False)),
    "fp8_token": ({"cache_dtype": FP8}, dict(rope_base=10000, rope_scaling=YARN,
                                             kv_scale=0.0078125)),
    "fp8_nhd_scale_tensor": ({"cache_dtype": FP8, "page_size": 8},
                             dict(rope_base=10000, kv_layout="NHD", kv_scale="tensor")),
    "k_3d_int64": ({"k_3d": True, "index_dtype": torch.int64}, dict(rope_base=50000.0)),
    "checked_slots": ({}, dict(rope_base=10000, check_slots=True)),
}


def variant(rng, device, dtype, name, T=19, H=16):
    layout, kw = VARIANTS[name]
    call = MlaCall(rng, dtype=dtype, device=device, T=T, H=H, **layout)
    kw = dict(kw)
    if kw.get("kv_scale") == "tensor":
        kw["kv_scale"] = torch.tensor([0.375], device=device)
    return call, kw


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_same_bits_as_the_call_with_k_pe_rot(kernel_device, rng, dtype, name, allocated):
    call, kw = variant(rng, kernel_device, dtype, name)
    q_ref, _, ref = with_k_rot(call, **kw)
    allocated.clear()
    q_rot, k_rot, cache = ropepool.mla_rope_pool_fused(*call.args(), **kw, return_k_rot=False)
    assert k_rot is None and cache is call.kv_cache
    assert allocated == [tuple(q_rot.shape)], "only q_pe_rot is allocated"
    assert_same_bits(q_rot, q_ref, "q_pe_rot")
    assert_same_call(call, ref)  # the cache, and the inputs (k_pe included) as they were


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("k_3d", [False, True])
def test_inplace_rotates_q_pe_and_leaves_k_pe(kernel_device, rng, fp8, k_3d):
    call = MlaCall(rng, dtype="bfloat16", device=kernel_device, T=11, H=16, k_3d=k_3d,
                   cache_dtype=FP8 if fp8 else None)
    kw = dict(rope_base=10000, rope_scaling=YARN, kv_scale=0.25 if fp8 else None)
    q_ref, _, ref = with_k_rot(call, **kw)  # not in place: ref's q and kv keep their values
    kv_before = call.kv.clone()
    args = call.args()
    out = ropepool.mla_rope_pool_fused(*args, **kw, inplace=True, return_k_rot=False)
    assert out[0] is args[0] and out[1] is None and out[2] is call.kv_cache
    assert_same_bits(args[0], q_ref, "q_pe rotated in place")
    assert_same_bits(call.q[..., :128], ref.q[..., :128], "q's nope columns")
    assert_same_bits(call.kv, kv_before, "kv (k_pe left as it was, kv_c)")
    assert_same_bits(call.kv_cache, ref.kv_cache, "kv_cache")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("inplace", [False, True])
def test_numpy(rng, dtype, inplace, allocated):
    call = MlaCall(rng, framework="numpy", dtype=dtype, T=13, H=4, P=40)
    q_ref, _, ref = with_k_rot(call, rope_base=10000.0)
    kv_before = call.kv.copy()
    args = call.args()
    allocated.clear()
    q_rot, k_rot, cache = ropepool.mla_rope_pool_fused(*args, rope_base=10000.0,
                                                       inplace=inplace, return_k_rot=False)
    assert k_rot is None and cache is call.kv_cache and isinstance(q_rot, np.ndarray)
    assert (q_rot is args[0]) == inplace
    assert allocated == ([] if inplace else [(13, 4, 64)]), "only q_pe_rot is allocated"
    assert_same_bits(q_rot, q_ref, "q_pe_rot")
    assert_same_bits(call.kv, kv_before, "kv (k_pe, kv_c)")
    assert_same_bits(call.kv_cache, ref.kv_cache, "kv_cache")


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_validation_without_k_pe_rot(rng, framework):
    """validate_mla_rope_pool takes the keyword; the core's checks still run without
    k_pe_rot (a bad cache reported, nothing written)."""
    call = MlaCall(rng, framework=framework, dtype="float32", T=6, H=4, P=16)
    ropepool.validate_mla_rope_pool(*call.args(), rope_base=10000.0, return_k_rot=False)
    ropepool.validate_mla_rope_pool(*call.args(), rope_base=10000.0, inplace=True,
                                    return_k_rot=False)
    before = call.clone()
    bad = call.kv_cache[:, :570]
    message = ("mla_rope_pool_fused: kv_cache shape must be [num_slots, kv_lora_rank + "
               "rope_dim] with kv_lora_rank + rope_dim = 512 + 64 = 576, got ")
    for fn in (ropepool.mla_rope_pool_fused, ropepool.validate_mla_rope_pool):
        for inplace in (False, True):
            with pytest.raises(ValueError, match="^" + re.escape(message)):
                fn(*call.args()[:5], bad, rope_base=10000.0, inplace=inplace,
                   return_k_rot=False)
    call.slots[3] = 16  # out of range: a data check, on the CPU before anything is written
    with pytest.raises(ValueError, match=r"^mla_rope_pool_fused: slots\[3\] = 16 is out of range"):
        ropepool.mla_rope_pool_fused(*call.args(), rope_base=10000.0, inplace=True,
                                     return_k_rot=False)
    call.slots[3] = before.slots[3]
    assert_same_call(call, before)


def test_custom_ops_equal_the_eager_path_and_empty_call(rng):
    """The registered ops (what torch.compile and dispatch modes reach) give the eager
    path's bits; T = 0 returns an empty q_pe_rot and writes nothing."""
    call = MlaCall(rng, dtype="bfloat16", T=5, H=16)
    sched = ropepool.rope_schedule(head_dim=64, rope_base=10000, rope_scaling=YARN)
    scalars = (None, 10000.0, True, list(sched.inv_freq), sched.attention_scaling, False,
               None, False)
    q_ref, _, ref = with_k_rot(call, rope_base=10000, schedule=sched)
    op_call = call.clone()
    q_rot = torch.ops.ropepool.mla_rope_pool_fused_no_k_rot(*op_call.args(), *scalars)
    assert_same_bits(q_rot, q_ref, "q_pe_rot (op)")
    assert_same_call(op_call, ref, "op: ")
    kv_before = call.kv.clone()
    assert torch.ops.ropepool.mla_rope_pool_fused_no_k_rot_(*call.args(), *scalars) is None
    assert_same_bits(call.args()[0], q_ref, "q_pe (in-place op)")
    assert_same_bits(call.kv, kv_before, "kv (in-place op)")
    assert_same_bits(call.kv_cache, ref.kv_cache, "kv_cache (in-place op)")
    empty = MlaCall(rng, dtype="bfloat16", T=0, H=16)
    before = empty.clone()
    q, k, cache = ropepool.mla_rope_pool_fused(*empty.args(), rope_base=10000.0,
                                               return_k_rot=False)
    assert q.shape == (0, 16, 64) and k is None and cache is empty.kv_cache
    assert_same_call(empty, before)


def test_schemas_and_versions(rng):
    """The ops without k_pe_rot write the cache (and q_pe in place), never k_pe; the
    functional one returns q_pe_rot alone. Autograd learns of the in-place writes."""
    ops = torch.ops.ropepool
    for op, written, returns in ((ops.mla_rope_pool_fused_no_k_rot, ["kv_cache"], 1),
                                 (ops.mla_rope_pool_fused_no_k_rot_, ["q_pe", "kv_cache"], 0)):
        schema = op.default._schema
        assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] \
            == written, str(schema)
        assert [a.name for a in schema.arguments] == \
            [a.name for a in ops.mla_rope_pool_fused.default._schema.arguments], str(schema)
        assert len(schema.returns) == returns and all(r.alias_info is None
                                                      for r in schema.returns)
    call = MlaCall(rng, dtype="float32", T=3, H=2, P=8)
    q_pe, k_pe, *rest = call.args()
    versions = q_pe._version, k_pe._version, call.kv_cache._version
    ropepool.mla_rope_pool_fused(q_pe, k_pe, *rest, rope_base=10000.0, inplace=True,
                                 return_k_rot=False)
    assert q_pe._version > versions[0] and call.kv_cache._version > versions[2]
    assert k_pe._version == versions[1]


@pytest.mark.parametrize("inplace", [False, True])
def test_opcheck(kernel_device, rng, inplace):
    """torch.library.opcheck on both ops: their schemas say what they write (the cache, and
    q_pe in place; never k_pe). (A bfloat16 cache: opcheck's schema test multiplies every
    tensor, which float8_e4m3fn cannot.)"""
    call = MlaCall(rng, dtype="bfloat16", device=kernel_device, T=7, H=8, page_size=8)
    scalars = (None, 10000.0, True, None, 1.0, True, None, False)
    op = (torch.ops.ropepool.mla_rope_pool_fused_no_k_rot_ if inplace
          else torch.ops.ropepool.mla_rope_pool_fused_no_k_rot)
    torch.library.opcheck(op.default, call.args() + scalars)


def _step(q, kv, positions, slots, cache, kw):
    q = q * 1.0  # ops before and after, so the custom op sits inside a larger graph
    q_pe, k_pe, kv_c = q[..., 128:], kv[:, 512:], kv[:, :512]
    q_rot, k_rot, cache = ropepool.mla_rope_pool_fused(q_pe, k_pe, kv_c, positions, slots,
                                                       cache, return_k_rot=False, **kw)
    return q_rot * 1, k_rot, cache, q


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_compile_fullgraph(kernel_device, rng, inplace, fp8):
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    sched = ropepool.rope_schedule(head_dim=64, rope_base=10000, rope_scaling=YARN)
    for T in (13, 29):  # two shapes: the second call retraces or runs a dynamic graph
        call = MlaCall(rng, dtype="bfloat16", device=kernel_device, T=T, H=16, page_size=16,
                       cache_dtype=FP8 if fp8 else None)
        kw = dict(rope_base=10000, schedule=sched, kv_layout="NHD", inplace=inplace,
                  kv_scale=0.5 if fp8 else None)
        q_ref, _, ref = with_k_rot(call, **{**kw, "inplace": False})
        kv_before = call.kv.clone()
        q_rot, k_rot, cache, q = compiled(call.q, call.kv, call.positions, call.slots,
                                          call.kv_cache, kw)
        assert k_rot is None and cache is call.kv_cache
        assert_same_bits(q_rot, q_ref, "q_pe_rot")
        if inplace:  # the op wrote the graph's own copy of q (q * 1.0)
            assert_same_bits(q[..., 128:], q_ref, "q_pe rotated in place")
        assert_same_bits(call.kv, kv_before, "kv")
        assert_same_bits(call.q, ref.q, "q")
        assert_same_bits(call.kv_cache, ref.kv_cache, "kv_cache")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_equals_the_call_with_k_pe_rot_and_graph(rng):
    """On CUDA at DeepSeek-V3's size (128 heads, fp8 NHD cache, a scale tensor): the call
    without k_pe_rot writes the bits of the call with it; captured in a CUDA graph, it
    replays with the static inputs' current contents."""
    if not ropepool.cuda_backend:
        pytest.skip("no CUDA backend in this build")
    ropepool.cuda_check_slot_errors()
    scale = torch.tensor([0.5], device="cuda")
    sched = ropepool.rope_schedule(head_dim=64, rope_base=10000, rope_scaling=YARN)
    kw = dict(rope_base=10000, schedule=sched, kv_layout="NHD", kv_scale=scale)
    for cache_dtype in (None, FP8):
        call = MlaCall(rng, dtype="bfloat16", device="cuda", T=64, H=128, page_size=64,
                       P=1024, cache_dtype=cache_dtype)
        ckw = kw if cache_dtype is FP8 else dict(kw, kv_scale=None)  # a scale is fp8's only
        q_ref, _, ref = with_k_rot(call, **ckw)
        q_rot, k_rot, _ = ropepool.mla_rope_pool_fused(*call.args(), **ckw, return_k_rot=False)
        torch.cuda.synchronize()
        assert k_rot is None
        assert_same_bits(q_rot, q_ref, "q_pe_rot")
        assert_same_call(call, ref)

    call = MlaCall(rng, dtype="bfloat16", device="cuda", T=32, H=16, page_size=16, P=256,
                   cache_dtype=FP8)
    graph, out = capture_graph(
        lambda: ropepool.mla_rope_pool_fused(*call.args(), **kw, return_k_rot=False), warmups=1)
    assert out[1] is None
    for _ in range(2):
        fresh = MlaCall(rng, dtype="bfloat16", device="cuda", T=32, H=16, page_size=16,
                        P=256, cache_dtype=FP8)
        for name in ("q", "kv", "positions", "slots", "kv_cache"):
            getattr(call, name).copy_(getattr(fresh, name))
        out[0].fill_(float("nan"))
        q_ref, _, ref = with_k_rot(call, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(out[0], q_ref, "q_pe_rot after replay")
        assert_same_call(call, ref, "after replay: ")
    ropepool.cuda_check_slot_errors()
