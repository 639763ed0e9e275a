"""The draft policy: which width a round verifies, from a cost model and the acceptance seen.

Choices are checked against injected cost tables (no timing); the measured cost model is checked
for its cache (written, reloaded, re-profiled when the key differs), not for its numbers; the
engine with the adaptive policy emits exactly plain greedy decoding's tokens.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import OracleDrafter, prompts_of
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp_lookup import MTPWithLookup
from specdraft.drafters.ngram import NgramDrafter
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request
from specdraft.speculative.verify import HEAD_BLOCK, SAMPLED_HEAD_BLOCK
from specdraft.speculative.acceptance import (LEARNING_RATE, LOOKUP_GAPS_FROM, LOOKUP_MAX_GAP, MAX_PROBE_GAP, POOL_RATE,
                                              POOL_RELAX, RELAX, SAMPLED_LEARNING_RATE, SAMPLED_RELAX, STEADY_LEARNING_RATE, STEADY_RELAX, STEADY_SOURCES)
from specdraft.speculative.costs import (MeasuredCosts, cost_key, cpu_identity, head_sizes, monotone, profiled_widths,
                                         row_buckets)
from specdraft.speculative import acceptance
from specdraft.speculative.policy import AdaptivePolicy, FixedPolicy
from specdraft.speculative.profiling import by_confidence, first_rows


class FakeCosts:
    """Seconds from formulas: verify(n, w) (the head's blocks not told apart) and draft(n, steps);
    `ensure` is a no-op, counted."""

    def __init__(self, verify, draft=lambda n, steps: 0.0):
        self.verify = lambda n, w, alive=None, block=None: verify(n, w)
        self.draft, self.ensured = draft, 0

    def ensure(self, model, drafter, rows, k, width) -> None:
        self.ensured += 1


def policy_for(costs, k: int = 4, width: int | None = None, **kw) -> AdaptivePolicy:
    p = AdaptivePolicy(costs, **kw)
    p.prepare(None, None, 1, k, width or k)  # no drafter: nothing to measure
    return p


def test_free_width_picks_full_k():
    """Verifying more tokens costs nothing and drafting is free: draft as many as allowed (once
    the drafter has shown it lands: no narrow start)."""
    p = policy_for(FakeCosts(lambda n, w: 1.0), k=5, narrow_start=False)
    assert p.choose([p.new_row("mtp") for _ in range(3)]) == 5


def test_expensive_verify_and_low_acceptance_run_plain():
    """Each verified token costs a full step and drafts are rarely accepted: plain step."""
    p = policy_for(FakeCosts(lambda n, w: float(w), lambda n, s: 0.1 * s), k=4, prior={"mtp": 0.2})
    assert p.choose([p.new_row("mtp")]) == 0


def test_draft_cost_counts():
    """Cheap verify but a drafter step as dear as a target step: fewer drafts than K."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.05 * (w - 1), lambda n, s: 0.6 * s)
    p = policy_for(costs, k=6, prior={"mtp": 0.8}, narrow_start=False)
    w = p.choose([p.new_row("mtp")])
    assert 0 < w < 6
    free = policy_for(FakeCosts(costs.verify), k=6, prior={"mtp": 0.8}, narrow_start=False)
    assert free.choose([free.new_row("mtp")]) > w


def test_batch_size_enters_through_the_verify_cost():
    """A verify whose cost grows with rows x width pays at batch 1 but not at batch 8."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.1 * n * (w - 1))
    p = policy_for(costs, k=4, prior={"mtp": 0.5})
    assert p.choose([p.new_row("mtp")]) > 0
    assert p.choose([p.new_row("mtp") for _ in range(8)]) == 0


def test_several_rows_draft_only_for_a_clear_gain():
    """A round of several rows must beat plain by BATCH_MARGIN (its host work is not in the
    costs); one row by MARGIN. A predicted gain of ~6%: drafted alone, not in a batch of 4."""
    from specdraft.speculative.policy import BATCH_MARGIN, MARGIN

    costs = FakeCosts(lambda n, w: 1.0 + 0.5 * (w - 1))  # a round verifying 1 draft: 1.5x a plain step
    p = policy_for(costs, k=1, prior={"mtp": 0.6})  # 1.6 tokens a row for 1.5x the time
    assert MARGIN < (1 + 0.6) / 1.5 - 1 < BATCH_MARGIN  # a 6.7% gain, between the two margins
    assert p.choose([p.new_row("mtp")]) == 1
    assert p.choose([p.new_row("mtp") for _ in range(4)]) == 0
    assert policy_for(costs, k=1, prior={"mtp": 0.6}, batch_margin=MARGIN).choose(
        [p.new_row("mtp") for _ in range(4)]) == 1


def test_acceptance_updates_move_the_choice():
    """Rejections push a row to plain rounds; plain rounds relax it back to the prior, so it is
    probed again; acceptances widen it."""
    p = policy_for(FakeCosts(lambda n, w: 1.0 + 0.2 * (w - 1)), k=4, prior={"mtp": 0.6})
    row = p.new_row("mtp")
    first = p.choose([row])
    assert first > 0
    for _ in range(20):  # a drafter's estimates move 0.1 of the way a round (STEADY_LEARNING_RATE)
        p.observe(row, "mtp", first, 0)  # position 1 always rejected
    assert p.choose([row]) == 0
    plain_rounds = 0
    while p.choose([row]) == 0:
        p.observe(row, None, 0, 0)
        plain_rounds += 1
        assert plain_rounds < 200, "a row that stopped drafting is never probed again"
    assert plain_rounds > 5  # not at once: probing costs a wide round
    for _ in range(20):
        w = p.choose([row])
        p.observe(row, "mtp", w, w)  # everything accepted
    assert p.choose([row]) == 4
    assert row.rates["mtp"][0] > 0.9


def _drafting_rounds(p, row, rounds: int, accept) -> int:
    """Rounds of `rounds` that drafted, where accept(width) gives each round's accepted count."""
    drafted = 0
    for _ in range(rounds):
        w = p.choose([row])
        if w == 0:
            p.observe(row, None, 0, 0)
            continue
        drafted += 1
        p.observe(row, "mtp", w, accept(w), requested=w)
    return drafted


def _probe_rounds(p, row, rounds: int, accept, source: str = "mtp", chance: float | None = None) -> list[int]:
    """The rounds (0-based) of `rounds` that drafted; accept(round, width) gives the accepted count;
    `chance`: a sampled row's acceptance chance of every judged draft."""
    drafted = []
    for r in range(rounds):
        w = p.choose([row])
        if w == 0:
            p.observe(row, None, 0, 0)
            continue
        drafted.append(r)
        accepted = accept(r, w)
        chances = None if chance is None else [chance] * min(w, accepted + 1)
        p.observe(row, source, w, accepted, chances=chances, requested=w)
    return drafted


E2B_LIKE = FakeCosts(lambda n, w: {1: 1.0, 2: 1.07, 3: 1.16, 4: 1.24}.get(w, 1.45), lambda n, s: 0.02 * s)


def test_probes_of_a_drafter_that_never_lands_back_off(monkeypatch):
    """Every first draft rejected: after PROBE_GAPS_FROM misses in a row the gaps between probes
    double up to MAX_PROBE_GAP (the estimates alone re-probed every few rounds: the negative control)."""
    p = policy_for(E2B_LIKE, k=4)
    row = p.new_row("mtp")
    probes = _probe_rounds(p, row, 128, lambda r, w: 0)
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == [0, 1, 2, 4, 8] and set(gaps[5:]) == {MAX_PROBE_GAP}
    assert len(probes) <= 12
    monkeypatch.setattr(acceptance, "PROBE_GAPS_FROM", 10**9)
    monkeypatch.setattr(acceptance, "PROBE_GAPS_FROM_LANDED", 10**9)
    p = policy_for(E2B_LIKE, k=4)
    assert len(_probe_rounds(p, p.new_row("mtp"), 128, lambda r, w: 0)) > 25


def test_a_drafter_that_recovers_is_found_again_within_the_largest_gap(monkeypatch):
    """Acceptance switches from none to every draft mid-request, at any point of a gap: the next
    probe comes within MAX_PROBE_GAP plain rounds, its accepted draft ends the streak and the row
    drafts every round from then on."""
    for switch in range(40, 40 + MAX_PROBE_GAP + 1):
        p = policy_for(E2B_LIKE, k=4)
        row = p.new_row("mtp")
        probes = _probe_rounds(p, row, switch + 40, lambda r, w: w if r >= switch else 0)
        found = next(r for r in probes if r >= switch)
        assert found - switch <= MAX_PROBE_GAP
        assert probes[probes.index(found):] == list(range(found, switch + 40))  # then every round drafts
        assert row.misses["mtp"] == 0
    monkeypatch.setattr(acceptance, "MAX_PROBE_GAP", 10**9)  # the negative control: gaps without a bound
    p = policy_for(E2B_LIKE, k=4)
    probes = _probe_rounds(p, p.new_row("mtp"), 200, lambda r, w: w if r >= 40 else 0)
    assert next(r for r in probes if r >= 40) - 40 > MAX_PROBE_GAP


def test_a_drafter_that_lands_backs_off_only_after_a_longer_streak():
    """Once the drafter landed in the request, a streak needs PROBE_GAPS_FROM_LANDED misses before
    a gap (a steady 50% drafter misses 5 in a row in 3% of its rounds); a drafter's sampled rows
    never wait, prompt lookups (greedy or sampled) only after LOOKUP_GAPS_FROM misses in a row."""
    from specdraft.speculative.acceptance import PROBE_GAPS_FROM, PROBE_GAPS_FROM_LANDED

    p = policy_for(FakeCosts(lambda n, w: 1.0), k=4, prior={"mtp": 0.9, "lookup": 0.9})
    fresh, landed = p.new_row("mtp"), p.new_row("mtp")
    p.observe(landed, "mtp", 1, 1, requested=1)
    for misses in range(1, PROBE_GAPS_FROM_LANDED + 1):
        for row in (fresh, landed):
            p.observe(row, "mtp", 1, 0, requested=1)
        assert p.estimates.waiting(fresh, "mtp") == (misses >= PROBE_GAPS_FROM)
        assert p.estimates.waiting(landed, "mtp") == (misses >= PROBE_GAPS_FROM_LANDED)
    assert p.choose([fresh]) == 0 and p.choose([landed]) == 0
    sampled = p.new_row("mtp", sampled=True)
    for _ in range(10):
        p.observe(sampled, "mtp", 1, 0, chances=[0.0], requested=1)
    assert not p.estimates.waiting(sampled, "mtp")
    lookup, sampled_lookup = p.new_row("lookup"), p.new_row("lookup", sampled=True)
    for misses in range(1, LOOKUP_GAPS_FROM + 1):
        p.observe(lookup, "lookup", 1, 0, requested=1)
        p.observe(sampled_lookup, "lookup", 1, 0, chances=[0.2], requested=1)
        assert p.estimates.waiting(lookup, "lookup") == (misses >= LOOKUP_GAPS_FROM)
        assert p.estimates.waiting(sampled_lookup, "lookup") == (misses >= LOOKUP_GAPS_FROM)


# Where a 2-wide verify costs next to nothing in the table, the estimates alone keep probing a
# lookup that always misses (its rate drifts back to a prior of 0.8 between probes).
CHEAP_VERIFY = FakeCosts(lambda n, w: {1: 1.0, 2: 1.01, 3: 1.05, 4: 1.1}.get(w, 1.3), lambda n, s: 0.02 * s)


def test_prompt_lookups_that_keep_missing_back_off(monkeypatch):
    """Every lookup draft rejected over 96 rounds: after LOOKUP_GAPS_FROM misses in a row the gaps
    between probes double up to LOOKUP_MAX_GAP (without the gaps: a probe in most rounds)."""
    p = policy_for(CHEAP_VERIFY, k=4)
    probes = _probe_rounds(p, p.new_row("lookup"), 96, lambda r, w: 0, source="lookup")
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert max(gaps) == LOOKUP_MAX_GAP and len(probes) <= 96 // LOOKUP_MAX_GAP + 8
    monkeypatch.setattr(acceptance, "LOOKUP_GAPS_FROM", 10**9)
    p = policy_for(CHEAP_VERIFY, k=4)
    assert len(_probe_rounds(p, p.new_row("lookup"), 96, lambda r, w: 0, source="lookup")) > 30


def test_sampled_prompt_lookups_that_keep_missing_back_off(monkeypatch):
    """A sampled row's lookups whose every draft is rejected (each judged at a 0.3 chance, as a
    temperature-1 target keeps a copied token) back off as greedy ones do; without the gaps they
    re-probe from the prior in most rounds."""
    p = policy_for(CHEAP_VERIFY, k=4)
    probes = _probe_rounds(p, p.new_row("lookup", sampled=True), 96, lambda r, w: 0, source="lookup", chance=0.3)
    assert len(probes) <= 96 // LOOKUP_MAX_GAP + 8
    monkeypatch.setattr(acceptance, "LOOKUP_GAPS_FROM", 10**9)
    p = policy_for(CHEAP_VERIFY, k=4)
    assert len(_probe_rounds(p, p.new_row("lookup", sampled=True), 96, lambda r, w: 0, source="lookup",
                             chance=0.3)) > 30


def test_a_lookup_that_lands_again_is_found_within_its_largest_gap():
    """Lookups miss for a while, then copy a stretch: the next probe comes within LOOKUP_MAX_GAP
    rounds and the row drafts every round from then on."""
    for switch in range(30, 30 + LOOKUP_MAX_GAP + 1):
        p = policy_for(CHEAP_VERIFY, k=4)
        row = p.new_row("lookup")
        probes = _probe_rounds(p, row, switch + 30, lambda r, w: w if r >= switch else 0, source="lookup")
        found = next(r for r in probes if r >= switch)
        assert found - switch <= LOOKUP_MAX_GAP
        assert probes[probes.index(found):] == list(range(found, switch + 30))


def _mixed_rounds(p, row, rounds: int) -> list[tuple[str | None, int]]:
    """mtp+ngram as the engine runs it, for a row whose lookup always matches and always misses
    while its MTP drafts all land: per round (the source that drafted or None, the width)."""
    out = []
    for _ in range(rounds):
        w = p.choose([row])
        if w == 0:
            p.observe(row, None, 0, 0)
            out.append((None, 0))
            continue
        source = row.source if p.skips_lookup(row) else row.next_source  # what the drafter does (DraftInput.no_lookup)
        p.observe(row, source, w, w if source == "mtp" else 0, requested=w)
        out.append((source, w))
    return out


def test_a_row_whose_lookups_keep_missing_drafts_with_mtp_while_they_wait(monkeypatch):
    """mtp+ngram: the row's last two tokens keep matching a lookup that is always rejected, while
    its MTP drafts land. While the lookup waits between probes the row drafts with the MTP drafter,
    priced and learnt as MTP (no wider than K; the lookup's misses untouched), so no round runs
    plain, and the lookups back off as a lookup drafter's do. The negative control: the lookup
    waits but the row is not handed to MTP, and those rounds run plain."""
    def run():
        p = policy_for(CHEAP_VERIFY, k=2, width=8)
        row = p.new_row("mtp", lookups=True, prompt=[5, 6, 7, 5, 6])
        assert row.next_source == "lookup"
        return row, _mixed_rounds(p, row, 64)

    row, rounds = run()
    sources = [s for s, _ in rounds]
    lookups = [i for i, s in enumerate(sources) if s == "lookup"]
    assert None not in sources and lookups[:LOOKUP_GAPS_FROM] == list(range(LOOKUP_GAPS_FROM))
    assert len(lookups) <= 64 // LOOKUP_MAX_GAP + 4 and max(b - a - 1 for a, b in zip(lookups, lookups[1:])) == LOOKUP_MAX_GAP
    assert all(w <= 2 for s, w in rounds if s == "mtp") and row.accepted["mtp"] > 0
    assert row.misses["lookup"] == len(lookups) and row.last_drafted["lookup"] == lookups[-1] + 1
    monkeypatch.setattr(acceptance.AcceptanceEstimates, "skips_lookup", lambda self, state: False)
    _, rounds = run()
    assert [s for s, _ in rounds].count(None) > 20 and "mtp" not in [s for s, _ in rounds]


def test_a_drafter_accepted_half_the_time_keeps_drafting():
    costs = FakeCosts(lambda n, w: {1: 1.0, 2: 1.07, 3: 1.16, 4: 1.24}.get(w, 1.45), lambda n, s: 0.02 * s)
    p = policy_for(costs, k=4)
    row = p.new_row("mtp")
    outcomes = iter([1, 0] * 200)  # first draft accepted every other round
    assert _drafting_rounds(p, row, 200, lambda w: min(w, next(outcomes))) == 200


def test_only_judged_positions_learn():
    """Position j learns only when drafts 1..j-1 were accepted; undrafted positions stay put."""
    p = policy_for(FakeCosts(lambda n, w: 1.0), k=4, prior={"mtp": 0.5})
    row = p.new_row("mtp")
    p.observe(row, "mtp", 3, 1)  # d1 accepted, d2 rejected, d3 unjudged, d4 not drafted
    a = row.rates["mtp"]
    assert a[0] > 0.5 and a[1] < 0.5 and a[2] == a[3] == 0.5


def test_sources_are_tracked_apart():
    """mtp+ngram: a row whose last two tokens occurred before will draft a lookup; accepted
    lookups earn lookup-wide rounds (past the MTP drafter's K) without touching its MTP estimate,
    and a fresh bigram sends it back to MTP-sized rounds."""
    p = policy_for(FakeCosts(lambda n, w: 1.0 + 0.1 * (w - 1)), k=2, width=8,
                   prior={"mtp": 0.3, "lookup": 0.5})
    row = p.new_row("mtp", lookups=True, prompt=[5, 6, 7, 8])
    assert row.next_source == "mtp" and 0 < p.choose([row]) <= 2
    p.extend(row, [5, 6])  # ... 7 8 5 6: "5 6" occurred before
    assert row.next_source == "lookup"
    for _ in range(10):
        p.observe(row, "lookup", 8, 8)
    assert p.choose([row]) == 8
    assert row.rates["mtp"] == [0.3, 0.3]
    p.extend(row, [99])
    assert row.next_source == "mtp" and p.choose([row]) <= 2


def test_drafters_without_lookups_never_expect_them():
    p = policy_for(FakeCosts(lambda n, w: 1.0), k=2, width=6, prior={"mtp": 0.5, "lookup": 0.8})
    row = p.new_row("mtp", prompt=[1, 2, 1, 2])
    p.extend(row, [1, 2])
    assert row.next_source == "mtp"
    e = p.expected_tokens(row)
    assert e[6] == e[2] == pytest.approx(1.75)  # no MTP drafts past K
    assert p.new_row("lookup").next_source == "lookup"  # the n-gram drafter: always lookups


def test_new_requests_start_from_what_the_engine_has_seen():
    p = policy_for(FakeCosts(lambda n, w: 1.0 + 0.2 * (w - 1)), k=4, prior={"mtp": 0.6})
    assert p.choose([p.new_row("mtp")]) > 0
    for _ in range(100):
        p.observe(p.new_row("mtp"), "mtp", 4, 0)  # earlier requests: nothing accepted
    fresh = p.new_row("mtp")
    assert p.choose([fresh]) == 0
    assert p.prior["mtp"] == 0.6  # plain rounds still relax towards the prior: probing goes on


def test_a_prior_per_position_reaches_past_where_a_flat_one_stops():
    """A second block of verified positions costs extra (the head's blockwise pass): with 0.8 at
    every lookup position the policy asks 3 drafts and so never sees whether later ones hold; with
    the per-position prior (copies that started right tend to go on) it asks the full width, and
    its estimates then learn from what the later positions do."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.05 * (w - 1) + (0.6 if w > 4 else 0.0))
    flat = policy_for(costs, k=3, width=7, prior={"mtp": 0.6, "lookup": 0.8})
    assert flat.choose([flat.new_row("lookup")]) == 3
    rising = policy_for(costs, k=3, width=7, prior={"mtp": 0.6, "lookup": (0.8, 0.9, 0.9, 0.95)})
    row = rising.new_row("lookup")
    assert row.next_source == "lookup" and rising.choose([row]) == 7
    rates = [0.8, 0.9, 0.9, 0.95, 0.95, 0.95, 0.95]
    assert rising.expected_tokens(row)[7] == pytest.approx(1 + sum(math.prod(rates[: j + 1]) for j in range(7)))
    for _ in range(20):
        rising.observe(row, "lookup", 7, 3)  # the 4th draft keeps failing
    assert rising.choose([row]) == 3
    for _ in range(2000):  # plain rounds: back towards each position's own prior
        rising.observe(row, None, 0, 0)
    assert row.rates["lookup"] == pytest.approx([0.8, 0.9, 0.9, 0.95, 0.95, 0.95, 0.95], abs=1e-6)


def test_a_lookup_without_match_counts_as_a_miss():
    p = policy_for(FakeCosts(lambda n, w: 1.0), k=3, prior={"lookup": 0.8})
    row = p.new_row("lookup")
    p.observe(row, "lookup", 0, 0)  # a drafting round in which this row found nothing
    assert row.rates["lookup"][0] < 0.8 and row.rates["lookup"][1] == 0.8


def test_a_drafter_that_stops_early_is_charged_for_what_it_drafts():
    """The MTP drafter stops after an unsure draft and a lookup where its match ends: a round asked
    for 4 drafts that keeps bringing 1 verifies 2 tokens, not 5. The policy learns how far the
    drafter carries on and charges the drafts and verify width it expects; without that it
    charged the full width and chose plain rounds where drafting paid."""
    widths_costed = []
    costs = FakeCosts(lambda n, w: widths_costed.append(w) or 1.0 + 0.6 * (w - 1), lambda n, s: 0.1 * s)
    p = policy_for(costs, k=4, prior={"mtp": 0.6})
    row = p.new_row("mtp")
    assert p.choose([row]) == 0  # asking 4 and verifying 5 does not pay at these prices
    for _ in range(60):  # (a drafter's estimates move 0.1 of the way a round)
        p.observe(row, "mtp", 1, 1, requested=4)  # one draft proposed (then unsure), accepted
    assert row.continues["mtp"][0] < 0.01 and row.continues["mtp"][1:] == [1.0, 1.0]
    assert p.expected_tokens(row)[4] == pytest.approx(2.0, abs=0.02)  # what 1 accepted draft brings
    widths_costed.clear()
    assert p.choose([row]) > 0
    assert max(widths_costed) < 2.02  # never charged more than the 2 tokens it verifies
    same = p.new_row("mtp")  # without `requested`, drafted < asked says nothing about stopping
    p.observe(same, "mtp", 1, 1)
    assert "mtp" not in same.continues
    p.observe(row, "mtp", 3, 3, requested=4)  # carried on to draft 3, then stopped
    assert row.continues["mtp"][0] > 0.01 and row.continues["mtp"][2] < 1.0


def test_a_drafter_that_carries_on_where_it_is_right_is_worth_asking_for_more():
    """The MTP drafter carries on where it is sure, which is where its drafts are accepted. Here
    half the rounds bring one draft that fails and half bring two that both pass: asking for 2
    emits 1 + 0.5 + 0.5 = 2 tokens, not the 1.75 that the overall chance of carrying on (0.5) times
    the first draft's acceptance gives. Counted the second way, the second draft did not pay
    and the policy ran plain rounds."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.05 * (w - 1), lambda n, s: 0.5 * s)
    p = policy_for(costs, k=2, prior={"mtp": 0.5})
    row = p.new_row("mtp")
    for _ in range(200):
        p.observe(row, "mtp", 1, 0, requested=2)
        p.observe(row, "mtp", 2, 2, requested=2)
        p.observe(row, "mtp", 2, 2, requested=2)
        p.observe(row, "mtp", 1, 0, requested=2)
    assert row.continues["mtp"][0] == pytest.approx(0.5, abs=0.15)
    assert row.continues_accepted["mtp"][0] == pytest.approx(1.0, abs=0.01)
    assert p.expected_tokens(row)[2] == pytest.approx(2.0, abs=0.1)
    assert p.choose([row]) == 2  # 2 tokens for ~1.83 seconds against 1 for 1 (and 1.5 for 1.55)


def test_an_unproven_drafter_starts_narrow_and_widens_as_it_lands():
    """A request whose drafter estimates start from the bare prior asks one draft more than it has
    seen accepted; a request starting from the engine's pooled evidence, a sampled one or a lookup
    is not held back."""
    p = policy_for(FakeCosts(lambda n, w: 1.0), k=5)
    row = p.new_row("mtp")
    assert p.choose([row]) == 1
    p.observe(row, "mtp", 1, 1, requested=1)
    assert p.choose([row]) == 2
    p.observe(row, "mtp", 2, 2, requested=2)
    assert p.choose([row]) == 4
    pooled = p.new_row("mtp")
    assert p.choose([pooled]) == 5  # the pool has seen drafting rounds: no narrow start
    p.observe(pooled, "mtp", 5, 0, requested=5)
    assert p.choose([pooled]) <= 1  # but once its drafts have all missed, it probes one wide
    fresh = policy_for(FakeCosts(lambda n, w: 1.0), k=5)
    assert fresh.choose([fresh.new_row("mtp", sampled=True)]) == 5
    assert fresh.choose([fresh.new_row("lookup")]) == 5


def test_fixed_policy_is_k_with_the_row_rule():
    assert FixedPolicy(5).choose([None] * 16) == 5
    rule = FixedPolicy(3, speculate_below=4)
    assert rule.choose([None] * 3) == 3 and rule.choose([None] * 4) == 0


def test_profiled_grid():
    assert row_buckets(1) == [1] and row_buckets(5) == [1, 2, 4, 8]
    assert profiled_widths(3) == [1, 2, 3, 4]
    assert profiled_widths(8)[:6] == [1, 2, 3, 4, 5, 6] and profiled_widths(8)[-1] == 9


def test_timing_noise_is_taken_out():
    """A cell slowed down by another process is lowered to a wider or larger cell's time."""
    noisy = {1: {1: 1.0, 2: 3.0, 3: 1.5}, 2: {1: 1.2, 2: 1.3, 3: 1.6}}
    clean = monotone(noisy)
    assert clean[1] == {1: 1.0, 2: 1.3, 3: 1.5} and clean[2] == noisy[2]


def test_forward_costs_interpolate_between_widths_and_batch_sizes(tmp_path):
    """Linear between profiled widths and between profiled batch sizes (tables whose widths
    differ included), proportional past either end."""
    costs = MeasuredCosts({"k": 1}, tmp_path)
    costs.target = {1: {1: 1.0, 2: 1.2, 4: 2.0}, 4: {1: 2.0, 2: 3.0}}
    assert costs.verify(1, 3) == pytest.approx(1.6)
    assert costs.verify(4, 1.5) == pytest.approx(2.5)
    assert costs.verify(4, 4) == pytest.approx(6.0)  # past its widths: proportional
    assert costs.verify(2, 1.5) == pytest.approx(1.1 + (2.5 - 1.1) / 3)
    assert costs.verify(8, 2) == pytest.approx(6.0)  # past the batch sizes: proportional
    assert costs.verify(1, 0.5) == pytest.approx(0.5)


# --- the measured cost model's cache ------------------------------------------------------------

def test_cost_cache_round_trip(gemma_tiny, tmp_path):
    """Profiled once and written; a new process with the same key reloads without timing; a
    different key (another thread count, say) is profiled afresh."""
    model, drafter = gemma_tiny.ours, NgramDrafter()
    key = cost_key("folder", "dtype", "float32", torch.device("cpu"))
    first = MeasuredCosts(key, tmp_path)
    first.ensure(model, drafter, 3, 2, 2)
    assert first.profiled > 0 and first.path.exists()
    assert set(first.target) == {1, 2, 4} and set(first.target[4]) == {1, 2, 3}
    saved = json.loads(first.path.read_text())
    assert saved["key"] == key

    again = MeasuredCosts(key, tmp_path)
    again.ensure(model, drafter, 3, 2, 2)
    assert again.profiled == 0
    assert again.target == first.target and again.drafts == first.drafts
    assert set(first.head) == set(head_sizes(3)) and again.head == first.head
    clean = monotone(again.target)
    assert clean[1][3] <= first.target[1][3]
    assert again.verify(1, 3) == clean[1][3] + again.head_seconds(3)  # every row's 3 positions scored
    # 3 rows lie between the profiled 2 and 4
    lo, hi = sorted([clean[2][2], clean[4][2]])
    assert lo <= again.verify(3, 2) - again.head_seconds(6) <= hi

    wider = MeasuredCosts(key, tmp_path)
    wider.ensure(model, drafter, 3, 2, 4)  # longer rounds: only the missing widths are timed
    assert wider.profiled == 3 * 2  # widths 4, 5 at 1, 2 and 4 rows

    other = MeasuredCosts({**key, "threads": key["threads"] + 1}, tmp_path)
    assert other.target == {}
    assert MeasuredCosts({**key, "code": "an older forward"}, tmp_path).target == {}  # code changes re-profile too
    other.ensure(model, drafter, 1, 2, 2)
    assert other.profiled > 0 and other.path != first.path


def test_cost_tables_do_not_move_between_cpus_sharing_a_name():
    """Clouds name a Zen 1 and a Zen 3 EPYC alike; their cost tables must differ (family/model)."""
    def info(family, model):
        return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                f"model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 99\nmodel name\t: other\n")
    zen1, zen3 = cpu_identity(info(23, 1)), cpu_identity(info(25, 1))
    assert zen1 == "AMD EPYC (family 23 model 1)" and zen3 == "AMD EPYC (family 25 model 1)"
    assert cpu_identity("processor\t: 0\nFeatures\t: neon\n") is None  # no model name: the caller falls back


