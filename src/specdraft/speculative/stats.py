"""Counting what speculative decoding did: forwards, drafts, acceptance, where time went."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class RequestStats:
    """One request's counts. `target_forwards` includes the prefill, which emits the first token;
    so new_tokens == accepted + target_forwards always, and tau is tokens per target forward."""

    draft_tokens: int
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache rather than prefilled

    @property
    def accepted(self) -> int:
        """Drafts that made it into the output (a round cut short by EOS or the length limit
        counts only what it emitted)."""
        return self.new_tokens - self.target_forwards

    @property
    def drafted(self) -> int:
        return sum(self.drafted_by_position)

    @property
    def mean_accepted(self) -> float:
        """tau: tokens emitted per target forward, the target's own token included."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """P(draft i accepted | draft i proposed); None where position i was never drafted."""
        return [a / d if d else None for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def summary(self) -> dict:
        """What reports show (generate --json, the server's `specdraft` object), rounded."""
        return {
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_by_position": [None if a is None else round(a, 4) for a in self.acceptance_by_position],
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "cached_prompt_tokens": self.cached_tokens,
        }


def merge(stats: list[RequestStats]) -> RequestStats:
    """Aggregate over requests (sums; tau and rates recomputed from the sums)."""
    k = max((s.draft_tokens for s in stats), default=0)
    total = RequestStats(k)
    total.drafted_by_position = [0] * k
    total.accepted_by_position = [0] * k
    for s in stats:
        total.new_tokens += s.new_tokens
        total.target_forwards += s.target_forwards
        for i, (d, a) in enumerate(zip(s.drafted_by_position, s.accepted_by_position)):
            total.drafted_by_position[i] += d
            total.accepted_by_position[i] += a
    return total


class Timer:
    """Wall time split into named phases (draft / verify / other); syncs CUDA at phase edges."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self.totals: dict[str, float] = {"draft": 0.0, "verify": 0.0, "other": 0.0}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
