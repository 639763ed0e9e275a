"""Training and decoding compute the same drafter logits for the same prefix.

Training path: `training.data.record_answers` (what a data shard stores) -> `objective.collate`
-> `objective.unrolled_loss` (queries at the anchors t over the stored K/V of the whole sequence,
state = stored hidden at t, teacher-forced inputs x(t+1+k)). Its logits are read off the
`F.linear` it scores the shortlist with (shortlist = the whole vocabulary here).

Decoding path: `MTPDrafter.propose` on a `DraftInput` as the engine builds it (cache holding
0..p, p = t, hidden at p, last token x(p+1)), with `MTPDrafter.logits` wrapped to record the
logits and to force the picked token to the teacher token, so steps 2..K get the same input as
in training while the state recurrence and the context reuse stay propose's own.

The held-out evaluation (`evaluate.teacher_forced_acceptance`: the inference head over the
training batch) is checked against the decoding logits too, candidates included.

The target cache also holds the K/V of the later tokens (prefilled, then rolled back, as after a
rejected verify), so a KV range that reached past p would read them. The target is the tiny
Gemma 3 (window 8, layers sliding, sliding, full) and the sequence is ~3x the window, so the
sliding drafter layer sees a window that matters. Everything is float32.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.drafters.base import DraftInput
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.sampling import SamplingParams
from specdraft.training import objective
from specdraft.training.data import Sequence, read_slots, record_answers
from specdraft.training.evaluate import teacher_forced_acceptance
from specdraft.training.objective import collate, make_head_space, unrolled_loss

from conftest import prompts_of

K_STEPS = 3
PROMPT_LEN, NEW_TOKENS = 12, 14
RTOL = 1e-4  # of max |logit|


def make_drafter(target, folder, head: str, clustered: bool, gate: bool = False) -> MTPDrafter:
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head=head, clustered=clustered,
                             num_centroids=16 if clustered else None, top_k_clusters=4)
    cfg.copy_gate = gate
    net = init_network(cfg, target, seed=3, std=0.2)
    if gate:  # open: bonuses of a few logits, varying with z
        with torch.no_grad():
            net.copy_gate.proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
            net.copy_gate.proj.bias.fill_(2.0)
    save_network(net, folder)
    d = load_mtp_drafter(folder, target, torch.float32, "cpu")
    return MTPDrafter(d.net, d.target, d.sources, min_confidence=0.0)  # always K steps


@pytest.fixture(scope="module")
def sequence(gemma_tiny) -> Sequence:
    """One greedy answer recorded exactly as a training shard stores it."""
    return recorded(gemma_tiny.ours, prompts_of([PROMPT_LEN], gemma_tiny.cfg.vocab_size, seed=5)[0])


@pytest.fixture(scope="module")
def repeating_sequence(gemma_tiny) -> Sequence:
    """The same for a prompt that repeats its first half: copies of one and two tokens to read."""
    half = prompts_of([PROMPT_LEN // 2], gemma_tiny.cfg.vocab_size, seed=6)[0]
    return recorded(gemma_tiny.ours, half + half)


def recorded(model, prompt: list[int]) -> Sequence:
    r = record_answers(model, [prompt], NEW_TOKENS, 0.0, 0, read_slots(model), 4, set())[0]
    slots = read_slots(model)
    return Sequence(tokens=r["tokens"].long(), prompt_length=r["prompt_length"], temperature=0.0,
                    hidden=r["hidden"], keys={s: r[f"k.{s}"] for s in slots}, values={s: r[f"v.{s}"] for s in slots},
                    topk_ids=r["topk_ids"].long(), topk_logp=r["topk_logp"])


def training_logits(drafter: MTPDrafter, seq: Sequence, anchors: list[int], monkeypatch):
    """unrolled_loss's per-step full-vocab logits [A, V] and drafter outputs z [A, h], per step."""
    target, vocab = drafter.target, drafter.target.config.vocab_size
    kv_heads = {s.slot: s.num_kv_heads for s in drafter.sources}
    batch = collate([seq], len(anchors), kv_heads, random.Random(0), torch.float32)
    batch.anchors = torch.tensor([anchors])
    batch.anchor_valid = torch.ones_like(batch.anchors, dtype=torch.bool)
    space = make_head_space(torch.arange(vocab), vocab, None)

    logits, zs = [], []
    real_linear, real_step = torch.nn.functional.linear, drafter.net.step

    class F:  # the objective module's `F`, with linear recorded
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(x, w, b=None):
            out = real_linear(x, w, b)
            logits.append(out.detach()[0].clone())
            return out

    def step(*a, **kw):
        z, state = real_step(*a, **kw)
        zs.append(z.detach()[0].clone())
        return z, state

    real_bonus = objective.add_copy_bonus

    def bonus(*a, **kw):  # the logits the loss sees are those with the copy bonus
        out = real_bonus(*a, **kw)
        logits[-1] = out.detach()[0].clone()
        return out

    monkeypatch.setattr(objective, "F", F())
    monkeypatch.setattr(objective, "add_copy_bonus", bonus)
    monkeypatch.setattr(drafter.net, "step", step)
    try:
        with torch.no_grad():
            unrolled_loss(drafter.net, target, drafter.sources, batch, K_STEPS, space)
    finally:
        monkeypatch.undo()
    assert len(logits) == K_STEPS and len(zs) == K_STEPS
    return logits, zs