def test_head_is_timed_on_the_rows_the_model_is_surest_about(gemma_tiny):
    """The exact greedy head costs more on near-ties (models/formats/screened_head.py), which real decoding
    rarely meets: its cost is timed on the rows with the widest gap between their two best scores,
    in that order, repeated past the rows there are."""
    model = gemma_tiny.ours
    states = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    with torch.inference_mode():
        best = model.logits(states).topk(2, dim=-1).values
    order = (best[:, 0] - best[:, 1]).argsort(descending=True)
    with torch.inference_mode():
        ranked = by_confidence(model, states)
        assert torch.equal(first_rows(ranked, 5), states[order[:5]])
        assert torch.equal(first_rows(ranked, 50), torch.cat([states[order], states[order[:10]]]))


def _tabled_costs(tmp_path, forward: dict[int, float], head: dict[int, float]) -> MeasuredCosts:
    costs = MeasuredCosts({"test": "tables"}, tmp_path)
    costs.target, costs.head = {1: dict(forward)}, dict(head)
    return costs


def test_verify_cost_scores_later_blocks_only_for_rows_still_unrejected(tmp_path):
    """Greedy verification scores positions a block at a time, later blocks only for rows whose
    drafts so far were all accepted (verify_greedy_blockwise): the cost counts each block's head
    for the expected rows that reach it."""
    costs = _tabled_costs(tmp_path, {1: 1.0, 9: 3.0}, {1: 0.5, 2: 0.6, 4: 0.8})
    assert costs.verify(1, 9) == 3.0 + 0.8 + 0.8 + 0.5  # every position: blocks of 4, 4 and 1
    assert costs.verify(1, 9, [1.0, 0.5, 0.25]) == pytest.approx(3.0 + 0.8 + 0.5 * 0.8 + 0.25 * 0.5)
    # two rows (past the tables: proportional): 8 head rows, then 1.5 x 4, then half a chance of 1
    assert costs.verify(2, 9, [2.0, 1.5, 0.5]) == pytest.approx(2 * 3.0 + 0.8 * 8 / 4 + 0.8 * 6 / 4 + 0.5 * 0.5)
    assert costs.verify(1, 5, [1.0, 0.0]) == pytest.approx(2.0 + 0.8)  # no row gets past position 4


