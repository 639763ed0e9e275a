"""What every drafter sees and returns.

The engine owns the target's KV cache and the token history; a drafter reads them and
proposes up to K tokens per row. Drafters that sample must return the exact distribution each
draft was drawn from (rejection sampling needs it); argmax drafters return none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.kv_cache import KVCache
from specdraft.sampling import SamplingParams


@dataclass
class DraftInput:
    """The engine's state for every row at the start of a round.

    The target cache holds positions 0..p (p = `position`); `last_token` (b) was emitted from
    the target's logits at p and is not in the cache yet; `hidden` is the target's final-normed
    hidden state at p. `tokens[:, :p + 2]` is the row's whole sequence so far, b included.
    """

    last_token: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, H]
    position: torch.Tensor  # [B]
    cache: KVCache
    tokens: torch.Tensor  # [B, capacity]
    active: torch.Tensor  # [B] bool: rows still generating


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, K']
    num_valid: torch.Tensor  # [B]: drafts past this per row are filler, never accepted
    probs: torch.Tensor | None = None  # [B, K', V]: the distribution each draft was sampled from
    # [B] bool, for drafters that mix sources (mtp+ngram): rows whose drafts came from prompt
    # lookup. None: every row's drafts came from the drafter's own kind.
    lookup: torch.Tensor | None = None


class Drafter:
    """Base class. `propose` is the only required method."""

    kind: str = "none"

    def prepare(self, batch_size: int, capacity: int) -> None:
        """Called once per batch before the first round (allocate per-batch state here).

        The engine may then propose for fewer rows than `batch_size`: rows 0..n-1 of a round
        are always the first n prepared rows (finished rows are compacted away)."""

    def reset_row(self, row: int) -> None:
        """A new request takes row `row`: forget what was kept for it. Stateless drafters ignore it."""

    def move_row(self, src: int, dst: int) -> None:
        """The request in row `src` moves to row `dst` (compaction); `src` becomes free.
        Drafters keeping per-row state (a cache, an index) move it along."""

    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        raise NotImplementedError

    def max_drafts(self, k: int) -> int:
        """The most drafts one round may carry when the engine asks for k (it sizes buffers by this)."""
        return k

    def nbytes(self) -> int:
        """Memory the drafter adds (parameters and buffers), for honest overhead reports."""
        return 0
