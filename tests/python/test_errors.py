"""SPEC §2: validation order and exact messages, shapes printed the way the caller's
framework prints them, hints as exception notes (never in the message), nothing written."""

import re

import numpy as np
import pytest
import torch

import ropepool
from rope_testing import make_case

T, HQ, HK, D, P = 5, 4, 2, 16, 12


def shape_text(framework, shape):
    """`str(x.shape)` spelled out independently of the code under test."""
    dims = ", ".join(str(int(n)) for n in shape)
    if framework == "torch":
        return f"torch.Size([{dims}])"
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def random_like(framework, rng, shape, dtype="float32", device="cpu"):
    x = rng.standard_normal(shape)
    if framework == "torch":
        return torch.from_numpy(x).to({"float32": torch.float32, "float16": torch.float16,
                                       "bfloat16": torch.bfloat16}[dtype]).to(device)
    return x.astype(dtype)


def expect_error(case, message, note=None, **extra):
    """Exactly `message` (full string), `note` as the only exception note (or no notes),
    and every argument bit-identical afterwards."""
    case.snapshot()
    # pytest's `match` also sees the notes, so the full-string check is done on str() itself.
    with pytest.raises(ValueError, match=f"^{re.escape(message)}") as info:
        ropepool.rope_pool_fused(*case.args(), **case.kwargs(**extra))
    assert str(info.value) == message
    notes = getattr(info.value, "__notes__", None)
    if note is None:
        assert notes is None, f"unexpected notes {notes}"
    else:
        assert notes == [note]
        assert note not in str(info.value)
    case.assert_unchanged()
    return info.value


@pytest.fixture(params=["torch", "numpy"])
def framework(request, device):
    if request.param == "numpy" and device != "cpu":
        pytest.skip("NumPy arrays live on the CPU")
    return request.param


