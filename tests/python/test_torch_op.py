"""The torch.library custom op: registration checks (opcheck), torch.compile(fullgraph=True)
without graph breaks, results identical to eager, pools updated in place."""

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import (Case, assert_pool_writes, assert_within_bound, capture_graph, make_case,
                          raw_bits)


def clone_case(case):
    """Same inputs, private copies of the pools."""
    return Case(case.q, case.k, case.v, case.positions, case.slots, case.k_pool.clone(),
                case.v_pool.clone(), case.head_dim, case.num_qo_heads, case.num_kv_heads,
                case.rope_base).snapshot()


def test_registered_as_custom_op():
    """The schema declares exactly k_pool and v_pool as written in place, and two fresh
    outputs (a custom op cannot return its mutated inputs)."""
    schema = torch.ops.ropepool.rope_pool_fused.default._schema
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["k_pool", "v_pool"], str(schema)
    scalars = ["head_dim", "num_qo_heads", "num_kv_heads", "rope_base", "check_slots",
               "rotary_dim", "interleaved", "inv_freq", "attention_scaling", "kv_layout",
               "k_scale_tensor", "k_scale", "v_scale_tensor", "v_scale", "q_scale_tensor",
               "q_scale", "q_fp8", "q_norm_weight", "k_norm_weight", "norm_eps", "norm_style",
               "mrope_section", "mrope_interleaved"]
    assert [a.name for a in schema.arguments] == [
        "q", "k", "v", "positions", "slots", "k_pool", "v_pool", *scalars]
    assert len(schema.returns) == 2 and all(r.alias_info is None for r in schema.returns)
    # the in-place variant (inplace=True) writes q and k too and returns nothing
    schema = torch.ops.ropepool.rope_pool_fused_.default._schema
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["q", "k", "k_pool", "v_pool"], str(schema)
    assert [a.name for a in schema.arguments][7:] == scalars and len(schema.returns) == 0


def test_pool_versions_bumped(rng):
    """Autograd learns that the pools changed in place (as for any torch in-place op)."""
    case = make_case("torch", "float32", rng, T=3, Hq=4, Hk=2, D=64, P=8)
    versions = (case.k_pool._version, case.v_pool._version, case.q._version)
    ropepool.rope_pool_fused(*case.args(), **case.kwargs())
    assert case.k_pool._version > versions[0] and case.v_pool._version > versions[1]
    assert case.q._version == versions[2]


def test_opcheck(kernel_device, rng):
    """torch.library.opcheck: schema (mutations declared), fake implementation matches the
    real one, works under FakeTensor/functionalization."""
    case = make_case("torch", "bfloat16", rng, T=7, Hq=4, Hk=2, D=64, P=16, device=kernel_device)
    args = case.args() + (case.head_dim, case.num_qo_heads, case.num_kv_heads, case.rope_base,
                          False)
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused.default, args)
    # SPEC §4: partial interleaved rotary with a precomputed schedule, and the in-place op
    sched = ropepool.rope_schedule(head_dim=case.head_dim, rope_base=case.rope_base,
                                   rotary_dim=32, rope_scaling={"rope_type": "linear",
                                                                "factor": 2.0})
    args = args + (32, True, list(sched.inv_freq), 0.75)
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused.default, args)
    torch.library.opcheck(torch.ops.ropepool.rope_pool_fused_.default, args)


def _attention_prologue(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads,
                        num_kv_heads, rope_base):
    """What a model's attention layer does around the op: torch ops before and after."""
    q = q * 1.0  # an op before, so the custom op sits inside a larger graph
    q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base)
    return q_rot + 0.0, k_rot, k_pool, v_pool


def _op_alone(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads,
              num_kv_heads, rope_base):
    return ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base)


# aot_eager traces everything inductor sees (FakeTensor, functionalization of the pool
# mutation) and is fast; inductor itself is run on the op alone, one shape, because each of
# its C++ kernel compiles costs tens of seconds on a small machine.
@pytest.mark.parametrize("backend,fn,token_counts", [
    ("aot_eager", _attention_prologue, (13, 29)),
    ("inductor", _op_alone, (13,)),
])
def test_compile_fullgraph_matches_eager(backend, fn, token_counts, kernel_device, rng):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for T in token_counts:  # a second shape recompiles or runs dynamic, never breaks the graph
        eager = make_case("torch", "bfloat16", rng, T=T, Hq=8, Hk=2, D=128, P=64,
                          device=kernel_device).snapshot()
        traced = clone_case(eager)
        q_e, k_e, _, _ = fn(*eager.args(), **eager.kwargs())
        q_c, k_c, k_pool, v_pool = compiled(*traced.args(), **traced.kwargs())
        assert k_pool is traced.k_pool and v_pool is traced.v_pool
        np.testing.assert_array_equal(raw_bits(q_c), raw_bits(q_e))
        np.testing.assert_array_equal(raw_bits(k_c), raw_bits(k_e))
        np.testing.assert_array_equal(raw_bits(traced.k_pool), raw_bits(eager.k_pool))
        np.testing.assert_array_equal(raw_bits(traced.v_pool), raw_bits(eager.v_pool))
        assert_within_bound(q_c, traced.q, traced.positions, traced.rope_base, "q_rot")
        assert_pool_writes(traced, k_c)
        traced.assert_unchanged("q", "k", "v", "positions", "slots")


