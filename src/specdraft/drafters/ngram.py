"""Prompt lookup: propose what followed the last time the current n-gram appeared.

Training-free. Strong when the output copies from the prompt (code edits, summaries, RAG) or
repeats itself. Searches prompt + output so far, longest n first, most recent match first,
through an index that grows with the text (lookup_index.py) rather than a rescan per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.drafters.lookup_index import LookupIndex
from specdraft.sampling import RowStreams, SamplingParams


@dataclass
class Lookup:
    drafts: torch.Tensor  # [B, K]: the continuation after the match (filler past num_valid)
    num_valid: torch.Tensor  # [B]: 0 where nothing matched or the row is inactive


def prompt_lookup(tokens: torch.Tensor, seq_len: torch.Tensor, active: torch.Tensor, k: int,
                  index: LookupIndex, repeat: bool = False) -> Lookup:
    """For rows whose sequences are tokens[:, :seq_len], find the latest earlier occurrence of the
    longest suffix n-gram (the index's max_ngram down to min_ngram) and return up to k tokens
    that followed.

    The latest match is often one period back in a loop, so fewer than k tokens follow it; with
    `repeat` the continuation cycles through them to fill k (a loop of period 3 drafts 8 tokens)."""
    width = tokens.shape[1]
    dev = tokens.device
    found_start = index.continuation_starts(tokens, seq_len)  # where the continuation starts, or -1
    steps = torch.arange(k, device=dev)[None, :]
    known = (seq_len - found_start).clamp(min=1)  # tokens after the match, up to the current end
    cont = found_start.clamp(min=0)[:, None] + (steps % known[:, None] if repeat else steps)
    drafts = tokens.gather(1, cont.clamp(max=width - 1))
    available = torch.full_like(known, k) if repeat else known.clamp(max=k)
    num_valid = torch.where((found_start >= 0) & active, available, 0)
    return Lookup(drafts, num_valid)


class NgramDrafter(Drafter):
    kind = "ngram"
    source = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index = LookupIndex(min_ngram, max_ngram)

    def prepare(self, batch_size: int, capacity: int) -> None:
        self.index.reset(batch_size)

    def reset_row(self, row: int) -> None:
        self.index.reset_row(row)

    def move_row(self, src: int, dst: int) -> None:
        self.index.move_row(src, dst)

    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams,
                generator: torch.Generator | RowStreams | None) -> Draft:
        found = prompt_lookup(inp.tokens, inp.position + 2, inp.active, k, self.index)
        longest = int(found.num_valid.max())
        # Rounds where nobody has a match verify only [b]: plain decoding cost, no filler drafts.
        return Draft(found.drafts[:, :longest], found.num_valid)