def test_sampled_rounds_are_costed_in_the_sampled_blocks(tmp_path):
    """Sampled verification scores a block of positions at a time (sampled_probs_blockwise): the
    cost takes the block it is told, and the policy prices each width at every block from 1 to
    HEAD_BLOCK."""
    costs = _tabled_costs(tmp_path, {1: 1.0, 4: 2.0}, {1: 0.5, 2: 0.6, 4: 0.8})
    assert costs.verify(1, 4, [1.0, 0.25], SAMPLED_HEAD_BLOCK) == pytest.approx(2.0 + 0.6 + 0.25 * 0.6)
    blocks = []
    p = policy_for(SimpleNamespace(verify=lambda n, w, alive=None, block=None: blocks.append(block) or 1.0,
                                   draft=lambda n, steps: 0.0, ensure=lambda *a: None), k=4)
    row = p.new_row("mtp")
    p.observe(row, "mtp", 2, 1, [0.9, 0.3])  # a sampled round
    p.choose([row])
    assert set(blocks) == set(range(1, HEAD_BLOCK + 1))


def _sampled_row(p: AdaptivePolicy, chances: list[float]):
    row = p.new_row("mtp", sampled=True)
    for _ in range(40):
        p.observe(row, "mtp", len(chances), len(chances), chances)
    return row


