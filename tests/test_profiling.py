"""The first-use step-cost profile under its time budget: which cells are timed and how often,
one prefill for every batch size, the estimate and the lines on stderr, the table shared by every
command for one model, and no profiling left for a timed generation.

The model's calls take seconds on a fake clock (no wall-clock asserts): a real-size model's
0.4-s forwards, or a small one's few milliseconds.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from specdraft.drafters.ngram import NgramDrafter
from specdraft.speculative import costs as cost_tables
from specdraft.speculative import profiling
from specdraft.speculative.costs import (CELL_BUDGET, MeasuredCosts, cost_key, estimate_seconds, head_sizes,
                                         profiled_widths, row_buckets)
from specdraft.speculative.engine import Engine
from specdraft.speculative.policy import AdaptivePolicy
from specdraft.speculative.profiling import PHRASE, PROFILE_CONTEXT, PROFILE_REPEATS


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A model whose calls also advance `clock`: a forward by `forward(rows, tokens)` seconds, a
    greedy head call by `head(rows)`; every call counted by what it was (shape)."""

    def __init__(self, model, clock: FakeClock, forward, head):
        self._model, self._clock, self._forward, self._head = model, clock, forward, head
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, cache):
        rows, width = tokens.shape
        self.calls[("forward", rows, width)] += 1
        self._clock.now += self._forward(rows, width)
        return self._model(tokens, cache)

    def greedy_tokens(self, hidden):
        self.calls[("head", hidden.shape[0])] += 1
        self._clock.now += self._head(hidden.shape[0])
        return self._model.greedy_tokens(hidden)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(profiling.time, "perf_counter", fake)
    return fake


def real_size(gemma_tiny, clock: FakeClock) -> Timed:
    """Forwards as at a real size on two cores: 0.4 s, 5% more a token; the head 0.05 s + 0.01 s a row."""
    return Timed(gemma_tiny.ours, clock, lambda rows, width: 0.4 * (1 + 0.05 * (rows * width - 1)),
                 lambda rows: 0.05 + 0.01 * rows)


def small(gemma_tiny, clock: FakeClock) -> Timed:
    """A small model's steps: 8 ms a forward, 2 ms a head call."""
    return Timed(gemma_tiny.ours, clock, lambda rows, width: 0.008 * (1 + 0.05 * (rows * width - 1)),
                 lambda rows: 0.002)


def prefills(model: Timed) -> dict[tuple, int]:
    """The forwards longer than any timed width: the scratch's prefill."""
    return {key: n for key, n in model.calls.items() if key[0] == "forward" and key[2] > 9}


def costs_for(tmp_path, name: str = "folder", progress: bool = False) -> MeasuredCosts:
    return MeasuredCosts(cost_key(tmp_path / name, "dtype", "float32", torch.device("cpu")), tmp_path, progress)


def test_a_cell_stops_once_its_calls_took_the_budget(clock):
    """In turns; a 0.4-s cell once, a 0.1-s cell until 0.25 s were spent (3 calls), a cheap one
    every repeat. Without a budget every key is called `repeats` times."""
    order = []

    def call(key, seconds):
        def fn():
            order.append(key)
            clock.now += seconds
        return fn

    calls = {"slow": call("slow", 0.4), "mid": call("mid", 0.1), "cheap": call("cheap", 0.001)}
    best = profiling.fastest_each(calls, torch.device("cpu"), repeats=6, budget=0.25)
    assert Counter(order) == {"slow": 1, "mid": 3, "cheap": 6}
    assert order[:3] == ["slow", "mid", "cheap"] and order[3:5] == ["mid", "cheap"]  # in turns
    assert best == pytest.approx({"slow": 0.4, "mid": 0.1, "cheap": 0.001})
    order.clear()
    profiling.fastest_each(calls, torch.device("cpu"), repeats=2)
    assert Counter(order) == {"slow": 2, "mid": 2, "cheap": 2}


def test_real_size_cells_are_timed_a_few_times_in_turns(gemma_tiny, tmp_path, clock, capsys):
    """At a real size each target width (0.4 s) is called until its calls took CELL_BUDGET (3
    times) past one warm-up, the heads (60-90 ms) PROFILE_REPEATS times, the free n-gram drafter
    every repeat; the text is prefilled once; the lines on stderr give an estimate near what it
    took, then what it took."""
    model = real_size(gemma_tiny, clock)
    costs = costs_for(tmp_path, progress=True)
    costs.ensure(model, NgramDrafter(), 1, 4, 4)
    widths = profiled_widths(4)
    assert widths == [1, 2, 3, 4, 5]
    forwards = {w: model.calls[("forward", 1, w)] for w in widths}
    assert CELL_BUDGET == 1.0
    assert forwards == {1: 4, 2: 3, 3: 3, 4: 3, 5: 3}  # width 1 is also the warm-up
    assert prefills(model) == {("forward", 1, PHRASE + 2 * 4): 1}  # a short prefill, ranking 8 rows for 4
    # heads 1-4 at 60-90 ms: six calls take under 1 s, so PROFILE_REPEATS each; the first size warmed up once more
    heads = {m: model.calls[("head", m)] for m in head_sizes(1)}
    assert heads == {1: 1 + 6, 2: 6, 3: 6, 4: 6}, heads
    assert set(costs.target[1]) == set(widths) and costs.target[1][1] == pytest.approx(0.4)
    err = capsys.readouterr().err
    estimate = float(re.search(r"measuring step costs once for this model \(~(\d+) s\) \.\.\.", err).group(1))
    took = float(re.search(r"step costs done in ([\d.]+) s", err).group(1))
    assert took == pytest.approx(clock.now, abs=0.05)
    assert 0.5 * took <= estimate <= 1.5 * took, err
    assert err.index("measuring") < err.index("done in")


