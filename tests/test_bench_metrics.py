"""Bench arithmetic on synthetic records: rates, speedup, tau, acceptance, identical rate."""

from __future__ import annotations

import pytest

from specdraft.bench import metrics


def row(method, index, new_tokens, seconds, *, category="c", bs=1, repeat=0, tokens=None, forwards=None,
        drafted=None, accepted=None, ttft=None):
    return {"method": method, "batch_size": bs, "batch": index // bs, "repeat": repeat, "index": index,
            "category": category, "new_tokens": new_tokens, "seconds": seconds, "ttft": ttft,
            "token_ids": tokens if tokens is not None else list(range(new_tokens)),
            "target_forwards": forwards, "drafted_by_position": drafted, "accepted_by_position": accepted}


def test_tokens_per_second_is_mean_of_per_prompt_rates():
    rows = [row("plain", 0, 10, 1.0), row("plain", 1, 10, 4.0)]
    # 10 tok/s and 2.5 tok/s -> mean 6.25 (not 20 tokens / 5 s = 4)
    assert metrics.mean_rate(rows) == pytest.approx(6.25)


def test_repeats_are_averaged_per_prompt_first():
    rows = [row("plain", 0, 10, 1.0, repeat=0), row("plain", 0, 10, 0.5, repeat=1), row("plain", 1, 10, 1.0)]
    # prompt 0: (10 + 20) / 2 = 15; prompt 1: 10 -> 12.5
    assert metrics.mean_rate(rows) == pytest.approx(12.5)


def test_speedup_is_ratio_of_mean_rates():
    ref = [row("plain", 0, 10, 1.0), row("plain", 1, 10, 2.0)]  # 10, 5 -> 7.5
    fast = [row("ngram", 0, 10, 0.5), row("ngram", 1, 10, 2.0)]  # 20, 5 -> 12.5
    assert metrics.speedup(fast, ref) == pytest.approx(12.5 / 7.5)
    # not the mean of per-prompt ratios, (2 + 1) / 2 = 1.5
    assert metrics.speedup(fast, ref) != pytest.approx(1.5)


def test_speedup_uses_prompts_both_ran():
    ref = [row("plain", 0, 10, 1.0), row("plain", 1, 10, 10.0)]
    only_first = [row("hf", 0, 10, 0.5)]
    assert metrics.speedup(only_first, ref) == pytest.approx(2.0)


def test_decode_time_per_token_leaves_the_prompt_out():
    # An answer that ends early: 0.5 s of prompt weighs on its tok/s, not on its decode time.
    ref = [row("plain", 0, 11, 1.5, ttft=0.5), row("plain", 1, 41, 4.5, ttft=0.5)]  # 1 s / 10, 4 s / 40
    short = [row("mtp", 0, 3, 0.6, ttft=0.5), row("mtp", 1, 41, 2.5, ttft=0.5)]  # 0.1 s / 2, 2 s / 40
    assert metrics.decode_ms_per_token(ref) == pytest.approx(1000 * 5 / 50)
    assert metrics.decode_ms_per_token(short) == pytest.approx(1000 * 2.1 / 42)
    assert metrics.decode_speedup(short, ref) == pytest.approx(100 / 50)
    assert metrics.speedup(short, ref) < 1.5  # the prompt-heavy short answer drags tok/s down
    # Prompts only one method ran, one-token answers and rows without a first-token time are left out.
    assert metrics.decode_speedup(short + [row("mtp", 2, 5, 9.0, ttft=0.1)], ref) == pytest.approx(2.0)
    assert metrics.decode_ms_per_token([row("hf", 0, 1, 0.5, ttft=0.5), row("hf", 1, 9, 1.0)]) is None


def test_tau_sums_tokens_over_forwards():
    rows = [row("mtp", 0, 12, 1.0, forwards=4), row("mtp", 1, 6, 1.0, forwards=6)]
    assert metrics.tau(rows) == pytest.approx(18 / 10)
    assert metrics.tau([row("hf", 0, 5, 1.0)]) is None


def test_acceptance_by_position_sums_counts():
    rows = [row("mtp", 0, 10, 1.0, drafted=[4, 4, 2], accepted=[3, 2, 0]),
            row("mtp", 1, 10, 1.0, drafted=[4, 2, 0], accepted=[1, 1, 0])]
    assert metrics.acceptance_by_position(rows) == [pytest.approx(0.5), pytest.approx(0.5), 0.0]
    never = [row("mtp", 0, 10, 1.0, drafted=[2, 0], accepted=[1, 0])]
    assert metrics.acceptance_by_position(never) == [0.5, None]
    assert metrics.acceptance_by_position([row("plain", 0, 1, 1.0)]) is None


