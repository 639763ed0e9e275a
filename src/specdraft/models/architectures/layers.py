"""Building blocks shared by every target and by the MTP drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.kv_cache import SHORT_FORWARD
from specdraft.models.formats.block_linear import stack_blocks
from specdraft.models.kernels.attention import KV_DTYPES as NATIVE_KV_DTYPES
from specdraft.models.kernels.attention import attend_prompt as native_attend_prompt
from specdraft.models.kernels.attention import attend_short as native_attend_short
from specdraft.models.kernels.build import applies as kernels_apply
from specdraft.models.kernels.gated_act import KINDS as NATIVE_ACTIVATIONS
from specdraft.models.kernels.gated_act import gated_act as native_gated_act
from specdraft.models.kernels.rms_norm import residual_norms as native_residual_norms
from specdraft.models.kernels.rms_norm import rms_norm as native_rms_norm


class RMSNorm(nn.Module):
    """RMSNorm in float32. Gemma scales by (1 + w) and rounds after the scale; Llama scales
    the already-rounded value by w. Both orders are kept so bf16 matches the references."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim)) if with_scale else None
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight version, 1 + w)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or residual + norm(x) (one call where the C kernel serves: eager float32 CPU steps)."""
        if kernels_apply(x) and (residual is None or residual.dtype == torch.float32) and self.native_ready():
            return native_rms_norm(x, self.native_scale(), self.eps, residual)
        y = self._reference(x)
        return y if residual is None else residual + y

    def native_ready(self) -> bool:
        """Whether the C kernels can apply this norm (a float32 scale, or none)."""
        return self.weight is None or self.weight.dtype == torch.float32

    def native_scale(self) -> torch.Tensor | None:
        """What the C kernels multiply by: 1 + w (offset norms), w, or None (no scale)."""
        return None if self.weight is None else self._offset_scale() if self.offset else self.weight

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes x * rsqrt(mean(x^2) + eps) (* scale) as the references write it, in
        # one call instead of five. A decode step runs ~110 norms, so calls are what costs: casts
        # that would do nothing are skipped rather than dispatched.
        shape = (x.shape[-1],)
        if self.weight is None:
            return _cast(F.rms_norm(_cast(x, torch.float32), shape, eps=self.eps), x.dtype)
        if self.offset:
            return _cast(F.rms_norm(_cast(x, torch.float32), shape, self._offset_scale(), self.eps), x.dtype)
        return self.weight * _cast(F.rms_norm(_cast(x, torch.float32), shape, eps=self.eps), x.dtype)

    def _offset_scale(self) -> torch.Tensor:
        """1 + w in float32. Without gradients it is kept until the weight changes (its version
        counter moves on any in-place update, loading included), instead of two ops per call."""
        w = self.weight
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return 1.0 + w.float()
        key = (w._version, w.data_ptr())
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, 1.0 + w.float())
        return self._scale[1]


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama, GeGLU (tanh gelu) for Gemma."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act, self.act_name = activation(act), act

        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """gate_proj and up_proj as one linear (one kernel call instead of two)."""
        parts = (self.gate_proj, self.up_proj) if self.gate_up_proj is None else ()
        if not parts or not all(type(p) is nn.Linear for p in parts):  # fused, or compacted while loading
            return
        self.gate_up_proj = stack_linears(parts)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        if self.act_name in NATIVE_ACTIVATIONS and kernels_apply(gate_up):
            return self.down_proj(native_gated_act(gate_up, self.act_name))  # one C call for act, chunk and product
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def stack_linears(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One nn.Linear computing every part's outputs, concatenated in order. Each output is the
    same dot product as before (only more outputs per call)."""
    first = parts[0]
    out = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    out.requires_grad_(first.weight.requires_grad)
    blocks = [getattr(p, "gguf_blocks", None) for p in parts]
    if all(b is not None for b in blocks):  # the GGUF blocks of the stacked weight (--weights gguf)
        out.gguf_blocks = stack_blocks(blocks)
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, S, D] (GQA when Hkv < H); mask [B, 1, T, S] bool.
    K and V may be stored narrower than q (a 16-bit KV cache): the C kernels widen them as they
    load them; PyTorch's ops get them widened first."""
    native = (kernels_apply(q) and k.dtype in NATIVE_KV_DTYPES and v.dtype == k.dtype
              and (mask is None or mask.dtype == torch.bool))
    if native and q.shape[2] > SHORT_QUERY and softcap is None and k.dtype == torch.float16:
        # A 16-bit cache's prompt: tiled over keys with an online softmax (attention.c), reading the
        # keys as stored. A float32 one keeps PyTorch's flash kernel (_attend_long), measured there.
        return native_attend_prompt(q, k, v, mask, scale)
    if native:
        return native_attend_short(q, k, v, mask, scale, softcap)  # one C call (models/kernels/attention.c)
    k, v = _cast(k, q.dtype), _cast(v, q.dtype)
    if softcap is None and q.shape[2] > SHORT_QUERY:
        return _attend_long(q, k, v, mask, scale)
    return _attend_short(q, k, v, mask, scale, softcap)


