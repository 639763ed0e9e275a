"""A preallocated KV cache for B rows that can verify several tokens at once and roll back.

Layout per cached layer: K and V of shape [B, kv_heads, capacity, head_dim], stored exactly as
attention uses them (after k-norm and RoPE). Each row has its own length, so rows of different
lengths share one batch. Writing T tokens puts them at positions lengths[b] .. lengths[b]+T-1;
`rollback` only lowers lengths: entries past a row's length are invisible (masked by position)
and get overwritten by the next write. Sliding-window layers keep every position too (no ring
buffer), so a rollback can never lose an entry that becomes visible again; attention only reads
the last `window` keys, so compute still follows the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionSpan:
    """The key range [lo, hi) that some query in a forward can see, and the mask over it.

    mask: [B, 1, T, hi - lo] bool, True where query t of row b may attend to key lo + j.
    """

    lo: int
    hi: int
    mask: torch.Tensor


def attention_span(positions: torch.Tensor, lowest: int, end: int, window: int | None) -> AttentionSpan:
    """Span for queries at `positions` [B, T] (all in [lowest, end)) over cached keys.

    A query at q sees keys j <= q, and with a sliding window only q - window < j. The span
    starts at the first key any query can see, so sliding layers read at most window + T keys.
    """
    lo = 0 if window is None else max(0, lowest - window + 1)
    keys = torch.arange(lo, end, device=positions.device)
    q = positions[:, :, None]
    mask = keys[None, None, :] <= q
    if window is not None:
        mask &= keys[None, None, :] > q - window
    return AttentionSpan(lo, end, mask[:, None])


class KVCache:
    def __init__(
        self,
        layer_shapes: list[tuple[int, int]],
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        """layer_shapes: (kv_heads, head_dim) for every layer that stores K/V, in order."""
        self.batch_size = batch_size
        self.capacity = capacity
        self.k = [torch.zeros(batch_size, h, capacity, d, dtype=dtype, device=device) for h, d in layer_shapes]
        self.v = [torch.zeros(batch_size, h, capacity, d, dtype=dtype, device=device) for h, d in layer_shapes]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._rows = torch.arange(batch_size, device=device)[:, None]
        # Set by `begin`: positions of the tokens being written in the current forward.
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self._uniform_start: int | None = 0

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, num_tokens: int) -> torch.Tensor:
        """Start a forward of `num_tokens` per row; returns their positions [B, T]."""
        lo, hi = (int(x) for x in torch.stack([self.lengths.min(), self.lengths.max()]).tolist())
        if hi + num_tokens > self.capacity:
            raise ValueError(f"KV cache full: {hi} + {num_tokens} tokens exceed capacity {self.capacity}")
        # Equal lengths (batch 1, or a fresh batch) let writes use a plain slice.
        self._uniform_start = lo if lo == hi else None
        self._span_bounds = (lo, hi + num_tokens)
        steps = torch.arange(num_tokens, device=self.device)
        self.positions = self.lengths[:, None] + steps[None, :]
        return self.positions

    def span(self, window: int | None) -> AttentionSpan:
        """Keys visible to the current forward's queries: causal, and within `window` if given."""
        min_len, hi = self._span_bounds
        return attention_span(self.positions, min_len, hi, window)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, head_dim] for the current forward at cache slot `slot`."""
        if self._uniform_start is not None:
            start = self._uniform_start
            self.k[slot][:, :, start : start + k.shape[2]] = k
            self.v[slot][:, :, start : start + v.shape[2]] = v
        else:
            self.k[slot][self._rows, :, self.positions] = k.transpose(1, 2)
            self.v[slot][self._rows, :, self.positions] = v.transpose(1, 2)

    def end(self) -> None:
        """Every written token now counts; callers roll back what they do not keep."""
        self.lengths += self.positions.shape[1]

    def rollback(self, lengths: torch.Tensor) -> None:
        """Shorten rows to `lengths` [B] (never lengthens). Bookkeeping only: nothing is copied."""
        self.lengths = torch.minimum(self.lengths, lengths.to(self.lengths))


@dataclass
class KVSource:
    """What a drafter layer needs to attend over one target layer's cached K/V: the cache slot,
    and the exact q-path of that layer (head_dim, RoPE table, softmax scale, window, q-norm style),
    because the drafter's queries are dotted with keys the target already normed and rotated."""

    layer: int
    slot: int
    layer_type: str
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None
    rope: object  # specdraft.models.rope.RopeTable
    q_norm: bool
    norm_offset: bool
