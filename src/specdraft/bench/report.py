"""results.json (everything raw), results.md (the tables) and the short table printed at the end."""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.bench.questions import PLAIN_TEMPLATE

MB = 1024 * 1024
BEST_FIXED_NOTE = (
    "In brackets: the middle 90% of a paired bootstrap over the category's batches (both methods on the "
    "same draw; a batch's rows share one timing, so a batch counts once; none under 3 batches), i.e. how "
    "far the cell moves with the prompts it happens to have; it does not cover the machine's drift over "
    "the run. The best fixed method is the fastest of the run's specdraft "
    "methods other than the adaptive one (plain included, same weights) in that category, picked on the "
    "same prompts, which flatters it. `plain-again` (when run) is plain decoding a second time: identical "
    "work, so its column is what timing noise alone reads in each cell.")


def _f(x, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


def _pct(x) -> str:
    return _f(x, ".0f", 100, "%")


def _mb(x) -> str:
    return _f(x, ".1f", 1 / MB)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


OVERALL_HEADERS = ["method", "tok/s", "speedup", "tau", "identical", "TTFT ms", "decode ms/tok", "decode speedup",
                   "latency s", "throughput tok/s", "peak RSS +MB"]


def overall_rows(payload: dict, bs: str) -> list[list[str]]:
    rows = []
    for name, m in payload["summary"]["batch_sizes"][bs]["methods"].items():
        o = m["overall"]
        rows.append([name, _f(o["tokens_per_second"], ".1f"), _f(o["speedup"], ".2f", suffix="x"), _f(o["tau"]),
                     _pct(o["identical_rate"]), _f(o["ttft"], ".0f", 1000), _f(o.get("decode_ms_per_token"), ".1f"),
                     _f(o.get("decode_speedup"), ".2f", suffix="x"), _f(o["latency"]),
                     _f(m["throughput"], ".1f"), _mb(m["rss_peak_delta"])])
    return rows


def category_rows(payload: dict, bs: str) -> tuple[list[str], list[list[str]]]:
    methods = payload["summary"]["batch_sizes"][bs]["methods"]
    ref = payload["summary"]["reference"]
    categories = list(dict.fromkeys(q["category"] for q in payload["questions"]))
    headers = ["category", "n", f"{ref} tok/s"] + [m for m in methods if m != ref]
    rows = []
    for c in categories + ["overall"]:
        cells = {m: (v["overall"] if c == "overall" else v["categories"].get(c)) for m, v in methods.items()}
        base = cells.get(ref) or {}
        row = [c, str(base.get("prompts", "-")), _f(base.get("tokens_per_second"), ".1f")]
        row += [_f((cells[m] or {}).get("speedup"), ".2f", suffix="x") for m in methods if m != ref]
        rows.append(row)
    return headers, rows


def _x(value, interval) -> str:
    """'1.32x (1.17-1.48)': a speedup and its bootstrap interval (metrics.speedup_interval)."""
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")


def best_fixed_rows(payload: dict, bs: str, method: str, code: bool = True) -> tuple[list[str], list[list[str]]]:
    """An adaptive method against the reference and against the best fixed method, per category
    (`code`: method names in backticks, for markdown)."""
    from specdraft.bench import CONTROL, method_weights

    name = (lambda m: f"`{m}`") if code else (lambda m: m)  # noqa: E731
    summary = payload["summary"]
    methods = summary["batch_sizes"][bs]["methods"]
    ref, entry = summary["reference"], methods[method]
    weights = method_weights(method)
    control = methods.get(CONTROL if weights is None else f"{CONTROL}:{weights}")  # the run's noise control
    categories = list(dict.fromkeys(question["category"] for question in payload["questions"]))
    headers = ["category", "n", f"{name(method)} vs {ref}", "best fixed method", "its speedup", f"{name(method)} vs it"]
    if control is not None:
        headers.append(f"{name(CONTROL)} vs {ref} (noise)")
    rows = []
    for c in categories + ["overall"]:
        mine = entry["overall"] if c == "overall" else entry["categories"].get(c)
        best = entry["against_best_fixed"]["overall"] if c == "overall" else entry["against_best_fixed"]["categories"].get(c)
        if mine is None or best is None:
            continue
        rows.append([c, str(mine["prompts"]), _x(mine["speedup"], mine.get("speedup_interval")), name(best["method"]),
                     _x(best["best_speedup"], None), _x(best["ratio"], best["interval"])])
        if control is not None:
            same = control["overall"] if c == "overall" else control["categories"].get(c)
            rows[-1].append(_x(same["speedup"], same.get("speedup_interval")) if same else "-")
    return headers, rows


def adaptive_tables(payload: dict, code: bool = True):
    """(batch size, method, headers, rows) of best_fixed_rows for every adaptive method that ran."""
    for bs, size in payload["summary"]["batch_sizes"].items():
        for method, entry in size["methods"].items():
            if entry.get("against_best_fixed"):
                yield (bs, method, *best_fixed_rows(payload, bs, method, code))


def acceptance_rows(payload: dict, bs: str) -> tuple[list[str], list[list[str]]]:
    methods = payload["summary"]["batch_sizes"][bs]["methods"]
    with_acc = {m: v["overall"]["acceptance_by_position"] for m, v in methods.items()
                if v["overall"]["acceptance_by_position"]}
    k = max((len(a) for a in with_acc.values()), default=0)
    headers = ["method", "K", "tau"] + [f"pos {i + 1}" for i in range(k)]
    rows = [[m, str(len(a)), _f(methods[m]["overall"]["tau"])] + [_pct(x) for x in a] + ["-"] * (k - len(a))
            for m, a in with_acc.items()]
    return headers, rows


def sweep_rows(payload: dict) -> tuple[list[str], list[list[str]]]:
    sizes = list(payload["summary"]["batch_sizes"])
    names = list(dict.fromkeys(m for bs in sizes for m in payload["summary"]["batch_sizes"][bs]["methods"]))
    headers = ["method"] + [f"bs {bs} tok/s" for bs in sizes] + [f"bs {bs} latency s" for bs in sizes]
    rows = []
    for name in names:
        cells = [payload["summary"]["batch_sizes"][bs]["methods"].get(name) for bs in sizes]
        rows.append([name] + [_f(c["throughput"], ".1f") if c else "-" for c in cells]
                    + [_f(c["overall"]["latency"]) if c else "-" for c in cells])
    return headers, rows


def memory_rows(payload: dict) -> tuple[list[str], list[list[str]]]:
    target = payload["target"]
    sizes = list(payload["summary"]["batch_sizes"])
    headers = ["what", "weights MB", "load RSS +MB", "drafter MB", "drafter % of target"] + \
              [f"peak RSS +MB bs {bs}" for bs in sizes]
    rows = [[f"specdraft target ({payload['machine']['dtype']}) + tokenizer", _mb(target["weight_bytes"]),
             _mb(target["load_rss_delta"]), "-", "-"] + ["-"] * len(sizes)]
    for name, info in payload["methods"].items():
        peaks = [payload["summary"]["batch_sizes"][bs]["methods"].get(name, {}).get("rss_peak_delta") for bs in sizes]
        rows.append([name, _mb(info["own_weight_bytes"] or None), _mb(info["load_rss_delta"] or None),
                     _mb(info["drafter_bytes"]), _f(info["drafter_overhead_pct"], ".2f", suffix="%")]
                    + [_mb(p) for p in peaks])
    return headers, rows


def _bandwidth_line(payload: dict) -> list[str]:
    """How close plain decoding at batch 1 comes to the weight-read floor (weights / bandwidth)."""
    gbs = payload["machine"].get("memory_read_gbs")
    plain = payload["summary"].get("batch_sizes", {}).get("1", {}).get("methods", {}).get("plain", {})
    rate = plain.get("overall", {}).get("tokens_per_second")
    if not gbs or not rate:
        return []
    # What a greedy step reads (not the input embedding table, of which it gathers one row).
    step_bytes = payload["target"].get("step_bytes") or payload["target"]["weight_bytes"]
    floor_ms = step_bytes / (gbs * 1e9) * 1e3
    step_ms = 1e3 / rate
    return [f"- memory read bandwidth {gbs:.1f} GB/s (torch, {payload['machine']['torch_threads']} threads): reading "
            f"the {step_bytes / 1e6:.0f} MB a step reads takes {floor_ms:.1f} ms; plain decoding at batch 1 takes {step_ms:.1f} ms per token "
            f"({floor_ms / step_ms:.0%} of the memory-bound ideal, prefill included)"]


def markdown(payload: dict) -> str:
    cfg, mach = payload["config"], payload["machine"]
    fmt = payload["prompt_format"]
    sizes = list(payload["summary"]["batch_sizes"])
    n = len(payload["questions"])
    cats = list(dict.fromkeys(q["category"] for q in payload["questions"]))
    prompt = (f"plain template `{PLAIN_TEMPLATE!r}` (the model has no chat template)" if fmt["style"] == "plain"
              else "the model's chat template (one user turn, first turn of each question)")
    commit = (mach.get("git_commit") or "unknown")[:12] + (" (dirty)" if mach.get("git_dirty") else "")
    out = [
        "# specdraft bench results",
        "",
        f"- model: `{payload['target']['name']}` ({mach['dtype']}, {mach['device']}), "
        f"weights {mach.get('weights', '?')}, {_mb(payload['target']['weight_bytes'])} MB"
        + (f", prompts in {mach['prefill_dtype']}" if mach.get("prefill_dtype") else ""),
        f"- machine: {mach['cpu']}, {mach['cpus_usable']} usable CPUs, {mach['torch_threads']} torch threads"
        + (f", GPU {mach['gpu']}" if mach.get("gpu") else ""),
        f"- software: torch {mach['torch']}, transformers {mach['transformers'] or '-'}, "
        f"llama-cpp-python {mach['llama_cpp_python'] or '-'}, specdraft commit {commit}",
        f"- questions: {n} from `{Path(cfg['questions']).name}` ({', '.join(cats)})"
        + (f", first {cfg['limit_per_category']} per category" if cfg["limit_per_category"] else ""),
        f"- prompt format: {prompt}",
        f"- generation: max {cfg['max_new_tokens']} new tokens, "
        + ("EOS ignored (every row generates them all), " if cfg.get("ignore_eos") else "stop at EOS only, ")
        + ("greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
                                             + (f", top-k {cfg['top_k']}" if cfg.get("top_k") else "")
                                             + (f", top-p {cfg['top_p']}" if cfg.get("top_p", 1.0) < 1 else "")
                                             + f", seed {cfg['seed']}")
        + f", {cfg['repeats']} repeat(s), one warm-up generation per method and batch size",
        f"- run: {payload['created']}, {payload['elapsed_seconds']:.0f} s",
        *_bandwidth_line(payload),
        *_simulated_line(payload),
        "",
        "tok/s is Spec-Bench's: the mean over prompts of new tokens / seconds. Speedup is a method's mean rate "
        f"over specdraft `{payload['summary']['reference']}`'s in the same run (methods interleaved batch by batch). "
        "tau: new tokens per target forward. Identical: share of prompts whose new token ids equal specdraft "
        "plain's greedy output at batch size 1 exactly. Decode ms/tok: time per new token after the first "
        "(seconds - TTFT over new tokens - 1, summed over prompts), i.e. without the prompt; decode speedup is "
        "the reference's over the method's. Latency: from the start of a batch to the row's last "
        "token (transformers returns a batch at once, so its rows share one). Peak RSS +MB: highest resident "
        "memory sampled while a batch generated, above the resident memory just before it.",
    ]
    if payload.get("interrupted"):
        out += ["", "**Interrupted**: the tables cover only what was measured before Ctrl-C."]
    if not sizes:
        out += ["", "No measurements."]
    for bs in sizes:
        out += ["", f"## Batch size {bs}", "", markdown_table(OVERALL_HEADERS, overall_rows(payload, bs))]
    out += _detail_sections(payload, sizes)
    return "\n".join(out) + "\n"


def _simulated_line(payload: dict) -> list[str]:
    """Methods named METHOD~PROFILE ran with simulated acceptance: say so before any table."""
    sims = {name: info["simulated_acceptance"] for name, info in payload["methods"].items()
            if info.get("simulated_acceptance")}
    if not sims:
        return []
    what = "; ".join(f"`{name}`: {s['profile']} ({', '.join(f'{p:g}' for p in s['cumulative'])})"
                     for name, s in sims.items())
    return [f"- **SIMULATED acceptance** (not measured: the drafter runs and is paid for, its drafts match "
            f"the plain output at these cumulative shares by position): {what}"]


def _detail_sections(payload: dict, sizes: list[str]) -> list[str]:
    out: list[str] = []
    if not sizes:
        return _trailer(payload)
    first = sizes[0]
    h, r = category_rows(payload, first)
    out += ["", f"## Speedup by category (batch size {first})", "", markdown_table(h, r)]
    h, r = acceptance_rows(payload, first)
    if r:
        out += ["", f"## Acceptance by draft position (batch size {first})", "", markdown_table(h, r)]
    for bs, method, h, r in adaptive_tables(payload):
        out += ["", f"## `{method}` against the reference and the best fixed method (batch size {bs})", "",
                BEST_FIXED_NOTE, "", markdown_table(h, r)]
    if len(sizes) > 1:
        h, r = sweep_rows(payload)
        out += ["", "## Batch sweep: total throughput and mean latency", "", markdown_table(h, r)]
    return out + _trailer(payload)


def _trailer(payload: dict) -> list[str]:
    out: list[str] = []
    h, r = memory_rows(payload)
    out += ["", "## Memory", "",
            "weights: bytes of the parameters a method holds itself (GGUF file size for llama.cpp); load RSS: "
            "resident memory its loading added (for the target: Runtime.load, tokenizer included); drafter: Drafter.nbytes() (draft-model includes its KV cache), "
            "as a share of the target's weight bytes (Runtime.nbytes()). "
            f"Process high-water mark (getrusage): {_mb(payload['max_rss'])} MB.", "", markdown_table(h, r)]
    notes = [f"- `{name}`: {'; '.join(info['notes'])}" for name, info in payload["methods"].items() if info["notes"]]
    if notes:
        out += ["", "## Method notes", ""] + notes
    if payload["skipped"]:
        out += ["", "## Skipped", ""] + [f"- `{k}`: {v}" for k, v in payload["skipped"].items()]
    if payload.get("plots"):
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in payload["plots"]]
    if payload.get("plots_note"):
        out += ["", f"Plots: {payload['plots_note']}"]
    return out


