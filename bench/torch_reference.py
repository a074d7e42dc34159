"""The unfused PyTorch path both benchmarks compare ropepool against (the same math).

float64 angles (as accurate as ropepool's schedule), float32 NeoX rotation, one rounding to
the dtype, then `index_copy_` of k_rot and v into the pools.
"""

import torch


def make_inv_freq(head_dim, rope_base, device="cpu"):
    """inv_freq[i] = rope_base ** (-2i / head_dim) in float64 (as ropepool's schedule)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return rope_base ** (-2.0 * i / head_dim)


def torch_rope_f32(q, k, positions, inv_freq64):
    """q and k rotated (NeoX pairs), in float32 before the one rounding to their dtype."""
    half = q.shape[-1] // 2
    theta = positions.to(torch.float64)[:, None] * inv_freq64[None, :]  # [T, D/2]
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
                    skip_negative_slots=True):
    """Rotate q and k, write k_rot and v into the pool rows of the tokens' slots.

    skip_negative_slots=False assumes every slot >= 0 and indexes with them directly, which
    on a GPU avoids the host synchronisation of a boolean mask (and keeps it capturable).
    """
    q_f, k_f = torch_rope_f32(q, k, positions, inv_freq64)
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
