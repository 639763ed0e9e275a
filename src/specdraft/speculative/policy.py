"""How many drafts a round verifies: a fixed K, or the width that pays most on this machine.

A round of width W costs drafting plus one target forward of W+1 tokens per row, and emits per
row 1 + sum_{i<=W} prod_{j<=i} a_j tokens on average (a_j: the chance draft j is accepted once
drafts 1..j-1 were). The adaptive policy picks the W (0 = a plain step) with the most expected
tokens per second, from

- a cost model measured here (costs.py): target forward seconds by (rows, width), greedy head
  seconds by rows scored and drafter seconds per step. Verification scores the head a block of
  positions at a time and only for rows still unrejected, so a wide round's head costs what its
  expected surviving rows cost;
- per-row acceptance estimates, one per draft source (acceptance.py); for mtp+ngram, which
  source a row's next drafts come from is read off its emitted tokens, and a row whose prompt
  lookups wait between probes drafts with the MTP drafter (skips_lookup).

The choice reads only past tokens and counts, so greedy output and sampling stay exact.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

import torch

from specdraft.drafters.base import Drafter
from specdraft.speculative.acceptance import STEADY_SOURCES, AcceptanceEstimates, RowAcceptance
from specdraft.speculative.profiling import by_confidence, first_rows, profile_tokens  # noqa: F401 (bench/steps.py)
from specdraft.speculative.verify import HEAD_BLOCK

DRAFT_POLICIES = ("adaptive", "fixed")  # --draft-policy: AdaptivePolicy, FixedPolicy
MARGIN = 0.03  # speculate only when it beats a plain step by this fraction (estimates are noisy)
# The same for rounds of several rows: their host work (drafter bookkeeping, lookups, ragged
# acceptance) grows with the rows and is not in the measured costs, which themselves read +-10%
# apart on a shared CPU (BENCHMARKS.md, "int8 rows on VNNI").
BATCH_MARGIN = 0.10
# The cost table times forwards alone; a round as the engine runs it also pays host work and a
# head over real rows, and a drafted round's share of that differs from a plain one's. So rounds
# are timed as they run, and drafted widths are priced at the measured drafted / plain ratio (never
# below 1) once each kind has run this many rounds (the median of the last ROUND_WINDOW of each).
ROUNDS_SEEN = 4
ROUND_WINDOW = 16
# A row that drafts every round never shows what a plain round costs; where drafting's predicted
# gain is below this, the policy runs ROUNDS_SEEN plain rounds to learn it (a clear gain needs no check).
PROBE_PLAIN_BELOW = 1.5


class DraftPolicy:
    """The engine asks `choose` for each round's width and reports back through `observe`."""

    def prepare(self, model: torch.nn.Module, drafter: Drafter | None, rows: int, k: int, width: int) -> None:
        """Called before a batch of up to `rows` rows starts (before the drafter's own prepare)."""

    def new_row(self, source: str, lookups: bool = False, prompt: list[int] = (), sampled: bool | tuple = False
                ) -> RowAcceptance | None:
        """Per-request state, kept by the engine with the request. `source`: where the drafter's
        own drafts come from ("mtp", "lookup", "draft"); `lookups`: it also proposes prompt lookups;
        `sampled`: the request samples (temperature > 0): True, or its (temperature, top-k,
        top-p), which then keeps a pool of its own."""
        return None

    def extend(self, state, tokens: list[int]) -> None:
        """Tokens the row emitted (host ints the engine has anyway)."""

    def skips_lookup(self, state) -> bool:
        """Whether the row's next drafts leave prompt lookup out (the engine tells a drafter that
        mixes lookups in through DraftInput.no_lookup)."""
        return False

    def choose(self, states: list) -> int:
        """The round's width W for these decoding rows' states: 0 = a plain step."""
        raise NotImplementedError

    def head_block(self) -> int | None:
        """How many positions verification scores per head call in the round `choose` last chose
        (None: verify.py's defaults). Any block gives the same verdicts (the head scores each row
        on its own); it only changes how often the head's table is read."""
        return None

    def observe_round(self, seconds: float) -> None:
        """The wall time of the round `choose` last chose a width for, as the engine ran it."""

    def observe(self, state, source: str | None, drafted: int, accepted: int,
                chances: list[float] | None = None, requested: int | None = None) -> None:
        """A row's round: `drafted` drafts verified (0 for a plain round), `accepted` of them taken;
        `chances`, when sampling: the probability each draft had of being accepted; `requested`:
        the width the round asked for (a drafter may stop sooner)."""


