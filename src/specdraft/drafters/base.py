"""What every drafter sees and returns.

The engine owns the target's KV cache and the token history; a drafter reads them and
proposes up to K tokens per row. Drafters that sample must return the exact distribution each
draft was drawn from (rejection sampling needs it); argmax drafters return none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.kv_cache import KVCache
from specdraft.sampling import RowStreams, SamplingParams


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
    # [B] bool: rows whose drafts must not be prompt lookups this round (the draft policy's: their
    # lookups keep missing while the drafter's drafts land); None: no such row. Read by drafters
    # that mix lookups in (mtp+ngram); a drafter of lookups alone never gets a row marked.
    no_lookup: torch.Tensor | None = None


@dataclass
class SparseProbs:
    """Distributions kept as their support: ids, probs [B, K, M] with M << V (a clustered MTP head
    samples among M candidate tokens). Verification needs Q at the drafted token of every
    position and Q in full at one rejected position per row: never K x V tensors."""

    ids: torch.Tensor  # [B, K, M] token ids (entries with prob 0 are padding)
    probs: torch.Tensor  # [B, K, M]
    vocab: int

    def __getitem__(self, key) -> "SparseProbs":
        return SparseProbs(self.ids[key], self.probs[key], self.vocab)

    def at(self, tokens: torch.Tensor) -> torch.Tensor:
        """Q of tokens [B, K] at their own positions -> [B, K]."""
        return ((self.ids == tokens[..., None]) * self.probs).sum(-1)

    def row(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Q in full at position pos[b] of row rows[b] -> [B, V]."""
        out = torch.zeros(rows.shape[0], self.vocab, dtype=self.probs.dtype, device=self.probs.device)
        return out.scatter_add_(1, self.ids[rows, pos], self.probs[rows, pos])

    def dense(self) -> torch.Tensor:
        """[B, K, V] (for tests and small vocabularies)."""
        b, k, _ = self.ids.shape
        out = torch.zeros(b, k, self.vocab, dtype=self.probs.dtype, device=self.probs.device)
        return out.scatter_add_(2, self.ids, self.probs)

    def padded(self, width: int) -> "SparseProbs":
        """K -> width positions; the new ones are empty (never read: their drafts are filler)."""
        extra = width - self.ids.shape[1]
        return SparseProbs(F.pad(self.ids, (0, 0, 0, extra)), F.pad(self.probs, (0, 0, 0, extra)), self.vocab)

    def point_masses(self, rows: torch.Tensor, tokens: torch.Tensor) -> "SparseProbs":
        """Rows `rows` [B] bool get a point mass on their tokens [B, K] (drafts that were not sampled)."""
        ids = torch.where(rows[:, None, None], 0, self.ids)
        probs = torch.where(rows[:, None, None], 0.0, self.probs)
        ids[..., 0] = torch.where(rows[:, None], tokens, ids[..., 0])
        probs[..., 0] = torch.where(rows[:, None], 1.0, probs[..., 0])
        return SparseProbs(ids, probs.to(self.probs.dtype), self.vocab)


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, K']
    num_valid: torch.Tensor  # [B]: drafts past this per row are filler, never accepted
    # The distribution each draft was sampled from: [B, K', V], or its support (SparseProbs).
    probs: torch.Tensor | SparseProbs | None = None
    # [B] bool, for drafters that mix sources (mtp+ngram): rows whose drafts came from prompt
    # lookup. None: every row's drafts came from the drafter's own kind.
    lookup: torch.Tensor | None = None


class Drafter:
    """Base class. `propose` is the only required method."""

    kind: str = "none"  # the --drafter name it runs as (drafters/kinds.py)
    # Where its own drafts come from, as the draft policy tells sources apart (their acceptance
    # differs): "mtp" (an MTP drafter), "lookup" (prompt lookup) or "draft" (a draft model).
    source: str = "draft"
    # Whether some rounds' drafts are prompt lookups instead (Draft.lookup says which rows).
    mixes_lookups: bool = False

    def prepare(self, batch_size: int, capacity: int) -> None:
        """Called once per batch before the first round (allocate per-batch state here).

        The engine may then propose for fewer rows than `batch_size`: rows 0..n-1 of a round
        are always the first n prepared rows (finished rows are compacted away)."""

    def reset_row(self, row: int) -> None:
        """A new request takes row `row`: forget what was kept for it. Stateless drafters ignore it."""

    def move_row(self, src: int, dst: int) -> None:
        """The request in row `src` moves to row `dst` (compaction); `src` becomes free.
        Drafters keeping per-row state (a cache, an index) move it along."""

    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams,
                generator: torch.Generator | RowStreams | None) -> Draft:
        """Up to k drafts per row. Sampled drafts (sampling not greedy) are drawn from `generator`:
        one stream for the batch (generate()), or RowStreams, row i drawing from its own (a
        server's requests), and Q is returned in Draft.probs."""
        raise NotImplementedError

    def max_drafts(self, k: int) -> int:
        """The most drafts one round may carry when the engine asks for k (it sizes buffers by this)."""
        return k

    def nbytes(self) -> int:
        """Memory the drafter adds (parameters and buffers), for honest overhead reports."""
        return 0

    def reads_window(self) -> int | None:
        """The widest sliding window its queries look back over in the target's KV cache, where
        wider than the target's own (the cache keeps that much of sliding layers); None if not."""
        return None

    # --- what the draft policy's cost model asks of a drafter -------------------------------------
    def cost_key(self) -> str:
        """What one drafting step's time depends on: the cost table keeps drafters apart by it."""
        return f"{type(self).__name__}:{self.kind}:{self.nbytes()}"

    def step_drafter(self) -> "Drafter":
        """The drafter whose steps cost time, as a cost profile times it: this one, or the part
        of a combined drafter that runs a network (lookups are free)."""
        return self

    @contextmanager
    def without_early_stop(self) -> Iterator[None]:
        """Meanwhile every round drafts all the steps it is asked for. A cost profile drafts on
        random text, where a drafter that stops when unsure would end its timed rounds early."""
        yield
