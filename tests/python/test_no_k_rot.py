"""`return_k_rot=False` (SPEC §4): no k_rot is written or returned; q_rot and the pools are
bit for bit those of the same call with k_rot, k is only read. Through the eager kernel
functions, the custom op (`ropepool::rope_pool_fused_out` with `k_out=None`: opcheck,
torch.compile(fullgraph=True), CUDA graph capture), NumPy, validate_rope_pool, and the
errors, with nothing written."""

import pytest
import torch

import ropepool
from rope_testing import assert_same_bits, capture_graph, default_call, make_case

FP8 = torch.float8_e4m3fn


def paged(case, layout, page_size):
    """The case's pools as 4-D paged pools of `layout` (the same slots address them)."""
    P, Hk, D = case.k_pool.shape
    assert P % page_size == 0
    pools = []
    for pool in (case.k_pool, case.v_pool):
        x = pool.reshape(P // page_size, page_size, Hk, D)
        if layout == "HND":
            x = x.transpose(1, 2).contiguous()
        pools.append(x)
    case.k_pool, case.v_pool = pools
    return case


# Keyword sets the call without k_rot must give the same bits for (SPEC §4, §6, §7).
KEYWORDS = {
    "plain": {},
    "gptj_partial_yarn": dict(rotary_dim=32, interleaved=True,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 4096}),
    "fp8_pool": dict(k_scale=0.05, v_scale=0.3),
    "fp8_pool_fp8_q": dict(k_scale=0.05, v_scale=0.3, q_out_dtype=FP8, q_scale=0.02),
    "qk_norm": "norm",
    "paged_nhd": ("NHD", 8),
    "paged_hnd_fp8": ("HND", 4),
    "checked_slots": dict(check_slots=True),
}


def setup(case, name, rng):
    """The call's keywords (the case's pools replaced where the set needs other pools)."""
    kw = KEYWORDS[name]
    if kw == "norm":
        D = case.q.shape[2]
        w = torch.from_numpy(1 + 0.3 * rng.standard_normal((2, D))).to(case.q.dtype) \
            .to(case.q.device)
        return dict(q_norm_weight=w[0], k_norm_weight=w[1], norm_eps=1e-6)
    if isinstance(kw, tuple):
        paged(case, *kw)
        extra = dict(kv_layout=kw[0])
        if name.endswith("fp8"):
            case.k_pool, case.v_pool = case.k_pool.to(FP8), case.v_pool.to(FP8)
            extra.update(k_scale=0.5, v_scale=0.25)
        return extra
    if "k_scale" in kw:
        case.k_pool, case.v_pool = case.k_pool.to(FP8), case.v_pool.to(FP8)
    return dict(kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(KEYWORDS))
def test_same_bits_as_the_call_with_k_rot(kernel_device, rng, dtype, name):
    case = make_case("torch", dtype, rng, T=19, Hq=8, Hk=2, D=64, P=48, device=kernel_device)
    kw = setup(case, name, rng)
    case.snapshot()
    q_ref, _, k_pool, v_pool = default_call(case, **kw)
    k_before = case.k.clone()
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(**kw, return_k_rot=False))
    assert out[1] is None
    assert out[2] is case.k_pool and out[3] is case.v_pool
    assert_same_bits(out[0], q_ref, "q_rot")
    assert_same_bits(case.k_pool, k_pool, "k_pool")
    assert_same_bits(case.v_pool, v_pool, "v_pool")
    assert_same_bits(case.k, k_before, "k")
    case.assert_unchanged("q", "k", "v", "positions", "slots")


@pytest.mark.parametrize("fp8_pool", [False, True])
def test_inplace_rotates_q_and_leaves_k(kernel_device, rng, fp8_pool):
    case = make_case("torch", "bfloat16", rng, T=11, Hq=4, Hk=2, D=64, P=32,
                     device=kernel_device)
    kw = setup(case, "fp8_pool" if fp8_pool else "plain", rng)
    case.snapshot()
    q_ref, _, k_pool, v_pool = default_call(case, **kw)
    q, k = case.q.clone(), case.k.clone()
    out = ropepool.rope_pool_fused(q, k, *case.args()[2:],
                                   **case.kwargs(**kw, inplace=True, return_k_rot=False))
    assert out[0] is q and out[1] is None
    assert_same_bits(q, q_ref, "q rotated in place")
    assert_same_bits(k, case.k, "k left as it was")
    assert_same_bits(case.k_pool, k_pool, "k_pool")
    assert_same_bits(case.v_pool, v_pool, "v_pool")