class FixedPolicy(DraftPolicy):
    """Always the drafter's full width (K; wider for prompt lookups), except that from
    `speculate_below` decoding rows on a round runs plain (None: never)."""

    def __init__(self, width: int, speculate_below: int | None = None):
        self.width, self.speculate_below = width, speculate_below

    def choose(self, states: list) -> int:
        if self.speculate_below is not None and len(states) >= self.speculate_below:
            return 0
        return self.width


class RoundTimes:
    """Measured over predicted seconds of the rounds the engine ran, plain and drafted apart."""

    def __init__(self) -> None:
        self.ratios = (deque(maxlen=ROUND_WINDOW), deque(maxlen=ROUND_WINDOW))  # [plain, drafted]
        self.pending: tuple[bool, float] | None = None  # the chosen round: (drafted, predicted seconds)

    def expect(self, drafted: bool, predicted: float) -> None:
        self.pending = (drafted, predicted)

    def observe(self, seconds: float) -> None:
        if self.pending is not None and self.pending[1] > 0 and seconds > 0:
            drafted, predicted = self.pending
            self.ratios[drafted].append(seconds / predicted)
        self.pending = None

    def wants_plain(self) -> bool:
        """Drafted rounds have run, plain ones not enough to compare them with."""
        return len(self.ratios[1]) >= ROUNDS_SEEN and len(self.ratios[0]) < ROUNDS_SEEN

    def drafted_factor(self) -> float:
        """What a drafted round costs against the table, relative to what a plain one does: 1 until
        both kinds have run ROUNDS_SEEN rounds (a run that never goes plain has nothing to compare).
        Never below 1: a round's time moves by tens of percent from one to the next on a shared CPU,
        so measurements may make drafting dearer than the table says, never cheaper (a drafter
        that never lands would be probed more often for a cheapness that is noise)."""
        plain, drafted = self.ratios
        if len(plain) < ROUNDS_SEEN or len(drafted) < ROUNDS_SEEN:
            return 1.0
        return max(1.0, median(drafted) / median(plain))