def test_a_head_as_dear_for_4_rows_as_for_1_scores_a_sampled_round_in_one_call(tmp_path):
    """A head whose table read dominates (1 to 4 rows for about one row's time, as on a Zen 4
    with VNNI): a 4-wide sampled round is scored in one head call, where blocks of 2 paid a
    second call whenever the first two drafts were accepted."""
    costs = _tabled_costs(tmp_path, {1: 4.0, 2: 4.2, 3: 4.4, 4: 4.6}, {1: 4.9, 2: 4.9, 3: 5.0, 4: 5.0})
    costs.drafts = {"": {1: [0.0, 0.1]}}
    p = policy_for(costs, k=3, narrow_start=False)
    row = _sampled_row(p, [0.7, 0.7, 0.7])
    assert p.choose([row]) == 3
    assert p.head_block() == 4
    assert costs.verify(1, 4, [1.0, 0.49], 4) < costs.verify(1, 4, [1.0, 0.49], SAMPLED_HEAD_BLOCK)


def test_a_head_that_costs_per_row_scores_a_sampled_round_in_smaller_blocks(tmp_path):
    """A head that costs about 4 ms more per row (BENCHMARKS.md: a 2-core AVX2 CPU, 11.9 to 24.8 ms
    for 1 to 4 rows) and first drafts accepted half the time: a 4-wide round scores fewer rows
    first, the rest only for the rows that reach them."""
    costs = _tabled_costs(tmp_path, {1: 10.0, 4: 11.0}, {1: 11.9, 2: 16.0, 3: 20.1, 4: 24.8})
    costs.drafts = {"": {1: [0.0, 0.01]}}
    p = policy_for(costs, k=3, narrow_start=False)
    row = _sampled_row(p, [0.5, 0.9, 0.9])
    w = p.choose([row])
    assert w >= 2 and p.head_block() < w + 1
    tokens = p.expected_tokens(row)
    alive = [1.0] + [tokens[i] - tokens[i - 1] for i in range(1, 4)]  # about 1, 0.5, 0.45, 0.4
    seconds = {b: costs.verify(1, w + 1, alive[::b], b) for b in range(1, HEAD_BLOCK + 1)}
    assert p.head_block() == min(seconds, key=lambda b: (seconds[b], -b))