def test_q_out_given(kernel_device, rng):
    case = make_case("torch", "float16", rng, T=9, Hq=4, Hk=2, D=32, P=24,
                     device=kernel_device).snapshot()
    q_ref, _, k_pool, v_pool = default_call(case)
    q_out = torch.full_like(case.q, float("nan"))
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(q_out=q_out, return_k_rot=False))
    assert out[0] is q_out and out[1] is None
    assert_same_bits(q_out, q_ref, "q_out")
    assert_same_bits(case.k_pool, k_pool, "k_pool")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy(rng, dtype):
    case = make_case("numpy", dtype, rng, T=13, Hq=4, Hk=2, D=32, P=40).snapshot()
    q_ref, _, k_pool, v_pool = default_call(case)
    out = ropepool.rope_pool_fused(*case.args(), **case.kwargs(return_k_rot=False))
    assert out[1] is None
    assert_same_bits(out[0], q_ref, "q_rot")
    assert_same_bits(case.k_pool, k_pool, "k_pool")
    assert_same_bits(case.v_pool, v_pool, "v_pool")
    case.assert_unchanged("q", "k", "v", "positions", "slots")


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_k_out_is_rejected_and_nothing_written(rng, framework):
    case = make_case(framework, "float32", rng, T=5, Hq=4, Hk=2, D=32, P=16).snapshot()
    k_out = case.k.copy() if framework == "numpy" else case.k.clone()
    message = ("rope_pool_fused: k_out cannot be combined with return_k_rot=False (no k_rot is "
               "written); pass k_out or return_k_rot=False, not both")
    for fn in (ropepool.rope_pool_fused, ropepool.validate_rope_pool):
        with pytest.raises(ValueError) as e:
            fn(*case.args(), **case.kwargs(k_out=k_out, return_k_rot=False))
        assert str(e.value) == message
    case.assert_unchanged("q", "k", "v", "positions", "slots", "k_pool", "v_pool")


def test_validation_without_k_rot(rng):
    """validate_rope_pool takes the keyword; the core's other checks still run (a bad pool
    is reported, nothing written)."""
    case = make_case("torch", "bfloat16", rng, T=6, Hq=4, Hk=2, D=32, P=16).snapshot()
    ropepool.validate_rope_pool(*case.args(), **case.kwargs(return_k_rot=False))
    bad = case.k_pool[:, :1]
    with pytest.raises(ValueError, match="k_pool has incompatible shape"):
        ropepool.rope_pool_fused(*case.args()[:5], bad, case.v_pool[:, :1],
                                 **case.kwargs(return_k_rot=False))
    case.assert_unchanged("q", "k", "v", "positions", "slots", "k_pool", "v_pool")


def test_opcheck_with_k_out_none(kernel_device, rng):
    """torch.library.opcheck on rope_pool_fused_out with k_out=None (`Tensor(d!)? k_out`)."""
    case = make_case("torch", "bfloat16", rng, T=7, Hq=4, Hk=2, D=64, P=16, device=kernel_device)
    q_out = torch.empty_like(case.q)
    args = case.args() + (q_out, None, 64, 4, 2, case.rope_base)
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused_out.default, args)


def _step(q, k, v, positions, slots, k_pool, v_pool, kw):
    q = q * 1.0  # an op before, so the custom op sits inside a larger graph
    return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool,
                                    return_k_rot=False, **kw)


@pytest.mark.parametrize("fp8", [False, True])
def test_compile_fullgraph(kernel_device, rng, fp8):
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    for T_ in (13, 29):
        case = make_case("torch", "bfloat16", rng, T=T_, Hq=8, Hk=2, D=64, P=64,
                         device=kernel_device)
        kw = setup(case, "fp8_pool_fp8_q" if fp8 else "plain", rng)
        case.snapshot()
        q_ref, _, k_pool, v_pool = default_call(case, **kw)
        q_rot, k_rot, kp, vp = compiled(*case.args(), case.kwargs(**kw))
        assert k_rot is None and kp is case.k_pool and vp is case.v_pool
        assert_same_bits(q_rot, q_ref, "q_rot")
        assert_same_bits(case.k_pool, k_pool, "k_pool")
        assert_same_bits(case.v_pool, v_pool, "v_pool")
        case.assert_unchanged("q", "k", "v", "positions", "slots")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_capture(rng):
    """A captured call without k_rot replays with the static inputs' current contents."""
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    T_, Hq, Hk, D_, P_ = 32, 8, 2, 128, 96
    case = make_case("torch", "bfloat16", rng, T=T_, Hq=Hq, Hk=Hk, D=D_, P=P_, device="cuda")
    q_out = torch.empty_like(case.q)
    graph, out = capture_graph(lambda: ropepool.rope_pool_fused(
        *case.args(), **case.kwargs(q_out=q_out, return_k_rot=False)))
    assert out[0] is q_out and out[1] is None
    for _ in range(2):
        case.copy_from(make_case("torch", "bfloat16", rng, T=T_, Hq=Hq, Hk=Hk, D=D_, P=P_,
                                 device="cuda", rope_base=case.rope_base))
        q_out.fill_(float("nan"))
        q_ref, _, k_pool, v_pool = default_call(case)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(q_out, q_ref, "q_out after replay")
        assert_same_bits(case.k_pool, k_pool, "k_pool after replay")
        assert_same_bits(case.v_pool, v_pool, "v_pool after replay")