def decoding_logits(drafter: MTPDrafter, seq: Sequence, t: int):
    """propose() at p = t with the teacher tokens forced as picks: per step (logits [M], cands [M] | None)."""
    tokens, model = seq.tokens, drafter.target
    cache = model.new_cache(1, len(tokens) + 8)
    with torch.no_grad():
        hidden = model(tokens[None, : len(tokens) - 1], cache)
    cache.rollback([t + 1])  # the cache holds 0..t; the later K/V stay behind as stale entries
    buf = torch.zeros(1, len(tokens) + 8, dtype=torch.long)
    buf[0, : t + 2] = tokens[: t + 2]
    inp = DraftInput(last_token=tokens[t + 1 : t + 2], hidden=hidden[:, t], position=torch.tensor([t]), cache=cache,
                     tokens=buf, active=torch.ones(1, dtype=torch.bool))
    seen = []
    real = drafter.logits

    def forced(z, state, copies=None):
        logits, cands = real(z, state, copies)
        k = len(seen)
        seen.append((logits[0].clone(), None if cands is None else cands[0].clone()))
        teacher = tokens[t + 2 + k : t + 3 + k]  # the input training feeds at step k + 1
        return torch.zeros(1, 1), teacher[:, None]  # pick 0 of candidates [teacher]

    drafter.logits = forced
    drafter.greedy_pick = lambda *a: None  # its one-call head picks as `logits` does (test_mtp_internals.py)
    try:
        d = drafter.propose(inp, K_STEPS, SamplingParams(), None)
    finally:
        del drafter.logits, drafter.greedy_pick
    assert d.tokens[0].tolist() == tokens[t + 2 : t + 2 + K_STEPS].tolist()
    return seen


def evaluation_logits(drafter: MTPDrafter, seq: Sequence) -> list[dict[int, tuple]]:
    """teacher_forced_acceptance's per-step (logits, cands) for every answer anchor t: [{t: ...}] per step."""
    kv_heads = {s.slot: s.num_kv_heads for s in drafter.sources}
    seen = []
    real = drafter.logits

    def record(z, state, copies=None):
        out = real(z, state, copies)
        seen.append(out)
        return out

    drafter.logits = record
    try:
        with torch.no_grad():
            teacher_forced_acceptance(drafter, [seq], K_STEPS, kv_heads, torch.device("cpu"))
    finally:
        del drafter.logits
    assert len(seen) == K_STEPS
    # collate with as many anchors as answer positions takes all of them, sorted: prompt_length - 1 .. n - 3.
    anchors = list(range(seq.prompt_length - 1, len(seq.tokens) - 2))
    out = []
    for k, (logits, cands) in enumerate(seen):
        assert logits.shape[0] >= len(anchors)
        valid = [a for a in anchors if a + 1 + k <= len(seq.tokens) - 2]
        out.append({t: (logits[i], None if cands is None else cands[i]) for i, t in enumerate(anchors) if t in valid})
    return out


@pytest.mark.parametrize("head,clustered,gate", [("own", False, False), ("target", False, False), ("own", True, False),
                                                ("target", True, False), ("own", False, True), ("target", True, True)])
def test_training_and_decoding_drafter_logits_agree(gemma_tiny, sequence, repeating_sequence, tmp_path, monkeypatch,
                                                    head, clustered, gate):
    model = gemma_tiny.ours
    drafter = make_drafter(model, tmp_path / "d", head, clustered, gate)
    assert [s.window for s in drafter.sources] == [8, None]
    seq = repeating_sequence if gate else sequence
    n = len(seq.tokens)
    assert n == PROMPT_LEN + NEW_TOKENS and n > 3 * 8
    # Every position whose K steps have inputs and labels: inside and past the window, prompt and answer.
    anchors = list(range(0, n - 1 - K_STEPS))
    assert max(anchors) > 2 * 8

    train, train_z = training_logits(drafter, seq, anchors, monkeypatch)

    evaluated = evaluation_logits(drafter, seq)
    worst = 0.0
    for a, t in enumerate(anchors):
        dec = decoding_logits(drafter, seq, t)
        for k, (logits, cands) in enumerate(dec):
            if t in evaluated[k]:
                # The held-out evaluation runs the inference head over the training batch: same logits and candidates.
                e_logits, e_cands = evaluated[k][t]
                assert (e_cands is None) == (cands is None) and (cands is None or torch.equal(e_cands, cands))
                finite = torch.isfinite(logits)  # -inf: a copy column whose token is already a candidate
                assert torch.equal(finite, torch.isfinite(e_logits))
                err = (e_logits[finite] - logits[finite]).abs().max().item()
                assert err <= RTOL * max(1.0, logits[finite].abs().max().item()), \
                    f"evaluation, anchor {t} step {k + 1}: {err:.3g}"
            ref = train[k][a]
            scale = max(1.0, ref.abs().max().item())
            if cands is None:
                assert logits.shape == ref.shape
                got = logits
            else:
                # Same kept clusters from the training z, and the same logits on their tokens (and on
                # the copies the gate added as candidates; -inf marks a copy already counted).
                kept = drafter.net.masked_embedding.candidates(train_z[k][a][None])[0]
                assert torch.equal(kept, cands[: len(kept)]), (t, k)
                finite = torch.isfinite(logits)
                got, ref = logits[finite], ref[cands[finite]]
            err = (got - ref).abs().max().item()
            assert err <= RTOL * scale, f"anchor {t} step {k + 1}: max |diff| {err:.3g} (max |logit| {scale:.3g})"
            worst = max(worst, err / scale)
    assert len(evaluated[0]) >= NEW_TOKENS - K_STEPS  # the evaluation path was compared at every answer anchor
    if gate:  # the gate had copies to add: the sequence repeats tokens and pairs
        copies = collate([seq], 1, {s.slot: s.num_kv_heads for s in drafter.sources}, random.Random(0),
                         torch.float32).copies[0]
        assert (copies[:, 0] >= 0).sum() > 5 and (copies[:, 1] >= 0).sum() > 0
    print(f"worst relative logit difference {worst:.2g}")
