"""Attention over the KV cache in one C call (attention.c): a few queries (decode, verify,
drafting) or a prompt's chunk. K and V may be float32 or float16; queries and outputs are float32."""

from __future__ import annotations

import threading

import torch

from specdraft.models.kernels.build import library

# The dtypes of K and V the kernels read (float16 widens exactly as it is loaded).
KV_DTYPES = (torch.float32, torch.float16)

_work = threading.local()  # the partials' buffer, kept between calls (a long context's is megabytes)


def _work_buffer(floats: int) -> torch.Tensor:
    buf = getattr(_work, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _work.buf = torch.empty(max(floats, 1), dtype=torch.float32)
    return buf


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    b, h, t, d = q.shape
    s = k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or k.stride(-2) != d:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(-2) != d:
        v = v.contiguous()
    if v.dtype != k.dtype:
        v = v.to(k.dtype)
    if mask is not None:
        mask = mask.expand(b, 1, t, s)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    args = (q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            int(k.dtype == torch.float16),
            None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0),
            0 if mask is None else mask.stride(2))
    return args, (q, k, v, mask)


def attend_short(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 softcap: float | None) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, Hkv, S, D] (float32 or float16, each key's D values
    contiguous), mask [B, 1, T, S] bool -> [B, H, T, D] (a view of a [B, T, H, D] tensor: the
    output projection reads it without a copy). Each row's result is the same whatever else the
    call computes (attention.c)."""
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    args, keep = _operands(q, k, v, mask)
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    work = _work_buffer(library().attend_work(b, h, t, s, d))
    library().attend_rows_kv(*args, out.data_ptr(), b, h, hkv, t, s, d, scale, softcap or 0.0, work.data_ptr(),
                             torch.get_num_threads())
    del keep
    return out.transpose(1, 2)


def attend_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """attend_short's contract for a prompt's chunk: keys in chunks with an online softmax, no
    [T, S] score matrix (attention.c, attend_prefill)."""
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    args, keep = _operands(q, k, v, mask)
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    library().attend_prefill(*args, out.data_ptr(), b, h, hkv, t, s, d, scale, 0.0, torch.get_num_threads())
    del keep
    return out.transpose(1, 2)
