"""The measured cost model: what a target forward, a greedy head call and a drafter step cost
on this machine, timed once (profiling.py) and kept on disk.

Tables live under $SPECDRAFT_CACHE/costs (or $SPECDRAFT_COSTS_DIR), one JSON file per cost key:
everything that changes a step's time (model, weights, dtype, device, torch, threads, CPU, the
code that computes and times a step). A table read from disk has its one-row forwards timed
again once per process, and one timed under load is measured afresh.

A first use times only what the policy prices for the rounds and batch asked for: the widths up
to the round's, the batch sizes up to the batch's, each cell until its calls took CELL_BUDGET
seconds, on one prefilled row copied to every batch size; it shows its estimated and its actual
length on stderr (`progress`).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdraft.drafters.base import Drafter
from specdraft.models.kernels import build as kernels
from specdraft.speculative.profiling import (PROFILE_REPEATS, Scratch, drafter_calls, fastest_each, head_calls,
                                             target_calls, time_call)
from specdraft.speculative.verify import HEAD_BLOCK

# A stored table's one-row forwards are timed again once per process (fastest of RECHECK_REPEATS);
# a cell now under RECHECK_SLACK of its stored time was timed under load (load only adds time),
# and the whole table is measured again (BENCHMARKS.md, "A cost table timed under load, and a
# check against it"). Cells under RECHECK_FLOOR are not judged: timer and scheduler noise alone
# move them that much.
RECHECK_REPEATS = 3
RECHECK_SLACK = 0.8
RECHECK_FLOOR = 1e-3
_RECHECKED: set[Path] = set()  # tables checked by this process
# A cell is timed again only until its calls took this long (and PROFILE_REPEATS times at most):
# a small model's steps keep every repeat; at real sizes, where one forward takes a large part of
# a second, each cell still gets several turns. With one or two, a slow stretch of a machine whose
# memory bandwidth wanders landed on some widths only: E4B's 4-token verify was tabled at 1.01x
# a step where `steps` measures 1.2-1.6x, and the policy drafted 3 a round at JSON-like
# acceptance (BENCHMARKS.md). The first-use profile takes ~10 s there, once per machine.
CELL_BUDGET = 1.0
# The estimate shown before profiling (estimate_seconds): a forward over n tokens costs about
# 1 + ROW_COST * (n - 1) one-token forwards, a head or drafting call about HEAD_COST and
# DRAFT_COST of one.
ROW_COST, HEAD_COST, DRAFT_COST = 0.1, 0.2, 0.2


def cpu_identity(cpuinfo: str) -> str | None:
    """The first processor's model name with its family and model numbers, from /proc/cpuinfo's
    text: clouds often report only "AMD EPYC", and a Zen 1 and a Zen 3 behind that name step at
    very different speeds, so a cost table must not move between them."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if "model name" not in fields:
        return None
    return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def _cpu_name() -> str:
    try:
        found = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        found = None
    return found or platform.processor() or platform.machine()


def cost_key(folder: str | Path, weights: str, dtype: str, device: torch.device) -> dict:
    """Everything a step's time depends on, as the cache key (a change means re-profiling). The
    model is its folder's resolved path, not the name it was given: a preset and its folder, or a
    relative and an absolute path, share one table across generate, serve and bench."""
    return {
        "folder": str(Path(folder).resolve()), "weights": weights, "dtype": dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "code": forward_code_digest(),
        "kernels": kernels.enabled(),
    }


@functools.lru_cache(maxsize=1)
def forward_code_digest() -> str:
    """A hash of the source that decides what a forward or a draft step costs and how it is timed
    (models/ and its C kernels, drafters/, the KV cache, this file and profiling.py): an update
    that makes steps cheaper or dearer, or times them differently, re-profiles instead of trusting
    an old table."""
    here = Path(__file__).resolve()
    root = here.parents[1]
    files = sorted([*(root / "models").rglob("*.py"), *(root / "models").rglob("*.c"),
                    *(root / "models").rglob("*.h"), *(root / "drafters").rglob("*.py")])
    files += [root / "kv_cache.py", here, here.with_name("profiling.py")]
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


COSTS_ENV = "SPECDRAFT_COSTS_DIR"  # where cost tables go, if not $SPECDRAFT_CACHE/costs (tests: a temp dir)


def costs_dir() -> Path:
    """$SPECDRAFT_COSTS_DIR if set, else $SPECDRAFT_CACHE/costs. The cost tables alone can move:
    the test suite keeps its tiny models' tables out of the user's cache while still reusing the
    real model converted there."""
    from specdraft.loading.presets import cache_root

    override = os.environ.get(COSTS_ENV)
    return Path(override) if override else cache_root() / "costs"


