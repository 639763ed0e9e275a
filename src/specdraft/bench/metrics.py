"""Pure arithmetic on the raw records; nothing here times, loads or prints.

A row record is one prompt's result for one method, batch size and repeat:
    {"method", "batch_size", "batch", "repeat", "index", "category", "new_tokens", "seconds",
     "ttft", "token_ids", "target_forwards", "drafted_by_position", "accepted_by_position", ...}
A batch record is one generate call: {"method", "batch_size", "batch", "repeat", "wall_seconds",
"new_tokens", "rss_peak_delta", ...}.

Definitions (Spec-Bench's where it has one):
- tokens/s: the mean over prompts of each prompt's new_tokens / seconds (repeats of a prompt
  averaged first). `seconds` is the row's latency from the start of its batch.
- speedup: a method's mean per-prompt rate over the reference's (specdraft plain, same run,
  same prompts, same batch size), i.e. the ratio of the two means, not the mean of ratios.
- tau: new tokens per target forward (the prefill counts as one), summed over prompts;
- acceptance by position i: accepted drafts at i / drafts proposed at i, summed over prompts
  (both as speculative/stats.py computes them for generate and serve).
- identical rate: the share of prompts whose new token ids equal the reference's exactly.
- throughput: all new tokens / all wall time of the batches; latency: mean row seconds.
- decode ms/token: (seconds - ttft) / (new_tokens - 1), summed over prompts: the time per token
  once the first one is out. tokens/s counts the prompt too, which weighs more for an answer that
  ends early (sampling ends answers at different lengths per method), and more on a slow prefill;
  decode speedup is the reference's decode ms/token over the method's, on the prompts both ran.
- speedup interval: a paired bootstrap over the batches both ran (whole batches, as a batch's rows
  share one timing; the same draw for both methods; the ratio of mean rates per draw), the middle
  90% of the draws, for cells of 3 batches or more. It shows how much a cell's speedup rests on
  which prompts it has (and on each batch's own timing noise); it cannot show a machine drifting
  over a run, which interleaving the methods is there for.
- against the best fixed method (an adaptive method, `auto`): per category, the fixed specdraft
  method with the highest speedup there (plain included; peers and other weight formats not),
  and the adaptive method's speedup over it, with its interval. The best is picked on the same
  prompts, which flatters it: with equal methods, the highest of several noisy cells is high.
- noise control (`plain-again`, when run): plain decoding a second time; its speedup over plain
  in a cell is what timing noise alone reads there, shown beside the adaptive method's.
"""

from __future__ import annotations

import random
from collections import defaultdict
from statistics import fmean

from specdraft.speculative.stats import RequestStats, merge

INTERVAL_LEVEL = 0.9
BOOTSTRAP_DRAWS = 1000
MIN_BATCHES = 3  # fewer measurements than this in a cell: no interval


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return fmean(values) if values else None


def row_rate(row: dict) -> float:
    return row["new_tokens"] / row["seconds"] if row["seconds"] > 0 else 0.0


def per_prompt_rates(rows: list[dict]) -> dict[int, float]:
    """Prompt index -> tokens/s, repeats averaged."""
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by_prompt[r["index"]].append(row_rate(r))
    return {i: fmean(v) for i, v in by_prompt.items()}


def mean_rate(rows: list[dict], only: set[int] | None = None) -> float | None:
    rates = per_prompt_rates(rows)
    return _mean(v for i, v in rates.items() if only is None or i in only)


def speedup(rows: list[dict], reference: list[dict]) -> float | None:
    """Ratio of mean per-prompt rates over the prompts both ran."""
    common = {r["index"] for r in rows} & {r["index"] for r in reference}
    num, den = mean_rate(rows, common), mean_rate(reference, common)
    return num / den if num is not None and den else None


