"""Explaining the training / decoding acceptance gap.

The teacher-forced metric averages over every answer position as an anchor; real decoding
starts rounds only where the previous round ended. `teacher_forced_acceptance` replays greedy
decoding over a recorded answer and reports acceptance at the replayed anchors;
`acceptance_gap` then runs the engine on the same prompts with a recording drafter. On a tiny
float32 target the replay must predict the engine exactly: same anchors, same first draft,
same accepted count at every anchor, same acceptance by position.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.training.evaluate import replay_greedy_decoding
from specdraft.training.gap import acceptance_gap, decoding_records


def test_replay_reports_where_rounds_start():
    anchors = torch.arange(4, 12)
    prefix = torch.tensor([2, 3, 3, 0, 2, 3, 3, 1])
    valid = torch.ones(8, dtype=torch.bool)
    visited: list[int] = []
    assert replay_greedy_decoding(anchors, valid, prefix, 5, visited) == (3 + 1 + 3 + 2, 4)
    assert visited == [4, 7, 8, 11]


def test_decoding_records_count_conditional_acceptance_and_cluster_recall():
    # Sequence positions 0..9; rounds at p = 2 (b = x3) and p = 5 (b = x6). Clusters: token // 2.
    seq = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    cluster_of = torch.arange(32) // 2
    rounds = [
        # drafts x4 (right), 99 (wrong, x5 = 15 in cluster 7, ranked 2nd), never reached third
        {"position": [2], "last_token": [13], "drafts": [[14, 3, 1]], "num_valid": [3],
         "clusters": [[[7, 1]], [[0, 7]], [[1, 2]]]},
        # first draft wrong; x7 = 17 in cluster 8, not in the ranked clusters at all
        {"position": [5], "last_token": [16], "drafts": [[5, 5, 5]], "num_valid": [3],
         "clusters": [[[3, 4]], [[0, 1]], [[0, 1]]]},
    ]
    c = decoding_records(rounds, seq, 3, (1, 2), cluster_of)
    assert c["reached"] == [2, 1, 0] and c["right"] == [1, 0, 0]
    # Position 1: round 1's x4 = 14 is cluster 7, ranked first; round 2's cluster 8 is absent.
    assert c["inside"] == {1: [1, 0, 0], 2: [1, 1, 0]}
    assert c["miss_outside"] == {1: [1, 1, 0], 2: [1, 0, 0]}
    assert c["by_anchor"] == {2: 1, 5: 0} and c["first_draft"] == {2: 14, 5: 5}
    with pytest.raises(AssertionError):  # b must be the token emitted at p + 1
        decoding_records([dict(rounds[0], last_token=[99])], seq, 3, (1,), cluster_of)


@pytest.mark.parametrize("clustered,min_confidence", [(False, 0.0), (True, 0.0), (False, None), (True, None)])
def test_replayed_decoding_predicts_the_engine_exactly_in_float32(gemma_tiny, tmp_path, clustered, min_confidence):
    from specdraft.runtime import Runtime

    rt = Runtime.load(str(gemma_tiny.folder), "float32", "cpu", progress=False, weights="dtype")
    target = rt.model
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head="target", clustered=clustered,
                             num_centroids=16 if clustered else None, top_k_clusters=4)
    save_network(init_network(cfg, target, seed=3, std=0.2), tmp_path / "d")
    d = load_mtp_drafter(tmp_path / "d", target, torch.float32, "cpu")
    # min_confidence None: the drafter's early stop, which the replay must then model as the engine runs it.
    drafter = MTPDrafter(d.net, d.target, d.sources, min_confidence=0.01)
    # A random drafter is never right, which would leave positions 2..K untested. Both paths call
    # net.step (float32 nn.Linear weights: the one-call draft step does not take them); make its next state the input token's embedding, so the (tied) head drafts "the
    # same token again", which the tiny target's greedy loops accept.
    real_step = d.net.step

    def repeat_step(emb, state, contexts):
        z, _ = real_step(emb, state, contexts)
        return z, emb

    d.net.step = repeat_step
    prompts = ["The quick brown fox", "def return The quick", "brown fox def"]
    k = 3
    r = acceptance_gap(rt, drafter, prompts, k, max_new_tokens=20, min_confidence=min_confidence, top_ks=(4, 8))
    json.dumps(r)  # the CLI prints it as one JSON line
    assert r["min_confidence"] == (0.01 if min_confidence is None else 0.0) and r["texts_equal_to_plain"] == "3/3"
    assert r["anchors_compared"] > 0 and r["anchors_agreeing"] == 1.0 and r["first_drafts_agreeing"] == 1.0
    # Acceptance at the replayed anchors is the engine's acceptance (both conditional on earlier drafts).
    assert r["replay_acceptance"] == r["engine_acceptance"]
    buckets = r["first_draft"]["by_target_confidence"]
    assert abs(sum(b["share"] for b in buckets) - 1) < 1e-3
    # Weighted by share, the buckets' acceptance is the teacher-forced first-draft acceptance.
    overall = sum(b["share"] * b["acceptance"] for b in buckets if b["share"])
    assert abs(overall - r["teacher_forced_acceptance"][0]) < 1e-3, (overall, r["teacher_forced_acceptance"])
    if clustered:
        recall = r["engine_cluster_recall"]
        assert all(0 <= x <= 1 for x in recall[4] if x is not None)
        assert max(x for x in recall[8] if x is not None) > 0  # recorded on every path, the C head's too
        # More kept clusters never lose the target's token.
        assert all(b >= a for a, b in zip(recall[4], recall[8]) if a is not None)
    else:
        assert r["engine_cluster_recall"] is None


def test_first_draft_acceptance_is_split_by_confidence_and_repeated_pairs():
    from specdraft.training.data import Sequence
    from specdraft.training.gap import first_draft_breakdown

    tokens = torch.tensor([3, 4, 3, 4, 5, 6])
    n = len(tokens)
    logp = torch.log(torch.tensor([0.95, 0.3, 0.995, 0.6, 0.95, 0.0]))[:, None]
    ids = torch.tensor([4, 3, 4, 9, 9, 0])[:, None]  # the target's top-1 after each position
    seq = Sequence(tokens=tokens, prompt_length=1, temperature=0.0, hidden=torch.zeros(n, 2), keys={},
                   values={}, topk_ids=ids, topk_logp=logp)
    # anchor t drafts the token predicted at t + 1 (ids[t + 1]); anchor 4 has no prediction after it
    picks = {0: (1, 3), 1: (0, 0), 2: (1, 9), 3: (0, 1), 4: (0, 0)}
    out = first_draft_breakdown([seq], [picks])
    by = {b["target_top1"]: b for b in out["by_target_confidence"]}
    assert by["0-0.5"] == {"target_top1": "0-0.5", "share": 0.25, "acceptance": 1.0}
    assert by["0.5-0.7"]["acceptance"] == 1.0
    assert by["0.9-0.99"] == {"target_top1": "0.9-0.99", "share": 0.25, "acceptance": 0.0}
    assert by["0.99-1"] == {"target_top1": "0.99-1", "share": 0.25, "acceptance": 0.0}
    assert by["0.7-0.9"]["acceptance"] is None
    # Anchor 1 drafts 4 after 3 (the pair (3, 4) is at 0-1): repeated; anchors 0, 2, 3 are new pairs.
    assert out["repeated_pairs"] == {"share": 0.25, "acceptance": 0.0, "elsewhere_acceptance": round(2 / 3, 4)}


def test_eval_drafter_drafts_every_round_at_batch_8(tmp_path):
    """The target drafting for itself accepts every draft; at batch 8 on a CPU the runtime's fixed
    policy would run plain rounds instead, which a drafter measurement must not count."""
    from conftest import make_tiny
    from specdraft.drafters import load_drafter
    from specdraft.runtime import Runtime
    from specdraft.training.evaluate import evaluate_drafter

    make_tiny(tmp_path / "m", "gemma3", seed=3, max_position_embeddings=256)
    rt = Runtime.load(str(tmp_path / "m"), "float32", "cpu", progress=False)
    assert rt.speculate_below is not None and rt.speculate_below <= 8
    drafter, _, _ = load_drafter(rt, "draft-model", str(tmp_path / "m"), 3, load_runtime=Runtime.load)
    prompts = [f"w{4 + i} w{9 + i} w{20 + i}" for i in range(8)]
    (row,) = evaluate_drafter(rt, drafter, prompts, [3], [0.0], max_new_tokens=16, batch_size=8)
    assert row.acceptance_by_position == [1.0, 1.0, 1.0], row
    assert row.tau > 2.5, row
