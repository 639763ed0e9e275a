"""MTP drafter internals: query-only attention over the target's cache, the constant query
position, nothing to undo after a rollback, and checkpoints that round-trip.

Target: the tiny Gemma 3 model (layers sliding, sliding, full; window 8). The drafter has one
sliding and one full layer, reading target layers 1 and 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TinyModel, prompts_of
from specdraft.drafters.base import Drafter, DraftInput, SparseProbs
from specdraft.drafters.mtp import (MTPConfig, MTPDrafter, drafter_config_for, init_network, load_mtp_drafter,
                                    save_network)
from specdraft.drafters.mtp.checkpoint import kv_sources
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine

GREEDY = SamplingParams()


def make_drafter(target: TinyModel, folder: Path, head="own", clustered=False, seed=0, std=0.2) -> MTPDrafter:
    cfg = drafter_config_for(target.ours, hidden=32, layers=2, heads=4, head=head, clustered=clustered,
                             num_centroids=16 if clustered else None, top_k_clusters=4)
    save_network(init_network(cfg, target.ours, seed=seed, std=std), folder)
    return load_mtp_drafter(folder, target.ours, torch.float32, "cpu")


def ragged_state(target: TinyModel, lengths: list[int], seed: int = 0) -> DraftInput:
    """Prefill rows of different lengths, write junk past them and roll it back (stale K/V)."""
    model, v = target.ours, target.cfg.vocab_size
    seqs = prompts_of(lengths, v, seed=seed)
    b, width = len(seqs), max(lengths)
    tokens = torch.zeros(b, width + 16, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    cache = model.new_cache(b, width + 16)
    lens = torch.tensor(lengths)
    with torch.inference_mode():
        hidden = model(tokens[:, :width], cache)
        cache.rollback(lens)
        model(torch.randint(4, v, (b, 6)), cache)  # rejected drafts, never kept
        cache.rollback(lens)
    # The last prompt token is b (not in the cache); p = len - 2 is the last cached position.
    rows = torch.arange(b)
    with torch.inference_mode():
        cache.rollback(lens - 1)
    return DraftInput(tokens[rows, lens - 1], hidden[rows, lens - 2], lens - 2, cache, tokens,
                      torch.ones(b, dtype=torch.bool))


def rope_by_hand(theta: float, dim: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]
    ang = torch.tensor([p * f for f in inv] * 2, dtype=torch.float64)
    return ang.cos(), ang.sin()


def attention_by_hand(attn, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, window: int | None,
                      theta: float, scale: float, eps: float) -> torch.Tensor:
    """One query (x [h]) at position p over keys/values [Hkv, capacity, D] of one row, float64."""
    heads, d = attn.heads, attn.head_dim
    q = (attn.q_proj.weight.double() @ x.double()).view(heads, d)
    if attn.q_norm is not None:
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps) * attn.q_norm.weight.double()
    cos, sin = rope_by_hand(theta, d, p)
    q = q * cos + torch.cat([-q[:, d // 2 :], q[:, : d // 2]], -1) * sin
    lo = 0 if window is None else max(0, p - window + 1)
    keys, values = k[:, lo : p + 1].double(), v[:, lo : p + 1].double()
    groups = heads // k.shape[0]
    outs = []
    for h in range(heads):
        scores = keys[h // groups] @ q[h] * scale
        outs.append(torch.softmax(scores, -1) @ values[h // groups])
    return attn.o_proj.weight.double() @ torch.cat(outs)


def capture_attention(drafter: MTPDrafter):
    calls = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, out, i=i: calls.append((i, args[0], args[1], out)))
             for i, layer in enumerate(drafter.net.model.layers)]
    return calls, hooks


def test_drafter_reads_the_last_target_layer_of_its_type(gemma_tiny, tmp_path) -> None:
    drafter = make_drafter(gemma_tiny, tmp_path / "d")
    assert drafter.net.config.layer_types == ["sliding_attention", "full_attention"]
    assert [s.layer for s in drafter.sources] == [1, 2]
    assert [s.window for s in drafter.sources] == [8, None]


@pytest.mark.parametrize("clustered", [False, True])
def test_attention_equals_explicit_softmax_over_target_cache(gemma_tiny, tmp_path, clustered) -> None:
    drafter = make_drafter(gemma_tiny, tmp_path / "d", clustered=clustered)
    inp = ragged_state(gemma_tiny, [21, 6, 13])  # p = 19 (> window), 4, 11
    hf_cfg = gemma_tiny.hf.config
    before = ([t.clone() for t in inp.cache.k], [t.clone() for t in inp.cache.v], inp.cache.lengths.clone())
    calls, hooks = capture_attention(drafter)
    try:
        k = 3
        drafter.propose(inp, k, GREEDY, None)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 2 * k
    for layer_idx, x, ctx, out in calls:
        src = drafter.sources[layer_idx]
        theta = hf_cfg.rope_parameters[src.layer_type]["rope_theta"]
        for row, p in enumerate(inp.position.tolist()):
            ref = attention_by_hand(drafter.net.model.layers[layer_idx].self_attn, x[row, 0],
                                    inp.cache.k[src.slot][row], inp.cache.v[src.slot][row], p,
                                    hf_cfg.sliding_window if src.window else None, theta,
                                    hf_cfg.query_pre_attn_scalar**-0.5, drafter.net.config.rms_norm_eps)
            assert (out[row, 0].double() - ref).abs().max().item() <= 1e-5
    # Drafting wrote nothing into the target's cache.
    assert all(torch.equal(a, b) for a, b in zip(before[0], inp.cache.k))
    assert all(torch.equal(a, b) for a, b in zip(before[1], inp.cache.v))
    assert torch.equal(before[2], inp.cache.lengths)


def test_query_position_is_constant_within_a_round(gemma_tiny, tmp_path) -> None:
    drafter = make_drafter(gemma_tiny, tmp_path / "d")
    inp = ragged_state(gemma_tiny, [17, 9])
    calls, hooks = capture_attention(drafter)
    try:
        drafter.propose(inp, 5, GREEDY, None)
    finally:
        for h in hooks:
            h.remove()
    head_dim = drafter.net.model.layers[0].self_attn.head_dim
    for layer_idx in (0, 1):
        ctxs = [c for i, _, c, _ in calls if i == layer_idx]
        assert len(ctxs) == 5
        theta = gemma_tiny.hf.config.rope_parameters[drafter.sources[layer_idx].layer_type]["rope_theta"]
        for c in ctxs:
            # Every step: the same rotation (position p of each row) and the same visible keys.
            assert torch.equal(c.cos, ctxs[0].cos) and torch.equal(c.sin, ctxs[0].sin)
            assert torch.equal(c.mask, ctxs[0].mask) and torch.equal(c.keys, ctxs[0].keys)
        for row, p in enumerate(inp.position.tolist()):
            cos, sin = rope_by_hand(theta, head_dim, p)
            assert torch.allclose(ctxs[0].cos[row, 0, 0].double(), cos, atol=1e-6)
            # The table's sin comes signed for apply_rope: (-sin, +sin) over the two halves.
            signed = torch.cat([-sin[: head_dim // 2], sin[head_dim // 2 :]])
            assert torch.allclose(ctxs[0].sin[row, 0, 0].double(), signed, atol=1e-6)
    # The inputs differ between steps (the state carries the recurrence), the position does not.
    xs = [x for i, x, _, _ in calls if i == 0]
    assert not torch.equal(xs[0], xs[1])


class RecordingDrafter(Drafter):
    """Delegates to an MTP drafter and keeps a snapshot of every round."""

    kind = "recording"

    def __init__(self, inner: MTPDrafter):
        self.inner, self.rounds = inner, []

    def propose(self, inp, k, sampling, generator):
        d = self.inner.propose(inp, k, sampling, generator)
        slot = self.inner.sources[0].slot
        stale = [inp.cache.k[slot][b, :, int(p) + 1 : int(p) + 1 + k].abs().sum().item() for b, p in enumerate(inp.position)]
        self.rounds.append(dict(position=inp.position.clone(), tokens=inp.tokens.clone(), hidden=inp.hidden.clone(),
                                last=inp.last_token.clone(), active=inp.active.clone(), drafts=d.tokens.clone(),
                                stale=stale))
        return d


@pytest.mark.parametrize("head", ["own", "target"])
def test_greedy_drafts_of_the_one_call_head_equal_the_tensor_path(gemma_tiny, tmp_path, head, monkeypatch) -> None:
    """Greedy rounds pick their drafts in the head's C call (greedy_pick, score_rows.c draft_head)
    where the kernels build; drafts, early stops and copies match the tensor path's (`logits` as
    tensor ops, softmax, argmax) exactly."""
    from specdraft.models.kernels import build

    if not build.available():
        pytest.skip("the C kernels do not build here")
    cfg = drafter_config_for(gemma_tiny.ours, hidden=32, layers=2, heads=4, head=head, clustered=True,
                             num_centroids=16, top_k_clusters=4)
    cfg.copy_gate = True
    net = init_network(cfg, gemma_tiny.ours, seed=3, std=0.2)
    with torch.no_grad():  # an open gate: copies win some steps
        net.copy_gate.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        net.copy_gate.proj.bias.fill_(2.0)
    save_network(net, tmp_path / "d")
    drafter = load_mtp_drafter(tmp_path / "d", gemma_tiny.ours, torch.float32, "cpu")
    drafter.min_confidence = 0.15
    inp = ragged_state(gemma_tiny, [12, 20, 7, 16, 25, 9])
    picks = []
    fast_pick = drafter.greedy_pick
    monkeypatch.setattr(drafter, "greedy_pick", lambda *a: picks.append(fast_pick(*a)) or picks[-1])

    def draft() -> tuple[torch.Tensor, torch.Tensor]:
        drafter.prepare(6, inp.cache.capacity)
        with torch.inference_mode():
            d = drafter.propose(inp, 5, GREEDY, None)
        return d.tokens, d.num_valid

    fast = draft()
    assert picks and all(p is not None for p in picks)
    monkeypatch.setattr(drafter, "greedy_pick", lambda *a: None)
    monkeypatch.setattr(drafter, "_head_kernel", lambda *a, **kw: None)
    slow = draft()
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    assert len(set(fast[1].tolist())) > 1  # some rows stopped early, others drafted on


def test_rollback_leaves_the_drafter_nothing_to_undo(gemma_tiny, tmp_path) -> None:
    """Proposals in the middle of a run (after many target rollbacks, with rejected drafts' K/V
    still in the cache past p) equal proposals from a fresh prefill of the same sequence."""
    model = gemma_tiny.ours
    drafter = make_drafter(gemma_tiny, tmp_path / "d", clustered=True)
    rec = RecordingDrafter(drafter)
    prompts = prompts_of([7, 12, 3], gemma_tiny.cfg.vocab_size, seed=4)
    k = 4
    Engine(model, None, rec, k).generate(prompts, 24, eos_token_ids=[])
    assert len(rec.rounds) >= 10
    checked = stale_seen = 0
    for r in rec.rounds[2::3]:
        for b in range(len(prompts)):
            if not r["active"][b]:
                continue
            p = int(r["position"][b])
            seq = r["tokens"][b, : p + 2]
            cache = model.new_cache(1, p + 2)
            with torch.inference_mode():
                hidden = model(seq[None, : p + 1], cache)[:, p]
            # Same state up to fp32 rounding (a verify pass vs. a prefill; hidden values reach ~20).
            assert (hidden[0] - r["hidden"][b]).abs().max().item() <= 1e-4
            fresh = DraftInput(seq[p + 1 : p + 2], hidden, torch.tensor([p]), cache, seq[None].clone(),
                               torch.ones(1, dtype=torch.bool))
            d = drafter.propose(fresh, k, GREEDY, None)
            assert d.tokens[0].tolist() == r["drafts"][b].tolist()
            checked += 1
            stale_seen += r["stale"][b] > 0
    assert checked >= 8
    assert stale_seen >= checked // 2, "the runs should have had rejected K/V past p in the cache"


def dense_q(q) -> torch.Tensor:
    """A draft's Q as [B, K, V] (clustered heads keep only their candidates' probabilities)."""
    return q.dense() if isinstance(q, SparseProbs) else q


@pytest.mark.parametrize("head", ["own", "target"])
@pytest.mark.parametrize("clustered", [False, True])
def test_checkpoint_round_trip(gemma_tiny, tmp_path, head, clustered) -> None:
    target = gemma_tiny.ours
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head=head, clustered=clustered,
                             num_centroids=16 if clustered else None, top_k_clusters=4, recommended_k=5)
    if clustered:
        cfg.sampling_top_k_clusters = 6
    net = init_network(cfg, target, seed=3, std=0.2)
    save_network(net, tmp_path / "d")
    loaded = load_mtp_drafter(tmp_path / "d", target, torch.float32, "cpu")
    assert MTPConfig.from_dict(cfg.to_dict()) == cfg == loaded.net.config
    assert loaded.recommended_k == 5
    ref_state, got_state = net.state_dict(), loaded.net.state_dict()
    assert set(ref_state) == set(got_state)
    assert all(torch.equal(ref_state[n], got_state[n]) for n in ref_state)
    original = MTPDrafter(net.eval(), target, kv_sources(cfg, target))
    inp = ragged_state(gemma_tiny, [15, 8])
    a = original.propose(inp, 4, GREEDY, None)
    b = loaded.propose(inp, 4, GREEDY, None)
    assert torch.equal(a.tokens, b.tokens)
    sampled = SamplingParams(1.0, top_k=20)
    a = original.propose(inp, 4, sampled, torch.Generator().manual_seed(1))
    b = loaded.propose(inp, 4, sampled, torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(dense_q(a.probs), dense_q(b.probs))
    # At temperature 1 with no filter, Q is the softmax of the drafter's logits over the whole
    # (or the clustered) vocabulary: equal bits here mean equal logits.
    full = SamplingParams(1.0)
    a = original.propose(inp, 4, full, torch.Generator().manual_seed(2))
    b = loaded.propose(inp, 4, full, torch.Generator().manual_seed(2))
    assert torch.equal(dense_q(a.probs), dense_q(b.probs))


def test_checkpoint_layout_is_what_transformers_reads(gemma_tiny, tmp_path) -> None:
    """transformers' Gemma4AssistantForCausalLM opens our drafter folder with no missing or
    unexpected tensors, and sees the same values."""
    from transformers import Gemma4AssistantForCausalLM

    target = gemma_tiny.ours
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, clustered=True, num_centroids=16, top_k_clusters=4)
    net = init_network(cfg, target, seed=5)
    save_network(net, tmp_path / "d")
    hf, info = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "d", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs = hf.state_dict()
    for name, t in net.state_dict().items():
        assert torch.equal(theirs[name].to(t.dtype), t), name
    assert hf.config.backbone_hidden_size == gemma_tiny.cfg.hidden_size
    assert hf.config.num_centroids == 16 and hf.config.centroid_intermediate_top_k == 4


def test_drafter_for_another_target_is_refused_by_name(gemma_tiny, tiny_factory, tmp_path) -> None:
    make_drafter(gemma_tiny, tmp_path / "d")
    other = tiny_factory("gemma3", hidden_size=48, head_dim=8)
    with pytest.raises(SpecdraftError, match=r"does not fit this target: backbone_hidden_size 64 != target hidden "
                                             r"size 48.*head_dim 16 != target layer \d head_dim 8"):
        load_mtp_drafter(tmp_path / "d", other.ours, torch.float32, "cpu")
    small_vocab = tiny_factory("gemma3", vocab_size=96)
    with pytest.raises(SpecdraftError, match="vocabulary 128 != target vocabulary 96"):
        load_mtp_drafter(tmp_path / "d", small_vocab.ours, torch.float32, "cpu")


def test_corrupt_drafter_folders(gemma_tiny, tmp_path) -> None:
    import json

    make_drafter(gemma_tiny, tmp_path / "d", clustered=True)
    with pytest.raises(SpecdraftError, match="is not a folder"):
        load_mtp_drafter(tmp_path / "missing", gemma_tiny.ours, torch.float32, "cpu")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(SpecdraftError, match="expected 'gemma4_assistant'"):
        load_mtp_drafter(tmp_path / "d", gemma_tiny.ours, torch.float32, "cpu")
    cfg["text_config"]["intermediate_size"] = 40
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="has shape .* config implies"):
        load_mtp_drafter(tmp_path / "d", gemma_tiny.ours, torch.float32, "cpu")


@pytest.mark.parametrize("value", [0, 17, "many"])
def test_a_bad_sampled_cluster_count_is_refused_with_its_name(gemma_tiny, value) -> None:
    cfg = drafter_config_for(gemma_tiny.ours, hidden=32, layers=2, heads=4, clustered=True, num_centroids=16,
                             top_k_clusters=4).to_dict()
    cfg["specdraft"]["sampling_top_k_clusters"] = value
    with pytest.raises(SpecdraftError, match="sampling_top_k_clusters|bad field"):
        MTPConfig.from_dict(cfg)
