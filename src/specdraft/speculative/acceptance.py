"""How often drafts are accepted, as the adaptive draft policy estimates it.

Per request and draft source ("lookup": prompt lookup, "mtp": the MTP drafter, "draft": a draft
model), one estimate per draft position: the chance draft j is accepted once drafts 1..j-1 were.
Each round's accepted counts (or, when sampling, each draft's acceptance chance) update them; a
row that drafts nothing keeps no evidence, so its estimates drift back towards a target during
plain rounds and the row gets probed again. Estimates pooled over every request seed new ones
(a server or a benchmark keeps one engine for many requests).

Everything here reads past tokens and counts only, so greedy output and sampling stay exact.
"""

from __future__ import annotations

# Acceptance before a row has any evidence (one value, or one per position, the last repeating).
# Optimistic on purpose: a pessimistic prior would never draft and so never learn otherwise. A
# lookup that got its first drafts right is copying a stretch and likely to go on, so its later
# positions start higher (BENCHMARKS.md, "Lookups that learn past 3 drafts").
PRIOR = {"lookup": (0.8, 0.9, 0.9, 0.95), "mtp": 0.6, "draft": 0.6}
# A lookup's acceptance comes in bursts (a copied stretch, then none): learn fast, re-probe rarely.
LEARNING_RATE = 0.3  # weight of one round's outcome in a row's estimate
RELAX = 0.01  # per plain round: how far unobserved estimates move back towards the prior
# A drafter's (MTP, draft model) acceptance is a steady rate that one round measures poorly (one
# coin flip): learn slowly and re-probe soon, or one rejection keeps a row plain for most of an
# answer (BENCHMARKS.md, "The draft policy on a slow CPU").
STEADY_LEARNING_RATE = 0.1
STEADY_RELAX = 0.05
STEADY_SOURCES = ("mtp", "draft")
# Rule: n >= start first drafts missed in a row -> wait min(2^(n - start), MAX_PROBE_GAP) plain rounds, greedy rows.
# start: PROBE_GAPS_FROM, or PROBE_GAPS_FROM_LANDED once the drafter landed in the request.
# Why: a drafter that never lands (a mismatched or untrained one) was re-probed every few
# rounds as its estimate drifted back to the prior, each probe ~1.2x a plain step at E2B size: 3-4%
# over 128 tokens. Doubling gaps probe it ~11 times there; a drafter that recovers (code inside
# prose) is found again within MAX_PROBE_GAP rounds, and one accepted draft ends the streak; one
# accepted half the time starts a gap in 3% of its rounds (BENCHMARKS.md, "Probes back off when drafts keep failing").
PROBE_GAPS_FROM = 2
PROBE_GAPS_FROM_LANDED = 5
MAX_PROBE_GAP = 16
# Prompt lookups back off too, later and for shorter gaps: their acceptance comes in bursts, so a
# miss says less about the next match. Without it, prompt lookup alone (`ngram`: what `auto` runs
# where no MTP drafter is found) with every draft rejected (simulated) drafted in 57 of 95 rounds
# at E4B (BENCHMARKS.md, "Prompt lookups that keep missing back off").
LOOKUP_GAPS_FROM = 3
LOOKUP_MAX_GAP = 8
# Sampling rows learn from each draft's acceptance chance, whose mean sits near break-even at
# temperature 1: a short memory keeps dipping below it (BENCHMARKS.md, "Fused projections,
# sampling-aware draft policy, long prompts").
SAMPLED_LEARNING_RATE = 0.1
SAMPLED_RELAX = 0.05
POOL_RATE = 0.05  # the same for the engine-wide estimates a new request starts from
# Per plain round of a drafter's sampled row (and per unasked position of any row): how far the
# pooled estimate creeps back to the prior, so that a pool below break-even cannot lock every
# later request out of drafting for good (BENCHMARKS.md, "Sampled rows locked out of drafting,
# and the fix").
POOL_RELAX = 0.002


