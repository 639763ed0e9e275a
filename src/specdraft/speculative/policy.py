"""How many drafts a round verifies: a fixed K, or the width that pays most on this machine.

A round of width W costs drafting plus one target forward of W+1 tokens per row, and emits per
row 1 + sum_{i<=W} prod_{j<=i} a_j tokens on average (a_j: the chance draft j is accepted once
drafts 1..j-1 were). The adaptive policy picks the W (0 = a plain step) with the most expected
tokens per second, from

- a cost model measured here: target forward seconds by (rows, width), greedy head seconds by
  rows scored and drafter seconds per step, profiled once on scratch caches and kept on disk
  under $SPECDRAFT_CACHE/costs (or $SPECDRAFT_COSTS_DIR), keyed by everything that changes them
  (model, weights, dtype, device, torch, threads, CPU). Verification scores the head a block
  of positions at a time and only for rows still unrejected (verify_greedy_blockwise, and
  sampled_probs_blockwise in smaller blocks), so a wide round's head costs what its expected
  surviving rows cost;
- per-row acceptance estimates, one per draft source (prompt lookup and the MTP drafter accept
  very differently), updated from each round's accepted counts; for mtp+ngram, which source a
  row's next drafts come from is read off its emitted tokens (a lookup needs a repeated bigram).

A row that stops drafting keeps no evidence, so its estimates drift back to the prior during
plain rounds: a row whose text turns predictable again gets probed now and then, at the cost of
one wide round every few dozen plain ones (lookups) or every few (a drafter's steady rate, which
is also learnt more slowly: one rejection is a single coin flip of it). A drafter's sampled rows
drift instead to what the engine's sampled rows have shown (see _relax_target), and that estimate
itself creeps back to the prior while they run plain, so it cannot lock every later request out of
drafting (POOL_RELAX). The choice reads only past tokens and counts, so greedy output and sampling
stay exact.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdraft.drafters.base import Drafter, DraftInput
from specdraft.models.kernels import build as kernels
from specdraft.sampling import SamplingParams
from specdraft.speculative.verify import HEAD_BLOCK, SAMPLED_HEAD_BLOCK

# Conditional per-position acceptance before a row has any evidence (one value, or one per draft
# position with the last repeating). Optimistic on purpose: a pessimistic prior would never draft
# and so never learn otherwise, and a position a row never drafts keeps its prior. A lookup that
# got its first drafts right is copying a stretch and likely to go on: replaying lookups over
# greedy answers to 120 training-source prompts, the chance draft j is right once drafts 1..j-1
# were read 0.78, 0.89, 0.91, 0.94, 0.94, 0.97, 0.97, 0.97. With 0.8 at every position the
# policy kept lookups to 3 drafts, never saw the later positions, and so never learnt them.
PRIOR = {"lookup": (0.8, 0.9, 0.9, 0.95), "mtp": 0.6, "draft": 0.6}
LEARNING_RATE = 0.3  # weight of one round's outcome in a row's estimate (lookups; continuation)
RELAX = 0.01  # per plain round: how far unobserved estimates move back towards the prior (a failed
# probe then costs one wide round in a few dozen plain ones)
# A drafter's (MTP, draft model) acceptance is a steady rate that one round measures poorly (one
# Bernoulli draw), while a lookup's comes in bursts (a copied stretch, then none). At 0.3 one
# rejected first draft took a row's MTP estimate from ~0.63 to ~0.44, below the ~0.5 break-even of
# a 2-core AVX2 CPU, and at 0.01 a round the row then waited ~70 plain rounds (most of an answer)
# before drafting again: `auto` ran plain in 72% of its rounds where fixed `mtp` gained 1.18x.
# Drafters' rows learn slowly and re-probe soon instead, as sampling rows do: 1.31x plain against
# 1.28x on 39 Spec-Bench questions there, tau 2.09 against 1.89 (BENCHMARKS.md).
STEADY_LEARNING_RATE = 0.1
STEADY_RELAX = 0.05
STEADY_SOURCES = ("mtp", "draft")
# Sampling rows learn from each draft's acceptance chance (see observe). At temperature 1 the
# MTP drafter's first-draft chance averages ~0.35 against a break-even of ~0.3 (2-core CPU), so a
# short memory keeps dipping below break-even and the row then waits in plain rounds: replaying
# chances recorded at T=1 through this policy gave 0.94x the best fixed width with (0.3, 0.01)
# and 0.99x with (0.1, 0.05) (BENCHMARKS.md).
SAMPLED_LEARNING_RATE = 0.1
SAMPLED_RELAX = 0.05
POOL_RATE = 0.05  # the same for the engine-wide estimate a new request starts from
# Per plain round of a drafter's sampled row: how far the engine's sampled estimate moves back
# towards the prior. Sampled rows start from that pool and drift to it (_relax_target), and it
# learns only from rounds that draft; a stretch of low chances that took it below break-even
# left every later sampled request plain for good (Spec-Bench at temperature 1, 10 prompts a
# category: `auto` ran plain from the 90th prompt on, tau 1.06-1.11 where fixed `mtp` had
# 1.48-1.71). With this a pool below break-even is probed again after a few hundred plain rounds,
# and one probe's chances pull it back as far as they say. The same creep applies, for any row, to
# the positions past what a drafting round asked for (AdaptivePolicy._relax_unasked).
POOL_RELAX = 0.002
MARGIN = 0.03  # speculate only when it beats a plain step by this fraction (estimates are noisy)
# The same for rounds of several rows: there a round's host work (drafter bookkeeping, copy
# lookups, ragged acceptance) grows with the rows and is not in the measured costs, and the
# costs themselves read +-10% apart on a shared CPU; with 3% `auto` drafted at batch 4 for a
# predicted gain and ran 0.94x plain (BENCHMARKS.md).
BATCH_MARGIN = 0.10
PROFILE_CONTEXT = 128  # cached tokens in the scratch cache the costs are timed over
# Timed calls per cell, taken in turns across every cell of a batch size (the target's widths, the
# drafter's rounds and the head's sizes: each once, then again...); the fastest counts (other
# processes only add time). Timed one cell after another, a few seconds of a slower machine
# landed on some widths only: a table once read a verify of 4 at 1.52x a plain step where it costs
# ~1.2x; and with the drafter timed after the target, a table read a draft step at 1.6x its usual
# time and `auto` drafted in a third of its rounds where it had drafted in two thirds. A table is
# kept until the code changes, checked once per process (RECHECK_*) (BENCHMARKS.md).
PROFILE_REPEATS = 6
# A table read from disk has its one-row forwards timed again once per process (fastest of
# RECHECK_REPEATS, ~0.3 s for Gemma 3 270M); a cell now under RECHECK_SLACK of its stored time was
# timed under load and the whole table is measured again. Six turns take about a second, so a
# job of a few seconds beside the profile lands on every repeat of some cells: a table once read
# a 9-token forward at 20.5 ms where it costs 14-15, and `auto` then never drafted more than 5
# lookups that day (BENCHMARKS.md, forty-first session). Load only adds time, so a cell can come
# out faster only if the table was slowed. Cells under RECHECK_FLOOR are not judged: there timer
# and scheduler noise alone move the fastest of a few calls by that much.
RECHECK_REPEATS = 3
RECHECK_SLACK = 0.8
RECHECK_FLOOR = 1e-3
_RECHECKED: set[Path] = set()  # tables checked by this process


class DraftPolicy:
    """The engine asks `choose` for each round's width and reports back through `observe`."""

    def prepare(self, model: torch.nn.Module, drafter: Drafter | None, rows: int, k: int, width: int) -> None:
        """Called before a batch of up to `rows` rows starts (before the drafter's own prepare)."""

    def new_row(self, source: str, lookups: bool = False, prompt: list[int] = (), sampled: bool = False
                ) -> "RowAcceptance | None":
        """Per-request state, kept by the engine with the request. `source`: where the drafter's
        own drafts come from ("mtp", "lookup", "draft"); `lookups`: it also proposes prompt lookups;
        `sampled`: the request samples (temperature > 0)."""
        return None

    def extend(self, state, tokens: list[int]) -> None:
        """Tokens the row emitted (host ints the engine has anyway)."""

    def choose(self, states: list) -> int:
        """The round's width W for these decoding rows' states: 0 = a plain step."""
        raise NotImplementedError

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


