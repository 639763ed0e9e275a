"""A preallocated KV cache for B rows that can verify several tokens at once and roll back.

Layout per cached layer: K and V of shape [B, kv_heads, capacity, head_dim], stored exactly as
attention uses them (after k-norm and RoPE). Each row has its own length, so rows of different
lengths share one batch. Writing T tokens puts them at positions lengths[b] .. lengths[b]+T-1;
`rollback` only lowers lengths: entries past a row's length are invisible (masked by position)
and get overwritten by the next write.

Sliding-window layers can keep a ring instead (`rings`): position p lives in slot p mod R, with
R = window + max_forward, where max_forward bounds both the tokens one forward writes and how far
a rollback reaches back past the furthest position written. Then every key a query can see is
still in the ring, and an entry a rejected draft overwrote is always older than any query's
window, so it stays masked. Keys sit in ring order; masks come from the position each slot holds
(`ring_positions`). Without rings, sliding layers keep every position and attention reads only
the last `window` keys.

K and V may be stored in float16 while the model computes in float32 (`kv_storage_dtype`): a
long context's step reads half the bytes, and the attention kernel widens each key exactly as it
loads it. Every forward rounds its new K/V once as it writes them and every reader (steps,
verification, the drafter) reads the same rounded values, so speculative decoding still equals
plain decoding.

Lengths live twice: as a device tensor (positions for RoPE and masks) and as a host list (key
spans, capacity checks). Keeping the host copy means a forward never waits on the device to
learn its own shapes; callers that know the new lengths on the host pass a list to `rollback`.

`rows(start, stop)` gives a cache over a contiguous range of rows that shares storage with
this one: a step-wise engine prefills a joining request through its own row and runs rounds
over the rows in use, and `copy_row` compacts finished rows away.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError


# Forwards of at most this many tokens per row (decode steps, verification, drafting) attend
# with two small matmuls, and their key spans start at 0 on every layer, sliding ones included:
# keys then sit at the same offsets whatever the round's lowest position, and a row's scores and
# p.V sums come out bit-identical whether it is verified with 1 or with K+1 queries (a span that
# starts later prepends keys to some rounds and not others, which changes p.V's blocking).
SHORT_FORWARD = 16
# Their key spans also end on a multiple of this many keys (masked past the last position): the
# attention matmuls then see a few shapes instead of a new one every step, so oneDNN reuses its
# compiled kernels instead of building and caching one per length (measured: resident memory
# crept up by the cached kernels). Appended masked keys add exact zeros: results are unchanged.
SPAN_BLOCK = 128
# An engine prefills prompts in forwards of at most this many tokens, which sizes its rings
# (window + this); wider chunks gain little and keep the rings and the attention masks larger.
PREFILL_CHUNK = 256


# The largest magnitude float16 holds; a key or value past it would be stored as infinity.
FLOAT16_MAX = 65504.0
KV_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16}


def kv_storage_dtype(compute: torch.dtype, device_type: str, largest: float | None) -> torch.dtype:
    """The dtype a KV cache stores K/V in: $SPECDRAFT_KV_DTYPE (auto, float32 or float16).

    auto: float16 where the model computes in float32 on the CPU and `largest`, a bound on any
    K/V element the model can write (None: unbounded), fits float16; the compute dtype otherwise
    (bfloat16 models, accelerators: their attention reads the cache as it is)."""
    name = os.environ.get("SPECDRAFT_KV_DTYPE", "auto")
    if name not in KV_DTYPES:
        raise SpecdraftError(f"SPECDRAFT_KV_DTYPE={name!r} is not one of {', '.join(KV_DTYPES)}")
    fits = largest is not None and largest < FLOAT16_MAX
    if compute != torch.float32 or device_type != "cpu" or name == "float32":
        return compute
    if name == "float16" and not fits:
        raise SpecdraftError("SPECDRAFT_KV_DTYPE=float16: this model's keys can exceed float16's range "
                             "(use float32 or auto)")
    return torch.float16 if fits else compute


@dataclass
class AttentionSpan:
    """The key range [lo, hi) that some query in a forward can see, and the mask over it.

    mask: [B, 1, T, hi - lo] bool, True where query t of row b may attend to key lo + j.
    """

    lo: int
    hi: int
    mask: torch.Tensor


def ring_positions(size: int, ends: torch.Tensor, span: int) -> torch.Tensor:
    """[B, span]: the position slot j of a ring of `size` slots holds, in each row whose writes end
    at ends[b] (exclusive): the latest position ≡ j (mod size) below the end; negative where
    nothing has been written yet."""
    j = torch.arange(span, device=ends.device)
    return j + size * torch.div(ends[:, None] - 1 - j, size, rounding_mode="floor")


def ring_span(positions: torch.Tensor, ends: torch.Tensor, size: int, end: int, window: int | None) -> AttentionSpan:
    """Span for queries at `positions` [B, T] over a ring of `size` slots whose rows' writes end at
    `ends` [B]: slots [0, min(size, end)), each masked by the position it holds."""
    held = ring_positions(size, ends, min(size, end))[:, None, :]
    q = positions[:, :, None]
    mask = (held >= 0) & (held <= q)
    if window is not None:
        mask &= held > q - window
    return AttentionSpan(0, held.shape[2], mask[:, None])


def ring_sizes(windows: list[int | None], capacity: int, max_forward: int | None,
               reads_window: int | None = None) -> list[int | None]:
    """Per slot: the ring a sliding slot keeps (window + max_forward, or the wider window another
    reader of the cache needs, + max_forward), or None where the whole capacity is as small."""
    if max_forward is None:
        return [None] * len(windows)
    out: list[int | None] = []
    for w in windows:
        size = None if w is None else max(w, reads_window or 0) + max_forward
        out.append(size if size is not None and size < capacity else None)
    return out


def attention_span(positions: torch.Tensor, lowest: int, end: int, window: int | None) -> AttentionSpan:
    """Span for queries at `positions` [B, T] (all in [lowest, end)) over cached keys.

    A query at q sees keys j <= q, and with a sliding window only q - window < j. The span
    starts at the first key any query can see, rounded down to a multiple of SPAN_BLOCK, so
    sliding layers read at most window + T + SPAN_BLOCK - 1 keys. The rounding keeps a query's
    arithmetic independent of the forward it is in: the attention kernel sums over keys in
    fixed chunks counted from the span's start (attention.c), and a short forward's span starts
    at 0; a span starting anywhere else would block a query's sums by its chunk's lowest position,
    and a prompt prefilled in other chunks (after a restored prefix) would round differently.
    """
    lo = 0 if window is None else max(0, lowest - window + 1) // SPAN_BLOCK * SPAN_BLOCK
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
        windows: list[int | None] | None = None,
        max_forward: int | None = None,
        reads_window: int | None = None,
    ):
        """layer_shapes: (kv_heads, head_dim) for every layer that stores K/V, in order.

        windows: each slot's sliding window (None: full attention). With `max_forward` set, sliding
        slots keep a ring (see the module docstring); `reads_window` is the widest window any
        other reader of the cache (a drafter) looks back over, if wider than the slot's own."""
        rings = ring_sizes(windows or [None] * len(layer_shapes), capacity, max_forward, reads_window)
        k = [torch.zeros(batch_size, h, r or capacity, d, dtype=dtype, device=device)
             for (h, d), r in zip(layer_shapes, rings)]
        v = [torch.zeros_like(t) for t in k]
        by_window = {w: r for w, r in zip(windows or [], rings) if r is not None}
        self._init(k, v, torch.zeros(batch_size, dtype=torch.long, device=device), [0] * batch_size, 0,
                   capacity, rings, by_window, max_forward, [0] * batch_size)

    def _init(self, k: list[torch.Tensor], v: list[torch.Tensor], lengths: torch.Tensor,
              host: list[int], offset: int, capacity: int, rings: list[int | None],
              ring_of_window: dict[int, int], max_forward: int | None, written: list[int]) -> None:
        self.k, self.v = k, v
        self.batch_size, self.capacity = lengths.shape[0], capacity
        self.rings = rings  # per slot: ring size, or None (slot j holds position j)
        self.ring_of_window = ring_of_window  # the same by sliding window (slots of one window share it)
        self.max_forward = max_forward
        self.lengths = lengths  # [B] device; updated in place so row views stay in step
        self._host, self._offset = host, offset  # the host copy is shared with every view
        self._written = written  # per row: the furthest position end written since reset (shared too)
        self._rows = torch.arange(self.batch_size, device=lengths.device)[:, None]
        # Set by `begin`: positions of the tokens being written in the current forward.
        self.positions = torch.zeros(self.batch_size, 0, dtype=torch.long, device=lengths.device)
        self._uniform_start: int | None = 0
        self._span_bounds = (0, 0)

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    @property
    def host_lengths(self) -> list[int]:
        """Row lengths as Python ints (no device sync)."""
        return self._host[self._offset : self._offset + self.batch_size]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # --- rows ------------------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> "KVCache":
        """A cache over rows [start, stop) sharing this cache's storage and lengths."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows [{start}, {stop}) outside a cache of {self.batch_size} rows")
        view = KVCache.__new__(KVCache)
        view._init([t[start:stop] for t in self.k], [t[start:stop] for t in self.v],
                   self.lengths[start:stop], self._host, self._offset + start, self.capacity, self.rings,
                   self.ring_of_window, self.max_forward, self._written)
        return view

    def copy_row(self, src: int, dst: int) -> None:
        """Make row dst a copy of row src (its K/V up to its length, and the length)."""
        n = self.host_lengths[src]
        for store in (self.k, self.v):
            for t, ring in zip(store, self.rings):
                m = n if ring is None else self._written[self._offset + src]  # a ring: stale slots too
                t[dst, :, : min(m, t.shape[2])] = t[src, :, : min(m, t.shape[2])]
        self._written[self._offset + dst] = self._written[self._offset + src]
        self._set_lengths({dst: n})

    def reset_row(self, row: int) -> None:
        """Empty one row (a new request takes its place)."""
        self._written[self._offset + row] = 0
        self._set_lengths({row: 0})

    # --- one forward -------------------------------------------------------------------------
    def begin(self, num_tokens: int) -> torch.Tensor:
        """Start a forward of `num_tokens` per row; returns their positions [B, T]."""
        host = self.host_lengths
        lo, hi = min(host), max(host)
        if hi + num_tokens > self.capacity:
            raise ValueError(f"KV cache full: {hi} + {num_tokens} tokens exceed capacity {self.capacity}")
        if self.ring_of_window and num_tokens > self.max_forward:
            raise ValueError(f"a forward of {num_tokens} tokens is wider than the rings allow ({self.max_forward})")
        # Equal lengths (batch 1, or a fresh batch) let writes use a plain slice.
        self._uniform_start = lo if lo == hi else None
        self._span_bounds = (lo, hi + num_tokens)
        steps = torch.arange(num_tokens, device=self.device)
        self.positions = self.lengths[:, None] + steps[None, :]
        return self.positions

    @property
    def span_end(self) -> int:
        """End of the key span of a short forward: past the last position it writes, rounded up
        to SPAN_BLOCK keys (the rest is masked) and capped at the capacity."""
        return min(self.capacity, -(-self._span_bounds[1] // SPAN_BLOCK) * SPAN_BLOCK)

    def span(self, window: int | None) -> AttentionSpan:
        """Keys visible to the current forward's queries: causal, and within `window` if given."""
        min_len, hi = self._span_bounds
        ring = self.ring_of_window.get(window)
        if ring is not None:
            return ring_span(self.positions, self.positions[:, -1] + 1, ring, self.span_end, window)
        if self.positions.shape[1] > SHORT_FORWARD:
            return attention_span(self.positions, min_len, hi, window)
        return attention_span(self.positions, 0, self.span_end, window)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, head_dim] for the current forward at cache slot `slot`."""
        ring, t = self.rings[slot], k.shape[2]
        start = self._uniform_start
        if start is not None and ring is not None and start % ring + t <= ring:
            start %= ring  # a ring that does not wrap in this forward: still one slice
        elif ring is not None:
            start = None
        if start is not None:
            self.k[slot][:, :, start : start + t] = k
            self.v[slot][:, :, start : start + t] = v
        else:
            at = self.positions if ring is None else self.positions % ring
            self.k[slot][self._rows, :, at] = k.transpose(1, 2).to(self.k[slot].dtype)
            self.v[slot][self._rows, :, at] = v.transpose(1, 2).to(self.v[slot].dtype)

    def end(self) -> None:
        """Every written token now counts; callers roll back what they do not keep."""
        t = self.positions.shape[1]
        self.lengths += t
        self._set_host([n + t for n in self.host_lengths])
        a = self._offset
        self._written[a : a + self.batch_size] = [max(w, n) for w, n in zip(self._written[a : a + self.batch_size],
                                                                            self.host_lengths)]

    def rollback(self, lengths: torch.Tensor | list[int]) -> None:
        """Shorten rows to `lengths` [B] (never lengthens). Bookkeeping only: nothing is copied.

        A list costs nothing; a tensor is read back to the host once."""
        wanted = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
        if len(wanted) != self.batch_size:
            raise ValueError(f"rollback got {len(wanted)} lengths for {self.batch_size} rows")
        if self.ring_of_window:
            written = self._written[self._offset : self._offset + self.batch_size]
            if any(w - int(b) > self.max_forward for w, b in zip(written, wanted)):
                raise ValueError(f"a rollback past {self.max_forward} tokens behind the furthest write "
                                 "would expose ring slots a later write replaced")
        self._set_host([min(a, int(b)) for a, b in zip(self.host_lengths, wanted)])
        self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.long), non_blocking=True)

    def _set_host(self, values: list[int]) -> None:
        self._host[self._offset : self._offset + self.batch_size] = values

    def _set_lengths(self, rows: dict[int, int]) -> None:
        for row, n in rows.items():
            self._host[self._offset + row] = n
            self.lengths[row] = n


    # --- saving and restoring a row (speculative/prefix_cache.py) ------------------------------
    def snapshot_row(self, row: int) -> "RowSnapshot":
        """A copy of row `row`'s K/V for positions below its length, in position order. A ring
        slot holds only its last `ring` positions written, so its copy starts later."""
        n, written = self.host_lengths[row], self._written[self._offset + row]
        k, v, first = [], [], []
        for kt, vt, ring in zip(self.k, self.v, self.rings):
            lo = 0 if ring is None else max(0, written - ring)
            at = torch.arange(lo, n, device=self.device)
            at = at if ring is None else at % ring
            k.append(kt[row].index_select(1, at))
            v.append(vt[row].index_select(1, at))
            first.append(lo)
        return RowSnapshot(n, k, v, first)

    def can_restore(self, snap: "RowSnapshot", length: int) -> bool:
        """Whether `snap` holds every key a query at `length` may read in this cache's layout: all
        positions for a full slot, the ring's lookback (ring - max_forward, a drafter's wider
        window included) for a ring slot."""
        if length > snap.length or len(snap.k) != len(self.k):
            return False
        for first, ring in zip(snap.first, self.rings):
            need = 0 if ring is None else max(0, length - (ring - self.max_forward))
            if first > need:
                return False
        return True

    def restore_row(self, row: int, snap: "RowSnapshot", length: int) -> None:
        """Make row `row` hold the first `length` positions of `snap` (can_restore must hold)."""
        if not self.can_restore(snap, length):
            raise ValueError(f"snapshot of {snap.length} positions cannot restore {length} in this cache")
        for kt, vt, sk, sv, first, ring in zip(self.k, self.v, snap.k, snap.v, snap.first, self.rings):
            lo = first if ring is None else max(first, length - ring)
            at = torch.arange(lo, length, device=self.device)
            at = at if ring is None else at % ring
            kt[row].index_copy_(1, at, sk[:, lo - first : length - first])
            vt[row].index_copy_(1, at, sv[:, lo - first : length - first])
        self._written[self._offset + row] = length
        self._set_lengths({row: length})


@dataclass
class RowSnapshot:
    """One row's K/V for positions [first[s], length) of each slot, copied out of a cache."""

    length: int
    k: list[torch.Tensor]  # per slot [kv_heads, length - first, head_dim]
    v: list[torch.Tensor]
    first: list[int]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class IndexedWrites:
    """The cache as a compiled step sees it: storage and the positions being written, nothing
    kept on the host, so one compiled graph serves every position and every mix of row lengths."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], positions: torch.Tensor,
                 rings: tuple[int | None, ...] = ()):
        self.k, self.v, self.positions = k, v, positions
        self.rings = rings or (None,) * len(k)
        self._rows = torch.arange(positions.shape[0], device=positions.device)[:, None]

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ring = self.rings[slot]
        at = self.positions if ring is None else self.positions % ring
        self.k[slot][self._rows, :, at] = k.transpose(1, 2).to(self.k[slot].dtype)
        self.v[slot][self._rows, :, at] = v.transpose(1, 2).to(self.v[slot].dtype)
