"""Prompt lookup: propose what followed the last time the current n-gram appeared.

Training-free. Strong when the output copies from the prompt (code edits, summaries, RAG) or
repeats itself. Searches prompt + output so far, longest n first, most recent match first.
All rows are searched at once with tensor ops; there is no per-row Python loop.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.sampling import SamplingParams


class NgramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        tokens = inp.tokens
        b, width = tokens.shape
        seq_len = inp.position + 2  # tokens so far per row, b included
        rows = torch.arange(b, device=tokens.device)
        found_start = torch.full((b,), -1, dtype=torch.long, device=tokens.device)  # where the continuation starts
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            suffix = tokens.gather(1, (seq_len[:, None] - n + torch.arange(n, device=tokens.device)).clamp(min=0))
            windows = tokens.unfold(1, n, 1)  # [B, width - n + 1, n]
            starts = torch.arange(windows.shape[1], device=tokens.device)
            # A match must be followed by at least one token that is already known.
            hit = (windows == suffix[:, None, :]).all(-1) & (starts[None, :] + n < seq_len[:, None])
            hit &= (seq_len >= n + 1)[:, None]
            latest = torch.where(hit, starts[None, :], -1).max(dim=1).values
            use = (found_start < 0) & (latest >= 0)
            found_start = torch.where(use, latest + n, found_start)
        cont = found_start.clamp(min=0)[:, None] + torch.arange(k, device=tokens.device)[None, :]
        drafts = tokens.gather(1, cont.clamp(max=width - 1))
        available = (seq_len - found_start).clamp(min=0, max=k)
        num_valid = torch.where((found_start >= 0) & inp.active, available, 0)
        longest = int(num_valid.max())
        # Rounds where nobody has a match verify only [b]: plain decoding cost, no filler drafts.
        return Draft(drafts[:, :longest], num_valid)