def test_identical_rate_exact_token_match_first_repeat():
    ref = [row("plain", 0, 3, 1.0, tokens=[1, 2, 3]), row("plain", 1, 3, 1.0, tokens=[4, 5, 6])]
    rows = [row("ngram", 0, 3, 1.0, tokens=[1, 2, 3]), row("ngram", 1, 3, 1.0, tokens=[4, 5, 7]),
            row("ngram", 1, 3, 1.0, tokens=[4, 5, 6], repeat=1)]
    assert metrics.identical_rate(rows, ref) == pytest.approx(0.5)
    # a prefix is not a match
    assert metrics.identical_rate([row("x", 0, 2, 1.0, tokens=[1, 2])], ref) == 0.0


def test_throughput_is_tokens_over_wall_time():
    batches = [{"new_tokens": 30, "wall_seconds": 2.0}, {"new_tokens": 10, "wall_seconds": 2.0}]
    assert metrics.throughput(batches) == pytest.approx(10.0)
    assert metrics.throughput([]) is None


def test_summarize_per_category_and_batch_size():
    rows = [row("plain", 0, 10, 1.0, category="a", tokens=[1] * 10),
            row("plain", 1, 10, 2.0, category="b", tokens=[2] * 10),
            row("ngram", 0, 10, 0.5, category="a", tokens=[1] * 10, forwards=5, drafted=[4], accepted=[4]),
            row("ngram", 1, 10, 2.0, category="b", tokens=[3] * 10, forwards=10, drafted=[4], accepted=[0]),
            row("plain", 0, 10, 1.0, category="a", bs=2, tokens=[1] * 10),
            row("plain", 1, 10, 1.0, category="b", bs=2, tokens=[2] * 10)]
    batches = [{"method": "plain", "batch_size": 1, "new_tokens": 20, "wall_seconds": 3.0, "rss_peak_delta": 5},
               {"method": "ngram", "batch_size": 1, "new_tokens": 20, "wall_seconds": 2.5, "rss_peak_delta": 7},
               {"method": "plain", "batch_size": 2, "new_tokens": 20, "wall_seconds": 1.0, "rss_peak_delta": 9}]
    s = metrics.summarize(rows, batches)
    one = s["batch_sizes"]["1"]["methods"]
    assert one["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert one["ngram"]["categories"]["a"]["speedup"] == pytest.approx(2.0)
    assert one["ngram"]["categories"]["b"]["speedup"] == pytest.approx(1.0)
    assert one["ngram"]["overall"]["speedup"] == pytest.approx(12.5 / 7.5)
    assert one["ngram"]["overall"]["tau"] == pytest.approx(20 / 15)
    assert one["ngram"]["overall"]["identical_rate"] == pytest.approx(0.5)
    assert one["ngram"]["throughput_speedup"] == pytest.approx((20 / 2.5) / (20 / 3.0))
    assert one["ngram"]["rss_peak_delta"] == 7
    two = s["batch_sizes"]["2"]["methods"]
    assert two["plain"]["throughput"] == pytest.approx(20.0)
    assert two["plain"]["overall"]["identical_rate"] == 1.0  # checked against batch size 1
    sampled = metrics.summarize(rows, batches, greedy=False)
    assert sampled["batch_sizes"]["1"]["methods"]["ngram"]["overall"]["identical_rate"] is None


def test_another_weight_format_is_compared_with_its_own_plain_output():
    """METHOD:WEIGHTS: speedup against the run's plain decoding, identical output against
    plain:WEIGHTS (the same weights' canonical greedy text), none when the run lacks it."""
    from specdraft.bench import method_weights, split_method

    assert split_method("auto:gguf-q8@runs/x") == ("auto", "runs/x") and method_weights("auto:gguf-q8@runs/x") == "gguf-q8"
    assert split_method("mtp@runs/a:b") == ("mtp", "runs/a:b") and method_weights("mtp@runs/a:b") is None
    rows = [row("plain", 0, 10, 1.0, tokens=[1] * 10),
            row("plain:gguf-q8", 0, 10, 0.5, tokens=[2] * 10),
            row("auto:gguf-q8", 0, 10, 0.25, tokens=[2] * 10),
            row("mtp:int8", 0, 10, 0.5, tokens=[1] * 10)]
    one = metrics.summarize(rows, [])["batch_sizes"]["1"]["methods"]
    assert one["auto:gguf-q8"]["overall"]["speedup"] == pytest.approx(4.0)
    assert one["auto:gguf-q8"]["overall"]["identical_rate"] == 1.0  # against plain:gguf-q8, not plain
    assert one["plain:gguf-q8"]["overall"]["identical_rate"] == 1.0
    assert one["mtp:int8"]["overall"]["identical_rate"] is None  # no plain:int8 in the run


def test_speedup_interval_is_a_paired_bootstrap():
    ref = [row("plain", i, 10, 1.0 + i) for i in range(6)]
    # Twice as fast on every prompt: every draw reads 2.0, however uneven the prompts are.
    assert metrics.speedup_interval([row("mtp", i, 10, (1.0 + i) / 2) for i in range(6)], ref) == pytest.approx((2.0, 2.0))
    # Faster on some prompts only: the interval holds the point estimate, has width, and reads the
    # same on every call (a fixed seed), and only common prompts count.
    mixed = [row("mtp", i, 10, (1.0 + i) / (3 if i % 2 else 1)) for i in range(6)]
    low, high = metrics.speedup_interval(mixed, ref)
    assert low < metrics.speedup(mixed, ref) < high and high - low > 0.1
    assert metrics.speedup_interval(mixed, ref) == (low, high)
    assert metrics.speedup_interval(mixed + [row("mtp", 9, 10, 0.01)], ref) == (low, high)
    assert metrics.speedup_interval([row("mtp", 9, 10, 1.0)], ref) is None
    assert metrics.speedup_interval(mixed[:2], ref) is None  # 2 measurements: too few for an interval


def test_speedup_interval_draws_whole_batches():
    """Rows of one batch share its timing: a batch is drawn whole, so 3 batches of 2 prompts give
    the interval of 3 one-prompt batches carrying the pairs' summed rates, and 2 batches give none."""
    ref = [row("plain", i, 10, 1.0 + i, bs=2) for i in range(6)]
    mine = [row("mtp", i, 10, (1.0 + i) / (3 if i < 2 else 1.5), bs=2) for i in range(6)]
    pair_sum = lambda rows, i: metrics.row_rate(rows[2 * i]) + metrics.row_rate(rows[2 * i + 1])  # noqa: E731
    ref1 = [row("plain", i, pair_sum(ref, i), 1.0, tokens=[]) for i in range(3)]
    mine1 = [row("mtp", i, pair_sum(mine, i), 1.0, tokens=[]) for i in range(3)]
    assert metrics.speedup_interval(mine, ref) == pytest.approx(metrics.speedup_interval(mine1, ref1))
    assert metrics.speedup_interval(mine[:4], ref[:4]) is None


def test_auto_is_held_against_the_best_fixed_method_per_category():
    rows = []
    for i, cat in enumerate(["a", "a", "a", "b", "b", "b"]):
        rows += [row("plain", i, 10, 1.0, category=cat),
                 row("mtp", i, 10, 0.5 if cat == "a" else 0.9, category=cat),  # 2x in a, 1.11x in b
                 row("ngram", i, 10, 0.8, category=cat),  # 1.25x
                 row("llama-cpp", i, 10, 0.1, category=cat),  # a peer: never the "best fixed"
                 row("mtp:int8", i, 10, 0.1, category=cat),  # other weights: nor this
                 row("auto", i, 10, 0.4, category=cat)]  # 2.5x
    s = metrics.summarize(rows, [])["batch_sizes"]["1"]["methods"]
    best = s["auto"]["against_best_fixed"]
    assert best["categories"]["a"]["method"] == "mtp" and best["categories"]["a"]["ratio"] == pytest.approx(1.25)
    assert best["categories"]["b"]["method"] == "ngram" and best["categories"]["b"]["ratio"] == pytest.approx(2.0)
    assert best["overall"]["method"] == "mtp" and best["overall"]["best_speedup"] == pytest.approx((20 + 10 / 0.9) / 2 / 10)
    assert best["categories"]["a"]["interval"] == pytest.approx((1.25, 1.25))
    assert "against_best_fixed" not in s["mtp"]

    from specdraft.bench.report import best_fixed_rows

    payload = {"summary": metrics.summarize(rows, []), "questions": [{"category": "a"}, {"category": "b"}]}
    headers, table = best_fixed_rows(payload, "1", "auto")
    assert [r[0] for r in table] == ["a", "b", "overall"]
    assert table[0][3:] == ["`mtp`", "2.00x", "1.25x (1.25-1.25)"]


def test_the_noise_control_is_shown_beside_auto_and_never_its_yardstick():
    """plain-again is plain decoding a second time: it must not be the "best fixed" method auto is held
    against (there it would only pick the luckier of two identical cells), and auto's table shows its
    speedup over plain per category, the noise a cell reads with no difference in work."""
    rows = []
    for i, cat in enumerate(["a", "a", "a", "b", "b", "b"]):
        rows += [row("plain", i, 10, 1.0, category=cat),
                 row("plain-again", i, 10, 0.8 if cat == "a" else 1.25, category=cat),  # 1.25x / 0.8x: noise
                 row("mtp", i, 10, 0.9, category=cat),
                 row("auto", i, 10, 0.5, category=cat)]
    summary = metrics.summarize(rows, [])
    best = summary["batch_sizes"]["1"]["methods"]["auto"]["against_best_fixed"]
    assert best["categories"]["a"]["method"] == "mtp" and best["overall"]["method"] == "mtp"
    assert metrics.fixed_methods(["plain", "plain-again", "mtp", "auto"], "auto") == ["plain", "mtp"]

    from specdraft.bench.report import best_fixed_rows

    payload = {"summary": summary, "questions": [{"category": "a"}, {"category": "b"}]}
    headers, table = best_fixed_rows(payload, "1", "auto")
    assert headers[-1] == "`plain-again` vs plain (noise)"
    assert [r[0] for r in table] == ["a", "b", "overall"]
    assert table[0][-1] == "1.25x (1.25-1.25)" and table[1][-1] == "0.80x (0.80-0.80)"
