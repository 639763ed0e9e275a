"""Attention of a few queries over the KV cache in one C call (attention.c)."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library


def attend_short(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 softcap: float | None) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, Hkv, S, D] (float32, each key's D values contiguous), mask
    [B, 1, T, S] bool -> [B, H, T, D] (a view of a [B, T, H, D] tensor: the output projection
    reads it without a copy)."""
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or k.stride(-2) != d:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(-2) != d:
        v = v.contiguous()
    if mask is not None:
        mask = mask.expand(b, 1, t, s)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    work = torch.empty(library().attend_work(b, h, t, s, d), dtype=torch.float32)
    library().attend_rows(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0),
        0 if mask is None else mask.stride(2), out.data_ptr(),
        b, h, hkv, t, s, d, scale, softcap or 0.0, work.data_ptr(), torch.get_num_threads())
    return out.transpose(1, 2)