@pytest.fixture
def case(framework, device, rng):
    """A valid call; each test breaks one thing."""
    return make_case(framework, "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P, device=device)


def with_(case, **changes):
    for name, value in changes.items():
        setattr(case, name, value)
    return case


# ---- SPEC §2 checks 1-11, exact contract text ----------------------------------------------

def test_1_qkv_rank(case, framework):
    expect_error(with_(case, q=case.q[:, 0]), "rope_pool_fused expects q/k/v to be 3-D")


def test_1_v_rank(case, framework):
    expect_error(with_(case, v=case.v[None]), "rope_pool_fused expects q/k/v to be 3-D")


def test_2_positions_slots_rank(case, framework):
    expect_error(with_(case, positions=case.positions[:, None]),
                 "rope_pool_fused expects positions/slots to be 1-D")


def test_2_slots_rank(case, framework):
    expect_error(with_(case, slots=case.slots.reshape(1, T)),
                 "rope_pool_fused expects positions/slots to be 1-D")


def test_3_layer_stacked_pool(case, framework):
    stacked = case.k_pool[None]
    expect_error(with_(case, k_pool=stacked), "rope_pool_fused expects pool tensors to be 3-D",
                 note=('a layer-stacked pool [L, P, H, D] must be indexed as `k_pool[layer]`; a paged '
                       'pool needs kv_layout "NHD" ([pages, page_size, H, D]) or "HND" '
                       '([pages, H, page_size, D])'))


def test_3_flat_pool(case, framework):
    flat = case.v_pool.reshape(P, HK * D)
    expect_error(with_(case, v_pool=flat), "rope_pool_fused expects pool tensors to be 3-D",
                 note="a flat pool [P, H*D] must be viewed as `[P, H, D]`")


def test_4_q_shape(case, framework, rng, device):
    q = random_like(framework, rng, (T, HQ + 1, D), device=device)
    expect_error(with_(case, q=q), "q shape must be [num_tokens, num_qo_heads, head_dim], got "
                 + shape_text(framework, (T, HQ + 1, D)),
                 note=f"num_qo_heads = {HQ} but q.shape[1] = {HQ + 1}")


def test_4_q_head_dim(case, framework, rng, device):
    q = random_like(framework, rng, (T, HQ, D + 2), device=device)
    expect_error(with_(case, q=q), "q shape must be [num_tokens, num_qo_heads, head_dim], got "
                 + shape_text(framework, (T, HQ, D + 2)),
                 note=f"head_dim = {D} but q.shape[2] = {D + 2}")


def test_5_k_shape(case, framework, rng, device):
    k = random_like(framework, rng, (T + 1, HK, D), device=device)
    expect_error(with_(case, k=k), "k shape must be [num_tokens, num_kv_heads, head_dim], got "
                 + shape_text(framework, (T + 1, HK, D)),
                 note=f"k.shape[0] = {T + 1} but q has {T} tokens")


def test_6_v_shape(case, framework, rng, device):
    v = random_like(framework, rng, (T, HK + 1, D), device=device)
    expect_error(with_(case, v=v), "v shape must match k shape, got "
                 + shape_text(framework, (T, HK + 1, D)) + " vs "
                 + shape_text(framework, (T, HK, D)))


def test_7_positions_length(case, framework):
    expect_error(with_(case, positions=case.positions[:-1]),
                 "positions/slots must have one entry per token")


def test_7_slots_length(case, framework):
    slots = case.slots[:-1]
    expect_error(with_(case, slots=slots), "positions/slots must have one entry per token")


def test_8_k_pool_shape(case, framework, rng, device):
    pool = random_like(framework, rng, (P, HK, D + 2), device=device)
    expect_error(with_(case, k_pool=pool, v_pool=random_like(framework, rng, (P, HK, D + 2),
                                                             device=device)),
                 "k_pool has incompatible shape " + shape_text(framework, (P, HK, D + 2)))


def test_8_k_pool_heads_and_head_size_swapped(case, framework, rng, device):
    pool = random_like(framework, rng, (P, D, HK), device=device)
    expect_error(with_(case, k_pool=pool),
                 "k_pool has incompatible shape " + shape_text(framework, (P, D, HK)),
                 note="the pool's heads and head size are swapped or merged; view it as "
                      "[P, num_kv_heads, head_dim]")


def test_9_v_pool_shape(case, framework, rng, device):
    pool = random_like(framework, rng, (P + 1, HK, D), device=device)
    expect_error(with_(case, v_pool=pool), "v_pool shape must match k_pool shape, got "
                 + shape_text(framework, (P + 1, HK, D)) + " vs "
                 + shape_text(framework, (P, HK, D)))


def test_10_qkv_dtypes(case, framework, rng, device):
    k = random_like(framework, rng, (T, HK, D), dtype="float16", device=device)
    expect_error(with_(case, k=k), "q/k/v dtypes must match",
                 note="got q float32, k float16, v float32")


def test_11_pool_dtypes(case, framework, rng, device):
    pool = random_like(framework, rng, (P, HK, D), dtype="float16", device=device)
    expect_error(with_(case, v_pool=pool), "pool dtypes must match q/k/v dtype",
                 note="got k_pool float32, v_pool float16 for q/k/v of float32; the pools hold "
                 "rotated k and v in q's dtype, or both in float8_e4m3fn")


# ---- order: the first failing check wins ---------------------------------------------------

def test_order_rank_before_everything(case, framework, rng, device):
    k = random_like(framework, rng, (T, HK, D), dtype="float16", device=device)
    expect_error(with_(case, q=case.q[0], positions=case.positions[None], k=k,
                       k_pool=case.k_pool[None]),
                 "rope_pool_fused expects q/k/v to be 3-D")


def test_order_shape_before_dtype(case, framework, rng, device):
    q = random_like(framework, rng, (T, HQ + 2, D), dtype="float16", device=device)
    expect_error(with_(case, q=q), "q shape must be [num_tokens, num_qo_heads, head_dim], got "
                 + shape_text(framework, (T, HQ + 2, D)),
                 note=f"num_qo_heads = {HQ} but q.shape[1] = {HQ + 2}")


def test_order_contract_before_index_dtype(case, framework, rng, device):
    pool = random_like(framework, rng, (P, HK, D), dtype="float16", device=device)
    positions = case.positions.astype(np.float32) if framework == "numpy" else case.positions.float()
    expect_error(with_(case, k_pool=pool, v_pool=pool, positions=positions),
                 "pool dtypes must match q/k/v dtype",
                 note="got k_pool float16, v_pool float16 for q/k/v of float32; the pools hold "
                 "rotated k and v in q's dtype, or both in float8_e4m3fn")


def test_order_slot_range_before_duplicates(case, framework):
    values = [3, 3, P + 7, 1, 2]
    case.slots[:] = torch.tensor(values) if framework == "torch" else np.array(values)
    expect_error(case, f"rope_pool_fused: slots[2] = {P + 7} is out of range for a pool of "
                 f"{P} slots",
                 note="slots index rows of k_pool/v_pool; use a negative slot to skip a token",
                 check_slots=True)


# ---- the checks after the contract (messages from src/rope_pool.cpp) -----------------------

def test_positions_dtype(case, framework):
    positions = case.positions.astype(np.float32) if framework == "numpy" else case.positions.float()
    expect_error(with_(case, positions=positions),
                 "rope_pool_fused: positions must be int32 or int64, got float32")


def test_head_dim_odd(framework, device, rng):
    case = make_case(framework, "float32", rng, T=T, Hq=HQ, Hk=HK, D=7, P=P, device=device)
    expect_error(case, "rope_pool_fused: head_dim must be even and > 0, got 7")


@pytest.mark.parametrize("rope_base,text", [(0.0, "0.000000"), (-1.0, "-1.000000"),
                                            (float("inf"), "inf")])
def test_rope_base(case, framework, rope_base, text):
    expect_error(with_(case, rope_base=rope_base),
                 f"rope_pool_fused: rope_base must be finite and > 0, got {text}")


def test_rope_base_nan(case, framework):
    with pytest.raises(ValueError, match=r"^rope_pool_fused: rope_base must be finite and > 0, "
                                         r"got -?nan$"):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs() | {"rope_base": float("nan")})