class RowAcceptance:
    """A request's acceptance estimates per draft source and position, and whether its next
    drafts will be a prompt lookup: the lookup drafter proposes where the sequence's last 2 tokens
    occurred before, which the host can tell from the tokens it already holds (no device sync)."""

    def __init__(self, source: str, lookups: bool, prompt: list[int] = (), sampled: bool = False):
        self.source, self.lookups = source, lookups  # lookups: the drafter mixes them in (mtp+ngram)
        self.rates: dict[str, list[float]] = {}
        # Per source, position j: the chance the drafter proposes draft j + 2 once it proposed draft
        # j + 1 and the round asked for more (the MTP drafter stops after an unsure draft; a lookup
        # ends where its match ends). A round that stops sooner drafts and verifies fewer tokens.
        self.continues: dict[str, list[float]] = {}
        # The same chance once draft j + 1 was also accepted: what the tokens a round emits depend
        # on. The drafter carries on where it is sure, which is where its drafts are accepted, so
        # this one is higher (see AdaptivePolicy._expected).
        self.continues_accepted: dict[str, list[float]] = {}
        self.sampled = sampled  # its rounds report acceptance chances (temperature > 0)
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


class AdaptivePolicy(DraftPolicy):
    """W maximising expected tokens / (draft(W) + verify(n, W + 1)) each round (see the module doc).
    `costs`: an object with ensure(model, drafter, rows, k, width), verify(n, w, alive, block) ->
    seconds (alive: the expected rows per block of head positions, see MeasuredCosts.verify) and
    draft(n, steps) -> seconds (MeasuredCosts here; tests pass their own)."""

    def __init__(self, costs, prior: dict[str, float | tuple[float, ...]] | None = None, margin: float = MARGIN,
                 batch_margin: float = BATCH_MARGIN, steady_sources: tuple[str, ...] = STEADY_SOURCES):
        self.costs, self.prior, self.margin, self.batch_margin = costs, dict(prior or PRIOR), margin, batch_margin
        self.steady_sources = steady_sources  # sources learnt slowly and re-probed soon (see STEADY_*)
        self.k = self.width = 0
        # Per source and kind of request (greedy, sampled: a drafter's sampled drafts are accepted
        # far less often), every request's outcomes pooled: a new request starts from what the
        # engine has seen (a server or a benchmark keeps one engine for many requests), else from
        # the prior.
        self.pooled: dict[tuple[str, bool], list[float]] = {}
        self.pooled_continues: dict[str, list[float]] = {}  # the same for continuation (prior: always)
        self.pooled_continues_accepted: dict[str, list[float]] = {}

    def prepare(self, model: torch.nn.Module, drafter: Drafter | None, rows: int, k: int, width: int) -> None:
        self.k, self.width = k, width
        if drafter is not None:
            self.costs.ensure(model, drafter, rows, k, width)

    def cap(self, source: str) -> int:
        """Most drafts a row of this source carries: lookups may go past the MTP drafter's K."""
        return self.width if source == "lookup" else self.k

    def new_row(self, source: str, lookups: bool = False, prompt: list[int] = (), sampled: bool = False
                ) -> RowAcceptance:
        return RowAcceptance(source, lookups, prompt, sampled)

    def extend(self, state: RowAcceptance | None, tokens: list[int]) -> None:
        if state is not None and state.lookups:
            state.extend(tokens)

    def _priors(self, source: str, size: int) -> list[float]:
        """The prior of each of `size` draft positions."""
        prior = self.prior.get(source, 0.5)
        values = list(prior) if isinstance(prior, (tuple, list)) else [prior]
        return [values[min(j, len(values) - 1)] for j in range(size)]

    def _start(self, source: str, sampled: bool) -> list[float]:
        key = (source, sampled)
        if key not in self.pooled or len(self.pooled[key]) != self.cap(source):
            self.pooled[key] = self._priors(source, self.cap(source))
        return self.pooled[key]

    def _rates(self, state: RowAcceptance, source: str) -> list[float]:
        if source not in state.rates:
            state.rates[source] = list(self._start(source, state.sampled))
        return state.rates[source]

    def _relax_target(self, state: RowAcceptance, source: str) -> list[float]:
        """Where a row's estimates of `source` drift during its plain rounds: the prior, except for
        a drafter's (MTP, draft model) sampled rows, which drift to what the engine's sampled rows
        of that source have shown. A drafter's sampled acceptance is a steady rate of the drafter
        and target (fixed `mtp` at temperature 1 read 0.86-1.02x plain in every Spec-Bench category
        on a 2-core CPU), its chances measure it with little noise, and it sits far below the
        greedy prior: drifting to 0.6 every few plain rounds, rows whose chances averaged ~0.3
        drafted every third round and decoded 5-11% slower than plain (BENCHMARKS.md). A lookup's
        acceptance comes in bursts (a copied stretch), so its rows keep re-probing from the prior."""
        size = len(state.rates[source])
        if state.sampled and source in self.steady_sources:
            return self._start(source, True)[:size]
        return self._priors(source, size)

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

    def _expected(self, state: RowAcceptance, source: str) -> tuple[list[float], list[float]]:
        """[W = 0..width] -> (expected tokens emitted, expected drafts proposed) for a round that
        asks W drafts: draft i exists with the chance the drafter carried on to it, and emits when
        it exists and it and every earlier one are accepted. The two chances of carrying on differ:
        the drafter stops where it is unsure, so it carries on more often after a draft that was
        accepted. Multiplying the overall chance into the tokens undervalued asking for more drafts
        (at temperature 1 the MTP drafter carried on after 30% of its first drafts)."""
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

    def expected_tokens(self, state: RowAcceptance) -> list[float]:
        """[W = 0..width] -> expected tokens this row emits in a round of width W."""
        return self._expected(state, state.next_source)[0]

    def choose(self, states: list) -> int:
        n = len(states)
        if self.width == 0 or n == 0:
            return 0
        gains = [0.0] * (self.width + 1)
        widths = [0.0] * (self.width + 1)  # the round's verify width: its widest row's expected drafts
        steps = [0.0] * (self.width + 1)  # drafter steps: until its last row stops
        # Expected rows whose drafts before each block of head positions were all accepted: only
        # those rows' positions reach the head (verify_greedy_blockwise, sampled_probs_blockwise).
        block = SAMPLED_HEAD_BLOCK if any(s.sampled for s in states) else HEAD_BLOCK
        alive = [float(n)] + [0.0] * (self.width // block)
        for s in states:
            source = s.next_source
            tokens, drafts = self._expected(s, source)
            for w in range(self.width + 1):
                gains[w] += tokens[w]
                widths[w] = max(widths[w], drafts[w])
                if source != "lookup":  # when every row looks up, the drafter itself does not run
                    steps[w] = max(steps[w], min(drafts[w], self.k))
            for b in range(block, self.width + 1, block):
                alive[b // block] += tokens[b] - tokens[b - 1]  # this row still unrejected there
        margin = self.margin if n == 1 else max(self.margin, self.batch_margin)
        best, best_rate = 0, n / self.costs.verify(n, 1, alive[:1], block) * (1 + margin)
        for w in range(1, self.width + 1):
            draft = self.costs.draft(n, steps[w]) if steps[w] > 0 else 0.0
            rate = gains[w] / (draft + self.costs.verify(n, widths[w] + 1, alive, block))
            if rate > best_rate:
                best, best_rate = w, rate
        return best

    def observe(self, state: RowAcceptance | None, source: str | None, drafted: int, accepted: int,
                chances: list[float] | None = None, requested: int | None = None) -> None:
        if state is None:
            return
        if source is None:
            # A plain round, no evidence: drift back towards the priors so the row gets re-tried.
            for src, rates in state.rates.items():
                relax = self._learning(state, src)[1]
                rates[:] = [r + relax * (p - r) for r, p in zip(rates, self._relax_target(state, src))]
                if state.sampled and src in self.steady_sources:  # the pool it drifts to must not lock in
                    pool = self._start(src, True)
                    pool[:] = [q + POOL_RELAX * (p - q) for q, p in zip(pool, self._priors(src, len(pool)))]
            for src, cont in [*state.continues.items(), *state.continues_accepted.items()]:
                relax = self._learning(state, src)[1]
                cont[:] = [c + relax * (1.0 - c) for c in cont]
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
        state.sampled |= chances is not None
        rate = self._learning(state, source)[0]
        rates, pooled = self._rates(state, source), self._start(source, state.sampled)
        # Draft j was judged only if drafts 1..j-1 were accepted: positions 1..accepted passed,
        # position accepted+1 failed (a lookup without a match counts as a failed first draft);
        # later ones say nothing. When sampling, a judged draft counts with the chance it had
        # (min(1, P/Q)) instead of the coin's outcome: the same mean, a fraction of the noise, so
        # one unlucky round no longer stops a row drafting for dozens of rounds.
        for j in range(min(accepted + 1, max(drafted, 1), len(rates))):
            if chances is not None and j < drafted:
                hit = chances[j]
            else:
                hit = 1.0 if j < accepted else 0.0
            rates[j] += rate * (hit - rates[j])
            pooled[j] += POOL_RATE * (hit - pooled[j])
        if requested is not None and requested < self.cap(source):  # else every position was asked
            self._relax_unasked(state, source, requested)

    def _relax_unasked(self, state: RowAcceptance, source: str, asked: int) -> None:
        """Positions past the `asked` drafts of a drafting round got no evidence: they drift back
        towards the prior as in a plain round, the row's at its relax rate and the engine's pool at
        POOL_RELAX. Without this a policy that stopped asking for them never learnt them again: a
        run of translations (whose lookups likely break after a few drafts) took the pool below break-even
        there, and every later request of a 480-question benchmark was held to 3 lookup drafts
        (BENCHMARKS.md, fortieth session)."""
        relax = self._learning(state, source)[1]
        rates, target = self._rates(state, source), self._relax_target(state, source)
        pooled, prior = self._start(source, state.sampled), self._priors(source, self.cap(source))
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


# --- the measured cost model --------------------------------------------------------------------

def cpu_identity(cpuinfo: str) -> str | None:
    """The first processor's model name with its family and model numbers, from /proc/cpuinfo's
    text: clouds often report only "AMD EPYC", and a Zen 1 and a Zen 3 behind that name step at
    very different speeds, so a cost table must not move between them."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if "model name" not in fields:
        return None
    return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def _cpu_name() -> str:
    try:
        found = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        found = None
    return found or platform.processor() or platform.machine()


def cost_key(model_name: str, folder: str, weights: str, dtype: str, device: torch.device) -> dict:
    """Everything a step's time depends on, as the cache key (a change means re-profiling)."""
    return {
        "model": model_name, "folder": str(folder), "weights": weights, "dtype": dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "code": forward_code_digest(),
        "kernels": kernels.enabled(),
    }


@functools.lru_cache(maxsize=1)
def forward_code_digest() -> str:
    """A hash of the source that decides what a forward or a draft step costs and how it is timed
    (models/ and its C kernels, drafters/, the KV cache, this file): an update that makes steps
    cheaper or dearer, or times them differently, re-profiles instead of trusting an old table."""
    root = Path(__file__).resolve().parents[1]
    files = sorted([*(root / "models").rglob("*.py"), *(root / "models").rglob("*.c"),
                    *(root / "models").rglob("*.h"), *(root / "drafters").rglob("*.py")])
    files += [root / "kv_cache.py", Path(__file__).resolve()]
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


COSTS_ENV = "SPECDRAFT_COSTS_DIR"  # where cost tables go, if not $SPECDRAFT_CACHE/costs (tests: a temp dir)


def costs_dir() -> Path:
    """$SPECDRAFT_COSTS_DIR if set, else $SPECDRAFT_CACHE/costs. The cost tables alone can move:
    the test suite keeps its tiny models' tables out of the user's cache while still reusing the
    real model converted there."""
    from specdraft.loading.presets import cache_root

    override = os.environ.get(COSTS_ENV)
    return Path(override) if override else cache_root() / "costs"


def drafter_key(drafter: Drafter) -> str:
    inner = getattr(drafter, "mtp", drafter)  # mtp+ngram: lookups are free, the MTP steps cost
    net = getattr(inner, "net", None)  # a clustered head's step reads the rows of the clusters it keeps
    kept = f":top{net.config.top_k_clusters}" if net is not None and net.config.clustered else ""
    return f"{type(inner).__name__}:{inner.kind}:{inner.nbytes()}{kept}"


def row_buckets(rows: int) -> list[int]:
    """Batch sizes profiled for up to `rows` rows: powers of two up to the first >= rows."""
    out = [1]
    while out[-1] < rows:
        out.append(out[-1] * 2)
    return out


def head_sizes(rows: int) -> list[int]:
    """Rows the greedy head is timed for: 1 to HEAD_BLOCK (a verification's first block at batch 1),
    then a block for each profiled batch size."""
    return sorted(set(range(1, HEAD_BLOCK + 1)) | {HEAD_BLOCK * b for b in row_buckets(rows)})


def profiled_widths(width: int) -> list[int]:
    """Query widths timed for rounds of up to `width` drafts: every one up to 6 (where packed
    kernels jump), then sparser (interpolated in between)."""
    top = width + 1
    return sorted({w for w in range(1, min(top, 6) + 1)} | set(range(6, top, 3)) | {top})


def _interpolate_at(xs: list[int], y: Callable[[int], float], x: float) -> float:
    """Piecewise linear through (xs[i], y(i)) (xs sorted), proportional past either end; y is
    called only for the points x falls between (the policy prices ~10 widths a round)."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return y(i)
    if i == 0 or i == len(xs):  # past the table: proportional
        j = 0 if i == 0 else len(xs) - 1
        return y(j) * x / xs[j]
    lo, hi = y(i - 1), y(i)
    return lo + (hi - lo) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _interpolate(table: dict[int, float], x: float) -> float:
    xs = sorted(table)
    return _interpolate_at(xs, lambda i: table[xs[i]], x)


def monotone(target: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """A forward never costs more than a wider one or one over more rows: another process can only
    add time to a measurement, so each cell is lowered to the cheapest wider or larger cell."""
    out: dict[int, dict[int, float]] = {}
    for n in sorted(target, reverse=True):
        row, best = {}, float("inf")
        for w in sorted(target[n], reverse=True):
            larger = [out[m][w] for m in out if w in out[m]]
            best = min([best, target[n][w]] + larger)
            row[w] = best
        out[n] = row
    return out


class MeasuredCosts:
    """Seconds per target forward by (rows, width), per greedy head call by rows scored, and per
    drafter step by rows, timed on this machine the first time they are needed and cached as
    JSON (`key` + tables) in `folder`."""

    def __init__(self, key: dict, folder: Path | None = None, progress: bool = False):
        self.key, self.progress = key, progress
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = (folder or costs_dir()) / f"{digest}.json"
        self.target: dict[int, dict[int, float]] = {}  # the forward alone (layers, final norm)
        self.head: dict[int, float] = {}  # model.greedy_tokens over that many hidden rows
        self.drafts: dict[str, dict[int, list[float]]] = {}  # drafter key -> rows -> [base s, per-step s]
        self.drafter = ""
        self._clean = None  # the target table with timing noise taken out (monotone), built on use
        self._curves: dict[float, tuple[list[int], list[float]]] = {}  # its curve over widths, per rows
        self._clean_head = None  # the same for the head: (sizes, seconds)
        self.profiled = 0  # cells timed by this process (tests read it)
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if data.get("key") != self.key:  # a hash collision or a hand-edited file: trust nothing
            return
        self.target = {int(n): {int(w): s for w, s in t.items()} for n, t in data.get("target", {}).items()}
        self.head = {int(m): s for m, s in data.get("head", {}).items()}
        self.drafts = {d: {int(n): v for n, v in t.items()} for d, t in data.get("drafts", {}).items()}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": self.key, "target": self.target, "head": self.head, "drafts": self.drafts},
                                  indent=1))
        tmp.replace(self.path)  # atomic: a concurrent reader sees the old table or the new one

    def verify(self, n: float, w: float, alive: list[float] | None = None, block: int = HEAD_BLOCK) -> float:
        """Seconds of a verification of w positions for n rows: the forward, then the head over
        the positions verification scores: `block` at a time (HEAD_BLOCK greedy, SAMPLED_HEAD_BLOCK
        sampling), block b for alive[b] rows (expected: those whose earlier drafts were all
        accepted; None: all n). The head is the greedy one's time either way."""
        widths, seconds = self._forward_curve(n)
        forward = _interpolate_at(widths, seconds.__getitem__, w)
        if not self.head:
            return forward
        head = 0.0
        for b, start in enumerate(range(0, math.ceil(w), block)):
            rows = n if alive is None else alive[b]
            # below one row expected: that chance of the block for one row
            head += min(1.0, rows) * self.head_seconds(max(1.0, rows) * min(block, w - start))
        return forward + head

    def _forward_curve(self, n: float) -> tuple[list[int], list[float]]:
        """(widths, seconds) of a forward over n rows, interpolated between the profiled batch sizes
        at every profiled width: once per n, as the policy prices every width of a round for the
        same n (a piecewise-linear curve through the union of the widths is exactly the
        interpolation of the rows' own curves)."""
        if self._clean is None:
            self._clean, self._curves = monotone(self.target), {}
        if n not in self._curves:
            rows = sorted(self._clean)
            widths = sorted({w for t in self._clean.values() for w in t})
            seconds = [_interpolate_at(rows, lambda i: _interpolate(self._clean[rows[i]], w), n) for w in widths]
            self._curves[n] = (widths, seconds)
        return self._curves[n]

    def head_seconds(self, rows: float) -> float:
        """The greedy head over `rows` hidden rows, interpolated (fewer than profiled: proportional)."""
        if self._clean_head is None:  # more rows never cost less: noise only adds time
            sizes = sorted(self.head)
            self._clean_head = (sizes, [min(s for k, s in self.head.items() if k >= m) for m in sizes])
        sizes, seconds = self._clean_head
        return _interpolate_at(sizes, seconds.__getitem__, rows)

    def draft(self, n: int, steps: int) -> float:
        if steps == 0:
            return 0.0
        table = self.drafts.get(self.drafter, {})
        if not table:
            return 0.0
        rows = sorted(table)
        base = _interpolate_at(rows, lambda i: table[rows[i]][0], n)
        step = _interpolate_at(rows, lambda i: table[rows[i]][1], n)
        return base + step * steps

    @torch.inference_mode()
    def ensure(self, model: torch.nn.Module, drafter: Drafter, rows: int, k: int, width: int) -> None:
        """Time what is missing for batches of up to `rows` rows and rounds of up to `width` drafts."""
        self.drafter = drafter_key(drafter)
        if self.path not in _RECHECKED:  # once per process; a table profiled here is not checked again
            _RECHECKED.add(self.path)
            if self.target and self.timed_under_load(model):
                self.target, self.head, self.drafts = {}, {}, {}
        widths = profiled_widths(width)
        todo = [b for b in row_buckets(rows) if not set(widths) <= set(self.target.get(b, {}))
                or b not in self.drafts.get(self.drafter, {})]
        heads = [m for m in head_sizes(rows) if m not in self.head]
        if not todo and not heads:
            return
        t0 = time.perf_counter()
        dev = model.embed_tokens.weight.device
        for i, b in enumerate(todo or [None]):
            calls: dict[tuple, Callable[[], None]] = {}
            if b is not None:
                cache, hidden, tokens, _ = _scratch(model, b, max(widths))
                start = list(cache.host_lengths)
                missing = [w for w in widths if w not in self.target.get(b, {})]
                calls.update({("target", w): fn for w, fn in _target_calls(model, cache, missing).items()})
                drafting = b not in self.drafts.get(self.drafter, {})
                steps = max(2, k)
                if drafting:
                    calls.update({("draft", n): fn for n, fn in _drafter_calls(drafter, cache, hidden, tokens,
                                                                                 steps).items()})
            if i == 0 and heads:  # with the first batch size's cells
                states = _scratch(model, 1, max(widths))[3]
                calls.update({("head", m): fn for m, fn in _head_calls(model, states, heads).items()})
            with _confidence_stop_lifted(drafter):
                best = _fastest_each(calls, dev)
            if i == 0 and heads:
                self.head.update({m: best[("head", m)] for m in heads})
                self.profiled += len(heads)
            if b is not None:
                cache.rollback(start)
                self.target.setdefault(b, {}).update({w: best[("target", w)] for w in missing})
                if drafting:
                    one, many = best[("draft", 1)], best[("draft", steps)]
                    step = max(0.0, (many - one) / (steps - 1))
                    self.drafts.setdefault(self.drafter, {})[b] = [max(0.0, one - step), step]
                self.profiled += len(missing)
        self._clean = self._clean_head = None
        self.save()
        if self.progress:
            import sys

            print(f"specdraft: measured step costs for batch sizes {todo} in {time.perf_counter() - t0:.0f} s "
                  f"(cached in {self.path})", file=sys.stderr)

    @torch.inference_mode()
    def timed_under_load(self, model: torch.nn.Module) -> bool:
        """Whether a one-row forward of the stored table now runs under RECHECK_SLACK of its
        stored time (see RECHECK_SLACK): the table was measured on a busy machine."""
        stored = {w: s for w, s in self.target.get(1, {}).items() if s >= RECHECK_FLOOR}
        if not stored:
            return False
        cache, _, _, _ = _scratch(model, 1, max(stored))
        now = _fastest_each(_target_calls(model, cache, sorted(stored)), model.embed_tokens.weight.device,
                            RECHECK_REPEATS)
        slowed = {w: stored[w] / now[w] for w in stored if now[w] < RECHECK_SLACK * stored[w]}
        if slowed and self.progress:
            import sys

            w = max(slowed, key=slowed.get)
            print(f"specdraft: the step costs in {self.path} read up to {slowed[w]:.2f}x this machine's time now "
                  f"({w} tokens); they were measured under load, measuring again", file=sys.stderr)
        return bool(slowed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest_each(calls: dict, device: torch.device, repeats: int = PROFILE_REPEATS) -> dict:
    """{key: the fastest of `repeats` timed calls}, the calls taken in turns, so that a slow
    stretch of the machine lands on every key alike instead of on a few."""
    best = {key: float("inf") for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def profile_tokens(vocab_size: int, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] token ids to time steps with: a random 40-token phrase, repeated. Text is
    mostly predictable, and a model continuing a repeat is sure of its next token as it is on
    most real steps; on uniform random tokens its scores are flat, and the greedy head's exact
    screen (models/formats/screened_head.py) rescores thousands of near-ties, which real text rarely
    costs."""
    phrase = torch.randint(0, vocab_size, (rows, 40), generator=torch.Generator().manual_seed(seed))
    return phrase.repeat(1, -(-length // 40))[:, :length]


def _scratch(model: torch.nn.Module, rows: int, top: int):
    """A cache holding PROFILE_CONTEXT tokens per row, its last hidden states, the history, and
    every position's hidden state (rows to time the head on)."""
    dev = model.embed_tokens.weight.device
    ctx = min(PROFILE_CONTEXT, model.config.max_position_embeddings - top - 2)
    cache = model.new_cache(rows, ctx + top + 2)
    tokens = profile_tokens(model.config.vocab_size, rows, ctx + top + 2, seed=0).to(dev)
    states = model(tokens[:, :ctx], cache)
    return cache, states[:, -1], tokens, states.reshape(-1, states.shape[-1])


def _target_calls(model: torch.nn.Module, cache, widths: list[int]) -> dict[int, Callable[[], None]]:
    """{w: one forward of w tokens per row} from the cache's current lengths (the head is timed
    apart: _head_calls). Each call rolls the cache back first."""
    dev, start = model.embed_tokens.weight.device, list(cache.host_lengths)
    calls = {}
    for w in widths:
        tokens = profile_tokens(model.config.vocab_size, cache.batch_size, max(start) + w, seed=0)
        tokens = tokens[:, -w:].to(dev)  # the phrase's continuation: what a draft that is right would be

        def forward(tokens=tokens) -> None:
            cache.rollback(start)
            model(tokens, cache)

        forward()  # warm-up: first-call allocations and any compilation stay out of the timing
        calls[w] = forward
    cache.rollback(start)
    return calls


def by_confidence(model: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """The hidden rows `states` [N, H], those whose two best scores lie furthest apart first. Real
    decoding is mostly sure of its next token, and the exact greedy head (models/formats/screened_head.py)
    costs what such a step costs; on the profile text's unsure positions (its first, unrepeated
    phrase, and some later ones on a small model) thousands of tokens tie within the screen's
    bound and the head reads the table a second time: timed on those, a 32-row head read 96.8 ms
    where sure rows take 88.1."""
    gaps = []
    for chunk in states.split(16):  # 16 rows of full scores at a time: 16 MB for a 262k vocabulary
        best = model.logits(chunk).topk(min(2, model.config.vocab_size), dim=-1).values
        gaps.append(best[:, 0] - best[:, -1])
    return states[torch.cat(gaps).argsort(descending=True, stable=True)]


def first_rows(rows: torch.Tensor, m: int) -> torch.Tensor:
    """The first m of `rows`, cycled when m exceeds them."""
    return rows.repeat(-(-m // rows.shape[0]), 1)[:m]


def _head_calls(model: torch.nn.Module, states: torch.Tensor, sizes: list[int]) -> dict[int, Callable[[], None]]:
    """{m: model.greedy_tokens over m hidden rows of profile text} for each m in `sizes`: the rows
    it is surest about (by_confidence)."""
    calls, ranked = {}, by_confidence(model, states)
    for m in sizes:
        rows = first_rows(ranked, m)
        model.greedy_tokens(rows)  # warm-up
        calls[m] = lambda rows=rows: model.greedy_tokens(rows)
    return calls


@contextlib.contextmanager
def _confidence_stop_lifted(drafter: Drafter | None):
    """The MTP drafter's confidence stop off meanwhile: random text would end timed rounds early."""
    inner = getattr(drafter, "mtp", drafter)
    stop = getattr(inner, "min_confidence", None)
    if stop is not None:
        inner.min_confidence = 0.0
    try:
        yield
    finally:
        if stop is not None:
            inner.min_confidence = stop


def _drafter_calls(drafter: Drafter, cache, hidden: torch.Tensor, tokens: torch.Tensor, steps: int
                   ) -> dict[int, Callable[[], None]]:
    """{n: a drafting round of n steps for the cache's rows} for n in (1, steps): their difference
    gives the seconds per drafter step, the rest the fixed seconds per round. Each call rolls the
    cache back first (the target's timed forwards write past its lengths)."""
    inner = getattr(drafter, "mtp", drafter)
    rows, start = cache.batch_size, list(cache.host_lengths)
    dev = tokens.device
    position = torch.tensor(start, device=dev) - 1
    active = torch.ones(rows, dtype=torch.bool, device=dev)
    inp = DraftInput(tokens[:, start[0]], hidden, position, cache, tokens, active)
    inner.prepare(rows, cache.capacity)
    for r in range(rows):
        inner.reset_row(r)
    greedy = SamplingParams()

    def propose(n: int) -> None:
        cache.rollback(start)
        inner.propose(inp, n, greedy, None)

    with _confidence_stop_lifted(drafter):
        propose(steps)  # warm-up
    return {1: lambda: propose(1), steps: lambda: propose(steps)}
