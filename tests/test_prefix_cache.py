"""The prefix cache (speculative/prefix_cache.py): a request that starts with a finished
request's tokens restores their K/V and prefills only the rest, with the same output as an
engine without the cache (greedy, and sampled with a per-request seed), Gemma 4's rings and the
MTP drafter included; a prefix further back than a ring keeps is passed over, never restored
wrong; the store stays within its bytes, least recently used evicted first. Exact reuse (the
server's) restores only whole prefill chunks of earlier prompts where a chunk's width changes the
arithmetic, and any prefix, replies included, where each position is computed alone (int8-activation
weights: the bits of every position checked against other chunkings); the chat's (exact=False)
reuses every position, replies included.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, prompts_of
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp_lookup import MTPWithLookup
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine
from specdraft.speculative.prefix_cache import PrefixCache
from specdraft.speculative.request import Request

BIG = 1 << 30


def run(engine: Engine, prompt: list[int], n: int, sampling: SamplingParams = SamplingParams()):
    engine.add(Request(prompt, n, sampling, eos_token_ids=[]))
    done = []
    while engine.has_work():
        done += engine.step()
    (result,) = done
    return result


def conversation(engine: Engine, first: list[int], turns: list[list[int]], n: int,
                 sampling: SamplingParams = SamplingParams()):
    """Each turn's prompt is the previous prompt + its reply + the new turn's tokens."""
    prompt, results = first, []
    for extra in [[]] + turns:
        prompt = prompt + extra
        r = run(engine, prompt, n, sampling)
        results.append(r)
        prompt = prompt + r.token_ids
    return results


@pytest.fixture(scope="module")
def mtp_folder(gemma_tiny: TinyModel, tmp_path_factory):
    cfg = drafter_config_for(gemma_tiny.ours, hidden=32, layers=2, heads=4, head="target", clustered=True,
                             num_centroids=16, top_k_clusters=4)
    folder = tmp_path_factory.mktemp("prefix_mtp") / "mtp"
    save_network(init_network(cfg, gemma_tiny.ours, seed=3, std=0.1), folder)
    return folder


def _engine(tiny: TinyModel, drafter: str, mtp_folder, cache: PrefixCache | None, chunk: int = 16) -> Engine:
    model = tiny.ours
    d = None
    if drafter != "none":
        mtp = load_mtp_drafter(mtp_folder, model, torch.float32, "cpu")
        d = MTPWithLookup(mtp) if drafter == "mtp+ngram" else mtp
    return Engine(model, drafter=d, draft_tokens=3, max_batch_size=2, capacity=400, prefill_chunk=chunk,
                  prefix_cache=cache)


@pytest.mark.parametrize("drafter", ["none", "mtp", "mtp+ngram"])
def test_next_turn_prefills_only_its_own_tokens_and_keeps_the_output(gemma_tiny, mtp_folder, drafter):
    first, *turns = prompts_of([40, 7, 12], gemma_tiny.cfg.vocab_size, seed=11)
    plain = conversation(_engine(gemma_tiny, drafter, mtp_folder, None), first, turns, 20)
    store = PrefixCache(BIG, exact=False)
    cached = conversation(_engine(gemma_tiny, drafter, mtp_folder, store), first, turns, 20)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert cached[0].stats.cached_tokens == 0
    for before, r, extra in zip(cached, cached[1:], turns):
        # Everything but the previous reply's last token (never in the cache) and the new turn.
        assert r.stats.cached_tokens == len(before.prompt_ids) + len(before.token_ids) - 1
        assert len(r.prompt_ids) - r.stats.cached_tokens == len(extra) + 1
    assert store.hits == 2 and len(store) == 1  # each turn's entry replaced the one it extends


def test_sampled_output_with_a_seed_is_unchanged(gemma_tiny, mtp_folder):
    first, *turns = prompts_of([30, 9], gemma_tiny.cfg.vocab_size, seed=12)
    sampling = SamplingParams(temperature=1.0, seed=5)
    plain = conversation(_engine(gemma_tiny, "mtp", mtp_folder, None), first, turns, 24, sampling)
    cached = conversation(_engine(gemma_tiny, "mtp", mtp_folder, PrefixCache(BIG, exact=False)), first, turns, 24,
                          sampling)
    assert cached[1].stats.cached_tokens > 0
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]


def test_shared_prefix_of_a_longer_prompt_and_the_negative_control(gemma_tiny, mtp_folder):
    """Two prompts sharing their first 60 tokens: the second restores the 48 of them that the first
    prefilled in whole chunks of 16, and prefills on from there as an uncached engine does.
    Spoiling the saved K/V changes the output: the restored K/V is what the answer reads."""
    shared, a, b = prompts_of([60, 20, 15], gemma_tiny.cfg.vocab_size, seed=13)
    plain = _engine(gemma_tiny, "none", mtp_folder, None)
    expected = run(plain, shared + b, 20).token_ids
    store = PrefixCache(BIG)
    engine = _engine(gemma_tiny, "none", mtp_folder, store)
    run(engine, shared + a, 10)
    r = run(engine, shared + b, 20)
    assert r.stats.cached_tokens == 48 and r.token_ids == expected
    with torch.inference_mode():
        for e in store._entries.values():
            for t in e.snapshot.k:
                t.mul_(-1.0)
    spoiled = run(engine, shared + b, 20)
    assert spoiled.stats.cached_tokens == 64 and spoiled.token_ids != expected  # 75 prompt tokens: 4 chunks


def test_store_stays_within_its_bytes_least_recently_used_first(gemma_tiny, mtp_folder):
    ps = prompts_of([50, 50, 50], gemma_tiny.cfg.vocab_size, seed=14)
    probe = PrefixCache(BIG, exact=False)
    engine = _engine(gemma_tiny, "none", mtp_folder, probe)
    run(engine, ps[0], 5)
    one = probe.bytes  # one finished row of 54 positions
    store = PrefixCache(int(one * 2.5), exact=False)
    engine = _engine(gemma_tiny, "none", mtp_folder, store)
    run(engine, ps[0], 5)
    run(engine, ps[1], 5)
    assert run(engine, ps[0] + [5], 5).stats.cached_tokens == 50  # ps[0] is now the most recent
    assert len(store) == 2  # ps[0] + its reply replaced ps[0]'s entry
    run(engine, ps[2], 5)  # evicts ps[1]'s entry, the least recently used
    assert store.bytes <= store.max_bytes and len(store) == 2
    assert run(engine, ps[1] + [7], 5).stats.cached_tokens == 0
    assert run(engine, ps[2] + [7], 5).stats.cached_tokens == 50
    tiny = PrefixCache(one // 2, exact=False)  # an entry larger than the whole store is not kept
    engine = _engine(gemma_tiny, "none", mtp_folder, tiny)
    run(engine, ps[0], 5)
    assert len(tiny) == 0


# --------------------------------------------------------------------------- Gemma 4 rings

@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from gemma4_tiny import assistant_config, randomize_, target_text_config
    from specdraft.loading import load_folder

    folder = tmp_path_factory.mktemp("prefix_gemma4")
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config()), seed=31)
    ref.save_pretrained(folder / "target")
    assistant = randomize_(transformers.Gemma4AssistantForCausalLM(assistant_config(ref.config)), seed=32)
    assistant.save_pretrained(folder / "assistant")
    model, _, _ = load_folder(folder / "target", torch.float32, "cpu")
    return model, folder / "assistant"


@pytest.mark.parametrize("with_drafter", [False, True])
def test_gemma4_rings_restore_a_conversation(gemma4, with_drafter):
    """Sliding window 8, prefill chunks of 4: rings of 12 slots wrap many times over 60-token
    turns; a next turn restores the whole conversation and decodes the same tokens."""
    model, assistant = gemma4

    def engine(store):
        d = load_mtp_drafter(assistant, model, torch.float32, "cpu") if with_drafter else None
        e = Engine(model, drafter=d, draft_tokens=3, max_batch_size=2, capacity=300, prefill_chunk=4,
                   prefix_cache=store)
        return e

    first, *turns = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                     for n in (37, 5, 9)]
    plain = conversation(engine(None), first, turns, 25)
    cached = conversation(engine(PrefixCache(BIG, exact=False)), first, turns, 25)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert cached[2].stats.cached_tokens == len(cached[1].prompt_ids) + len(cached[1].token_ids) - 1


def test_gemma4_prefix_further_back_than_a_ring_is_passed_over(gemma4):
    """A snapshot whose rings no longer hold the window before the shared prefix's end cannot
    restore it: the request prefills from the start, with the same output."""
    model, _ = gemma4
    gen = torch.Generator().manual_seed(40)
    shared, a, b = (torch.randint(3, 250, (n,), generator=gen).tolist() for n in (20, 30, 6))
    expected = run(Engine(model, capacity=300, prefill_chunk=4), shared + b, 12).token_ids
    store = PrefixCache(BIG, exact=False)
    engine = Engine(model, capacity=300, prefill_chunk=4, prefix_cache=store)
    run(engine, shared + a, 8)  # the rings (12 slots) end 37 positions past the shared 20
    r = run(engine, shared + b, 12)
    assert r.stats.cached_tokens == 0 and r.token_ids == expected
    run(engine, shared + b + r.token_ids, 1)  # near its end a snapshot restores
    near = run(engine, shared + b + r.token_ids + [9], 12)
    assert near.stats.cached_tokens == len(shared + b + r.token_ids)


def test_exact_reuse_restores_whole_chunks_of_earlier_prompts_only(gemma_tiny, mtp_folder):
    """A next turn in exact mode: nothing of the reply (decoded, not prefilled) and no part-chunk is
    restored, so every position holds what an uncached prefill computes; the output is the same."""
    first, *turns = prompts_of([40, 7, 12], gemma_tiny.cfg.vocab_size, seed=11)
    plain = conversation(_engine(gemma_tiny, "mtp", mtp_folder, None), first, turns, 20)
    cached = conversation(_engine(gemma_tiny, "mtp", mtp_folder, PrefixCache(BIG)), first, turns, 20)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    for before, r in zip(cached, cached[1:]):
        assert r.stats.cached_tokens == len(before.prompt_ids) - len(before.prompt_ids) % 16 > 0


# --------------------------------------------------------------------------- any prefix, exactly

@pytest.fixture(scope="module")
def q8_gemma(gemma_tiny: TinyModel) -> TinyModel:
    """gemma_tiny with every matrix in 8-bit blocks against int8 activations (--weights q8): the
    kernels the default model runs, each position computed alone at any chunk width."""
    from conftest import load_ours
    from specdraft.models.formats import q8_act_linear
    from specdraft.models.formats.quant import compact_weights

    if not q8_act_linear.kernel_available():
        pytest.skip("the int8-activation kernel does not build here")
    model, cfg = load_ours(gemma_tiny.folder)
    compact_weights(model, "q8")
    return TinyModel("gemma3", gemma_tiny.folder, gemma_tiny.hf, model, cfg)


def _prefill(model, ids: list[int], bounds: list[int]):
    """Prefill `ids` in the chunks `bounds` marks: the hidden states and every layer's K and V."""
    cache = model.new_cache(1, len(ids) + 16)
    t = torch.tensor([ids])
    with torch.inference_mode():
        hidden = torch.cat([model(t[:, a:b], cache) for a, b in zip(bounds, bounds[1:])], dim=1)
    n = len(ids)
    return [hidden] + [x[:, :, :n] for x in cache.k] + [x[:, :, :n] for x in cache.v]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_each_position_gets_the_same_bits_in_any_chunks_and_the_negative_control(q8_gemma, gemma_tiny, monkeypatch):
    """300 tokens past a sliding window of 8: chunks of 64 from 0, chunks starting anywhere,
    one-token steps at the end, and chunks at or under the step kernels' width give every
    position's K/V and hidden state the same bits. Key spans of wide chunks that start where the
    window does (not on a multiple of the attention kernel's key chunk, as short forwards' do)
    break it: the check sees it."""
    from specdraft import kv_cache

    model = q8_gemma.ours
    (ids,) = prompts_of([300], q8_gemma.cfg.vocab_size, seed=21)
    assert model.prefill_rows_alone(model.new_cache(1, 8))
    assert not gemma_tiny.ours.prefill_rows_alone(gemma_tiny.ours.new_cache(1, 8))  # float32 GEMMs: no
    chunkings = ([0, 100, 164, 228, 292, 300], [0, 37, 53, 250, 297, 298, 299, 300], list(range(0, 300, 16)) + [300])
    reference = _prefill(model, ids, [0, 64, 128, 192, 256, 300])
    for bounds in chunkings:
        assert _same_bits(_prefill(model, ids, bounds), reference), bounds
    monkeypatch.setattr(kv_cache, "SPAN_BLOCK", 1)
    reference = _prefill(model, ids, [0, 64, 128, 192, 256, 300])
    assert not all(_same_bits(_prefill(model, ids, bounds), reference) for bounds in chunkings)


