"""Orchestration: load once, tokenize once, warm up, then interleave methods prompt by prompt.

Interleaving (every method runs batch g before any method runs batch g+1, with the method
order rotated from batch to batch) makes slow drift of the machine (thermal, other tenants)
land on all methods alike instead of on whichever ran last.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdraft.bench import (ALL_METHODS, DEFAULT_METHODS, PEER_METHODS, SPECDRAFT_METHODS, memory, metrics, peers,
                             split_method)
from specdraft.bench.methods import BenchContext, Method, Skip, build_specdraft
from specdraft.bench.questions import (DEFAULT_QUESTIONS, PLAIN_TEMPLATE, Question, encode, prompt_style,
                                       read_questions, select)
from specdraft.bench.steps import weight_bytes_per_step
from specdraft.device import dtype_name, set_threads
from specdraft.drafters.simulated import SimulatedAcceptance
from specdraft.errors import SpecdraftError
from specdraft.loading.presets import DEFAULT_MODEL
from specdraft.sampling import SamplingParams

REFERENCE = "plain"
WARMUP_TOKENS = 8
# The warm-up pays first-call costs (kernel builds, allocations, a peer's start), which do not grow
# with the prompt: a long prompt warms up on its last tokens only, not once more in full.
WARMUP_PROMPT_TOKENS = 256


@dataclass
class BenchConfig:
    questions: Path = DEFAULT_QUESTIONS
    model: str = DEFAULT_MODEL
    categories: list[str] | None = None
    limit_per_category: int | None = None
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    drafter_path: str | None = None
    draft_model: str | None = None
    draft_tokens: int | None = None
    gguf: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    temperature: float = 0.0
    top_k: int = 0  # with temperature > 0: keep the k likeliest tokens (0 = off)
    top_p: float = 1.0  # with temperature > 0: the smallest set of tokens holding this mass
    seed: int = 0
    max_new_tokens: int = 128
    ignore_eos: bool = False  # every row generates max_new_tokens: sampled methods then compare like for like
    repeats: int = 1
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None  # CPU threads for torch and llama.cpp alike; None = the physical cores
    weights: str = "auto"  # models.formats.choice.resolve_weights
    prefill_dtype: str = "auto"  # models.formats.choice.resolve_prefill_dtype
    compile: bool = False  # models/compile.py
    out: Path = Path("bench-out")
    warmup: bool = True
    progress: bool = True
    plots: bool = True

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise SpecdraftError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise SpecdraftError(f"--repeats must be >= 1, got {self.repeats}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise SpecdraftError(f"--batch-sizes must be positive integers, got {self.batch_sizes}")
        if self.threads is not None and self.threads < 1:
            raise SpecdraftError(f"--threads must be >= 1, got {self.threads}")
        if self.limit_per_category is not None and self.limit_per_category < 1:
            raise SpecdraftError(f"--limit-per-category must be >= 1, got {self.limit_per_category}")


def machine_info(rt) -> dict:
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "llama_cpp_python": version("llama_cpp_python"),
        "specdraft": version("specdraft"),
        "device": str(rt.device),
        "dtype": rt.dtype_name,
        "weights": rt.weights,
        "prefill_dtype": None if rt.prefill_dtype is None else dtype_name(rt.prefill_dtype),
        "compiled": rt.model.compiled_step is not None,
        "compile_seconds": round(rt.model.compiled_step.compile_seconds, 1) if rt.model.compiled_step else None,
        "gpu": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else None,
    }
    info.update(_git_state())
    info["memory_read_gbs"] = read_bandwidth_gbs(rt.device)
    return info


def read_bandwidth_gbs(device: torch.device, megabytes: int = 512) -> float:
    """Memory read bandwidth as torch sees it (best of 5 sums over a 512 MB tensor, current threads).

    Decoding one token reads every weight once, so weight bytes / this bandwidth is the floor of
    a memory-bound step; results.md compares plain decoding against it.
    """
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return round(x.numel() * 4 / best / 1e9, 2)


def _git_state() -> dict:
    """The commit of the specdraft checkout (read-only git calls; None outside a checkout)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
        return {"git_commit": commit, "git_dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def _batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _method_order(methods: list[Method], g: int) -> list[Method]:
    """Rotate so each method takes each slot in turn; the first-run method is not always first."""
    k = g % len(methods)
    return methods[k:] + methods[:k]


def build_method(name: str, ctx: BenchContext) -> Method:
    """Build one method or raise Skip. Peers' imports (transformers, llama.cpp) are optional."""
    if split_method(name)[0] in SPECDRAFT_METHODS:
        return build_specdraft(name, ctx)
    if split_method(name)[0] in PEER_METHODS:
        return peers.build(name, ctx)
    raise SpecdraftError(f"unknown method {name!r} (choose from {', '.join(ALL_METHODS)})")


def _build_methods(names: list[str], ctx: BenchContext) -> tuple[list[Method], dict[str, str]]:
    methods, skipped = [], {}
    for name in names:
        try:
            methods.append(build_method(name, ctx))
        except Skip as e:
            skipped[name] = str(e)
    return methods, skipped


def _records(m: Method, out, batch_idx: list[int], g: int, bs: int, repeat: int, questions: list[Question],
             ids: list[list[int]], mem: memory.PeakSampler) -> tuple[list[dict], dict]:
    rows = []
    for i, row in zip(batch_idx, out.rows):
        q = questions[i]
        rec = {"method": m.name, "batch_size": bs, "batch": g, "repeat": repeat, "index": i,
               "question_id": q.qid, "category": q.category, "prompt_tokens": len(ids[i]),
               "new_tokens": len(row.token_ids), "seconds": row.seconds, "ttft": row.ttft,
               "finish_reason": row.finish_reason, "token_ids": row.token_ids,
               "target_forwards": None, "drafted_by_position": None, "accepted_by_position": None}
        if row.stats:
            rec.update(row.stats)
        rows.append(rec)
    batch = {"method": m.name, "batch_size": bs, "batch": g, "repeat": repeat, "rows": len(out.rows),
             "wall_seconds": out.wall_seconds, "new_tokens": sum(len(r.token_ids) for r in out.rows),
             "rss_before": mem.before, "rss_peak": mem.peak, "rss_peak_delta": mem.delta,
             "cuda_peak": mem.cuda_peak}
    return rows, batch


@dataclass
class _Measured:
    rows: list[dict] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)
    interrupted: bool = False


