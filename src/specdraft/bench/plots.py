"""PNG figures for results.md: speedup by category, acceptance by position, batch sweep.

Every method keeps one colour and one marker across figures (and hatching on bars), so the
figures read in greyscale too.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from specdraft.bench import ALL_METHODS  # noqa: E402

_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "h"]
_HATCHES = ["", "//", "..", "xx", "\\\\", "oo", "--", "++", "**"]


def _style(method: str) -> dict:
    i = ALL_METHODS.index(method) if method in ALL_METHODS else len(ALL_METHODS)
    i %= len(_COLOURS)
    return {"color": _COLOURS[i], "marker": _MARKERS[i], "hatch": _HATCHES[i]}


def _title(payload: dict, what: str) -> str:
    m = payload["machine"]
    return f"{what}\n{payload['target']['name']}, {m['dtype']} on {m['device']}, max {payload['config']['max_new_tokens']} new tokens"


def speedup_by_category(payload: dict, path: Path) -> bool:
    bs = next(iter(payload["summary"]["batch_sizes"]))
    methods = payload["summary"]["batch_sizes"][bs]["methods"]
    ref = payload["summary"]["reference"]
    others = [m for m in methods if m != ref]
    if not others:
        return False
    categories = list(dict.fromkeys(q["category"] for q in payload["questions"]))
    groups = categories + ["overall"] if len(categories) > 1 else ["overall"]
    width = 0.8 / len(others)
    fig, ax = plt.subplots(figsize=(min(22.0, max(7.0, 2.0 + 0.2 * len(groups) * (len(others) + 1))), 4.8))
    for j, m in enumerate(others):
        values = []
        for c in groups:
            cell = methods[m]["overall"] if c == "overall" else methods[m]["categories"].get(c)
            values.append((cell or {}).get("speedup") or 0.0)
        xs = [i + (j - (len(others) - 1) / 2) * width for i in range(len(groups))]
        s = _style(m)
        ax.bar(xs, values, width, label=m, color=s["color"], hatch=s["hatch"], edgecolor="black", linewidth=0.5)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{ref} = 1.0")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30 if len(groups) > 5 else 0, ha="right" if len(groups) > 5 else "center")
    ax.set_xlabel("Spec-Bench category")
    ax.set_ylabel(f"speedup over specdraft {ref} (x)")
    ax.set_title(_title(payload, f"Speedup by category (batch size {bs}, mean per-prompt tokens/s)"), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never covers a bar
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def acceptance_by_position(payload: dict, path: Path) -> bool:
    bs = next(iter(payload["summary"]["batch_sizes"]))
    methods = payload["summary"]["batch_sizes"][bs]["methods"]
    curves = {m: v["overall"]["acceptance_by_position"] for m, v in methods.items()
              if v["overall"]["acceptance_by_position"]}
    if not curves:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for m, acc in curves.items():
        xs = [i + 1 for i, a in enumerate(acc) if a is not None]
        ys = [a for a in acc if a is not None]
        s = _style(m)
        ax.plot(xs, ys, marker=s["marker"], color=s["color"], label=f"{m} (tau {methods[m]['overall']['tau']:.2f})")
    k = max(len(a) for a in curves.values())
    ax.set_xticks(range(1, k + 1))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(draft i accepted | drafted)")
    ax.set_title(_title(payload, f"Acceptance by draft position (batch size {bs})"), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def batch_sweep(payload: dict, path: Path) -> bool:
    sizes = list(payload["summary"]["batch_sizes"])
    if len(sizes) < 2:
        return False  # one point per method is not a sweep; the tables have those numbers
    names = list(dict.fromkeys(m for bs in sizes for m in payload["summary"]["batch_sizes"][bs]["methods"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.4))
    for m in names:
        pts = [(int(bs), payload["summary"]["batch_sizes"][bs]["methods"].get(m)) for bs in sizes]
        pts = [(b, c) for b, c in pts if c is not None]
        s = _style(m)
        ax1.plot([b for b, _ in pts], [c["throughput"] for _, c in pts], marker=s["marker"], color=s["color"], label=m)
        ax2.plot([b for b, _ in pts], [c["overall"]["latency"] for _, c in pts], marker=s["marker"], color=s["color"],
                 label=m)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(b) for b in sizes])
        ax.set_xticklabels(sizes)
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("total throughput (new tokens / s)")
    ax1.set_title("Throughput: all new tokens / wall time", fontsize=10)
    ax2.set_ylabel("mean per-request latency (s)")
    ax2.set_title("Latency: batch start to a row's last token", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = payload["machine"]
    fig.suptitle(f"Batch sweep: {payload['target']['name']}, {m['dtype']} on {m['device']}, "
                 f"max {payload['config']['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def make_all(out: Path, payload: dict) -> list[str]:
    """Write the figures that have data; returns their file names."""
    made = []
    for name, fn in (("speedup_by_category.png", speedup_by_category),
                     ("acceptance_by_position.png", acceptance_by_position),
                     ("throughput_vs_batch_size.png", batch_sweep)):
        if fn(payload, out / name):
            made.append(name)
    return made