def test_a_plain_round_has_no_head_block_and_the_fixed_policy_keeps_the_defaults(tmp_path):
    costs = _tabled_costs(tmp_path, {1: 1.0, 4: 9.0}, {1: 1.0, 4: 1.0})
    p = policy_for(costs, k=3, prior={"mtp": 0.05})
    assert p.choose([p.new_row("mtp")]) == 0 and p.head_block() is None
    assert FixedPolicy(3).head_block() is None


def test_cheap_rejections_make_long_lookups_pay(tmp_path):
    """With a head as dear as the forward, a 9-wide lookup round that usually fails early costs
    about one head block, not three: the policy takes it where a cost of every position's head
    would keep the round short."""
    costs = _tabled_costs(tmp_path, {1: 1.0, 9: 1.4}, {1: 1.0, 4: 1.0, 8: 2.0})
    p = policy_for(costs, k=2, width=8, prior={"mtp": 0.1, "lookup": 0.8})
    row = p.new_row("mtp", lookups=True, prompt=[5, 6, 7, 8])
    p.extend(row, [5, 6])  # a lookup round comes next
    assert p.choose([row]) > HEAD_BLOCK  # past the first block of positions
    full = policy_for(FakeCosts(costs.verify), k=2, width=8, prior={"mtp": 0.1, "lookup": 0.8})
    other = full.new_row("mtp", lookups=True, prompt=[5, 6, 7, 8])
    full.extend(other, [5, 6])
    assert full.choose([other]) < HEAD_BLOCK


def test_cost_cache_ignores_a_file_with_another_key(gemma_tiny, tmp_path):
    key = cost_key("folder", "dtype", "float32", torch.device("cpu"))
    costs = MeasuredCosts(key, tmp_path)
    costs.path.write_text(json.dumps({"key": {**key, "torch": "0.0"}, "target": {"1": {"1": 9.0}}, "drafts": {}}))
    reread = MeasuredCosts(key, tmp_path)
    assert reread.target == {}
    reread.ensure(gemma_tiny.ours, NgramDrafter(), 1, 1, 1)
    assert reread.profiled > 0 and reread.target[1][1] != 9.0


def test_a_table_timed_under_load_is_measured_again(gemma_tiny, tmp_path, monkeypatch):
    """A stored table is checked once per process: its one-row forwards are timed again, and a cell
    that now runs well under its stored time (the table was measured on a busy machine) has the
    whole table measured afresh; a table no faster now is kept, cells too short to judge are not
    judged, and a second engine in the process does not check again."""
    from specdraft.speculative import costs as cost_tables

    model, drafter = gemma_tiny.ours, NgramDrafter()
    key = cost_key("folder", "dtype", "float32", torch.device("cpu"))
    first = MeasuredCosts(key, tmp_path)
    first.ensure(model, drafter, 1, 2, 2)
    honest = json.loads(first.path.read_text())

    def reload(scale: dict[int, float]) -> MeasuredCosts:
        data = json.loads(json.dumps(honest))
        for w, f in scale.items():
            data["target"]["1"][str(w)] *= f
        first.path.write_text(json.dumps(data))
        cost_tables._RECHECKED.discard(first.path)  # a new process
        costs = MeasuredCosts(key, tmp_path)
        costs.ensure(model, drafter, 1, 2, 2)
        return costs

    slowed = reload({2: 1000.0})  # one cell timed while something else ran
    assert slowed.profiled > 0 and slowed.target[1][2] < 100.0 * honest["target"]["1"]["2"]
    monkeypatch.setattr(cost_tables, "RECHECK_FLOOR", 0.0)
    # A table reading 100x faster than now: kept. (It would be measured again only if this
    # machine now ran 125x faster than when `honest` was timed: RECHECK_SLACK 0.8 of 0.01.)
    faster = reload({1: 0.01, 2: 0.01, 3: 0.01})
    assert faster.profiled == 0 and faster.target[1][1] == 0.01 * honest["target"]["1"]["1"]
    monkeypatch.setattr(cost_tables, "RECHECK_FLOOR", 1e9)
    unjudged = reload({2: 1000.0})  # every cell under the floor: not judged
    assert unjudged.profiled == 0

    monkeypatch.setattr(cost_tables, "RECHECK_FLOOR", 0.0)
    checks = []
    monkeypatch.setattr(MeasuredCosts, "timed_under_load", lambda self, model: checks.append(1) or False)
    cost_tables._RECHECKED.discard(first.path)
    for _ in range(2):
        MeasuredCosts(key, tmp_path).ensure(model, drafter, 1, 2, 2)
    assert len(checks) == 1


