"""Sliding layers' KV in a ring of their window (kv_cache.py): same results, window-sized memory.

Gemma 4 tiny configs (sliding window 8) against transformers in float32: prompts and
generations run far past window + max_forward, so every ring wraps many times, rollbacks after
rejected drafts leave stale slots behind, and ragged batches put rows at different ring offsets.
"""

from __future__ import annotations

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
from specdraft.drafters.base import DraftInput  # noqa: E402
from specdraft.drafters.mtp import load_mtp_drafter  # noqa: E402
from specdraft.kv_cache import KVCache, ring_positions  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.models.compile import CompiledStep  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

WINDOW = 8
TARGETS = {"ple_kv_shared": {}, "moe": moe_overrides()}


@pytest.fixture(scope="module", params=list(TARGETS))
def pair(request, tmp_path_factory):
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**TARGETS[request.param])), seed=21)
    folder = tmp_path_factory.mktemp(f"ring_{request.param}")
    ref.save_pretrained(folder)
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    assert model.config.sliding_window == WINDOW
    return ref, model


def test_ring_positions_name_what_each_slot_holds():
    size, ends = 5, torch.tensor([0, 3, 5, 12])
    held = ring_positions(size, ends, size)
    for row, end in enumerate(ends.tolist()):
        slots = [-1] * size
        for p in range(end):
            slots[p % size] = p
        assert [p if p >= 0 else -1 for p in held[row].tolist()] == slots


def test_sliding_slots_keep_window_plus_max_forward(pair):
    _, model = pair
    cache = model.new_cache(2, 512, max_forward=4)
    linear = model.new_cache(2, 512)
    for slot, layer in enumerate(model.kv_layers()):
        sliding = model.windows[model.config.layer_types[layer]] is not None
        assert cache.k[slot].shape[2] == (WINDOW + 4 if sliding else 512)
        assert cache.rings[slot] == (WINDOW + 4 if sliding else None)
    assert cache.nbytes() < linear.nbytes()
    # a drafter that looks further back widens the ring; a cache no longer than a ring keeps none
    assert max(r or 0 for r in model.new_cache(1, 512, max_forward=4, reads_window=20).rings) == 24
    assert all(r is None for r in model.new_cache(1, WINDOW + 4, max_forward=4).rings)


