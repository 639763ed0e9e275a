"""q/k norms, RoPE and the KV cache write of one attention layer, in one C call (qk_rope.c)."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library

MAX_HEAD_DIM = 1024  # the kernel's per-head scratch


def qk_rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_scale: torch.Tensor | None, k_scale: torch.Tensor | None, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """qkv [B, T, (H + 2 Hkv) D] float32 -> rotated queries [B, T, H, D]; rotated keys and the
    values are written into k_cache, v_cache [B, Hkv, capacity, D] at `positions` [B, T].
    cos, sin: [B, T, D] (RopeTable.lookup, sin signed); q_scale, k_scale: the q/k norms' scales
    (None: the model has no q/k norms)."""
    b, t, _ = qkv.shape
    qkv, positions = qkv.contiguous(), positions.contiguous()
    cos, sin = cos.reshape(b * t, head_dim).contiguous(), sin.reshape(b * t, head_dim).contiguous()
    q = torch.empty(b, t, num_heads, head_dim, dtype=torch.float32)
    library().qk_rope_write(
        qkv.data_ptr(), b * t, t, num_heads, num_kv_heads, head_dim,
        None if q_scale is None else q_scale.data_ptr(), None if k_scale is None else k_scale.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), q.data_ptr(),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), torch.get_num_threads())
    return q