def test_the_builder_builds_the_policy(tmp_path, monkeypatch):
    """engine_builder: adaptive by default, cached under $SPECDRAFT_CACHE/costs; fixed = the engine's own."""
    from specdraft.engine_builder import draft_policy

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDRAFT_COSTS_DIR")  # conftest points it at a temp dir for the test run
    stub = SimpleNamespace(name="m", folder=tmp_path, weights="int8", dtype_name="bfloat16",
                           device=torch.device("cpu"))
    policy = draft_policy(stub)
    assert isinstance(policy, AdaptivePolicy) and policy.costs.path.parent == tmp_path / "costs"
    monkeypatch.setenv("SPECDRAFT_COSTS_DIR", str(tmp_path / "elsewhere"))  # the tables alone can move
    assert draft_policy(stub).costs.path.parent == tmp_path / "elsewhere"
    assert policy.costs.key["weights"] == "int8" and policy.costs.key["threads"] == torch.get_num_threads()
    assert draft_policy(stub, "fixed") is None
    with pytest.raises(ValueError):
        draft_policy(stub, "sometimes")


# --- the engine under the adaptive policy -------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_lookup(gemma_tiny, tmp_path_factory):
    target = gemma_tiny.ours
    folder = tmp_path_factory.mktemp("policy-drafter")
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head="target", clustered=True,
                             num_centroids=16, top_k_clusters=4)
    save_network(init_network(cfg, target, seed=3, std=0.1), folder / "d")
    return MTPWithLookup(load_mtp_drafter(folder / "d", target, torch.float32, "cpu"), lookup_tokens=6)


def switching_costs() -> FakeCosts:
    """Width pays at small batches and only with good acceptance: rounds switch between plain,
    narrow and wide as estimates move."""
    return FakeCosts(lambda n, w: 1.0 + 0.08 * n * (w - 1), lambda n, s: 0.05 * s)


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("name", ["mtp+ngram", "oracle-noisy"])
def test_adaptive_engine_emits_plain_greedy_tokens(b, name, gemma_tiny, mtp_lookup):
    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = [p + p[:5] for p in prompts_of([7, 12, 3, 9][:b], vocab, seed=20 + b)]
    max_new = 40
    plain = [r.token_ids for r in Engine(model).generate(prompts, max_new, eos_token_ids=[])]
    if name == "oracle-noisy":
        seqs = [list(p) + o for p, o in zip(prompts, plain)]
        drafter, k = OracleDrafter(seqs, noise=0.3, seed=1, vocab=vocab), 5
    else:
        drafter, k = mtp_lookup, 2
    costs = switching_costs()
    policy = AdaptivePolicy(costs, prior={"mtp": 0.45, "lookup": 0.6, "draft": 0.6})
    widths = []
    choose = policy.choose
    policy.choose = lambda states: widths.append(choose(states)) or widths[-1]
    results = Engine(model, None, drafter, k, policy=policy).generate(prompts, max_new, eos_token_ids=[])
    assert [r.token_ids for r in results] == plain
    assert costs.ensured == 1
    # The policy did choose: rounds of different widths, drafts verified in some of them.
    assert len(set(widths)) > 1 and max(widths) > 0
    assert sum(r.stats.drafted for r in results) > 0


@pytest.mark.parametrize("b", [1, 3])
def test_rows_whose_lookups_wait_draft_with_mtp_and_emit_plain_greedy_tokens(b, gemma_tiny):
    """Prompts that repeat themselves, so lookups keep matching, and a target that does not
    follow them: lookups miss and back off, and in the rounds they wait the engine hands the rows
    to the drafter behind them (an oracle here, so its drafts land; DraftInput.no_lookup). Those
    rounds are observed as the drafter's, and the tokens are plain greedy decoding's."""
    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = [p * 4 for p in prompts_of([3, 4, 5][:b], vocab, seed=11)]
    max_new = 96
    plain = [r.token_ids for r in Engine(model).generate(prompts, max_new, eos_token_ids=[])]
    oracle = OracleDrafter([list(p) + o for p, o in zip(prompts, plain)])
    oracle.recommended_k = 2
    marked, sources = [], []

    class Spy(AdaptivePolicy):
        def skips_lookup(self, state) -> bool:
            marked.append(super().skips_lookup(state))
            return marked[-1]

        def observe(self, state, source, *args, **kw) -> None:
            if source is not None and self.estimates.skips_lookup(state):
                sources.append(source)
            super().observe(state, source, *args, **kw)

    policy = Spy(CHEAP_VERIFY, prior={"mtp": 0.6, "lookup": 0.8})
    drafter = MTPWithLookup(oracle, lookup_tokens=6)
    results = Engine(model, None, drafter, 2, policy=policy).generate(prompts, max_new, eos_token_ids=[])
    assert [r.token_ids for r in results] == plain
    assert sum(marked) > 0 and len(sources) == sum(marked) and set(sources) == {"mtp"}
    assert drafter.row_rounds["lookup"] > 0


def test_adaptive_engine_never_drafts_when_it_cannot_pay(gemma_tiny, mtp_lookup):
    """Costs under which no width pays: every round is a plain step, same tokens."""
    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = prompts_of([7, 12, 3, 9], vocab, seed=5)
    plain = [r.token_ids for r in Engine(model).generate(prompts, 16, eos_token_ids=[])]
    policy = AdaptivePolicy(FakeCosts(lambda n, w: float(w), lambda n, s: 1.0 * s))
    results = Engine(model, None, mtp_lookup, 2, policy=policy).generate(prompts, 16, eos_token_ids=[])
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.drafted == 0 for r in results)


def test_adaptive_engine_samples_with_truncated_drafts(gemma_tiny, mtp_lookup):
    """At temperature > 0 a round narrower than the lookups is cut to a prefix (tokens and Q)
    and the batch runs through; the same seed repeats the same text."""
    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = [p + p[:5] for p in prompts_of([7, 12], vocab, seed=8)]
    sampling = SamplingParams(temperature=1.0, seed=3)

    def run():
        policy = AdaptivePolicy(FakeCosts(lambda n, w: 1.0 + 0.15 * (w - 1)), prior={"mtp": 0.5, "lookup": 0.5})
        return [r.token_ids for r in Engine(model, None, mtp_lookup, 2, policy=policy).generate(
            prompts, 24, sampling, eos_token_ids=[])]

    first = run()
    assert all(len(t) == 24 for t in first) and run() == first


def test_sampling_rounds_learn_from_acceptance_chances():
    """At temperature > 0 a judged draft moves the estimate towards the chance it had of being
    accepted (min(1, P/Q)), not towards the coin's 0 or 1; unjudged positions stay put."""
    p = policy_for(FakeCosts(lambda n, w: 1.0), k=4, prior={"mtp": 0.5})
    row = p.new_row("mtp")
    p.observe(row, "mtp", 3, 1, [0.9, 0.4, 0.7])  # d1 accepted, d2 rejected, d3 unjudged
    a = row.rates["mtp"]
    assert a[0] == pytest.approx(0.5 + SAMPLED_LEARNING_RATE * (0.9 - 0.5))
    assert a[1] == pytest.approx(0.5 + SAMPLED_LEARNING_RATE * (0.4 - 0.5))
    assert a[2:] == [0.5, 0.5]
    before, pooled = a[0], 0.5 + POOL_RATE * (0.9 - 0.5)  # what the engine's sampled rows have shown
    p.observe(row, None, 0, 0)  # a plain round: a sampling row relaxes at its own rate, to the pool
    assert a[0] == pytest.approx(before + SAMPLED_RELAX * (pooled - before))
    fresh = policy_for(FakeCosts(lambda n, w: 1.0), k=4, prior={"mtp": 0.5, "lookup": 0.5})  # (p pooled the row above)
    greedy = fresh.new_row("mtp")
    fresh.observe(greedy, "lookup", 3, 1)  # no chances: the outcomes themselves
    assert greedy.rates["lookup"][:2] == [pytest.approx(0.5 + LEARNING_RATE * 0.5),
                                          pytest.approx(0.5 - LEARNING_RATE * 0.5)]