def speedup_interval(rows: list[dict], reference: list[dict], level: float = INTERVAL_LEVEL,
                     draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float] | None:
    """(low, high): the middle `level` of speedup(rows, reference) over bootstrap draws of the prompts
    both ran. A draw takes whole batches (rows of one generate call share its timing, so a batch is
    one measurement, not B; at batch size 1 a batch is a prompt) and the same batches for both
    methods (paired). None with fewer than MIN_BATCHES batches: no interval worth printing."""
    mine, theirs = per_prompt_rates(rows), per_prompt_rates(reference)
    batch_of = {r["index"]: r.get("batch", r["index"]) for r in reference}  # the same batches for every method
    units: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for i in sorted(mine.keys() & theirs.keys()):
        units[batch_of[i]].append((mine[i], theirs[i]))
    if len(units) < MIN_BATCHES:
        return None
    sums = [(sum(a for a, _ in u), sum(b for _, b in u)) for u in units.values()]
    rng = random.Random(seed)  # fixed: a report reads the same every time it is rebuilt
    ratios = []
    for _ in range(draws):
        drawn = rng.choices(sums, k=len(sums))
        den = sum(b for _, b in drawn)
        if den > 0:
            ratios.append(sum(a for a, _ in drawn) / den)
    if not ratios:
        return None
    ratios.sort()
    tail = (1 - level) / 2 * (len(ratios) - 1)
    return ratios[int(tail)], ratios[len(ratios) - 1 - int(tail)]


def request_stats(row: dict) -> RequestStats:
    """A row record's speculative counters as the engine keeps them (absent ones count 0)."""
    drafted, accepted = list(row.get("drafted_by_position") or []), list(row.get("accepted_by_position") or [])
    positions = min(len(drafted), len(accepted))
    return RequestStats(positions, row["new_tokens"], row.get("target_forwards") or 0, drafted[:positions],
                        accepted[:positions])


def tau(rows: list[dict]) -> float | None:
    counted = [r for r in rows if r.get("target_forwards")]
    if not counted:
        return None
    return merge([request_stats(r) for r in counted]).mean_accepted


def acceptance_by_position(rows: list[dict]) -> list[float | None] | None:
    return merge([request_stats(r) for r in rows]).acceptance_by_position or None


def identical_rate(rows: list[dict], reference: list[dict]) -> float | None:
    """Share of prompts (first repeat) whose new tokens equal the reference's exactly."""
    ref = {r["index"]: r["token_ids"] for r in reference if r["repeat"] == 0}
    pairs = [(r["token_ids"], ref[r["index"]]) for r in rows if r["repeat"] == 0 and r["index"] in ref]
    if not pairs:
        return None
    return sum(a == b for a, b in pairs) / len(pairs)


def throughput(batches: list[dict]) -> float | None:
    wall = sum(b["wall_seconds"] for b in batches)
    return sum(b["new_tokens"] for b in batches) / wall if wall > 0 else None


def decode_ms_per_token(rows: list[dict], only: set[int] | None = None) -> float | None:
    timed = [r for r in rows if r.get("ttft") is not None and r["new_tokens"] > 1
             and (only is None or r["index"] in only)]
    tokens = sum(r["new_tokens"] - 1 for r in timed)
    return 1000 * sum(r["seconds"] - r["ttft"] for r in timed) / tokens if tokens else None


def decode_speedup(rows: list[dict], reference: list[dict]) -> float | None:
    common = {r["index"] for r in rows} & {r["index"] for r in reference}
    mine, theirs = decode_ms_per_token(rows, common), decode_ms_per_token(reference, common)
    return theirs / mine if mine and theirs is not None else None


def cell(rows: list[dict], reference: list[dict], identical_to: list[dict] | None) -> dict:
    """The numbers for one method on one slice of prompts."""
    return {
        "prompts": len({r["index"] for r in rows}),
        "tokens_per_second": mean_rate(rows),
        "speedup": speedup(rows, reference),
        "speedup_interval": speedup_interval(rows, reference),
        "tau": tau(rows),
        "acceptance_by_position": acceptance_by_position(rows),
        "identical_rate": identical_rate(rows, identical_to) if identical_to is not None else None,
        "ttft": _mean(r.get("ttft") for r in rows),
        "decode_ms_per_token": decode_ms_per_token(rows),
        "decode_speedup": decode_speedup(rows, reference),
        "latency": _mean(r["seconds"] for r in rows),
        "mean_new_tokens": _mean(r["new_tokens"] for r in rows),
    }