def _measure(cfg: BenchConfig, methods: list[Method], skipped: dict[str, str], questions: list[Question],
             ids: list[list[int]], device: torch.device) -> _Measured:
    """Warm up, then run every batch with every method (order rotating), repeats back to back.

    A method that raises is dropped and reported in `skipped`; Ctrl-C stops the loop and keeps
    what was measured so far."""
    from tqdm import tqdm

    got = _Measured()
    plan = [(bs, _batches(len(questions), bs)) for bs in cfg.batch_sizes]
    total = sum(len(groups) * sum(m.supports(bs) for m in methods) for bs, groups in plan) * cfg.repeats
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not cfg.progress, dynamic_ncols=True)

    def drop(m: Method, why: str) -> None:
        skipped[m.name] = why
        methods.remove(m)

    try:
        for bs, groups in plan:
            if cfg.warmup:
                for m in [m for m in methods if m.supports(bs)]:
                    try:  # one short generation per method and batch shape: first-call costs stay out
                        m.generate([ids[i][-WARMUP_PROMPT_TOKENS:] for i in groups[0]],
                                   min(cfg.max_new_tokens, WARMUP_TOKENS))
                    except Exception as e:  # a peer that breaks must not take the run down
                        drop(m, f"failed during warm-up: {type(e).__name__}: {e}")
            for g, idx in enumerate(groups):
                for m in _method_order([m for m in methods if m.supports(bs)], g):
                    for repeat in range(cfg.repeats):
                        bar.set_postfix_str(f"bs={bs} {m.name}")
                        try:
                            with memory.PeakSampler(device) as mem:
                                out = m.generate([ids[i] for i in idx], cfg.max_new_tokens)
                        except Exception as e:
                            drop(m, f"failed at batch size {bs}: {type(e).__name__}: {e}")
                            break
                        r, b = _records(m, out, idx, g, bs, repeat, questions, ids, mem)
                        got.rows.extend(r)
                        got.batches.append(b)
                        bar.update(1)
    except KeyboardInterrupt:
        got.interrupted = True
    finally:
        bar.close()
    return got


