"""Timing target forwards, greedy head calls and drafting rounds on scratch state.

The cost model (costs.py) and `specdraft steps` (bench/steps.py) time with these: calls taken
in turns, the fastest of each counting, on a scratch cache of profile text that the model is as
sure of as it is of most real text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

from specdraft.drafters.base import Drafter, DraftInput
from specdraft.sampling import SamplingParams

PROFILE_CONTEXT = 128  # cached tokens in the scratch cache the costs are timed over
# Timed calls per cell, taken in turns across every cell of a batch size; the fastest counts
# (other processes only add time). Timed one cell after another, a slow stretch of the machine
# landed on a few cells only (BENCHMARKS.md, "The draft policy on a slow CPU: MTP rows learnt
# slowly, costs timed in turns").
PROFILE_REPEATS = 6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest_each(calls: dict[Hashable, Callable[[], None]], device: torch.device,
                 repeats: int = PROFILE_REPEATS) -> dict[Hashable, float]:
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
    screen (models/formats/screened_head.py) rescores thousands of near-ties, which real text
    rarely costs."""
    phrase = torch.randint(0, vocab_size, (rows, 40), generator=torch.Generator().manual_seed(seed))
    return phrase.repeat(1, -(-length // 40))[:, :length]


def scratch(model: torch.nn.Module, rows: int, top: int):
    """(cache, last hidden states, token history, every position's hidden state): a cache holding
    PROFILE_CONTEXT tokens of profile text per row, with room for `top` more."""
    dev = model.embed_tokens.weight.device
    ctx = min(PROFILE_CONTEXT, model.config.max_position_embeddings - top - 2)
    cache = model.new_cache(rows, ctx + top + 2)
    tokens = profile_tokens(model.config.vocab_size, rows, ctx + top + 2, seed=0).to(dev)
    states = model(tokens[:, :ctx], cache)
    return cache, states[:, -1], tokens, states.reshape(-1, states.shape[-1])


def target_calls(model: torch.nn.Module, cache, widths: list[int]) -> dict[int, Callable[[], None]]:
    """{w: one forward of w tokens per row} from the cache's current lengths (the head is timed
    apart: head_calls). Each call rolls the cache back first."""
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
    decoding is mostly sure of its next token, and the exact greedy head
    (models/formats/screened_head.py) costs what such a step costs; on unsure rows thousands of
    tokens tie within the screen's bound and the head reads the table a second time
    (BENCHMARKS.md, "Weights fetched ahead, attention by query blocks, the head timed on sure
    rows")."""
    gaps = []
    for chunk in states.split(16):  # 16 rows of full scores at a time: 16 MB for a 262k vocabulary
        best = model.logits(chunk).topk(min(2, model.config.vocab_size), dim=-1).values
        gaps.append(best[:, 0] - best[:, -1])
    return states[torch.cat(gaps).argsort(descending=True, stable=True)]


def first_rows(rows: torch.Tensor, m: int) -> torch.Tensor:
    """The first m of `rows`, cycled when m exceeds them."""
    return rows.repeat(-(-m // rows.shape[0]), 1)[:m]


def head_calls(model: torch.nn.Module, states: torch.Tensor, sizes: list[int]) -> dict[int, Callable[[], None]]:
    """{m: model.greedy_tokens over m hidden rows of profile text} for each m in `sizes`: the rows
    it is surest about (by_confidence)."""
    calls, ranked = {}, by_confidence(model, states)
    for m in sizes:
        rows = first_rows(ranked, m)
        model.greedy_tokens(rows)  # warm-up
        calls[m] = lambda rows=rows: model.greedy_tokens(rows)
    return calls


def drafter_calls(drafter: Drafter, cache, hidden: torch.Tensor, tokens: torch.Tensor, steps: int
                  ) -> dict[int, Callable[[], None]]:
    """{n: a drafting round of n steps for the cache's rows} for n in (1, steps): their difference
    gives the seconds per drafter step, the rest the fixed seconds per round. Each call rolls the
    cache back first (the target's timed forwards write past its lengths). The caller times them
    under drafter.without_early_stop()."""
    stepping = drafter.step_drafter()
    rows, start = cache.batch_size, list(cache.host_lengths)
    dev = tokens.device
    position = torch.tensor(start, device=dev) - 1
    active = torch.ones(rows, dtype=torch.bool, device=dev)
    inp = DraftInput(tokens[:, start[0]], hidden, position, cache, tokens, active)
    stepping.prepare(rows, cache.capacity)
    for r in range(rows):
        stepping.reset_row(r)
    greedy = SamplingParams()

    def propose(n: int) -> None:
        cache.rollback(start)
        stepping.propose(inp, n, greedy, None)

    with drafter.without_early_stop():
        propose(steps)  # warm-up
    return {1: lambda: propose(1), steps: lambda: propose(steps)}