def text_summary(payload: dict) -> str:
    parts = []
    for bs in payload["summary"]["batch_sizes"]:
        parts += [f"batch size {bs}:", text_table(OVERALL_HEADERS, overall_rows(payload, bs)), ""]
    sizes = list(payload["summary"]["batch_sizes"])
    if sizes:
        h, r = category_rows(payload, sizes[0])
        if len(r) > 2:
            parts += ["speedup by category:", text_table(h, r), ""]
        for bs, method, h, r in adaptive_tables(payload, code=False):
            parts += [f"{method} against the best fixed method, batch size {bs} (90% bootstrap intervals):",
                      text_table(h, r), ""]
    else:
        parts.append("no measurements")
    if payload.get("interrupted"):
        parts.append("interrupted: partial results")
    for k, v in payload["skipped"].items():
        parts.append(f"skipped {k}: {v}")
    return "\n".join(parts).rstrip()


def write_all(out: Path, payload: dict, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload["plots"] = []
    if plots:
        try:
            from specdraft.bench.plots import make_all
        except ImportError:
            payload["plots_note"] = "matplotlib is not installed (pip install 'specdraft[bench]'); no plots"
        else:
            payload["plots"] = make_all(out, payload) if payload["summary"]["batch_sizes"] else []
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "results.md").write_text(markdown(payload))