def test_a_small_models_cells_keep_every_repeat(gemma_tiny, tmp_path, clock, capsys):
    """Cheap steps are timed as before the budget: PROFILE_REPEATS calls a cell."""
    model = small(gemma_tiny, clock)
    costs_for(tmp_path).ensure(model, NgramDrafter(), 1, 4, 4)
    assert all(model.calls[("forward", 1, w)] == PROFILE_REPEATS + (w == 1) for w in profiled_widths(4))
    assert all(model.calls[("head", m)] == PROFILE_REPEATS + (m == 1) for m in head_sizes(1))
    assert capsys.readouterr().err == ""  # progress only where asked for


def test_every_batch_size_is_timed_on_one_prefill(gemma_tiny, tmp_path, clock):
    """A server's batch sizes 1, 2 and 4 are timed on copies of one prefilled row, each at its
    own number of rows, and the drafter for each."""
    model = real_size(gemma_tiny, clock)
    costs = costs_for(tmp_path)
    costs.ensure(model, NgramDrafter(), 4, 2, 2)
    assert prefills(model) == {("forward", 1, PHRASE + 2 * 16): 1}  # heads up to 16 rows
    for b in row_buckets(4):
        assert all(model.calls[("forward", b, w)] >= 1 for w in profiled_widths(2))
        assert set(costs.target[b]) == set(profiled_widths(2)) and b in costs.drafts[costs.drafter]
    assert set(costs.head) == set(head_sizes(4))


def test_the_recheck_and_the_missing_batch_sizes_share_the_prefill(gemma_tiny, tmp_path, clock, monkeypatch):
    """A table of one row read by a server of 4 rows: the stored row checked against load and
    batch sizes 2 and 4 timed, on one prefill."""
    first = costs_for(tmp_path)
    first.ensure(real_size(gemma_tiny, clock), NgramDrafter(), 1, 2, 2)
    cost_tables._RECHECKED.discard(first.path)  # a new process
    model = real_size(gemma_tiny, clock)
    costs = costs_for(tmp_path)
    costs.ensure(model, NgramDrafter(), 4, 2, 2)
    assert len(prefills(model)) == 1 and model.calls[("forward", 1, 3)] >= 1  # the recheck
    assert set(costs.target) == {1, 2, 4}


def test_the_scratch_holds_the_profile_context_in_every_row(gemma_tiny):
    """One row prefilled, its keys and values copied on to PROFILE_CONTEXT positions and to every
    row; the states returned are those of the phrase's repeat."""
    cache, hidden, tokens, states = profiling.scratch(gemma_tiny.ours, 3, 5, ranked=4)
    assert cache.host_lengths == [PROFILE_CONTEXT] * 3 and cache.capacity == PROFILE_CONTEXT + 5 + 2
    typed = PHRASE + 8
    for store in cache.k + cache.v:
        assert torch.equal(store[0, :, typed : 2 * typed], store[0, :, :typed])
        assert torch.equal(store[1, :, :PROFILE_CONTEXT], store[0, :, :PROFILE_CONTEXT])
        assert torch.equal(store[2], store[0])
    assert states.shape[0] == 8 and hidden.shape[0] == 3 and torch.equal(hidden[2], hidden[0])
    assert torch.equal(tokens[1], tokens[0])


def test_the_estimate_follows_the_plan():
    """Twice the widths, about twice the seconds; a cheap first call, a cheap profile."""
    plan = {1: ([1, 2, 3], True)}
    one = estimate_seconds(plan, [1, 2, 3, 4], ("target", 1), 1, 0.4)
    two = estimate_seconds({1: ([1, 2, 3, 4, 5, 6], True)}, [1, 2, 3, 4], ("target", 1), 1, 0.4)
    assert 1.0 < one < two
    assert estimate_seconds(plan, [1, 2, 3, 4], ("target", 1), 1, 0.004) < one / 5
    assert estimate_seconds(plan, [], ("head", 1), None, 0.08) > 0


def test_generate_serve_and_bench_share_a_table(tmp_path, monkeypatch):
    """The table is the model's folder, resolved, whatever name or path reached it."""
    folder = tmp_path / "model"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    keys = [cost_key(p, "int8", "bfloat16", torch.device("cpu")) for p in (folder, "model", "./model/", str(folder))]
    assert all(k == keys[0] for k in keys) and keys[0]["folder"] == str(folder.resolve())
    assert MeasuredCosts(keys[0], tmp_path).path == MeasuredCosts(keys[2], tmp_path).path


def test_a_prepared_engine_does_not_profile_in_generate(gemma_tiny, tmp_path, monkeypatch):
    """prepare_policy(rows) times everything a generate of up to `rows` prompts asks for: the
    timed generation itself times nothing."""
    costs = costs_for(tmp_path)
    engine = Engine(gemma_tiny.ours, None, NgramDrafter(), 3, policy=AdaptivePolicy(costs))
    engine.prepare_policy(2)
    timed, saved = costs.profiled, json.loads(costs.path.read_text())
    assert timed > 0
    calls = []
    for module in (profiling, cost_tables):
        monkeypatch.setattr(module, "time_call", lambda fn, device: calls.append(fn))
    prompt = [5, 6, 7, 8, 9, 10]
    engine.generate([prompt], 8, eos_token_ids=[])
    engine.generate([prompt, prompt[::-1]], 8, eos_token_ids=[])
    assert costs.profiled == timed and calls == [] and json.loads(costs.path.read_text()) == saved