class RowAcceptance:
    """A request's acceptance estimates per draft source and position, and whether its next
    drafts will be a prompt lookup: the lookup drafter proposes where the sequence's last 2 tokens
    occurred before, which the host can tell from the tokens it already holds (no device sync)."""

    def __init__(self, source: str, lookups: bool, prompt: list[int] = (), sampled: bool | tuple = False):
        self.source, self.lookups = source, lookups  # lookups: the drafter mixes them in (mtp+ngram)
        self.rates: dict[str, list[float]] = {}
        # Per source, position j: the chance the drafter proposes draft j + 2 once it proposed draft
        # j + 1 and the round asked for more (the MTP drafter stops after an unsure draft; a lookup
        # ends where its match ends). A round that stops sooner drafts and verifies fewer tokens.
        self.continues: dict[str, list[float]] = {}
        # The same chance once draft j + 1 was also accepted: what the tokens a round emits depend
        # on. The drafter carries on where it is sure, which is where its drafts are accepted, so
        # this one is higher (see AcceptanceEstimates.expected).
        self.continues_accepted: dict[str, list[float]] = {}
        self.sampled = bool(sampled)  # its rounds report acceptance chances (temperature > 0)
        # Which engine-wide pool it starts from and drifts to: False (greedy), or the request's
        # (temperature, top-k, top-p) when known (True otherwise). A drafter's sampled acceptance
        # depends on the shaping (on gemma3-270m, first drafts: 47% at temperature 1, BENCHMARKS.md),
        # so a server mixing temperatures keeps one pool per shaping, not one for them all.
        self.pool_key: bool | tuple = sampled if isinstance(sampled, tuple) else self.sampled
        self.misses: dict[str, int] = {}  # per source: first drafts rejected in a row
        self.rounds = 0  # rounds the row has run
        self.last_drafted: dict[str, int] = {}  # per source: the round (1 = the first) it last drafted in
        self.accepted: dict[str, int] = {}  # per source: drafts accepted
        self.from_prior: set[str] = set()  # sources whose estimates started from the bare prior (no pool)
        self._seen: set[tuple[int, int]] = set()  # every bigram but the last
        self._last: tuple[int, ...] = ()
        if lookups:
            self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            if len(self._last) == 2:
                self._seen.add(self._last)
            self._last = (self._last + (t,))[-2:]

    @property
    def next_source(self) -> str:
        """Where the next round's drafts most likely come from."""
        return "lookup" if self.lookups and self._last in self._seen else self.source


