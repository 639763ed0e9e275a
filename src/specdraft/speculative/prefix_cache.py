"""Saved KV of finished requests, so a request that starts with the same tokens is not prefilled
again: a conversation's next turn (the chat and the server alike) or a shared system prompt.

When a request leaves the engine, its row's K/V (every position the cache holds, in position
order; kv_cache.RowSnapshot) is saved under the token ids those positions hold. A joining
request restores the longest saved prefix of its prompt into its row and prefills only the rest,
at least its last token: the first new token and the MTP drafter's state come from the target's
hidden state at the prompt's end, which only a forward gives.

Bounds: entries are kept up to `max_bytes` in all, least recently used evicted first; the memory
is the engine's apart from any request's KV row. A ring slot (Gemma 4's sliding layers) keeps only
its last window + max_forward positions, so a snapshot restores a prefix only that far behind its
end (KVCache.can_restore); a longer one is passed over, never restored wrong.

Exact reuse (`exact=True`, the server's default): every restored position must hold the bits an
uncached prefill computes, so the output equals the uncached output. Where the target computes
each position alone whatever forward it is in (TargetModel.prefill_rows_alone: the default
model's int8-activation kernels over a float32 cache), that holds for any prefix, replies
included, and `step` is 1. Elsewhere a chunk's arithmetic depends on its width (a wide chunk
takes a GEMM, maybe in bf16; its last, shorter chunk another blocking) and `step` is the prefill
chunk: a request prefills in chunks that start at multiples of it from position 0, so only
whole chunks that the earlier request prefilled as whole chunks are restored, the new request
goes on from a chunk boundary, and positions decoded after a prompt are never reused.
`exact=False` (the chat) reuses every position: a conversation continues from the K/V its
replies were generated with, which a fresh prefill of the same text may round differently.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from specdraft.kv_cache import KVCache, RowSnapshot


@dataclass
class _Entry:
    tokens: list[int]  # the ids of positions 0..len-1
    snapshot: RowSnapshot
    reusable: int  # leading positions a match may restore (exact reuse: see `step`)


class PrefixCache:
    """Longest-prefix lookup over saved rows, bounded in bytes, least recently used evicted."""

    def __init__(self, max_bytes: int, exact: bool = True):
        self.max_bytes, self.exact = max_bytes, exact
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int], cache: KVCache, step: int) -> tuple[RowSnapshot | None, int]:
        """The saved row and the number of leading positions of `prompt` it restores into `cache`
        (0: none). At most len(prompt) - 1: the last prompt token is always prefilled. `step`:
        exact reuse restores a multiple of it (module docstring)."""
        best, best_n, best_key = None, 0, None
        for key, e in self._entries.items():
            n = min(len(os.path.commonprefix([e.tokens, prompt])), len(prompt) - 1, e.reusable)
            if self.exact:
                n -= n % step  # the rest is prefilled from a chunk boundary, as without the cache
            if n > best_n and cache.can_restore(e.snapshot, n):
                best, best_n, best_key = e.snapshot, n, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
            self.hits += 1
            self.reused_tokens += best_n
        return best, best_n

    def save(self, tokens: list[int], snapshot: RowSnapshot, prompt_length: int, step: int) -> None:
        """Keep `snapshot` (positions 0..len(tokens)-1 of `tokens`, the first `prompt_length` of
        them prefilled in chunks of `step` when it is over 1); older entries whose tokens it
        extends are dropped when it restores everything they could."""
        size = snapshot.nbytes()
        reusable = min(snapshot.length, len(tokens))
        if self.exact and step > 1:  # whole chunks of the prompt only (module docstring)
            reusable = min(reusable, prompt_length - prompt_length % step)
        if size > self.max_bytes or not tokens or reusable <= 0:
            return
        for key, e in list(self._entries.items()):
            if len(e.tokens) <= len(tokens) and tokens[: len(e.tokens)] == e.tokens and e.reusable <= reusable and all(
                    f <= g for f, g in zip(snapshot.first, e.snapshot.first)):
                self._drop(key)
        self._entries[self._next] = _Entry(list(tokens), snapshot, reusable)
        self._next += 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).snapshot.nbytes()