def test_compile_counts_one_graph(rng):
    """fullgraph=True already fails on a graph break; this also checks the op is in the
    graph as one call, with the pools as mutated inputs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_attention_prologue, fullgraph=True, backend=counter)
    case = make_case("torch", "float32", rng, T=11, Hq=4, Hk=4, D=64, P=32).snapshot()
    compiled(*case.args(), **case.kwargs())
    assert counter.frame_count == 1
    graph_code = counter.graphs[0].code
    assert graph_code.count("ropepool.rope_pool_fused") == 1, graph_code


def test_errors_propagate_through_the_op(rng):
    """A ValueError raised inside the custom op keeps its message and note."""
    case = make_case("torch", "float32", rng, T=4, Hq=4, Hk=2, D=64, P=8)
    with pytest.raises(ValueError) as info:
        ropepool.rope_pool_fused(case.q, case.k, case.v, case.positions, case.slots,
                                 case.k_pool[None], case.v_pool, **case.kwargs())
    assert str(info.value) == "rope_pool_fused expects pool tensors to be 3-D"
    assert info.value.__notes__ == [
        'a layer-stacked pool [L, P, H, D] must be indexed as `k_pool[layer]`; a paged pool '
        'needs kv_layout "NHD" ([pages, page_size, H, D]) or "HND" ([pages, H, page_size, D])']


def test_inductor_writes_the_pools_in_place(rng):
    """Functionalization must not turn the in-place pool update into copy-then-write-back:
    the compiled code calls the op on the graph's own pool inputs, with no clone or copy_."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    case = make_case("torch", "float16", rng, T=6, Hq=4, Hk=2, D=64, P=20).snapshot()
    compiled = torch.compile(_op_alone, fullgraph=True, backend="inductor")
    (q_rot, k_rot, _, _), codes = run_and_get_code(compiled, *case.args(), **case.kwargs())
    code = "\n".join(codes)
    assert "torch.ops.ropepool.rope_pool_fused.default(" in code, code
    assert ".clone(" not in code and "copy_(" not in code, code
    assert_pool_writes(case, k_rot)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_side_stream_and_graph_replay(rng):
    """SPEC §5: the op runs on the caller's current stream and can be captured in a CUDA
    graph; replays with new contents of the static inputs give fresh results."""
    if not ropepool.cuda_backend:
        pytest.skip("this ropepool build has no CUDA backend")
    case = make_case("torch", "bfloat16", rng, T=32, Hq=8, Hk=2, D=128, P=96, device="cuda")
    graph, (q_rot, k_rot, _, _) = capture_graph(lambda: _op_alone(*case.args(), **case.kwargs()))
    case.copy_from(make_case("torch", "bfloat16", rng, T=32, Hq=8, Hk=2, D=128, P=96,
                             device="cuda"))
    case.snapshot()
    graph.replay()
    torch.cuda.synchronize()
    assert_within_bound(q_rot, case.q, case.positions, case.rope_base, "q_rot")
    assert_within_bound(k_rot, case.k, case.positions, case.rope_base, "k_rot")
    assert_pool_writes(case, k_rot)