def row_buckets(rows: int) -> list[int]:
    """Batch sizes profiled for up to `rows` rows: powers of two up to the first >= rows."""
    out = [1]
    while out[-1] < rows:
        out.append(out[-1] * 2)
    return out


def head_sizes(rows: int) -> list[int]:
    """Rows the greedy head is timed for: 1 to HEAD_BLOCK (a verification's first block at batch 1),
    then a block for each profiled batch size."""
    return sorted(set(range(1, HEAD_BLOCK + 1)) | {HEAD_BLOCK * b for b in row_buckets(rows)})


def profiled_widths(width: int) -> list[int]:
    """Query widths timed for rounds of up to `width` drafts: every one up to 6 (where packed
    kernels jump), then sparser (interpolated in between)."""
    top = width + 1
    return sorted({w for w in range(1, min(top, 6) + 1)} | set(range(6, top, 3)) | {top})


def _interpolate_at(xs: list[int], y: Callable[[int], float], x: float) -> float:
    """Piecewise linear through (xs[i], y(i)) (xs sorted), proportional past either end; y is
    called only for the points x falls between (the policy prices ~10 widths a round)."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return y(i)
    if i == 0 or i == len(xs):  # past the table: proportional
        j = 0 if i == 0 else len(xs) - 1
        return y(j) * x / xs[j]
    lo, hi = y(i - 1), y(i)
    return lo + (hi - lo) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _interpolate(table: dict[int, float], x: float) -> float:
    xs = sorted(table)
    return _interpolate_at(xs, lambda i: table[xs[i]], x)


def monotone(target: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """A forward never costs more than a wider one or one over more rows: another process can only
    add time to a measurement, so each cell is lowered to the cheapest wider or larger cell."""
    out: dict[int, dict[int, float]] = {}
    for n in sorted(target, reverse=True):
        row, best = {}, float("inf")
        for w in sorted(target[n], reverse=True):
            larger = [out[m][w] for m in out if w in out[m]]
            best = min([best, target[n][w]] + larger)
            row[w] = best
        out[n] = row
    return out


def estimate_seconds(plan: dict[int, tuple[list[int], bool]], heads: list[int], first: tuple, rows: int | None,
                     seconds: float) -> float:
    """Rough seconds of a profile of `plan` ({rows: (target widths, whether drafting is timed)})
    and `heads` (greedy head sizes), from one call that took `seconds`: `first` ("target", width)
    for `rows` rows, or a ("head", m) or ("draft", steps) call. Each cell's calls are counted
    as under CELL_BUDGET, priced by ROW_COST, HEAD_COST and DRAFT_COST."""
    kind = first[0]
    if kind == "target":
        unit = seconds / (1 + ROW_COST * (rows * first[1] - 1))
    else:
        unit = seconds / (HEAD_COST if kind == "head" else DRAFT_COST)

    def cell(t: float) -> float:
        return t * min(PROFILE_REPEATS, max(1, math.ceil(CELL_BUDGET / t))) if t > 0 else 0.0

    total = sum(cell(unit * HEAD_COST) for _ in heads)
    for i, (b, (widths, drafting)) in enumerate(plan.items()):
        forwards = [unit * (1 + ROW_COST * (b * w - 1)) for w in widths]
        total += sum(cell(t) for t in forwards) + (forwards[0] if i and forwards else 0.0)  # its warm-up
        if drafting:
            total += 2 * cell(unit * DRAFT_COST)
    return total


class MeasuredCosts:
    """Seconds per target forward by (rows, width), per greedy head call by rows scored, and per
    drafter step by rows, timed on this machine the first time they are needed and cached as
    JSON (`key` + tables) in `folder`."""

    def __init__(self, key: dict, folder: Path | None = None, progress: bool = False):
        self.key, self.progress = key, progress
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = (folder or costs_dir()) / f"{digest}.json"
        self.target: dict[int, dict[int, float]] = {}  # the forward alone (layers, final norm)
        self.head: dict[int, float] = {}  # model.greedy_tokens over that many hidden rows
        self.drafts: dict[str, dict[int, list[float]]] = {}  # drafter key -> rows -> [base s, per-step s]
        self.drafter = ""
        self._clean = None  # the target table with timing noise taken out (monotone), built on use
        self._curves: dict[float, tuple[list[int], list[float]]] = {}  # its curve over widths, per rows
        self._clean_head = None  # the same for the head: (sizes, seconds)
        self.profiled = 0  # cells timed by this process (tests read it)
        self._scratch: Scratch | None = None  # profile text in a cache, while ensure() runs
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if data.get("key") != self.key:  # a hash collision or a hand-edited file: trust nothing
            return
        self.target = {int(n): {int(w): s for w, s in t.items()} for n, t in data.get("target", {}).items()}
        self.head = {int(m): s for m, s in data.get("head", {}).items()}
        self.drafts = {d: {int(n): v for n, v in t.items()} for d, t in data.get("drafts", {}).items()}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": self.key, "target": self.target, "head": self.head, "drafts": self.drafts},
                                  indent=1))
        tmp.replace(self.path)  # atomic: a concurrent reader sees the old table or the new one

    def verify(self, n: float, w: float, alive: list[float] | None = None, block: int = HEAD_BLOCK) -> float:
        """Seconds of a verification of w positions for n rows: the forward, then the head over
        the positions verification scores: `block` at a time (HEAD_BLOCK greedy, SAMPLED_HEAD_BLOCK
        sampling), block b for alive[b] rows (expected: those whose earlier drafts were all
        accepted; None: all n). The head is the greedy one's time either way."""
        widths, seconds = self._forward_curve(n)
        forward = _interpolate_at(widths, seconds.__getitem__, w)
        if not self.head:
            return forward
        head = 0.0
        for b, start in enumerate(range(0, math.ceil(w), block)):
            rows = n if alive is None else alive[b]
            # below one row expected: that chance of the block for one row
            head += min(1.0, rows) * self.head_seconds(max(1.0, rows) * min(block, w - start))
        return forward + head

    def _forward_curve(self, n: float) -> tuple[list[int], list[float]]:
        """(widths, seconds) of a forward over n rows, interpolated between the profiled batch sizes
        at every profiled width: once per n, as the policy prices every width of a round for the
        same n (a piecewise-linear curve through the union of the widths is exactly the
        interpolation of the rows' own curves)."""
        if self._clean is None:
            self._clean, self._curves = monotone(self.target), {}
        if n not in self._curves:
            rows = sorted(self._clean)
            widths = sorted({w for t in self._clean.values() for w in t})
            seconds = [_interpolate_at(rows, lambda i: _interpolate(self._clean[rows[i]], w), n) for w in widths]
            self._curves[n] = (widths, seconds)
        return self._curves[n]

    def head_seconds(self, rows: float) -> float:
        """The greedy head over `rows` hidden rows, interpolated (fewer than profiled: proportional)."""
        if self._clean_head is None:  # more rows never cost less: noise only adds time
            sizes = sorted(self.head)
            self._clean_head = (sizes, [min(s for k, s in self.head.items() if k >= m) for m in sizes])
        sizes, seconds = self._clean_head
        return _interpolate_at(sizes, seconds.__getitem__, rows)

    def draft(self, n: int, steps: int) -> float:
        if steps == 0:
            return 0.0
        table = self.drafts.get(self.drafter, {})
        if not table:
            return 0.0
        rows = sorted(table)
        base = _interpolate_at(rows, lambda i: table[rows[i]][0], n)
        step = _interpolate_at(rows, lambda i: table[rows[i]][1], n)
        return base + step * steps

    @torch.inference_mode()
    def ensure(self, model: torch.nn.Module, drafter: Drafter, rows: int, k: int, width: int) -> None:
        """Time what is missing for batches of up to `rows` rows and rounds of up to `width` drafts
        of which the drafter proposes up to `k`: each batch size's cells in turns until each took
        CELL_BUDGET seconds or PROFILE_REPEATS calls (profiling.fastest_each)."""
        self.drafter = drafter.cost_key()
        widths = profiled_widths(width)
        top = max([*widths, *self.target.get(1, {})])
        # one prefill for every batch size and the recheck, ranking enough rows for the largest head
        self._scratch = Scratch(model, row_buckets(rows)[-1], top, head_sizes(rows)[-1])
        try:
            if self.path not in _RECHECKED:  # once per process; a table profiled here is not checked again
                _RECHECKED.add(self.path)
                if self.target and self.timed_under_load(model):
                    self.target, self.head, self.drafts = {}, {}, {}
            self._measure(model, drafter, rows, k, widths)
        finally:
            self._scratch = None  # the scratch cache's memory goes back

    def _measure(self, model: torch.nn.Module, drafter: Drafter, rows: int, k: int, widths: list[int]) -> None:
        todo = [b for b in row_buckets(rows) if not set(widths) <= set(self.target.get(b, {}))
                or b not in self.drafts.get(self.drafter, {})]
        heads = [m for m in head_sizes(rows) if m not in self.head]
        if not todo and not heads:
            return
        t0 = time.perf_counter()
        dev, steps = model.embed_tokens.weight.device, max(2, k)
        plan = {b: ([w for w in widths if w not in self.target.get(b, {})],
                    b not in self.drafts.get(self.drafter, {})) for b in todo}
        report = _Progress(self.progress, t0, plan, heads)
        for i, b in enumerate(todo or [None]):
            calls: dict[tuple, Callable[[], None]] = {}
            if b is not None:
                cache, hidden, tokens, _ = self._scratch.rows(b)
                start = list(cache.host_lengths)
                missing, drafting = plan[b]
                calls.update({("target", w): fn for w, fn in target_calls(model, cache, missing).items()})
                if drafting:
                    calls.update({("draft", n): fn for n, fn in drafter_calls(drafter, cache, hidden, tokens,
                                                                                steps).items()})
            if i == 0 and heads:  # with the first batch size's cells
                states = self._scratch.rows(1)[3]
                calls.update({("head", m): fn for m, fn in head_calls(model, states, heads).items()})
            with drafter.without_early_stop():
                # One untimed call of each kind first, so that its code path's first-call
                # allocations (and any compilation) stay out of the table; the first also prices
                # the estimate shown.
                for kind in dict.fromkeys(key[0] for key in calls):
                    key = next(key for key in calls if key[0] == kind)
                    report.warmed(key, b, time_call(calls[key], dev))
                best = fastest_each(calls, dev, PROFILE_REPEATS, CELL_BUDGET)
            if i == 0 and heads:
                self.head.update({m: best[("head", m)] for m in heads})
                self.profiled += len(heads)
            if b is not None:
                cache.rollback(start)
                self.target.setdefault(b, {}).update({w: best[("target", w)] for w in missing})
                if drafting:
                    one, many = best[("draft", 1)], best[("draft", steps)]
                    step = max(0.0, (many - one) / (steps - 1))
                    self.drafts.setdefault(self.drafter, {})[b] = [max(0.0, one - step), step]
                self.profiled += len(missing)
        self._clean = self._clean_head = None
        self.save()
        report.done(self.path)

    @torch.inference_mode()
    def timed_under_load(self, model: torch.nn.Module) -> bool:
        """Whether a one-row forward of the stored table now runs under RECHECK_SLACK of its
        stored time (see RECHECK_SLACK): the table was measured on a busy machine."""
        stored = {w: s for w, s in self.target.get(1, {}).items() if s >= RECHECK_FLOOR}
        if not stored:
            return False
        scratch = self._scratch or Scratch(model, 1, max(stored), ranked=0)
        cache = scratch.rows(1)[0]
        start, dev = list(cache.host_lengths), model.embed_tokens.weight.device
        calls = target_calls(model, cache, sorted(stored))
        time_call(calls[min(stored)], dev)  # warm-up
        now = fastest_each(calls, dev, RECHECK_REPEATS, CELL_BUDGET)
        cache.rollback(start)
        slowed = {w: stored[w] / now[w] for w in stored if now[w] < RECHECK_SLACK * stored[w]}
        if slowed and self.progress:
            w = max(slowed, key=slowed.get)
            print(f"specdraft: the step costs in {self.path} read up to {slowed[w]:.2f}x this machine's time now "
                  f"({w} tokens); they were measured under load, measuring again", file=sys.stderr)
        return bool(slowed)


class _Progress:
    """The one-time profile's lines on stderr: how long it will take, estimated once its first
    call has been timed (at real sizes it holds up the first token for seconds), then what it took."""

    def __init__(self, enabled: bool, t0: float, plan: dict[int, tuple[list[int], bool]], heads: list[int]):
        self.enabled, self.t0, self.plan, self.heads = enabled, t0, plan, heads
        self.estimate: float | None = None

    def warmed(self, key: tuple, rows: int | None, seconds: float) -> None:
        """A warm-up call (`key` as in ensure's cells, for `rows` rows) took `seconds`."""
        if self.estimate is not None:
            return
        self.estimate = time.perf_counter() - self.t0 + estimate_seconds(self.plan, self.heads, key, rows, seconds)
        if self.enabled:
            print(f"specdraft: measuring step costs once for this model (~{max(1, round(self.estimate))} s) ...",
                  file=sys.stderr, flush=True)

    def done(self, path: Path) -> None:
        if self.enabled:
            rows = f" for batch sizes {', '.join(map(str, self.plan))}" if self.plan else ""
            print(f"specdraft: step costs done in {time.perf_counter() - self.t0:.1f} s{rows} (cached in {path})",
                  file=sys.stderr, flush=True)