class AcceptanceEstimates:
    """Every row's estimates and the engine-wide pools they start from. `k`: the most drafts the
    drafter proposes; `width`: the most a round carries (lookups may go past k)."""

    def __init__(self, prior: dict[str, float | tuple[float, ...]] | None = None,
                 steady_sources: tuple[str, ...] = STEADY_SOURCES):
        self.prior, self.steady_sources = dict(prior or PRIOR), steady_sources
        self.k = self.width = 0
        # Per source and kind of request (greedy; sampled, per shaping: a drafter's sampled drafts
        # are accepted far less often, and less the hotter), every request's outcomes pooled.
        self.pooled: dict[tuple[str, bool | tuple], list[float]] = {}
        self.pooled_continues: dict[str, list[float]] = {}  # the same for continuation (prior: always)
        self.pooled_continues_accepted: dict[str, list[float]] = {}
        self.pool_rounds: dict[tuple[str, bool | tuple], int] = {}  # drafting rounds the pools have seen

    def cap(self, source: str) -> int:
        """Most drafts a row of this source carries: lookups may go past the MTP drafter's K."""
        return self.width if source == "lookup" else self.k

    def priors(self, source: str, size: int) -> list[float]:
        """The prior of each of `size` draft positions."""
        prior = self.prior.get(source, 0.5)
        values = list(prior) if isinstance(prior, (tuple, list)) else [prior]
        return [values[min(j, len(values) - 1)] for j in range(size)]

    def _start(self, source: str, sampled: bool | tuple) -> list[float]:
        key = (source, sampled)
        if key not in self.pooled or len(self.pooled[key]) != self.cap(source):
            self.pooled[key] = self.priors(source, self.cap(source))
        return self.pooled[key]

    def _rates(self, state: RowAcceptance, source: str) -> list[float]:
        if source not in state.rates:
            if self.pool_rounds.get((source, state.pool_key), 0) == 0:
                state.from_prior.add(source)
            state.rates[source] = list(self._start(source, state.pool_key))
        return state.rates[source]

    def _relax_target(self, state: RowAcceptance, source: str) -> list[float]:
        """Where a row's estimates of `source` drift during its plain rounds: the prior, except for
        a drafter's (MTP, draft model) sampled rows, which drift to what the engine's sampled rows
        of that source have shown. A drafter's sampled acceptance is a steady rate of drafter and
        target, measured with little noise and far below the greedy prior: drifting to the prior,
        such rows kept drafting at a loss (BENCHMARKS.md, "Temperature 1: a drafter's sampled
        rows stop re-probing at a loss"). A lookup's acceptance comes in bursts, so its rows
        re-probe from the prior."""
        size = len(state.rates[source])
        if state.sampled and source in self.steady_sources:
            return self._start(source, state.pool_key)[:size]
        return self.priors(source, size)

    def _start_continues(self, source: str, accepted: bool = False) -> list[float]:
        pool = self.pooled_continues_accepted if accepted else self.pooled_continues
        size = max(0, self.cap(source) - 1)
        if source not in pool or len(pool[source]) != size:
            pool[source] = [1.0] * size
        return pool[source]

    def _continues(self, state: RowAcceptance, source: str, accepted: bool = False) -> list[float]:
        rows = state.continues_accepted if accepted else state.continues
        if source not in rows:
            rows[source] = list(self._start_continues(source, accepted))
        return rows[source]

    def expected(self, state: RowAcceptance, source: str) -> tuple[list[float], list[float]]:
        """[W = 0..width] -> (expected tokens emitted, expected drafts proposed) for a round that
        asks W drafts: draft i exists with the chance the drafter carried on to it, and emits when
        it exists and it and every earlier one are accepted. The drafter stops where it is unsure,
        so it carries on more often after an accepted draft: the tokens use that chance, the
        drafts the overall one."""
        rates = self._rates(state, source)
        continues, after_accept = self._continues(state, source), self._continues(state, source, True)
        tokens, drafts, reach, exists = [1.0], [0.0], 1.0, 1.0
        for w in range(1, self.width + 1):
            if w > len(rates):  # no drafts past the source's cap
                reach = exists = 0.0
            else:
                exists *= continues[w - 2] if w >= 2 else 1.0
                reach *= rates[w - 1] * (after_accept[w - 2] if w >= 2 else 1.0)
            tokens.append(tokens[-1] + reach)
            drafts.append(drafts[-1] + exists)
        return tokens, drafts

    def observe(self, state: RowAcceptance, source: str | None, drafted: int, accepted: int,
                chances: list[float] | None = None, requested: int | None = None) -> None:
        """A row's round (see DraftPolicy.observe)."""
        if source is not None and self.skips_lookup(state):
            # The lookup was left out (skips_lookup reads the state choose saw): no evidence about
            # it, so its estimates drift back as they did when such rounds ran plain.
            self._plain_round(state, ("lookup",))
        state.rounds += 1
        if source is None:
            self._plain_round(state)
            return
        if requested is not None:  # did the drafter carry on to the next draft, where asked to?
            asked = min(requested, self.cap(source)) - 1
            # After each proposed draft, then after each accepted one (accepted <= drafted).
            for after, judged in ((False, drafted), (True, accepted)):
                cont, pooled = self._continues(state, source, after), self._start_continues(source, after)
                for i in range(min(judged, asked, len(cont))):
                    hit = 1.0 if i + 1 < drafted else 0.0
                    cont[i] += LEARNING_RATE * (hit - cont[i])
                    pooled[i] += POOL_RATE * (hit - pooled[i])
        if chances is not None and not state.sampled:
            state.sampled = state.pool_key = True
        rate = self._learning(state, source)[0]
        rates, pooled = self._rates(state, source), self._start(source, state.pool_key)
        # Draft j was judged only if drafts 1..j-1 were accepted: positions 1..accepted passed,
        # position accepted+1 failed (a lookup without a match counts as a failed first draft);
        # later ones say nothing. When sampling, a judged draft counts with the chance it had
        # (min(1, P/Q)) instead of the coin's outcome: the same mean, a fraction of the noise.
        for j in range(min(accepted + 1, max(drafted, 1), len(rates))):
            if chances is not None and j < drafted:
                hit = chances[j]
            else:
                hit = 1.0 if j < accepted else 0.0
            rates[j] += rate * (hit - rates[j])
            pooled[j] += POOL_RATE * (hit - pooled[j])
        if requested is not None and requested < self.cap(source):  # else every position was asked
            self._relax_unasked(state, source, requested)
        if drafted > 0:
            state.misses[source] = 0 if accepted > 0 else state.misses.get(source, 0) + 1
            state.last_drafted[source] = state.rounds
        state.accepted[source] = state.accepted.get(source, 0) + accepted
        key = (source, state.pool_key)
        self.pool_rounds[key] = self.pool_rounds.get(key, 0) + 1

    def width_cap(self, state: RowAcceptance, source: str) -> int | None:
        """The most drafts a round may ask of this row (None: no cap). A greedy request whose
        estimates of a drafter start from the bare prior drafts one more token than it has seen
        accepted: the prior is a guess, and a wide round on a drafter that never lands costs ~4x
        a narrow one (at E2B's costs a 4-wide verify 1.24x a plain step, a 2-wide one 1.07x),
        while one that lands widens within a few rounds. At E2B's costs a drafter that never lands
        then costs 2% over 128 tokens instead of 3.2%; one accepted as vLLM reports 1% (BENCHMARKS.md,
        "Simulated acceptance at real sizes"). The same holds for a request that started from the
        engine's pooled evidence but whose drafts have all missed so far: its later rounds are
        probes, and a probe one token wide learns as much about the first position for a quarter
        of a wide one's cost."""
        if state.sampled or source not in self.steady_sources:
            return None
        landed = state.accepted.get(source, 0)
        if source in state.from_prior or (landed == 0 and state.misses.get(source, 0) > 0):
            return 1 + landed
        return None

    def skips_lookup(self, state: RowAcceptance) -> bool:
        """Whether a row of a drafter that mixes in prompt lookups (mtp+ngram) should draft with
        its drafter this round although a lookup matches: its lookups wait between probes, its
        drafter's drafts do not. Left to the drafter's choice, such a row could only go plain and
        lost the MTP drafts that land while its lookups miss (BENCHMARKS.md, "Prompt lookups that
        keep missing back off")."""
        return (state.lookups and state.next_source == "lookup" and self.waiting(state, "lookup")
                and not self.waiting(state, state.source))

    def source(self, state: RowAcceptance) -> str:
        """Where the row's drafts come from this round: its next_source, or its drafter's own
        where the lookup is skipped (skips_lookup; the engine tells the drafter, DraftInput.no_lookup)."""
        return state.source if self.skips_lookup(state) else state.next_source

    def waiting(self, state: RowAcceptance, source: str) -> bool:
        """Whether a row whose drafter keeps failing (greedy rows) or whose prompt lookups keep
        failing (any row) waits between probes (PROBE_GAPS_FROM, LOOKUP_GAPS_FROM). A drafter's
        sampled rows learn a steady rate instead (_relax_target); a sampled lookup is a point
        mass whose token the target keeps with its own probability, so at temperature 1 a row
        that kept re-probing from the prior decoded below plain (BENCHMARKS.md, "Sampled prompt
        lookups back off too")."""
        if source in self.steady_sources:
            start = PROBE_GAPS_FROM if state.accepted.get(source, 0) == 0 else PROBE_GAPS_FROM_LANDED
            most = MAX_PROBE_GAP
        elif source == "lookup":
            start, most = LOOKUP_GAPS_FROM, LOOKUP_MAX_GAP
        else:
            return False
        misses = state.misses.get(source, 0)
        if (state.sampled and source != "lookup") or misses < start:
            return False
        gap = min(most, 2 ** (misses - start))
        return state.rounds - state.last_drafted.get(source, 0) < gap

    def _plain_round(self, state: RowAcceptance, sources: tuple[str, ...] | None = None) -> None:
        """No evidence (of `sources`; None: of any): drift back towards the priors so the row gets re-tried."""
        for src, rates in state.rates.items():
            if sources is not None and src not in sources:
                continue
            relax = self._learning(state, src)[1]
            rates[:] = [r + relax * (p - r) for r, p in zip(rates, self._relax_target(state, src))]
            if state.sampled and src in self.steady_sources:  # the pool it drifts to must not lock in
                pool = self._start(src, state.pool_key)
                pool[:] = [q + POOL_RELAX * (p - q) for q, p in zip(pool, self.priors(src, len(pool)))]
        for src, cont in [*state.continues.items(), *state.continues_accepted.items()]:
            if sources is not None and src not in sources:
                continue
            relax = self._learning(state, src)[1]
            cont[:] = [c + relax * (1.0 - c) for c in cont]

    def _relax_unasked(self, state: RowAcceptance, source: str, asked: int) -> None:
        """Positions past the `asked` drafts of a drafting round got no evidence: they drift back
        towards the prior as in a plain round, the row's at its relax rate and the engine's pool at
        POOL_RELAX. Without this a policy that stopped asking for them never learnt them again
        (BENCHMARKS.md, "More synthetic prompts: no gain; long lookups locked out for the rest of
        a run")."""
        relax = self._learning(state, source)[1]
        rates, target = self._rates(state, source), self._relax_target(state, source)
        pooled, prior = self._start(source, state.pool_key), self.priors(source, self.cap(source))
        for j in range(asked, len(rates)):
            rates[j] += relax * (target[j] - rates[j])
            pooled[j] += POOL_RELAX * (prior[j] - pooled[j])
        for after in (False, True):
            cont, pool = self._continues(state, source, after), self._start_continues(source, after)
            for i in range(max(asked - 1, 0), len(cont)):
                cont[i] += relax * (1.0 - cont[i])
                pool[i] += POOL_RELAX * (1.0 - pool[i])

    def _learning(self, state: RowAcceptance, source: str) -> tuple[float, float]:
        """(learning rate, relax per plain round) for this row's estimates of `source`."""
        if state.sampled:
            return SAMPLED_LEARNING_RATE, SAMPLED_RELAX
        if source in self.steady_sources:
            return STEADY_LEARNING_RATE, STEADY_RELAX
        return LEARNING_RATE, RELAX