# Prompts: queries in blocks of this many, each over only the keys some query of the block sees.
QUERY_BLOCK = 64


def _attend_long(q, k, v, mask, scale):
    """The CPU flash kernel reads every key for every query and only then applies the mask, so a
    causal prompt paid for the keys after each query too, and sliding layers for keys past their
    window: attention was ~85% of a 700-token prompt's non-matmul time (BENCHMARKS.md,
    "Lookups that learn past 3 drafts"). Blocks of queries over the key range their mask opens skip most of that:
    Gemma 3 270M's prompt of 300 / 700 / 1500 tokens 1.13x / 1.10x / 1.42x faster, blocks of 64
    measured against 128 and 256 (sliding layers then read ~window + 64 keys a query)."""
    gqa = k.shape[1] != q.shape[1]
    t, span = q.shape[2], k.shape[2]
    if mask is None or t <= QUERY_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    seen = mask.any(0)[0]  # [T, S]: keys some row's query t sees
    first = seen.int().argmax(1)  # first visible key per query (0 where none: the mask decides)
    last = span - seen.flip(1).int().argmax(1)  # one past the last
    starts = list(range(0, t, QUERY_BLOCK))
    lows = torch.stack([first[a : a + QUERY_BLOCK].min() for a in starts]).tolist()
    highs = torch.stack([last[a : a + QUERY_BLOCK].max() for a in starts]).tolist()
    out = []
    for a, lo, hi in zip(starts, lows, highs):
        b = a + QUERY_BLOCK
        out.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi],
                                                  attn_mask=mask[:, :, a:b, lo:hi], scale=scale, enable_gqa=gqa))
    return torch.cat(out, dim=2)


# Decode, verify and drafter queries are a handful of tokens; for those the CPU flash kernel
# costs 2-5x more than two small matmuls (2.2 ms vs 0.4 ms for 1 query over 1000 keys).
SHORT_QUERY = SHORT_FORWARD


def _attend_short(q, k, v, mask, scale, softcap):
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    # Fold each KV head's query group into the query axis: one matmul per KV head, no K/V copies.
    qg = q.reshape(b, hkv, g * t, d)
    scores = _cast(_query_key_scores(qg, k), torch.float32) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        m = mask[:, :, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, mask.shape[-1])
        scores = scores.masked_fill(~m, float("-inf"))
    probs = _cast(torch.softmax(scores, dim=-1), v.dtype)
    return torch.matmul(probs, v).reshape(b, h, t, d)


def _query_key_scores(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qg [B, Hkv, M, D] . k [B, Hkv, S, D] -> [B, Hkv, M, S]. At batch 1, F.linear per KV head:
    on a CPU a matmul against the transposed cache slice costs 3x as much (101 vs 32 us for 4
    queries over 640 keys), for the same bits (checked row by row, M = 1..64)."""
    if qg.shape[0] != 1:
        return torch.matmul(qg, k.transpose(-1, -2))
    return torch.stack([F.linear(qg[0, h], k[0, h]) for h in range(qg.shape[1])])[None]


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap
