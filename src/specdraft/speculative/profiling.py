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


def time_call(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one call of fn."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def fastest_each(calls: dict[Hashable, Callable[[], None]], device: torch.device,
                 repeats: int = PROFILE_REPEATS, budget: float | None = None) -> dict[Hashable, float]:
    """{key: the fastest of its timed calls}, the calls taken in turns, so that a slow stretch of
    the machine lands on every key alike instead of on a few. Each key is called `repeats` times;
    with a `budget`, a key stops sooner once its calls took `budget` seconds (but is called at
    least once): where one forward takes a large part of a second, more samples cost seconds and
    say little the first did not."""
    best = dict.fromkeys(calls, float("inf"))
    spent = dict.fromkeys(calls, 0.0)
    taken = dict.fromkeys(calls, 0)
    sampling = list(calls)
    while sampling:
        for key in sampling:
            seconds = time_call(calls[key], device)
            best[key] = min(best[key], seconds)
            spent[key] += seconds
            taken[key] += 1
        sampling = [key for key in sampling if taken[key] < repeats and (budget is None or spent[key] < budget)]
    return best


PHRASE = 40  # tokens of profile text before it repeats


def profile_tokens(vocab_size: int, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] token ids to time steps with: a random PHRASE-token phrase, repeated. Text is
    mostly predictable, and a model continuing a repeat is sure of its next token as it is on
    most real steps; on uniform random tokens its scores are flat, and the greedy head's exact
    screen (models/formats/screened_head.py) rescores thousands of near-ties, which real text
    rarely costs."""
    phrase = torch.randint(0, vocab_size, (rows, PHRASE), generator=torch.Generator().manual_seed(seed))
    return phrase.repeat(1, -(-length // PHRASE))[:, :length]


def scratch(model: torch.nn.Module, rows: int, top: int, ranked: int = 16):
    """(cache, last hidden states, token history, hidden states of the repeat): a cache of `rows`
    rows each holding PROFILE_CONTEXT positions of profile text, with room for `top` more, and
    the hidden states of at least `ranked` positions where the phrase repeats (the rows the head
    is timed on, head_calls).

    Only one row's first PHRASE + 2 * `ranked` tokens are prefilled; their keys and values are
    copied on to PROFILE_CONTEXT positions and to the other rows. A forward costs the same
    whichever keys it attends to, and at real sizes a prefill costs seconds a row."""
    dev = model.embed_tokens.weight.device
    ctx = min(PROFILE_CONTEXT, model.config.max_position_embeddings - top - 2)
    typed = min(ctx, PHRASE + 2 * ranked)
    cache = model.new_cache(rows, ctx + top + 2)
    tokens = profile_tokens(model.config.vocab_size, 1, ctx + top + 2, seed=0).to(dev)
    first = cache.rows(0, 1) if rows > 1 else cache
    states = model(tokens[:, :typed], first)
    for store in cache.k + cache.v:
        for at in range(typed, ctx, typed):
            n = min(typed, ctx - at)
            store[0, :, at : at + n] = store[0, :, :n]
    first.begin(ctx - typed)  # lengthen the row over the copies
    first.end()
    for r in range(1, rows):
        cache.copy_row(0, r)
    repeat = states[0, PHRASE:] if typed > PHRASE else states[0]
    return cache, states[:, -1].repeat(rows, 1), tokens.repeat(rows, 1), repeat


class Scratch:
    """scratch() for up to `rows` rows, built on first use and shared by every batch size timed:
    `rows(b)` is (cache, last hidden states, token history, states) for its first b rows."""

    def __init__(self, model: torch.nn.Module, rows: int, top: int, ranked: int = 16):
        self.model, self.size, self.top, self.ranked = model, rows, top, ranked
        self.built: tuple | None = None

    def rows(self, b: int) -> tuple:
        if self.built is None:
            self.built = scratch(self.model, self.size, self.top, self.ranked)
        cache, hidden, tokens, states = self.built
        return (cache.rows(0, b) if b < cache.batch_size else cache), hidden[:b], tokens[:b], states


def target_calls(model: torch.nn.Module, cache, widths: list[int]) -> dict[int, Callable[[], None]]:
    """{w: one forward of w tokens per row} from the cache's current lengths (the head is timed
    apart: head_calls). Each call rolls the cache back first; the caller rolls it back after the
    last."""
    dev, start = model.embed_tokens.weight.device, list(cache.host_lengths)
    calls = {}
    for w in widths:
        tokens = profile_tokens(model.config.vocab_size, cache.batch_size, max(start) + w, seed=0)
        tokens = tokens[:, -w:].to(dev)  # the phrase's continuation: what a draft that is right would be

        def forward(tokens=tokens) -> None:
            cache.rollback(start)
            model(tokens, cache)

        calls[w] = forward
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
        calls[m] = lambda rows=rows: model.greedy_tokens(rows)
    return calls


def drafter_calls(drafter: Drafter, cache, hidden: torch.Tensor, tokens: torch.Tensor, steps: int
                  ) -> dict[int, Callable[[], None]]:
    """{n: a drafting round of n steps for the cache's rows} for n in (1, steps): their difference
    gives the seconds per drafter step, the rest the fixed seconds per round. Each call rolls the
    cache back first (the target's timed forwards write past its lengths). The caller calls them
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

    return {1: lambda: propose(1), steps: lambda: propose(steps)}