def _chunked_logits(model, ids: torch.Tensor, chunk: int, redo: int) -> torch.Tensor:
    """Logits of ids in forwards of `chunk` tokens; after each, the last `redo` tokens are rolled
    back and written again (a verify whose drafts were rejected)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + chunk, max_forward=chunk)
    assert any(r is not None for r in cache.rings)
    out, at = [], 0
    while at < ids.shape[1]:
        n = min(chunk, ids.shape[1] - at)
        model(ids[:, at : at + n], cache)
        if redo and n > redo:
            cache.rollback([at + n - redo] * ids.shape[0])
            model(ids[:, at + n - redo : at + n], cache)
        cache.rollback([at] * ids.shape[0])  # the last pass's logits, as one forward of n tokens
        out.append(model.logits(model(ids[:, at : at + n], cache)))
        at += n
    return torch.cat(out, dim=1)


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
@pytest.mark.parametrize("chunk, redo", [(1, 0), (4, 2), (6, 5)])
def test_ring_logits_match_transformers(pair, chunk, redo):
    ref, model = pair
    ids = torch.randint(3, 250, (2, 41), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        expected = ref(ids).logits
    assert_fp32_close(_chunked_logits(model, ids, chunk, redo), expected, reduction_depth(model.config))


def test_compiled_step_logic_reads_the_ring_like_the_cache(pair):
    """The function a compiled step traces (positions only, no host state) against the eager
    path, on a wrapped ring with rows at different lengths."""
    _, model = pair
    ids = torch.randint(3, 250, (2, 30), generator=torch.Generator().manual_seed(23))
    cache = model.new_cache(2, 64, max_forward=4)
    for at in range(0, 28, 4):
        model(ids[:, at : at + 4], cache)
    cache.rollback([28, 25])
    twin = model.new_cache(2, 64, max_forward=4)
    for a, b in zip(twin.k + twin.v, cache.k + cache.v):
        a.copy_(b)
    twin.rollback([0, 0])
    twin._written[:] = cache._written[:]
    twin._set_lengths({0: 28, 1: 25})
    step = CompiledStep(model, announce=False)
    tokens = ids[:, 26:29]
    positions = twin.begin(3)
    traced = step._run(tokens, positions, twin.span_end, twin.k, twin.v, tuple(twin.rings),
                       tuple(sorted(twin.ring_of_window.items())))
    eager = model(tokens, cache)
    assert_fp32_close(traced, eager, reduction_depth(model.config))
    for a, b in zip(twin.k + twin.v, cache.k + cache.v):
        assert torch.equal(a, b)


def test_misuse_of_a_ring_is_refused():
    cache = KVCache([(1, 4), (1, 4)], 1, 64, torch.float32, windows=[8, None], max_forward=4)
    with pytest.raises(ValueError, match="wider than the rings allow"):
        cache.begin(5)
    for _ in range(5):
        cache.begin(4)
        cache.end()
    cache.rollback([16])  # back over one forward: fine
    with pytest.raises(ValueError, match="rollback past 4 tokens"):
        cache.rollback([15])


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
@pytest.mark.parametrize("k", [1, 3])
def test_engine_with_rings_equals_transformers_greedy(pair, k, tmp_path_factory):
    """Plain and speculative decoding with rings (prefill chunks of 4, so rings of 12 slots)
    give transformers' greedy tokens, ragged batch included."""
    ref_t, model = pair
    gen = torch.Generator().manual_seed(24)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 14, 23)]
    expected = [s[len(p):] for s, p in zip(greedy_sequences(ref_t, prompts, 30), prompts)]
    plain = Engine(model, prefill_chunk=4).generate(prompts, max_new_tokens=30, eos_token_ids=[])
    assert [r.token_ids for r in plain] == expected
    ref_a = transformers.Gemma4AssistantForCausalLM(assistant_config(ref_t.config))
    follow_transitions_(randomize_(ref_a, seed=25), ref_t, [p + e for p, e in zip(prompts[:2], expected[:2])])
    folder = tmp_path_factory.mktemp(f"ring_assistant_k{k}")
    ref_a.save_pretrained(folder)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    engine = Engine(model, drafter=drafter, draft_tokens=k, prefill_chunk=4)
    spec = engine.generate(prompts, max_new_tokens=30, eos_token_ids=[])
    assert engine.cache_bytes < model.new_cache(4, engine.capacity).nbytes()
    assert [r.token_ids for r in spec] == expected
    accepted = sum(r.stats.accepted for r in spec)
    assert 0 < accepted < sum(r.stats.drafted for r in spec)


@pytest.mark.usefixtures("float32_kv")  # float32: the two caches then differ in summation order only
def test_drafter_reads_a_wrapped_ring_like_the_whole_cache(pair, tmp_path_factory):
    """The drafter over a wrapped ring gives the distributions it gives over the whole cache. The
    two caches hold the same keys in different slot orders, so the target's hidden states and the
    drafter's distributions agree to float rounding, not to the bit (a chained greedy draft can
    flip on a near tie): drafts are sampled with one seed and their distributions compared
    position by position while the drawn tokens agree."""
    ref_t, model = pair
    ref_a = randomize_(transformers.Gemma4AssistantForCausalLM(assistant_config(ref_t.config)), seed=26)
    folder = tmp_path_factory.mktemp("ring_reader")
    ref_a.save_pretrained(folder)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    ids = torch.randint(3, 250, (2, 33), generator=torch.Generator().manual_seed(27))
    drafts = []
    for max_forward in (None, 4):
        cache = model.new_cache(2, 40, max_forward=max_forward)
        for at in range(0, 32, 4):
            hidden = model(ids[:, at : at + 4], cache)
        cache.rollback([32, 29])
        assert (max_forward is None) == all(r is None for r in cache.rings)
        # row 0 holds positions 0..31, row 1 0..28 (its last three rolled back)
        state = torch.stack([hidden[0, -1], hidden[1, -4]])
        last = torch.stack([ids[0, 32], ids[1, 29]])
        inp = DraftInput(last_token=last, hidden=state, position=torch.tensor([31, 28]), cache=cache,
                         tokens=ids, active=torch.ones(2, dtype=torch.bool))
        with drafter.without_early_stop():
            drafts.append(drafter.propose(inp, 4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(28)))
    whole, ring = drafts
    dense = [d.probs.dense() if hasattr(d.probs, "dense") else d.probs for d in drafts]
    compared = 0
    for pos in range(4):
        torch.testing.assert_close(dense[1][:, pos], dense[0][:, pos], atol=1e-4, rtol=0)
        compared += 1
        if not torch.equal(whole.tokens[:, pos], ring.tokens[:, pos]):
            break
    assert compared >= 2 and dense[0][:, 0].max() < 0.9  # spread enough to catch a misread slot
