"""What goes into the step-wise engine (a Request) and what comes out (a GenerationResult)."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Callable, Collection

import torch

from specdraft.sampling import SamplingParams
from specdraft.speculative.stats import RequestStats

# Where an emitted token came from: the target's own token (one per round, the prefill's first
# token included), or an accepted draft of the MTP drafter, of prompt lookup, of a draft model.
SOURCES = ("target", "mtp", "lookup", "draft")

_ids = itertools.count()


@dataclass(eq=False)
class SamplingGroup:
    """Rows that sample with one set of parameters from one random stream.

    `generate()` puts its whole batch in one group (one seed for the batch). A server request is
    a group of its own, with its own random stream: its drafts, when sampled, draw from it row by
    row (group_verify.draft_sampling), and its verification draws from it alone. `sample_drafts`:
    whether a round of this group's rows alone draws its drafts from the one stream."""

    params: SamplingParams
    seed: int | None
    generator: torch.Generator | None
    sample_drafts: bool

    @classmethod
    def create(cls, params: SamplingParams, device: torch.device, sample_drafts: bool) -> "SamplingGroup":
        if params.greedy:
            return cls(params, params.seed, None, sample_drafts)
        # Without a seed draw one (reported with the result, so a run can be repeated); never
        # torch.seed(), which would reseed torch's global generator as a side effect.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return cls(params, seed, torch.Generator(device=device).manual_seed(seed), sample_drafts)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    eos_token_ids: Collection[int] | None = None  # None: the tokenizer's
    # Called after each step that emitted tokens for this request: (new ids, their SOURCES).
    on_tokens: Callable[[list[int], list[str]], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # False: this request never drafts (a server request's "speculative": false); the output is
    # the same either way, only the speed differs.
    speculative: bool = True


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only (EOS included when it ended the row)
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "abort"
    stats: RequestStats
    seconds: float  # from the request's arrival until it finished
    ttft: float  # from the request's arrival until its first token
    seed: int | None = None  # the sampling seed used (None for greedy without one)
    request_id: int = -1
