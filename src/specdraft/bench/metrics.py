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
- tau: new tokens per target forward (the prefill counts as one), summed over prompts.
- acceptance by position i: accepted drafts at i / drafts proposed at i, summed over prompts.
- identical rate: the share of prompts whose new token ids equal the reference's exactly.
- throughput: all new tokens / all wall time of the batches; latency: mean row seconds.
- decode ms/token: (seconds - ttft) / (new_tokens - 1), summed over prompts: the time per token
  once the first one is out. tokens/s counts the prompt too, which weighs more for an answer that
  ends early (sampling ends answers at different lengths per method), and more on a slow prefill;
  decode speedup is the reference's decode ms/token over the method's, on the prompts both ran.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean


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


def tau(rows: list[dict]) -> float | None:
    counted = [r for r in rows if r.get("target_forwards")]
    if not counted:
        return None
    return sum(r["new_tokens"] for r in counted) / sum(r["target_forwards"] for r in counted)


def acceptance_by_position(rows: list[dict]) -> list[float | None] | None:
    drafted: list[int] = []
    accepted: list[int] = []
    for r in rows:
        for i, (d, a) in enumerate(zip(r.get("drafted_by_position") or [], r.get("accepted_by_position") or [])):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    if not drafted:
        return None
    return [a / d if d else None for a, d in zip(accepted, drafted)]


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
        "tau": tau(rows),
        "acceptance_by_position": acceptance_by_position(rows),
        "identical_rate": identical_rate(rows, identical_to) if identical_to is not None else None,
        "ttft": _mean(r.get("ttft") for r in rows),
        "decode_ms_per_token": decode_ms_per_token(rows),
        "decode_speedup": decode_speedup(rows, reference),
        "latency": _mean(r["seconds"] for r in rows),
        "mean_new_tokens": _mean(r["new_tokens"] for r in rows),
    }


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def summarize(rows: list[dict], batches: list[dict], reference: str = "plain", greedy: bool = True) -> dict:
    """Everything the report shows, per batch size -> method -> overall and per category.

    Identical outputs are checked against the reference at batch size 1 when the run has it
    (the canonical greedy output), else at the same batch size; a method with another weight
    format (METHOD:WEIGHTS) against `reference:WEIGHTS` (the same weights' plain output), None
    if the run lacks it; None when sampling."""
    from specdraft.bench import method_weights

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
        out["batch_sizes"][str(bs)] = {"methods": methods}
    return out