def _method_infos(methods: list[Method], target_bytes: int) -> dict:
    infos = {}
    for m in methods:
        drafter = getattr(getattr(m, "engine", None), "drafter", None)
        if drafter is not None:
            m.drafter_bytes = drafter.nbytes()  # after a run: includes per-batch state (draft-model KV)
        rounds = getattr(drafter, "row_rounds", None)
        if rounds and sum(rounds.values()):
            share = 100 * rounds["lookup"] / sum(rounds.values())
            m.notes.append(f"prompt lookup drafted {share:.0f}% of row-rounds, the MTP drafter the rest "
                           "(warm-up included)")
        sim = drafter if isinstance(drafter, SimulatedAcceptance) else None
        infos[m.name] = {
            "simulated_acceptance": None if sim is None else {**sim.profile.describe(), "diverged_requests": sim.diverged},
            "draft_tokens": m.draft_tokens,
            "max_batch_size": m.max_batch_size,
            "notes": m.notes,
            "load_rss_delta": m.load_rss_delta,
            "own_weight_bytes": m.own_weight_bytes,
            "drafter_bytes": m.drafter_bytes,
            "drafter_overhead_pct": 100 * m.drafter_bytes / target_bytes if m.drafter_bytes else None,
        }
    return infos


def run_bench(cfg: BenchConfig) -> dict:
    """Run the whole benchmark and write results.json, results.md and the plots into cfg.out."""
    from specdraft.bench import report
    from specdraft.runtime import Runtime

    cfg.check()
    questions = select(read_questions(cfg.questions), cfg.categories, cfg.limit_per_category)
    names = list(dict.fromkeys([REFERENCE] + list(cfg.methods)))  # plain is the yardstick: always run
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    set_threads(cfg.threads)  # llama.cpp reads the same number (peers.py)

    rss0 = memory.rss_bytes()
    rt = Runtime.load(cfg.model, cfg.dtype, cfg.device, progress=cfg.progress, weights=cfg.weights,
                      compile=cfg.compile, prefill_dtype=cfg.prefill_dtype)
    if cfg.compile:
        rt.model.compiled_step.warm_up(max(cfg.batch_sizes))  # compile time stays out of every timer
    target_load = max(0, memory.rss_bytes() - rss0)
    style = prompt_style(rt.tokenizer)
    ids = [encode(rt.tokenizer, q, style) for q in questions]  # tokenized once, outside every timer
    ctx = BenchContext(rt, sampling, cfg.draft_tokens, cfg.drafter_path, cfg.draft_model, cfg.gguf,
                       n_ctx=max(len(p) for p in ids) + cfg.max_new_tokens + 64, ignore_eos=cfg.ignore_eos)
    methods, skipped = _build_methods(names, ctx)
    built = list(methods)
    for m in methods:
        too_big = [bs for bs in cfg.batch_sizes if not m.supports(bs)]
        if too_big:
            skipped[f"{m.name} @ batch size {','.join(map(str, too_big))}"] = \
                f"runs batch sizes up to {m.max_batch_size} only"

    started = time.time()
    got = _measure(cfg, methods, skipped, questions, ids, rt.device)
    elapsed = time.time() - started
    infos = _method_infos(methods, rt.nbytes())
    for m in built:
        m.close()

    payload = {
        "schema": 1,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "elapsed_seconds": elapsed,
        "interrupted": got.interrupted,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "prompt_format": {"style": style,
                          "template": PLAIN_TEMPLATE if style == "plain" else "the model's chat template, one user turn"},
        "machine": machine_info(rt),
        "target": {"name": rt.name, "folder": str(rt.folder), "weight_bytes": rt.nbytes(),
                   "step_bytes": weight_bytes_per_step(rt.model), "load_rss_delta": target_load},
        "methods": infos,
        "skipped": skipped,
        "questions": [{"index": i, "question_id": q.qid, "category": q.category, "prompt_tokens": len(ids[i])}
                      for i, q in enumerate(questions)],
        "rows": got.rows,
        "batches": got.batches,
        "summary": metrics.summarize(got.rows, got.batches, REFERENCE, sampling.greedy),
        "max_rss": memory.max_rss_bytes(),
    }
    report.write_all(cfg.out, payload, plots=cfg.plots)
    return payload


def rebuild_report(folder: Path, plots: bool = True) -> dict:
    """Recompute a finished run's tables from the raw records in folder/results.json with this
    version's arithmetic (metrics.py) and rewrite results.json, results.md and the plots; nothing
    is measured again."""
    from specdraft.bench import report

    path = folder / "results.json"
    if not path.is_file():
        raise SpecdraftError(f"{path} does not exist (--report-from takes the --out folder of a finished run)")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        rows, batches, config = payload["rows"], payload["batches"], payload["config"]
        reference = payload.get("summary", {}).get("reference", REFERENCE)
        payload["summary"] = metrics.summarize(rows, batches, reference, config["temperature"] == 0)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecdraftError(f"{path} is not a `specdraft bench` results file ({type(e).__name__}: {e})") from None
    report.write_all(folder, payload, plots=plots)
    return payload
