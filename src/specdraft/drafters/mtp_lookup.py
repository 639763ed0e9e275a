"""The MTP drafter with prompt lookup in front of it ("mtp+ngram").

Small models repeat themselves (lists, templates, loops) and copy from their prompt. Prompt
lookup predicts those stretches for free and further ahead than the MTP drafter's K; the MTP
drafter covers the rest. Per row and round: if the sequence's last `min_match` or more tokens
occurred before, propose `lookup_tokens` tokens that followed them (cycling through them when
fewer follow, as in a loop); otherwise, or where the draft policy marks the row
(DraftInput.no_lookup: its lookups keep missing), propose the MTP drafter's K. One-token matches
are left to the MTP drafter: replaying greedy decoding over held-out answers of gemma3-270m,
requiring 2 matched tokens gave a higher tau than 1 or 3.

The choice depends only on tokens already emitted (and the policy's mark, on counts of earlier
rounds), so with sampling each row's Q is still the exact distribution its drafts came from (a
point mass for looked-up tokens).
"""

from __future__ import annotations

from typing import ContextManager

import torch
import torch.nn.functional as F

from specdraft.drafters.base import Draft, Drafter, DraftInput, SparseProbs
from specdraft.drafters.lookup_index import LookupIndex
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.drafters.ngram import prompt_lookup
from specdraft.sampling import RowStreams, SamplingParams

LOOKUP_TOKENS = 8
MIN_MATCH = 2
MAX_NGRAM = 3


class MTPWithLookup(Drafter):
    kind = "mtp+ngram"
    source = "mtp"
    mixes_lookups = True

    def __init__(self, mtp: MTPDrafter, lookup_tokens: int = LOOKUP_TOKENS, min_match: int = MIN_MATCH,
                 max_ngram: int = MAX_NGRAM):
        self.mtp, self.lookup_tokens = mtp, lookup_tokens
        self.min_match, self.max_ngram = min_match, max_ngram
        self.index = LookupIndex(min_match, max_ngram)
        self.recommended_k = mtp.recommended_k
        self.row_rounds = {"lookup": 0, "mtp": 0}  # active rows' rounds drafted by each, since creation

    def max_drafts(self, k: int) -> int:
        return max(k, self.lookup_tokens)

    def nbytes(self) -> int:
        return self.mtp.nbytes()

    def reads_window(self) -> int | None:
        return self.mtp.reads_window()

    def cost_key(self) -> str:
        return self.mtp.cost_key()  # lookups are free: the MTP steps cost

    def step_drafter(self) -> Drafter:
        return self.mtp

    def without_early_stop(self) -> ContextManager[None]:
        return self.mtp.without_early_stop()

    def set_min_confidence(self, value: float) -> None:
        self.mtp.set_min_confidence(value)

    def set_top_k_clusters(self, top_k: int) -> None:
        self.mtp.set_top_k_clusters(top_k)

    def prepare(self, batch_size: int, capacity: int) -> None:
        self.mtp.prepare(batch_size, capacity)
        self.index.reset(batch_size)

    def reset_row(self, row: int) -> None:
        self.mtp.reset_row(row)
        self.index.reset_row(row)

    def move_row(self, src: int, dst: int) -> None:
        self.mtp.move_row(src, dst)
        self.index.move_row(src, dst)

    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams,
                generator: torch.Generator | RowStreams | None) -> Draft:
        found = prompt_lookup(inp.tokens, inp.position + 2, inp.active, self.lookup_tokens, self.index,
                              repeat=True)
        looked_up = found.num_valid > 0
        if inp.no_lookup is not None:  # the draft policy's: these rows' lookups keep missing
            looked_up &= ~inp.no_lookup
        # One host sync for the three numbers the round's shape depends on (a marked row's match
        # does not widen the round).
        longest = torch.where(looked_up, found.num_valid, 0).max()
        n_lookup, n_active, longest = torch.stack([looked_up.sum(), inp.active.sum(), longest]).tolist()
        self.row_rounds["lookup"] += n_lookup
        self.row_rounds["mtp"] += n_active - n_lookup
        if n_lookup == n_active:
            # Every active row has a match: no drafter forward at all this round.
            return Draft(found.drafts[:, :longest], found.num_valid, lookup=looked_up)
        mtp = self.mtp.propose(inp, k, sampling, generator)
        m = mtp.tokens.shape[1]  # K, or fewer when every row stopped early
        width = max(m, longest)
        # Pad both to the round's width (K may exceed lookup_tokens, or the other way round).
        looked = F.pad(found.drafts, (0, max(0, width - self.lookup_tokens)))[:, :width]
        tokens = torch.where(looked_up[:, None], looked, F.pad(mtp.tokens, (0, width - m)))
        num_valid = torch.where(looked_up, found.num_valid, mtp.num_valid)
        probs = mtp.probs
        if isinstance(probs, SparseProbs):
            probs = probs.padded(width)
            if n_lookup:  # looked-up drafts were not sampled: their Q is a point mass on the token
                probs = probs.point_masses(looked_up, tokens)
        elif probs is not None:
            probs = F.pad(probs, (0, 0, 0, width - m))
            if n_lookup:
                probs[looked_up] = F.one_hot(tokens[looked_up], probs.shape[-1]).to(probs.dtype)
        return Draft(tokens, num_valid, probs, lookup=looked_up)