def fixed_methods(methods: list[str], adaptive: str) -> list[str]:
    """The methods an adaptive one is held against: specdraft's fixed methods (plain included) with
    the same weight format; not peers, not other adaptive ones, not the noise control (plain again:
    the best of two identical noisy cells would only flatter the yardstick)."""
    from specdraft.bench import CONTROL, SPECDRAFT_METHODS, method_weights, split_method

    kind = lambda m: split_method(m)[0]  # noqa: E731
    return [m for m in methods if kind(m) in SPECDRAFT_METHODS and kind(m) not in ("auto", CONTROL)
            and method_weights(m) == method_weights(adaptive)]


def against_best_fixed(rows: list[dict], fixed: dict[str, list[dict]], reference: list[dict]) -> dict | None:
    """An adaptive method's rows of one slice against the fixed methods' rows of the same slice: the
    fastest of those over the reference, and the adaptive method's speedup over it."""
    speeds = {m: speedup(r, reference) for m, r in fixed.items() if r}
    speeds = {m: v for m, v in speeds.items() if v is not None}
    if not rows or not speeds:
        return None
    best = max(speeds, key=speeds.get)
    return {"method": best, "best_speedup": speeds[best], "ratio": speedup(rows, fixed[best]),
            "interval": speedup_interval(rows, fixed[best])}


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def summarize(rows: list[dict], batches: list[dict], reference: str = "plain", greedy: bool = True) -> dict:
    """Everything the report shows, per batch size -> method -> overall and per category.

    Identical outputs are checked against the reference at batch size 1 when the run has it
    (the canonical greedy output), else at the same batch size; a method with another weight
    format (METHOD:WEIGHTS) against `reference:WEIGHTS` (the same weights' plain output), None
    if the run lacks it; None when sampling."""
    from specdraft.bench import method_weights, split_method

    def canonical(method: str, bs: int) -> list[dict] | None:
        weights = method_weights(method)
        name = reference if weights is None else f"{reference}:{weights}"
        bs1 = [r for r in rows if r["method"] == name and r["batch_size"] == 1]
        return (bs1 or [r for r in rows if r["method"] == name and r["batch_size"] == bs] or None) if greedy else None

    out: dict = {"reference": reference, "batch_sizes": {}}
    for bs in sorted({r["batch_size"] for r in rows}):
        rows_bs = [r for r in rows if r["batch_size"] == bs]
        ref = [r for r in rows_bs if r["method"] == reference]
        ref_batches = [b for b in batches if b["method"] == reference and b["batch_size"] == bs]
        ref_throughput = throughput(ref_batches)
        methods = {}
        for m in _ordered(r["method"] for r in rows_bs):
            mine = [r for r in rows_bs if r["method"] == m]
            mine_batches = [b for b in batches if b["method"] == m and b["batch_size"] == bs]
            identical_to = canonical(m, bs)
            entry = {"overall": cell(mine, ref, identical_to), "categories": {}}
            for c in _ordered(r["category"] for r in mine):
                entry["categories"][c] = cell([r for r in mine if r["category"] == c],
                                              [r for r in ref if r["category"] == c], identical_to)
            tp = throughput(mine_batches)
            entry["throughput"] = tp
            entry["throughput_speedup"] = tp / ref_throughput if tp is not None and ref_throughput else None
            entry["rss_peak_delta"] = max((b["rss_peak_delta"] for b in mine_batches), default=None)
            cuda = [b.get("cuda_peak") for b in mine_batches if b.get("cuda_peak") is not None]
            entry["cuda_peak"] = max(cuda) if cuda else None
            methods[m] = entry
        for m in methods:
            if split_method(m)[0] == "auto":
                methods[m]["against_best_fixed"] = _against_best_fixed(rows_bs, m, fixed_methods(list(methods), m), ref)
        out["batch_sizes"][str(bs)] = {"methods": methods}
    return out


def _against_best_fixed(rows: list[dict], adaptive: str, fixed: list[str], reference: list[dict]) -> dict:
    """against_best_fixed overall and per category, for one batch size's rows."""
    def part(keep) -> dict | None:
        return against_best_fixed([r for r in rows if r["method"] == adaptive and keep(r)],
                                  {m: [r for r in rows if r["method"] == m and keep(r)] for m in fixed},
                                  [r for r in reference if keep(r)])

    categories = _ordered(r["category"] for r in rows if r["method"] == adaptive)
    return {"overall": part(lambda r: True),
            "categories": {c: part(lambda r, c=c: r["category"] == c) for c in categories}}