class AdaptivePolicy(DraftPolicy):
    """W maximising expected tokens / (draft(W) + verify(n, W + 1)) each round (see the module doc).
    `costs`: an object with ensure(model, drafter, rows, k, width), verify(n, w, alive, block) ->
    seconds (alive: the expected rows per block of head positions, see MeasuredCosts.verify) and
    draft(n, steps) -> seconds (costs.MeasuredCosts; tests pass their own)."""

    def __init__(self, costs, prior: dict[str, float | tuple[float, ...]] | None = None, margin: float = MARGIN,
                 batch_margin: float = BATCH_MARGIN, steady_sources: tuple[str, ...] = STEADY_SOURCES,
                 narrow_start: bool = True, timed_rounds: bool = False):
        """`narrow_start`: a request whose drafter is unproven starts narrow (AcceptanceEstimates.width_cap);
        `timed_rounds`: price drafted rounds by how the engine's rounds measured (RoundTimes)."""
        self.costs, self.margin, self.batch_margin = costs, margin, batch_margin
        self.narrow_start = narrow_start
        self.round_times = RoundTimes() if timed_rounds else None
        self.estimates = AcceptanceEstimates(prior, steady_sources)
        self._block: int | None = None  # the head block of the round `choose` last chose (head_block)

    @property
    def prior(self) -> dict[str, float | tuple[float, ...]]:
        return self.estimates.prior

    @property
    def pooled(self) -> dict[tuple[str, bool | tuple], list[float]]:
        """Every request's outcomes pooled, per (source, greedy or the sampling's shaping): where a
        new request starts."""
        return self.estimates.pooled

    @property
    def k(self) -> int:
        return self.estimates.k

    @property
    def width(self) -> int:
        return self.estimates.width

    def prepare(self, model: torch.nn.Module, drafter: Drafter | None, rows: int, k: int, width: int) -> None:
        self.estimates.k, self.estimates.width = k, width
        if drafter is not None:
            self.costs.ensure(model, drafter, rows, k, width)

    def new_row(self, source: str, lookups: bool = False, prompt: list[int] = (), sampled: bool | tuple = False
                ) -> RowAcceptance:
        """`sampled`: False (greedy), or the request's SamplingParams.shaping: its pool."""
        return RowAcceptance(source, lookups, prompt, sampled)

    def extend(self, state: RowAcceptance | None, tokens: list[int]) -> None:
        if state is not None and state.lookups:
            state.extend(tokens)

    def skips_lookup(self, state: RowAcceptance | None) -> bool:
        return state is not None and self.estimates.skips_lookup(state)

    def expected_tokens(self, state: RowAcceptance) -> list[float]:
        """[W = 0..width] -> expected tokens this row emits in a round of width W."""
        return self.estimates.expected(state, self.estimates.source(state))[0]

    def choose(self, states: list) -> int:
        n = len(states)
        if self.width == 0 or n == 0:
            return 0
        gains = [0.0] * (self.width + 1)
        widths = [0.0] * (self.width + 1)  # the round's verify width: its widest row's expected drafts
        steps = [0.0] * (self.width + 1)  # drafter steps: until its last row stops
        # Expected rows whose drafts before each position were all accepted: only those rows'
        # positions reach the head (verify_greedy_blockwise, sampled_probs_blockwise).
        alive = [float(n)] + [0.0] * self.width
        cap = 0  # the widest any row may ask: rows whose drafter is unproven start narrow (width_cap)
        for s in states:
            source = self.estimates.source(s)  # a lookup that waits leaves the row to the drafter
            tokens, drafts = self.estimates.expected(s, source)
            row_cap = self.estimates.width_cap(s, source) if self.narrow_start else None
            if self.estimates.waiting(s, source):  # a failing drafter between probes: no drafts expected
                tokens, drafts, row_cap = [1.0] * (self.width + 1), [0.0] * (self.width + 1), 0
            cap = max(cap, self.width if row_cap is None else row_cap)
            for w in range(self.width + 1):
                gains[w] += tokens[w]
                widths[w] = max(widths[w], drafts[w])
                if source != "lookup":  # when every row looks up, the drafter itself does not run
                    steps[w] = max(steps[w], min(drafts[w], self.k))
            for i in range(1, self.width + 1):
                alive[i] += tokens[i] - tokens[i - 1]  # this row still unrejected at position i
        margin = self.margin if n == 1 else max(self.margin, self.batch_margin)
        factor = self.round_times.drafted_factor() if self.round_times is not None else 1.0
        plain_cost = self.costs.verify(n, 1, alive[:1], 1)
        plain_rate = n / plain_cost
        best, best_rate, best_cost, self._block = 0, plain_rate * (1 + margin), plain_cost, None
        for w in range(1, min(cap, self.width) + 1):
            draft = self.costs.draft(n, steps[w]) if steps[w] > 0 else 0.0
            verify, block = self._verify_cost(n, widths[w] + 1, alive)
            cost = draft + verify
            rate = gains[w] / (cost * factor)
            if rate > best_rate:
                best, best_rate, best_cost, self._block = w, rate, cost, block
        if self.round_times is not None:
            if best > 0 and self.round_times.wants_plain() and best_rate < PROBE_PLAIN_BELOW * plain_rate:
                best, best_cost = 0, plain_cost
            self.round_times.expect(best > 0, best_cost)
        return best

    def _verify_cost(self, n: int, w: float, alive: list[float]) -> tuple[float, int]:
        """(seconds, head block) of the cheapest way to verify w positions for n rows, `alive[i]`
        of them expected to reach position i: for each block of 1 to HEAD_BLOCK positions (the
        largest the cost table times the head for), the forward plus a head call per block for
        the rows that reach its first position. Where the head costs about the same for 1 to 4
        rows, one call for every position beats a second call at the acceptance of sampling's
        first drafts; where each row costs more (BENCHMARKS.md: a 2-core AVX2 CPU, 11.9 ms for
        one row, 24.8 for 4) a round that mostly ends early pays for fewer rows. Ties go to the
        larger block."""
        best = None
        for block in range(min(HEAD_BLOCK, math.ceil(w)), 0, -1):
            seconds = self.costs.verify(n, w, alive[::block], block)
            if best is None or seconds < best[0]:
                best = (seconds, block)
        return best

    def head_block(self) -> int | None:
        return self._block

    def observe_round(self, seconds: float) -> None:
        if self.round_times is not None:
            self.round_times.observe(seconds)

    def observe(self, state: RowAcceptance | None, source: str | None, drafted: int, accepted: int,
                chances: list[float] | None = None, requested: int | None = None) -> None:
        if state is not None:
            self.estimates.observe(state, source, drafted, accepted, chances, requested)
