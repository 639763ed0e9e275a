"""The KV cache: chunked forwards, rollback, ragged batches and sliding windows (fp32).

The tiny Gemma model has a sliding window of 8 on two of its three layers, so every sequence
here (up to ~45 tokens) runs far past the window.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, assert_fp32_close, prompts_of, reduction_depth
from specdraft.speculative.engine import Engine


def forward_chunks(model, ids: list[int], chunks: list[int], capacity: int = 64) -> torch.Tensor:
    """Logits [T, V] of `ids` fed through one cache in chunks of the given sizes."""
    assert sum(chunks) == len(ids)
    cache = model.new_cache(1, capacity)
    out, start = [], 0
    with torch.inference_mode():
        for n in chunks:
            out.append(model.logits(model(torch.tensor([ids[start : start + n]]), cache))[0])
            start += n
    assert int(cache.lengths[0]) == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("name", ["gemma_tiny", "llama_tiny"])
def test_one_forward_equals_token_by_token(name: str, request) -> None:
    tiny: TinyModel = request.getfixturevalue(name)
    ids = prompts_of([30], tiny.cfg.vocab_size, seed=5)[0]
    whole = forward_chunks(tiny.ours, ids, [30])
    stepwise = forward_chunks(tiny.ours, ids, [1] * 30)
    mixed = forward_chunks(tiny.ours, ids, [7, 1, 5, 9, 2, 6])
    depth = reduction_depth(tiny.cfg)
    assert_fp32_close(stepwise, whole, depth)
    assert_fp32_close(mixed, whole, depth)
    assert torch.equal(whole.argmax(-1), stepwise.argmax(-1))
    # And all of them are the reference model's logits.
    assert_fp32_close(whole, tiny.hf_logits(ids), depth)


def test_rollback_then_reforward_equals_never_forwarded(gemma_tiny: TinyModel) -> None:
    """Junk written past the kept length and rolled back leaves no trace: bit-identical logits."""
    model = gemma_tiny.ours
    ids = prompts_of([32], gemma_tiny.cfg.vocab_size, seed=6)[0]
    junk = prompts_of([10], gemma_tiny.cfg.vocab_size, seed=7)[0]
    # Reference: 20 tokens, then 6, then 6, never any junk.
    clean = forward_chunks(model, ids, [20, 6, 6])
    cache = model.new_cache(1, 64)
    got = []
    with torch.inference_mode():
        got.append(model.logits(model(torch.tensor([ids[:20]]), cache))[0])
        model(torch.tensor([junk]), cache)  # 10 junk tokens at 20..29 (past the window of 8)
        cache.rollback(torch.tensor([20]))
        assert int(cache.lengths[0]) == 20
        got.append(model.logits(model(torch.tensor([ids[20:26]]), cache))[0])
        model(torch.tensor([junk[:4]]), cache)  # rejected "drafts" at 26..29
        cache.rollback(torch.tensor([26]))
        got.append(model.logits(model(torch.tensor([ids[26:32]]), cache))[0])
    assert torch.equal(torch.cat(got), clean)


def test_rollback_never_lengthens(gemma_tiny: TinyModel) -> None:
    cache = gemma_tiny.ours.new_cache(2, 16)
    with torch.inference_mode():
        gemma_tiny.ours(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache)
    cache.rollback(torch.tensor([1, 9]))
    assert cache.lengths.tolist() == [1, 3]


def test_cache_capacity_is_enforced(gemma_tiny: TinyModel) -> None:
    cache = gemma_tiny.ours.new_cache(1, 4)
    with pytest.raises(ValueError, match="capacity"):
        with torch.inference_mode():
            gemma_tiny.ours(torch.tensor([[5, 6, 7, 8, 9]]), cache)


def test_per_row_rollback_in_a_batch(gemma_tiny: TinyModel) -> None:
    """Rows rolled back to different lengths continue exactly as their own sequences."""
    model = gemma_tiny.ours
    v = gemma_tiny.cfg.vocab_size
    seqs = prompts_of([40, 40, 40], v, seed=8)
    keep = [13, 21, 9]
    cache = model.new_cache(3, 64)
    with torch.inference_mode():
        model(torch.tensor([s[:24] for s in seqs]), cache)  # everyone writes 24 tokens
        cache.rollback(torch.tensor(keep))  # rows keep different prefixes
        # Continue each row with its own next 12 tokens (a ragged write at different positions).
        cont = torch.tensor([s[k : k + 12] for s, k in zip(seqs, keep)])
        logits = model.logits(model(cont, cache))
    for i, (s, k) in enumerate(zip(seqs, keep)):
        ref = gemma_tiny.hf_logits(s[: k + 12])[k:]
        assert_fp32_close(logits[i], ref, reduction_depth(gemma_tiny.cfg))


def test_sliding_window_through_speculative_rounds(gemma_tiny: TinyModel) -> None:
    """Simulate rounds of verify-then-rollback far past the window: every kept position's
    logits equal the reference model's on the full sequence."""
    model, v = gemma_tiny.ours, gemma_tiny.cfg.vocab_size
    window = gemma_tiny.cfg.sliding_window
    seq = prompts_of([48], v, seed=9)[0]
    junk = prompts_of([200], v, seed=10)[0]
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, 80)
    kept_logits = {}
    with torch.inference_mode():
        length = 5
        out = model.logits(model(torch.tensor([seq[:length]]), cache))[0]
        for t in range(length):
            kept_logits[t] = out[t]
        j = 0
        while length < len(seq) - 4:
            # A round: [b, d1..d3] where only the first n drafts are "accepted" (true tokens).
            n = int(torch.randint(0, 4, (1,), generator=g))
            block = seq[length : length + 1 + n] + junk[j : j + 3 - n]
            j += 3
            out = model.logits(model(torch.tensor([block]), cache))[0]
            for t in range(n + 1):
                kept_logits[length + t] = out[t]
            length += n + 1
            cache.rollback(torch.tensor([length]))
    assert length > 4 * window
    ref = gemma_tiny.hf_logits(seq[:length])
    got = torch.stack([kept_logits[t] for t in range(length)])
    assert_fp32_close(got, ref, reduction_depth(gemma_tiny.cfg))


@pytest.mark.parametrize("name", ["gemma_tiny", "llama_tiny"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_ragged_batch_equals_each_prompt_alone(name: str, drafter: str, request) -> None:
    from specdraft.drafters.ngram import NgramDrafter

    tiny: TinyModel = request.getfixturevalue(name)
    prompts = prompts_of([3, 17, 1, 9, 25], tiny.cfg.vocab_size, seed=12)
    engine = Engine(tiny.ours, None, NgramDrafter() if drafter == "ngram" else None, 3)
    together = engine.generate(prompts, 24, eos_token_ids=[])
    for p, r in zip(prompts, together):
        alone = engine.generate([p], 24, eos_token_ids=[])[0]
        assert r.token_ids == alone.token_ids
        assert len(r.token_ids) == 24


def test_engine_plain_greedy_matches_reference(gemma_tiny: TinyModel) -> None:
    """Plain decoding through the cache = greedy decoding by re-running the HF model from scratch
    on the whole sequence (no cache at all), past the sliding window."""
    from conftest import greedy_reference

    prompts = prompts_of([4, 11], gemma_tiny.cfg.vocab_size, seed=13)
    results = Engine(gemma_tiny.ours).generate(prompts, 20, eos_token_ids=[])
    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_reference(gemma_tiny, p, 20)
