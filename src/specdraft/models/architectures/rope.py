"""Rotary position embeddings: inverse frequencies per RoPE variant, and a cos/sin table.

The table holds cos/sin for positions 0..n-1 in float32, computed exactly as the reference
implementations do (outer product in float32, then cos/sin), so a lookup by position gives
bit-identical values to computing them on the fly.
"""

from __future__ import annotations

import math

import torch

from specdraft.config import ConfigError, RopeParams


def inverse_frequencies(rope: RopeParams, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq of length head_dim // 2, attention scaling applied to cos and sin).

    Always computed on the CPU in float32 (models are often built on the meta device).
    """
    with torch.device("cpu"):
        return _inverse_frequencies(rope, head_dim, max_position_embeddings)


def _inverse_frequencies(rope: RopeParams, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    if rope.kind == "proportional":
        # Gemma 4 full layers: only the first `partial` of the angles rotate; the rest have
        # frequency 0 (cos 1, sin 0), and exponents are relative to the whole head_dim.
        angles = int(rope.partial * head_dim // 2)
        exps = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
        inv = 1.0 / (rope.theta**exps)
        inv = torch.cat([inv, torch.zeros(head_dim // 2 - angles)])
        return inv / rope.factor, 1.0
    if rope.partial != 1.0:
        raise ConfigError(f"partial_rotary_factor {rope.partial} is only supported with proportional RoPE")
    dim = head_dim
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "default":
        return inv, 1.0
    if rope.kind == "linear":
        return inv / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv, rope, max_position_embeddings), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    raise ConfigError(f"unsupported rope type {rope.kind!r}")


def _llama3(inv: torch.Tensor, rope: RopeParams, max_pos: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeParams, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    old_len = rope.original_max_position_embeddings or max_pos
    factor = rope.factor
    attn_factor = rope.attention_factor
    if attn_factor is None:
        attn_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn_factor)


class RopeTable:
    """cos/sin for positions [0, length), grown on demand. Shapes: [length, head_dim]."""

    def __init__(self, rope: RopeParams, head_dim: int, max_position_embeddings: int):
        self.inv_freq, self.scaling = inverse_frequencies(rope, head_dim, max_position_embeddings)
        self.cos = torch.empty(0, head_dim, device="cpu")
        self.signed_sin = torch.empty(0, head_dim, device="cpu")  # sin with its first half negated

    def ensure(self, length: int, device: torch.device) -> None:
        if self.cos.shape[0] >= length and self.cos.device == device:
            return
        length = max(length, 2 * self.cos.shape[0])
        pos = torch.arange(length, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :].float()
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * self.scaling).to(device)
        sin = emb.sin() * self.scaling
        half = sin.shape[1] // 2
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=1).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, signed sin [B, 1, T, head_dim] in `dtype`, ready to broadcast
        over heads and to pass to `apply_rope` (the sin's first half is negated, see there).

        The caller has `ensure`d the table covers every position (the KV cache's capacity).
        """
        cos = torch.nn.functional.embedding(positions, self.cos)
        sin = torch.nn.functional.embedding(positions, self.signed_sin)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) for halves x1, x2.

    `signed_sin` (from `RopeTable.lookup`) is (-sin1, sin2), so rotate_half becomes a roll:
    (x2, x1) * (-sin1, sin2) has the same bits as (-x2, x1) * (sin1, sin2) (negation is exact),
    in two ops instead of four (chunk, neg, cat)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
