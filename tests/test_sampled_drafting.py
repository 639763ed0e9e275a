"""Sampled drafting's policy: the acceptance a drafter's sampled drafts show is learnt per
sampling shaping (temperature, top-k, top-p), so a server mixing temperatures starts each new
request from what requests like it have shown, not from every sampled request's average."""

from __future__ import annotations

import pytest
import torch

from conftest import prompts_of
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.sampling import SamplingParams
from specdraft.speculative.acceptance import AcceptanceEstimates, RowAcceptance
from specdraft.speculative.engine import Engine
from specdraft.speculative.policy import AdaptivePolicy, FixedPolicy

HOT, WARM = SamplingParams(1.0).shaping, SamplingParams(0.7, top_p=0.95).shaping


def estimates() -> AcceptanceEstimates:
    e = AcceptanceEstimates({"mtp": 0.6})
    e.k = e.width = 3
    return e


def learn(e: AcceptanceEstimates, shaping, chance: float, rounds: int = 200) -> None:
    row = RowAcceptance("mtp", False, sampled=shaping)
    for _ in range(rounds):
        e.observe(row, "mtp", 3, 3, chances=[chance] * 3)


def test_each_shaping_keeps_its_own_pool():
    e = estimates()
    learn(e, HOT, 0.45)
    learn(e, WARM, 0.8)
    assert e.pooled[("mtp", HOT)][0] == pytest.approx(0.45, abs=0.01)
    assert e.pooled[("mtp", WARM)][0] == pytest.approx(0.8, abs=0.01)
    # A new request starts from its own shaping's pool; an unseen shaping from the prior.
    fresh = {s: e.expected(RowAcceptance("mtp", False, sampled=s), "mtp")[0][1] for s in (HOT, WARM, (0.3, 0, 1.0))}
    assert fresh[HOT] == pytest.approx(1.45, abs=0.01) and fresh[WARM] == pytest.approx(1.8, abs=0.01)
    assert fresh[(0.3, 0, 1.0)] == pytest.approx(1.6)


def test_negative_control_one_pool_for_every_temperature_mixes_them():
    """Rows that only say `sampled=True` (no shaping) share one pool: what the per-shaping key avoids."""
    e = estimates()
    learn(e, True, 0.45)
    learn(e, True, 0.8, rounds=20)
    assert 0.5 < e.pooled[("mtp", True)][0] < 0.75  # neither temperature's acceptance


def test_a_plain_rounds_drift_goes_to_its_own_shapings_pool():
    e = estimates()
    learn(e, HOT, 0.2)
    learn(e, WARM, 0.9)
    row = RowAcceptance("mtp", False, sampled=WARM)
    e.observe(row, "mtp", 3, 0, chances=[0.0, 0.0, 0.0])  # one bad round, then plain rounds
    for _ in range(300):
        e.observe(row, None, 0, 0)
    assert row.rates["mtp"][0] == pytest.approx(e.pooled[("mtp", WARM)][0], abs=0.02)


def test_the_engine_files_sampled_rows_under_their_shaping(gemma_tiny, tmp_path):
    """Generated at temperature 0.7 / top-p 0.95 with a drafter, the engine-wide pool that learnt
    is that shaping's; greedy rows keep the greedy pool."""
    from test_policy import switching_costs

    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = prompts_of([7, 12], vocab, seed=3)
    cfg = drafter_config_for(model, hidden=32, layers=2, heads=4, head="target", clustered=True,
                             num_centroids=16, top_k_clusters=4)
    save_network(init_network(cfg, model, seed=3, std=0.1), tmp_path / "d")
    drafter = load_mtp_drafter(tmp_path / "d", model, torch.float32, "cpu")
    policy = AdaptivePolicy(switching_costs(), prior={"mtp": 0.9, "lookup": 0.6, "draft": 0.6})
    engine = Engine(model, None, drafter, 3, policy=policy)
    engine.generate(prompts, 12, SamplingParams(0.7, top_p=0.95, seed=1), eos_token_ids=[])
    engine.generate(prompts, 12, eos_token_ids=[])
    assert set(policy.pooled) == {("mtp", (0.7, 0, 0.95)), ("mtp", False)}


class BlockPolicy(FixedPolicy):
    """Every round K drafts, verified `block` positions per head call (the adaptive policy's
    head_block, here fixed)."""

    def __init__(self, width: int, block: int | None):
        super().__init__(width)
        self.block = block

    def head_block(self) -> int | None:
        return self.block


def test_the_policys_head_block_changes_the_head_calls_never_the_tokens(gemma_tiny, tmp_path, monkeypatch):
    """Sampled rounds verified 1, 2, 3 or 4 positions per head call emit the same tokens (the head
    scores each row on its own); blocks of 1 call the head more often than one block of 4."""
    model, vocab = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    prompts = prompts_of([9, 14], vocab, seed=5)
    cfg = drafter_config_for(model, hidden=32, layers=2, heads=4, head="target", clustered=True,
                             num_centroids=16, top_k_clusters=4)
    save_network(init_network(cfg, model, seed=5, std=0.1), tmp_path / "d")
    drafter = load_mtp_drafter(tmp_path / "d", model, torch.float32, "cpu")
    calls, logits = [], model.logits
    monkeypatch.setattr(model, "logits", lambda rows: calls.append(rows.shape[0]) or logits(rows))
    outputs, counts = {}, {}
    for block in (1, 2, 3, 4, None):
        calls.clear()
        engine = Engine(model, None, drafter, 3, policy=BlockPolicy(3, block))
        results = engine.generate(prompts, 16, SamplingParams(1.0, seed=2), eos_token_ids=[])
        outputs[block], counts[block] = [r.token_ids for r in results], len(calls)
        accepted = sum(sum(r.stats.accepted_by_position) for r in results)
    assert all(out == outputs[4] for out in outputs.values())
    assert accepted > 0 and counts[1] > counts[2] >= counts[4]