def test_unsupported_float_dtype(framework, device, rng):
    case = make_case(framework, "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P, device=device)
    for name in ("q", "k", "v", "k_pool", "v_pool"):
        x = getattr(case, name)
        setattr(case, name, x.astype(np.float64) if framework == "numpy" else x.double())
    # The dtype's name in this message is the C++ layer's (it reads "other" for float64).
    case.snapshot()
    with pytest.raises(ValueError, match=r"^rope_pool_fused: unsupported dtype \w+ for "
                                         r"q/k/v/pools; expected float32, float16 or bfloat16$"):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs())
    case.assert_unchanged()


def test_last_dim_not_contiguous(case, framework, rng, device):
    """A non-contiguous last dimension is rejected with the strides (in elements) and a hint,
    not silently copied."""
    wide = random_like(framework, rng, (T, HK, 2 * D), device=device)
    k = wide[:, :, ::2]
    strides = (2 * HK * D, 2 * D, 2)
    expect_error(with_(case, k=k),
                 f"rope_pool_fused: k must have a contiguous last dimension (stride 1), got "
                 f"strides {strides}",
                 note="pass a view whose head_dim axis is contiguous, e.g. x.contiguous()")


def test_transposed_q(case, framework):
    q = case.q.transpose(0, 2, 1).copy().transpose(0, 2, 1) if framework == "numpy" else \
        case.q.transpose(1, 2).contiguous().transpose(1, 2)
    expect_error(with_(case, q=q),
                 f"rope_pool_fused: q must have a contiguous last dimension (stride 1), got "
                 f"strides {(HQ * D, 1, HQ)}",
                 note="pass a view whose head_dim axis is contiguous, e.g. x.contiguous()")


def test_broadcast_pool_is_rejected(device, rng):
    """An expand()ed pool (stride 0) would make every slot the same memory."""
    case = make_case("torch", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P, device=device)
    pool = case.k_pool[:1].expand(P, HK, D)
    expect_error(with_(case, k_pool=pool),
                 f"rope_pool_fused: k_pool has overlapping or negative strides (0, {D}, 1); "
                 "every element it receives needs its own memory")


# ---- devices --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tensors_on_two_devices(rng):
    if not ropepool.cuda_backend:
        pytest.skip("needs the CUDA backend (otherwise the no-backend error comes first)")
    case = make_case("torch", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P, device="cuda")
    expect_error(with_(case, v_pool=case.v_pool.cpu()),
                 f"rope_pool_fused: all tensors must be on one device, got q on "
                 f"cuda:{case.q.device.index} and v_pool on cpu",
                 note="move every tensor (the pools too) to the device the model runs on")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_without_cuda_backend(rng):
    if ropepool.cuda_backend:
        pytest.skip("this build has the CUDA backend")
    case = make_case("torch", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P, device="cuda")
    expect_error(case, f"rope_pool_fused: tensors are on cuda:{case.q.device.index} but this "
                 "build of ropepool has no CUDA backend",
                 note="rebuild with CUDA (nvcc on PATH, -DROPEPOOL_WITH_CUDA=ON)")


# ---- arguments that are not arrays: TypeError before any validation ----------------------

def test_not_an_array(case, framework):
    message = {
        "numpy": "rope_pool_fused: slots must be an array (torch.Tensor, numpy.ndarray or "
                 "another DLPack producer), got list",
        "torch": "rope_pool_fused: slots is a list but other arguments are torch.Tensors; "
                 "pass every array as a torch.Tensor",
    }[framework]
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        ropepool.rope_pool_fused(*with_(case, slots=[0, 1, 2, 3, 4]).args(), **case.kwargs())


def test_torch_mixed_with_numpy(rng):
    case = make_case("torch", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P)
    with pytest.raises(TypeError, match=re.escape(
            "rope_pool_fused: v_pool is a ndarray but other arguments are torch.Tensors; "
            "pass every array as a torch.Tensor")):
        ropepool.rope_pool_fused(*with_(case, v_pool=case.v_pool.numpy()).args(), **case.kwargs())


def test_read_only_pool(rng):
    case = make_case("numpy", "float32", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P)
    case.k_pool.flags.writeable = False
    with pytest.raises(TypeError, match=re.escape(
            "rope_pool_fused: k_pool is read-only; the op writes into it, pass a writable array")):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs())


def test_read_only_inputs_are_fine(rng):
    case = make_case("numpy", "float16", rng, T=T, Hq=HQ, Hk=HK, D=D, P=P)
    for x in (case.q, case.k, case.v, case.positions, case.slots):
        x.flags.writeable = False
    q_rot, _, _, _ = ropepool.rope_pool_fused(*case.args(), **case.kwargs())
    assert not np.isnan(q_rot).any()


def test_keyword_only_and_integer_params(case):
    with pytest.raises(TypeError):
        ropepool.rope_pool_fused(*case.args(), D, HQ, HK, 10000.0)
    with pytest.raises(TypeError):
        ropepool.rope_pool_fused(*case.args(), **case.kwargs() | {"head_dim": float(D)})
