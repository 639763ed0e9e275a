"""A request while the engine holds it: its emitted tokens, where it stops, its counters, and
the result it ends with."""

from __future__ import annotations

import time
from collections.abc import Callable

from specdraft.speculative.request import GenerationResult, Request, SamplingGroup
from specdraft.speculative.stats import RequestStats
from specdraft.speculative.stops import StopChecker


class ActiveRow:
    """A request's host-side state while the engine holds it."""

    def __init__(self, req: Request, group: SamplingGroup, eos: set[int], stops: StopChecker | None, k: int,
                 times: dict[str, float], acceptance=None):
        self.req, self.group, self.eos, self.stops = req, group, eos, stops
        self.acceptance = acceptance  # the draft policy's estimates for this request (acceptance.py)
        self.ids: list[int] = []
        self.prefilled = 0  # prompt tokens in the cache
        self.position = -1  # p: the cache holds 0..p (decoding rows)
        self.done, self.finish_reason, self.text = False, "length", ""
        self.stats = RequestStats(k, drafted_by_position=[0] * k, accepted_by_position=[0] * k)
        self.arrived, self.first_token_at = time.perf_counter(), 0.0
        self.times_at_start = dict(times)

    def take(self, new: list[int]) -> list[int]:
        """Append a round's tokens, cut at EOS, max_new_tokens or a stop string; returns the ones
        kept (`done` and `finish_reason` say whether and why the row ended)."""
        new = new[: self.req.max_new_tokens - len(self.ids)]
        for j, t in enumerate(new):
            if t in self.eos:
                new = new[: j + 1]
                self.done, self.finish_reason = True, "eos"
                break
        checked = len(self.ids)
        self.ids.extend(new)
        if len(self.ids) >= self.req.max_new_tokens and not self.done:
            self.done, self.finish_reason = True, "length"
        if self.stops is not None:
            end = self.stops.first_hit(self.ids, checked)
            if end is not None:
                del self.ids[end:]
                new = new[: end - checked]
                self.text = self.stops.text_before(self.ids)
                self.done, self.finish_reason = True, "stop"
        return new

    def result(self, reason: str, phase_totals: dict[str, float], decode: Callable[[list[int]], str]
               ) -> GenerationResult:
        """What the request ends with; `phase_totals`: the engine's timer now (the row's share is
        what grew since it arrived)."""
        s = self.stats
        s.new_tokens = len(self.ids)
        s.times = {k: v - self.times_at_start.get(k, 0.0) for k, v in phase_totals.items()}
        text = self.text if reason == "stop" else decode(self.ids)
        now = time.perf_counter()
        ttft = self.first_token_at - self.arrived if self.first_token_at else now - self.arrived
        return GenerationResult(list(self.req.prompt), self.ids, text, reason, s, now - self.arrived, ttft,
                                self.group.seed, self.req.id)
