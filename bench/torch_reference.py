"""The unfused PyTorch path both benchmarks compare ropepool against (the same math).

float64 angles (as accurate as ropepool's schedule), float32 NeoX rotation, one rounding to
the dtype, then `index_copy_` of k_rot and v into the pools. The SPEC §7 fusions: the QK
RMSNorm as transformers' Qwen3RMSNorm computes it, and mRoPE angles from positions [3, T].
"""

import torch


def make_inv_freq(head_dim, rope_base, device="cpu"):
    """inv_freq[i] = rope_base ** (-2i / head_dim) in float64 (as ropepool's schedule)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return rope_base ** (-2.0 * i / head_dim)


def mrope_axes(mrope_section, interleaved, device="cpu"):
    """The position row (0 temporal, 1 height, 2 width) each frequency i < R/2 reads, as
    SPEC §7 defines it: sections in order (Qwen2-VL), or interleaved (Qwen3-VL)."""
    s_t, s_h, s_w = mrope_section
    i = torch.arange(s_t + s_h + s_w, device=device)
    if not interleaved:
        return (i >= s_t).long() + (i >= s_t + s_h).long()
    axes = torch.zeros_like(i)
    axes[(i % 3 == 1) & (i < 3 * s_h)] = 1
    axes[(i % 3 == 2) & (i < 3 * s_w)] = 2
    return axes


def rope_angles(positions, inv_freq64, mrope_section=None, mrope_interleaved=False):
    """theta [T, R/2] in float64: positions [T], or with mrope_section positions [3, T] and
    each frequency's position taken from its row."""
    if mrope_section is None:
        return positions.to(torch.float64)[:, None] * inv_freq64[None, :]
    axes = mrope_axes(mrope_section, mrope_interleaved, positions.device)
    return positions.to(torch.float64)[axes].t() * inv_freq64[None, :]


def torch_rms_norm(x, weight, eps):
    """transformers' Qwen3RMSNorm over the last dimension (SPEC §7 "rms"): mean and rsqrt in
    float32, the normalised value rounded to x's dtype, times the weight, rounded to x's dtype
    again (a float32 weight's float32 product too: the rotation consumes x's dtype)."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    normalised = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return (weight * normalised).to(x.dtype)


def torch_rope_f32(q, k, positions, inv_freq64, mrope_section=None, mrope_interleaved=False):
    """q and k rotated (NeoX pairs), in float32 before the one rounding to their dtype."""
    half = q.shape[-1] // 2
    theta = rope_angles(positions, inv_freq64, mrope_section, mrope_interleaved)  # [T, D/2]
    cos = torch.cos(theta).to(torch.float32)
    sin = torch.sin(theta).to(torch.float32)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]

    def rotate(x):
        xf = x.to(torch.float32)
        rotated_half = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return xf * cos + rotated_half * sin

    return rotate(q), rotate(k)


def torch_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64, *,
                    skip_negative_slots=True, mrope_section=None, mrope_interleaved=False):
    """Rotate q and k, write k_rot and v into the pool rows of the tokens' slots.

    skip_negative_slots=False assumes every slot >= 0 and indexes with them directly, which
    on a GPU avoids the host synchronisation of a boolean mask (and keeps it capturable).
    """
    q_f, k_f = torch_rope_f32(q, k, positions, inv_freq64, mrope_section, mrope_interleaved)
    q_rot, k_rot = q_f.to(q.dtype), k_f.to(k.dtype)
    if skip_negative_slots:
        written = slots >= 0
        rows = slots[written].to(torch.int64)
        k_pool.index_copy_(0, rows, k_rot[written])
        v_pool.index_copy_(0, rows, v[written])
    else:
        rows = slots.to(torch.int64)
        k_pool.index_copy_(0, rows, k_rot)
        v_pool.index_copy_(0, rows, v)
    return q_rot, k_rot, k_pool, v_pool


def torch_norm_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq64, q_norm_weight,
                         k_norm_weight, eps, *, skip_negative_slots=True):
    """The unfused Qwen3 sequence: every head of q and of k normalised (torch_rms_norm), then
    rotated and written into the pools as torch_rope_pool does."""
    return torch_rope_pool(torch_rms_norm(q, q_norm_weight, eps),
                           torch_rms_norm(k, k_norm_weight, eps), v, positions, slots, k_pool,
                           v_pool, inv_freq64, skip_negative_slots=skip_negative_slots)


def torch_rope_fp8_paged(q, k, v, positions, slots, k_cache, v_cache, inv_freq64, k_scale,
                         v_scale, page_size):
    """The same rotation, k and v quantised to float8 e4m3 (x / scale, saturated to +-448)
    and written into an NHD paged cache [pages, page_size, Hk, D] at (slot // page_size,
    slot % page_size); every slot >= 0 (no host synchronisation)."""
    q_f, k_f = torch_rope_f32(q, k, positions, inv_freq64)
    fp8 = k_cache.dtype
    s = slots.to(torch.int64)
    page, row = s // page_size, s % page_size
    k_cache[page, row] = (k_f / k_scale).clamp(-448.0, 448.0).to(fp8)
    v_cache[page, row] = (v.to(torch.float32) / v_scale).clamp(-448.0, 448.0).to(fp8)
    return q_f.to(q.dtype), k_f.to(k.dtype)