def _q8_engine(tiny: TinyModel, drafter: str, mtp_folder, cache: PrefixCache | None) -> Engine:
    d = load_mtp_drafter(mtp_folder, tiny.ours, torch.float32, "cpu") if drafter == "mtp" else None
    return Engine(tiny.ours, drafter=d, draft_tokens=3, max_batch_size=2, capacity=400, prefill_chunk=64,
                  prefix_cache=cache)


def test_exact_reuse_restores_a_prefix_ending_mid_chunk_where_positions_are_computed_alone(q8_gemma, mtp_folder):
    """Exact reuse on a model whose prefill computes each position alone: a shared prefix of 150
    tokens (mid-chunk: chunks of 64) is restored whole, and the answer is the uncached engine's."""
    shared, a, b = prompts_of([150, 20, 15], q8_gemma.cfg.vocab_size, seed=22)
    expected = run(_q8_engine(q8_gemma, "none", mtp_folder, None), shared + b, 20).token_ids
    engine = _q8_engine(q8_gemma, "none", mtp_folder, PrefixCache(BIG))
    run(engine, shared + a, 10)
    r = run(engine, shared + b, 20)
    assert r.stats.cached_tokens == 150 and r.token_ids == expected


@pytest.mark.parametrize("drafter", ["none", "mtp"])
def test_exact_reuse_restores_a_whole_conversation_where_positions_are_computed_alone(q8_gemma, mtp_folder,
                                                                                       drafter):
    """A next turn restores the previous prompt and reply (decoded positions hold a prefill's
    bits too), and every turn's tokens equal an uncached engine's, speculative or plain."""
    first, *turns = prompts_of([170, 7, 12], q8_gemma.cfg.vocab_size, seed=23)
    plain = conversation(_q8_engine(q8_gemma, "none", mtp_folder, None), first, turns, 20)
    cached = conversation(_q8_engine(q8_gemma, drafter, mtp_folder, PrefixCache(BIG)), first, turns, 20)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    for before, r in zip(cached, cached[1:]):
        assert r.stats.cached_tokens == len(before.prompt_ids) + len(before.token_ids) - 1
