"""Official-layout Gemma 4 assistants (Gemma4AssistantForCausalLM checkpoints) as MTP drafters.

Parity: given identical inputs (target hidden state at p, last token, the target's K/V for
positions 0..p, query position p), specdraft's drafter and transformers' assistant produce the
same states, the same selected clusters and the same logits over them, step after step.
transformers' generate loop queries at p + 1 and can see one more (possibly rejected) K/V; that
is a different convention, not a different network, so the comparison calls the assistant
directly at position p. Its bidirectional sliding mask admits window + 1 keys, so it is handed
exactly the `window` keys the target's own sliding layer sees at p.

End to end: speculative greedy generation with target + assistant equals transformers' plain
greedy generation, token for token, for K in {1, 3} and a ragged batch.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_fp32_close, reduction_depth  # noqa: E402
from gemma4_tiny import (  # noqa: E402
    assistant_config,
    follow_transitions_,
    greedy_sequences,
    moe_overrides,
    randomize_,
    target_text_config,
)
from specdraft.config import FULL, SLIDING  # noqa: E402
from specdraft.drafters.base import DraftInput  # noqa: E402
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

TARGETS = {"ple_kv_shared": {}, "moe": moe_overrides()}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    """(transformers target, specdraft target loaded from its folder)."""
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**TARGETS[request.param])), seed=11)
    folder = tmp_path_factory.mktemp(f"target_{request.param}")
    ref.save_pretrained(folder)
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    return ref, model


def _assistant(target_ref, tmp_path_factory, name: str, **overrides):
    """(transformers assistant, its folder) for `target_ref`."""
    ref = randomize_(transformers.Gemma4AssistantForCausalLM(assistant_config(target_ref.config, **overrides)),
                     seed=12)
    folder = tmp_path_factory.mktemp(name)
    ref.save_pretrained(folder)
    return ref, folder


@pytest.mark.parametrize("clustered", [True, False], ids=["clustered", "dense"])
def test_drafter_matches_transformers_assistant(target, clustered, tmp_path_factory):
    ref_t, model = target
    ref_a, folder = _assistant(ref_t, tmp_path_factory, "assistant", use_ordered_embeddings=clustered)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    window = ref_t.config.sliding_window
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(13))
    p = 13  # query position: more than `window` keys before it

    # The target's K/V (0..p) and final-normed hidden state at p; ours must equal transformers'.
    cache = model.new_cache(2, 24)
    hidden = model(ids[:, : p + 1], cache)
    with torch.no_grad():
        out = ref_t(ids[:, : p + 1], return_shared_kv_states=True, output_hidden_states=True)
    depth = reduction_depth(model.config)
    assert_fp32_close(hidden, out.hidden_states[-1], depth)
    kv = {}
    for kind, src in ((SLIDING, drafter.sources[0]), (FULL, drafter.sources[-1])):
        k, v = cache.k[src.slot][:, :, : p + 1], cache.v[src.slot][:, :, : p + 1]
        assert_fp32_close(k, out.shared_kv_states[kind][0], depth)
        assert_fp32_close(v, out.shared_kv_states[kind][1], depth)
        lo = 0 if kind == FULL else p + 1 - window
        kv[kind] = (k[:, :, lo:], v[:, :, lo:])

    # Ours: three greedy draft steps at position p, recording what the head saw.
    seen = []
    head = drafter.logits

    def recording_head(z, state, copies=None):
        logits, cands = head(z, state, copies)
        seen.append((state.clone(), logits, cands))
        return logits, cands

    drafter.logits = recording_head
    drafter.greedy_pick = lambda *a: None  # picks in C what `logits` picks (test_mtp_internals.py)
    token = ids[:, p + 1]
    draft = drafter.propose(DraftInput(token, hidden[:, p], torch.full((2,), p), cache,
                                       torch.zeros(2, 24, dtype=torch.long), torch.ones(2, dtype=torch.bool)),
                            3, SamplingParams(), None)

    # transformers: the same three steps, fed its own previous token and state.
    tok, state = token[:, None], hidden[:, p : p + 1]
    for step in range(3):
        with torch.no_grad():
            o = ref_a(inputs_embeds=torch.cat([ref_t.get_input_embeddings()(tok), state], dim=-1),
                      position_ids=torch.full((2, 1), p), shared_kv_states=kv)
        logits = o.logits[:, 0]
        our_state, our_logits, cands = seen[step]
        # The drafter's steps add their own layers' sums to the target's.
        step_depth = depth + (step + 1) * reduction_depth(drafter.net.config)
        assert_fp32_close(our_state, o.last_hidden_state[:, 0], step_depth)
        if clustered:
            for row in range(2):  # the same clusters: exactly the tokens not filled with the mask value
                kept = (logits[row] > logits[row].min()).nonzero().flatten()
                assert sorted(cands[row].tolist()) == kept.tolist()
            assert_fp32_close(our_logits, logits.gather(1, cands), step_depth)
        else:
            assert cands is None
            assert_fp32_close(our_logits, logits, step_depth)
        tok, state = logits.argmax(-1, keepdim=True), o.last_hidden_state
        assert draft.tokens[:, step].tolist() == tok[:, 0].tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_transformers_greedy(target, k, tmp_path_factory):
    ref_t, model = target
    gen = torch.Generator().manual_seed(14)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (6, 11, 17)]
    expected = greedy_sequences(ref_t, prompts, 24)
    # A random assistant is never right; wire one to the target's continuations of two of the
    # prompts, so rounds accept some drafts and reject others.
    ref_a = transformers.Gemma4AssistantForCausalLM(assistant_config(ref_t.config))
    follow_transitions_(randomize_(ref_a, seed=15), ref_t, expected[:2])
    folder = tmp_path_factory.mktemp(f"assistant_k{k}")
    ref_a.save_pretrained(folder)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    results = Engine(model, drafter=drafter, draft_tokens=k).generate(prompts, max_new_tokens=24, eos_token_ids=[])
    assert [r.token_ids for r in results] == [s[len(p):] for s, p in zip(expected, prompts)]
    accepted = sum(r.stats.accepted for r in results)
    drafted = sum(r.stats.drafted for r in results)
    assert 0 < accepted < drafted


def test_mismatched_assistant_is_refused_by_name(target, tmp_path_factory):
    ref_t, model = target
    cases = {
        "backbone_hidden_size 48 != target hidden size 64": dict(backbone_hidden_size=48),
        "head_dim 16 != target layer": dict(text_global_head_dim=16),
        "KV heads 2 != target layer": dict(text_num_global_key_value_heads=2, text_attention_k_eq_v=True),
    }
    assert model.params.num_kv_heads[FULL] == 1 and model.params.head_dim[FULL] == 32
    for message, overrides in cases.items():
        _, folder = _assistant(ref_t, tmp_path_factory, "mismatch", **overrides)
        with pytest.raises(SpecdraftError, match=message):
            load_mtp_drafter(folder, model, torch.float32, "cpu")


def test_specdraft_written_drafter_reads_back_in_transformers(target, tmp_path):
    """Drafters specdraft trains use the same layout: transformers reads their per-type shapes
    as we do (full-layer KV heads included), and specdraft reads them back unchanged."""
    _, model = target
    cfg = drafter_config_for(model, hidden=32, layers=4, heads=4, clustered=True, num_centroids=8, top_k_clusters=2)
    save_network(init_network(cfg, model), tmp_path)
    hf = transformers.Gemma4AssistantConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    text = hf.get_text_config()
    full = text.layer_types.index(FULL)
    assert text.per_layer_config[full].head_dim == model.params.head_dim[FULL]
    assert text.per_layer_config[full].num_key_value_heads == model.params.num_kv_heads[FULL]
    drafter = load_mtp_drafter(tmp_path, model, torch.float32, "cpu")
    assert drafter.net.config.num_kv_heads == cfg.num_kv_heads and drafter.net.config.head_dim == cfg.head_dim
