"""A decoder layer's short forward with fp16 weights in one C call (decoder_layer.c)."""

from __future__ import annotations

import ctypes

import torch

from specdraft.models.kernels.build import library

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class LayerWeights(ctypes.Structure):
    """Pointers into the layer's own tensors: valid while those tensors live and stay in place."""

    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64),
                ("qkv_kv_heads", _I64), ("sandwich", _INT), ("act", _INT), ("eps", _F), ("qk_eps", _F),
                ("scale", _F), ("softcap", _F), ("layer_scalar", _F),
                ("norm_in", _P), ("norm_post_attn", _P), ("norm_pre_mlp", _P), ("norm_post_mlp", _P),
                ("q_norm", _P), ("k_norm", _P), ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
                ("qkv_bias", _P), ("o_bias", _P), ("gate_up_bias", _P), ("down_bias", _P)]


class LayerStep(ctypes.Structure):
    _fields_ = [("B", _I64), ("T", _I64), ("cos", _P), ("sin", _P), ("positions", _P), ("k_cache", _P),
                ("v_cache", _P), ("cache_sb", _I64), ("cache_sh", _I64), ("span_lo", _I64), ("span_len", _I64),
                ("mask", _P), ("mask_sb", _I64), ("mask_st", _I64)]


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decoder_layer(weights: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, span_lo: int,
                  span_hi: int, mask: torch.Tensor) -> torch.Tensor:
    """x [B, T, hidden] float32 -> the layer's output [B, T, hidden]; writes the new K/V into
    k_cache, v_cache [B, kv_heads, capacity, head_dim] (same strides, head_dim contiguous) at
    `positions` [B, T] (None: query-only, nothing written); attends over keys [span_lo, span_hi)
    under mask [B, 1, T, span] bool."""
    b, t, hidden = x.shape
    d = weights.head_dim
    x = x.contiguous()
    cos, sin = cos.reshape(b * t, d).contiguous(), sin.reshape(b * t, d).contiguous()
    mask = mask.expand(b, 1, t, span_hi - span_lo)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    positions = None if positions is None else positions.contiguous()
    step = LayerStep(b, t, cos.data_ptr(), sin.data_ptr(), pointer(positions), k_cache.data_ptr(),
                     v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), span_lo, span_hi - span_lo,
                     mask.data_ptr(), mask.stride(0), mask.stride(2))
    lib = library()
    scratch = torch.empty(lib.decoder_layer_scratch(ctypes.byref(weights), b * t, span_hi - span_lo),
                          dtype=torch.float32)
    out = torch.empty_like(x)
    lib.decoder_layer(ctypes.byref(weights), ctypes.byref(step), x.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
    return out


def fusable(linears, norms, act: str, qk_norms, head_dim: int) -> bool:
    """Whether decoder_layer.c computes a layer made of these parts: every projection holding
    fp16_gemv tiles, an activation gated_act.c takes, norms with float32 scales (or none) and one
    eps, q/k norms (those the layer has) with scales."""
    from specdraft.models.kernels.gated_act import KINDS
    from specdraft.models.kernels.qk_rope import MAX_HEAD_DIM
    from specdraft.models.quant import Fp16Linear

    qk_ok = all(n.weight is not None and n.native_ready() for n in qk_norms)
    return (all(type(m) is Fp16Linear and m.tiles is not None for m in linears) and qk_ok and act in KINDS
            and all(n.native_ready() for n in norms) and len({n.eps for n in norms}) == 1
            and head_dim <= MAX_HEAD_DIM)


def parts_key(linears, norms, *extra) -> tuple[tuple, tuple]:
    """(key, tiles): what a kept LayerWeights points into, as a key that changes when a projection
    or its tiles are replaced (`to()`, loading) or a norm's weight is written; keep `tiles` (and
    the modules) referenced with the weights so the ids stay theirs."""
    tiles = tuple(getattr(m, "tiles", None) for m in linears)
    versions = tuple(-1 if n.weight is None else n.weight._version for n in norms)
    return tuple(map(id, tuple(linears) + tiles)) + versions + extra, tiles


def reads_cache(k: torch.Tensor, v: torch.Tensor, head_dim: int) -> bool:
    """Whether K/V storage (or a key span of it) is laid out as decoder_layer.c reads it."""
    return (k.dtype == v.dtype == torch.float32 and k.stride(-1) == 1 and k.stride(-2) == head_dim
            and v.stride() == k.stride())