def test_fake_tensors_take_the_custom_op(rng):
    """Eager calls on plain tensors skip the dispatcher; tensor subclasses (here FakeTensor,
    as torch.export and compile tracing see them) still go through the op's fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case("torch", "bfloat16", rng, T=5, Hq=4, Hk=2, D=64, P=16)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in case.args()]
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(*fake, **case.kwargs())
        assert q_rot.shape == case.q.shape and k_rot.shape == case.k.shape
        assert k_pool is fake[5] and v_pool is fake[6]


def test_eager_fast_path_matches_the_op(kernel_device, rng, monkeypatch):
    """The second eager call of a geometry takes the fast path (only the four required
    keywords): the same bits as the registered op, the pools' versions bumped, q/k written
    in place with inplace=True, and the core's exact errors for a bad call; keyword types
    the slow path rejects (a bool head_dim) are still rejected."""
    monkeypatch.setattr(ropepool._op, "_FAST_GEOMETRIES", set())  # (bounded: may be full)
    case = make_case("torch", "bfloat16", rng, T=5, Hq=4, Hk=2, D=64, P=16,
                     device=kernel_device, rope_base=12345.0)
    ref = clone_case(case)
    q_ref, k_ref = torch.ops.ropepool.rope_pool_fused(*ref.args(), 64, 4, 2, 12345.0)
    for _ in range(2):  # the first call registers the geometry, the second is the fast path
        run = clone_case(case)
        versions = (run.k_pool._version, run.v_pool._version)
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(*run.args(), **run.kwargs())
        assert k_pool is run.k_pool and v_pool is run.v_pool
        assert (raw_bits(q_rot) == raw_bits(q_ref)).all() and (raw_bits(k_rot) == raw_bits(k_ref)).all()
        assert (raw_bits(k_pool) == raw_bits(ref.k_pool)).all()
        assert (raw_bits(v_pool) == raw_bits(ref.v_pool)).all()
        assert run.k_pool._version > versions[0] and run.v_pool._version > versions[1]
        assert (64, 4, 2, 12345.0) in ropepool._op._FAST_GEOMETRIES  # the next call is fast
    run = clone_case(case)
    q, k = run.q.clone(), run.k.clone()
    out = ropepool.rope_pool_fused(q, k, *run.args()[2:], **run.kwargs(), inplace=True)
    assert out[0] is q and out[1] is k
    assert (raw_bits(q) == raw_bits(q_ref)).all() and (raw_bits(k) == raw_bits(k_ref)).all()
    bad = clone_case(case)
    with pytest.raises(ValueError, match=r"^k shape must be \[num_tokens, num_kv_heads, "
                                         r"head_dim\], got torch.Size\(\[5, 2, 32\]\)"):
        ropepool.rope_pool_fused(bad.q, bad.k[..., :32], *bad.args()[2:], **bad.kwargs())
    bad.assert_unchanged()
    with pytest.raises(TypeError, match="head_dim"):
        ropepool.rope_pool_fused(*bad.args(), head_dim=True, num_qo_heads=4, num_kv_heads=2,
                                 rope_base=12345.0)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_schedules_on_the_eager_fast_path(kernel_device, rng, monkeypatch):
    """A schedule= made by rope_schedule, and a rope_scaling dict an earlier call has made a
    schedule from, take the fast path: the same bits as the first call (the keyword
    machinery) and as schedule=. A changed dict makes its own schedule; a bad dict raises
    every time; a schedule made for another rope_base is still the slow path's error."""
    import ropepool._op as op
    monkeypatch.setattr(op, "_FAST_GEOMETRIES", set())
    monkeypatch.setattr(op, "_SCALING_SCHEDULES", {})
    taken = []
    fast = op._fast_keyword_call
    monkeypatch.setattr(op, "_fast_keyword_call", lambda *a: taken.append(a[-1]) or fast(*a))
    case = make_case("torch", "bfloat16", rng, T=6, Hq=4, Hk=2, D=64, P=16,
                     device=kernel_device, rope_base=500000.0)
    case.positions.copy_(torch.from_numpy(rng.integers(2**15, 2**17, size=6)).to(case.positions))

    def call(**kw):
        run = clone_case(case)
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(*run.args(), **run.kwargs(**kw))
        return [raw_bits(x) for x in (q_rot, k_rot, k_pool, v_pool)]

    def same(a, b, what):
        for name, x, y in zip(("q_rot", "k_rot", "k_pool", "v_pool"), a, b):
            np.testing.assert_array_equal(x, y, f"{name}: {what}")

    def schedule(scaling):
        return ropepool.rope_schedule(head_dim=64, rope_base=500000.0, rope_scaling=scaling)

    scaling = dict(LLAMA3_SCALING)
    first = call(rope_scaling=scaling)  # registers the geometry and the dict's schedule
    assert taken == []
    again = call(rope_scaling=scaling)
    assert len(taken) == 1 and taken[-1].inv_freq == schedule(scaling).inv_freq
    same(first, again, "rope_scaling, fast path")
    sched = schedule(scaling)
    same(first, call(schedule=sched), "schedule=")
    assert len(taken) == 2 and taken[-1] is sched
    plain = call()
    assert len(taken) == 2, "a plain call is _fast_call's"
    assert not (first[0] == plain[0]).all(), "llama3 changes the rotation at these positions"
    # a changed dict: its own schedule (slow, then fast)
    scaling["factor"] = 32.0
    changed = call(rope_scaling=scaling)
    assert len(taken) == 2
    same(changed, call(schedule=schedule(scaling)), "factor 32")
    assert not (changed[0] == first[0]).all()
    n = len(taken)
    same(changed, call(rope_scaling=scaling), "factor 32, fast path")
    assert len(taken) == n + 1
    # a bad dict raises on every call; another rope_base's schedule is an error
    bad = dict(LLAMA3_SCALING, rope_type="llama4")
    for _ in range(2):
        with pytest.raises(ValueError, match="llama4"):
            call(rope_scaling=bad)
    with pytest.raises(ValueError, match="disagrees with the schedule"):
        call(schedule=ropepool.rope_schedule(head_dim=64, rope_base=10000.0))
    with pytest.raises(ValueError, match="schedule replaces rope_scaling"):
        call(schedule=sched, rope_scaling=dict(LLAMA3_SCALING))
    assert len(taken) == n + 1
    # int and float values are different keys (each made once, the same schedule here)
    as_int = dict(LLAMA3_SCALING, factor=8)
    same(first, call(rope_scaling=as_int), "factor 8 (int)")
    assert len(taken) == n + 1
    same(first, call(rope_scaling=as_int), "factor 8 (int), fast path")
    assert len(taken) == n + 2