def test_a_drafters_rate_survives_one_rejection():
    """A drafter's acceptance is a steady rate that one round measures as a single coin flip, so a
    greedy row learns it slowly (STEADY_LEARNING_RATE) and re-probes soon (STEADY_RELAX); lookups,
    which come in bursts, keep the fast rates. Here a round verifying one draft breaks even at an
    acceptance of ~0.55: a row estimated at 0.65 keeps drafting after one rejection (at the fast
    rate it fell to 0.455 and waited in plain rounds)."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.45 * (w - 1), lambda n, s: 0.05 * s)
    for steady, drafts_after in ((STEADY_SOURCES, True), ((), False)):
        p = policy_for(costs, k=1, prior={"mtp": 0.65}, steady_sources=steady)
        row = p.new_row("mtp")
        assert p.choose([row]) == 1
        p.observe(row, "mtp", 1, 0)  # the first draft rejected
        learning, relax = (STEADY_LEARNING_RATE, STEADY_RELAX) if steady else (LEARNING_RATE, RELAX)
        after = 0.65 * (1 - learning)
        assert row.rates["mtp"][0] == pytest.approx(after)
        assert (p.choose([row]) == 1) == drafts_after
        p.observe(row, None, 0, 0)  # a plain round: back towards the prior
        assert row.rates["mtp"][0] == pytest.approx(after + relax * (0.65 - after))
    p = policy_for(costs, k=1, prior={"lookup": 0.65})
    row = p.new_row("mtp")
    p.observe(row, "lookup", 1, 0)
    assert row.rates["lookup"][0] == pytest.approx(0.65 * (1 - LEARNING_RATE))


def test_sampled_drafter_rows_drift_to_what_sampled_rows_showed():
    """A drafter's sampled acceptance is a steady rate far below the greedy prior: once the
    engine's sampled rows have shown it, a sampled row's plain rounds drift to it instead of the
    prior (no probing every few rounds at a loss), new sampled rows start from it, and greedy rows
    keep their own pool. Lookups come in bursts: a sampled row still drifts back to their prior."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.45 * (w - 1))  # one draft breaks even at ~0.45
    p = policy_for(costs, k=1, prior={"mtp": 0.6, "lookup": 0.6})
    for _ in range(200):  # earlier sampled requests: chances of 0.25
        p.observe(p.new_row("mtp", sampled=True), "mtp", 1, 0, [0.25])
    greedy, sampled = p.new_row("mtp"), p.new_row("mtp", sampled=True)
    assert p.choose([greedy]) == 1  # the greedy pool is the prior still
    assert p.choose([sampled]) == 0
    assert sampled.rates["mtp"][0] == pytest.approx(0.25, abs=0.01)
    row = p.new_row("mtp", sampled=True)
    row.rates["mtp"] = [0.5]  # a row that drafted for a while, then fell below break-even
    p.observe(row, "mtp", 1, 0, [0.3])
    for _ in range(300):
        assert p.choose([row]) == 0, "a sampled row re-probed towards the greedy prior"
        p.observe(row, None, 0, 0)
    assert row.rates["mtp"][0] == pytest.approx(p.pooled[("mtp", True)][0], abs=0.02)  # it follows the pool
    looking = p.new_row("mtp", lookups=True, sampled=True)
    p.observe(looking, "lookup", 1, 0, [0.1])
    for _ in range(300):
        p.observe(looking, None, 0, 0)
    assert looking.rates["lookup"][0] == pytest.approx(0.6, abs=0.01)


def test_a_sampled_pool_below_break_even_is_probed_again():
    """The sampled pool learns only from rounds that draft, so once a stretch of low chances took
    it below break-even no sampled row would draft again, whatever the drafter could do later
    (a benchmark's later categories ran plain). While its rows run plain it creeps back towards
    the prior (POOL_RELAX): not soon (no probing every few rounds at a loss), but in the end; and
    the chances the probe sees decide what follows."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.45 * (w - 1))  # one draft breaks even at ~0.45
    for later_chance, keeps_drafting in ((0.7, True), (0.2, False)):
        p = policy_for(costs, k=1, prior={"mtp": 0.6})
        for _ in range(200):  # a bad stretch: chances of 0.25
            p.observe(p.new_row("mtp", sampled=True), "mtp", 1, 0, [0.25])
        low, plain = p.pooled[("mtp", True)][0], 0
        assert low < 0.3
        while True:  # requests of 64 tokens each, run plain while the policy says so
            row = p.new_row("mtp", sampled=True)
            drafted = False
            for _ in range(64):
                if p.choose([row]) == 1:
                    drafted = True
                    break
                p.observe(row, None, 0, 0)
                plain += 1
            if drafted:
                break
            assert plain < 5000, "the pool never came back above break-even"
        assert plain > 300, "probed again too soon"
        assert p.pooled[("mtp", True)][0] == pytest.approx(0.6 - (0.6 - low) * (1 - POOL_RELAX) ** plain)
        for _ in range(40):  # the probe and what follows: the drafter's chances now
            row = p.new_row("mtp", sampled=True)
            if p.choose([row]) == 1:
                p.observe(row, "mtp", 1, 0, [later_chance])
            else:
                p.observe(row, None, 0, 0)
        assert (p.choose([p.new_row("mtp", sampled=True)]) == 1) == keeps_drafting


def test_engine_tells_the_policy_which_requests_sample(llama_tiny):
    engine = Engine(llama_tiny.ours, drafter=NgramDrafter(), draft_tokens=3,
                    policy=AdaptivePolicy(FakeCosts(lambda n, w: 1.0)))
    prompt = prompts_of([7], llama_tiny.cfg.vocab_size, seed=3)[0]
    for temperature in (0.0, 1.0):
        engine.add(Request(prompt, 4, SamplingParams(temperature, seed=0)))
        assert engine.waiting[-1].acceptance.sampled == (temperature > 0)


class RecordingPolicy(FixedPolicy):
    def __init__(self, width: int):
        super().__init__(width)
        self.seen: list = []

    def observe(self, state, source, drafted, accepted, chances=None, requested=None):
        self.seen.append((drafted, accepted, chances))
        self.requested = requested


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_reports_chances_only_when_sampling(llama_tiny, temperature):
    policy = RecordingPolicy(3)
    prompts = [p + p for p in prompts_of([7, 9], llama_tiny.cfg.vocab_size, seed=3)]
    engine = Engine(llama_tiny.ours, drafter=NgramDrafter(), draft_tokens=3, policy=policy)
    engine.generate(prompts, 12, SamplingParams(temperature, seed=0), eos_token_ids=[])
    judged = [(d, a, c) for d, a, c in policy.seen if d > 0]
    assert policy.requested == 3  # the width each round asked for
    assert judged
    for drafted, accepted, chances in judged:
        if temperature == 0:
            assert chances is None
        else:
            assert len(chances) >= drafted and all(0.0 <= c <= 1.0 for c in chances[:drafted])


def test_a_drafter_keeping_other_clusters_is_profiled_apart(gemma_tiny, tmp_path):
    """A clustered head's draft step reads the rows of the clusters it keeps: the same weights
    with another top-k (a config edit) must not reuse the old step time."""
    target, keys = gemma_tiny.ours, set()
    for top_k in (2, 4):
        cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head="target", clustered=True,
                                 num_centroids=16, top_k_clusters=top_k)
        save_network(init_network(cfg, target, seed=3), tmp_path / f"d{top_k}")
        keys.add(MTPWithLookup(load_mtp_drafter(tmp_path / f"d{top_k}", target, torch.float32, "cpu")).cost_key())
    assert len(keys) == 2 and all(k.endswith((":top2", ":top4")) for k in keys), keys


def test_profile_cells_are_timed_in_turns_and_the_fastest_counts(monkeypatch):
    """A slow stretch of the machine must land on every width alike: the cells are called in
    turns (a, b, a, b, ...), not one after another, and each keeps its fastest call."""
    from specdraft.speculative import profiling

    clock, order = [0.0], []
    slow = {("a", 0): 5.0, ("b", 1): 5.0}  # one slow call each, at different turns

    def call(key):
        def fn():
            turn = sum(1 for k in order if k == key)
            order.append(key)
            clock[0] += slow.get((key, turn), 1.0 if key == "a" else 2.0)
        return fn

    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])
    best = profiling.fastest_each({"a": call("a"), "b": call("b")}, torch.device("cpu"), repeats=3)
    assert order == ["a", "b"] * 3
    assert best == {"a": 1.0, "b": 2.0}


def test_lookup_positions_the_policy_stopped_asking_for_are_probed_again():
    """A run of requests whose lookups fail at the 4th draft takes the engine's pool there below
    break-even, so later requests ask 3 lookup drafts; those rounds judge nothing past the 3rd, so
    without a drift back the pool never learnt the later positions again, whatever later text did
    (a benchmark's last categories ran 3-draft lookups only). Unasked positions creep back to the
    prior: not at once, but in the end, and what the probes see decides what follows."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.05 * (w - 1) + (0.6 if w > 4 else 0.0))

    def requests(p, count: int, holds: int) -> list[int]:
        """Widths of `count` requests of 64 rounds whose lookups hold for `holds` drafts."""
        widths = []
        for _ in range(count):
            row = p.new_row("lookup")
            for _ in range(64):
                width = p.choose([row])
                p.observe(row, "lookup", width, min(width, holds), requested=width)
                widths.append(width)
        return widths

    for later_holds, keeps_wide in ((7, True), (3, False)):
        p = policy_for(costs, k=3, width=7)
        for _ in range(100):  # translations: copies that break after 3 drafts
            p.observe(p.new_row("lookup"), "lookup", 7, 3, requested=7)
        assert p.choose([p.new_row("lookup")]) == 3
        widths = requests(p, 40, later_holds)
        assert 7 in widths, "positions past the 3rd were never asked for again"
        assert widths.index(7) > 30, "probed again too soon"
        last = widths[-20 * 64:]
        assert (last.count(7) / len(last) > 0.8) == keeps_wide


def test_drafter_positions_the_policy_stopped_asking_for_are_probed_again():
    """The same lock-out for the MTP drafter: after requests whose second draft always failed the
    policy asks one draft a round, which judges nothing past the first; when later text lets the
    drafter's drafts hold, the unasked positions drift back until they are probed and learnt."""
    costs = FakeCosts(lambda n, w: 1.0 + 0.05 * (w - 1), lambda n, s: 0.12 * s)
    for holds, full_rounds in ((3, True), (1, False)):
        p = policy_for(costs, k=3)
        for _ in range(100):
            p.observe(p.new_row("mtp"), "mtp", 3, 1, requested=3)
        assert p.choose([p.new_row("mtp")]) == 1
        widths = []
        for _ in range(10):
            row = p.new_row("mtp")
            for _ in range(64):
                widths.append(p.choose([row]))
                p.observe(row, "mtp", widths[-1], min(widths[-1], holds), requested=widths[-1])
        assert (widths[-64:].count(3) == 64) == full_rounds, widths[-64:]


def test_rounds_dearer_than_the_table_says_are_priced_as_measured():
    """Drafting pays by the table (1.19 tokens for 1.09x a step) but drafted rounds measure 1.3x what
    it predicts while plain ones measure as predicted: once both kinds have run ROUNDS_SEEN rounds,
    the policy runs plain. Rounds measuring as predicted leave the choice alone (the control)."""
    from specdraft.speculative.policy import ROUNDS_SEEN

    costs = FakeCosts(lambda n, w: 1.0 + 0.03 * (w - 1))

    def after(drafted_ratio: float) -> int:
        p = policy_for(costs, k=1, prior={"mtp": 0.19}, narrow_start=False, timed_rounds=True)
        row = p.new_row("mtp")
        assert p.choose([row]) == 1
        for _ in range(ROUNDS_SEEN):
            p.choose([row])
            p.observe_round(costs.verify(1, 2) * drafted_ratio)
            p.round_times.expect(False, costs.verify(1, 1))  # a plain round, as the engine would have run one
            p.observe_round(costs.verify(1, 1))
        return p.choose([row])

    assert after(1.0) == 1
    assert after(1.3) == 0


def test_round_times_wait_for_both_kinds_and_take_the_median():
    from specdraft.speculative.policy import ROUND_WINDOW, ROUNDS_SEEN, RoundTimes

    t = RoundTimes()
    for _ in range(ROUNDS_SEEN):
        t.expect(True, 1.0)
        t.observe(1.5)
    assert t.drafted_factor() == 1.0  # no plain round yet: nothing to compare with
    t.observe(9.0)  # no round was chosen: nothing learnt
    for ratio in [1.0] * ROUNDS_SEEN + [50.0]:  # one stalled round does not move the median
        t.expect(False, 2.0)
        t.observe(2.0 * ratio)
    assert t.drafted_factor() == pytest.approx(1.5)
    for _ in range(2 * ROUND_WINDOW):  # drafted rounds measuring cheaper than plain ones: the table stands
        t.expect(True, 1.0)
        t.observe(0.5)
    assert t.drafted_factor() == 1.0


def test_the_engine_times_every_round_it_chose_a_width_for(gemma_tiny, mtp_lookup):
    """One timed round per round the policy chose, each a positive wall time; same tokens."""
    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = prompts_of([9], vocab, seed=3)
    plain = [r.token_ids for r in Engine(model).generate(prompts, 12, eos_token_ids=[])]
    seen = []

    class Spy(AdaptivePolicy):
        def observe_round(self, seconds: float) -> None:
            seen.append(seconds)
            super().observe_round(seconds)

    policy = Spy(FakeCosts(lambda n, w: 1.0 + 0.01 * (w - 1)), prior={"mtp": 0.9}, timed_rounds=True)
    results = Engine(model, None, mtp_lookup, 2, policy=policy).generate(prompts, 12, eos_token_ids=[])
    assert [r.token_ids for r in results] == plain
    assert len(seen) == results[0].stats.target_forwards - 1 and all(s > 0 for s in seen)  # the first token: prefill
    assert sum(map(len, policy.round_times.ratios)) == len(seen)


def test_a_row_that_always_drafts_runs_plain_rounds_to_learn_their_cost():
    """Drafting predicted to gain a little (under PROBE_PLAIN_BELOW) has its plain rounds timed:
    after ROUNDS_SEEN drafted rounds the policy runs ROUNDS_SEEN plain ones, then prices drafting
    by what both measured (here 1.3x dearer than the table: plain from then on). A clear predicted
    gain is never interrupted (the control)."""
    from specdraft.speculative.policy import PROBE_PLAIN_BELOW, ROUNDS_SEEN

    costs = FakeCosts(lambda n, w: 1.0 + 0.03 * (w - 1))

    def run(prior: float, rounds: int) -> list[int]:
        p = policy_for(costs, k=1, prior={"mtp": prior}, narrow_start=False, timed_rounds=True)
        row, widths = p.new_row("mtp"), []
        for _ in range(rounds):
            w = p.choose([row])
            widths.append(w)
            p.observe_round(costs.verify(1, w + 1) * (1.3 if w else 1.0))
        return widths

    assert (1 + 0.19) / 1.03 < PROBE_PLAIN_BELOW < (1 + 0.9) / 1.03
    widths = run(0.19, 3 * ROUNDS_SEEN)
    assert widths[:ROUNDS_SEEN] == [1] * ROUNDS_SEEN and widths[ROUNDS_SEEN:] == [0] * (2 * ROUNDS_SEEN)
    assert run(0.9, 3 * ROUNDS_SEEN) == [1] * (3 * ROUNDS_SEEN)
