"""One runner per method behind one small interface: ids in, tokens and times out.

Every method gets the same token ids (tokenized once, outside the timer), the same
max_new_tokens and the same stop rule (the target's EOS ids, nothing else; none under
--ignore-eos, `BenchContext.eos_token_ids`), and is timed
around its generate call only. A method that cannot run here raises `Skip` with the reason,
and the benchmark reports it instead of crashing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams

if TYPE_CHECKING:
    from specdraft.engine_builder import BuiltEngine


class Skip(Exception):
    """This method cannot run in this environment; the message says why."""


@dataclass
class RowOutput:
    token_ids: list[int]  # new tokens, cut after the first EOS (included)
    seconds: float  # from the start of the batch until this row was finished
    ttft: float | None  # time to first token; None where the method cannot tell
    finish_reason: str  # "eos" | "length"
    stats: dict | None = None  # speculative counters, for methods that expose them


@dataclass
class BatchOutput:
    rows: list[RowOutput]
    wall_seconds: float  # the whole generate call


@dataclass
class BenchContext:
    """What method builders need: the loaded specdraft target and the run's settings."""

    rt: object  # specdraft.runtime.Runtime
    sampling: SamplingParams
    draft_tokens: int | None = None
    drafter_path: str | None = None
    draft_model: str | None = None
    gguf_path: str | None = None  # for llama-cpp; None = derive from the model, or skip
    n_ctx: int = 2048  # llama.cpp context: longest prompt + max_new_tokens + slack
    shared: dict = field(default_factory=dict)  # weights loaded once and shared (hf and hf-pld)
    ignore_eos: bool = False  # --ignore-eos: every row generates max_new_tokens

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids every method stops at: the target's EOS ids, or none under --ignore-eos."""
        return [] if self.ignore_eos else list(self.rt.tokenizer.eos_token_ids)

    def runtime(self, weights: str | None):
        """The run's target, or the same model with another weight format (METHOD:WEIGHTS), loaded once."""
        from specdraft.runtime import Runtime

        if weights is None or weights == self.rt.weights:
            return self.rt
        key = ("runtime", weights)
        if key not in self.shared:
            try:
                self.shared[key] = Runtime.load(self.rt.name, device=self.rt.device.type, weights=weights,
                                                progress=False)
            except SpecdraftError as e:
                raise Skip(f"--weights {weights}: {e}") from None
        return self.shared[key]


class Method:
    """Base class. `generate` is the one required method."""

    name: str = ""
    max_batch_size: int | None = None  # None: any batch size
    draft_tokens: int = 0
    notes: list[str]

    def __init__(self) -> None:
        self.notes = []
        self.load_rss_delta = 0  # set by the builder: resident memory its loading added
        self.own_weight_bytes = 0  # weights this method holds beyond the specdraft target
        self.drafter_bytes: int | None = None  # Drafter.nbytes() for specdraft drafters

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
        raise NotImplementedError

    def supports(self, batch_size: int) -> bool:
        return self.max_batch_size is None or batch_size <= self.max_batch_size

    def close(self) -> None:
        """Free what the method holds (peers' models)."""


def cut_at_eos(ids: list[int], eos: set[int], max_new: int) -> tuple[list[int], str]:
    """New tokens up to and including the first EOS; the same rule specdraft's engine applies."""
    ids = ids[:max_new]
    for j, t in enumerate(ids):
        if t in eos:
            return ids[: j + 1], "eos"
    return ids, "length"


class SpecdraftMethod(Method):
    def __init__(self, name: str, rt, built: BuiltEngine, sampling: SamplingParams,
                 eos_token_ids: list[int] | None = None):
        super().__init__()
        self.name, self.rt, self.sampling = name, rt, sampling
        self.eos_token_ids = eos_token_ids  # None: the tokenizer's
        self.engine, self.draft_tokens = built.engine, built.draft_tokens
        drafter = built.engine.drafter
        self.drafter_bytes = drafter.nbytes() if drafter is not None else None

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
        from specdraft.speculative.simulation import prepare_references

        self.engine.prepare_policy(len(prompts))  # the adaptive policy's one-time cost profile stays out of the timing
        # Simulated acceptance: the plain continuations its drafts match, decoded here, untimed.
        prepare_references(self.engine, prompts, max_new_tokens, (), self.eos_token_ids)
        cuda = self.rt.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = self.engine.generate(prompts, max_new_tokens, self.sampling, eos_token_ids=self.eos_token_ids)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        rows = []
        for r in results:
            s = r.stats
            stats = {
                "target_forwards": s.target_forwards,
                "drafted_by_position": list(s.drafted_by_position),
                "accepted_by_position": list(s.accepted_by_position),
                "time_split": {k: round(v, 6) for k, v in s.times.items()},
            }
            rows.append(RowOutput(list(r.token_ids), r.seconds, r.ttft, r.finish_reason, stats))
        return BatchOutput(rows, wall)


def measure_load(load):
    """Run `load()` and return (result, resident bytes it added)."""
    from specdraft.bench.memory import rss_bytes

    before = rss_bytes()
    out = load()
    return out, max(0, rss_bytes() - before)


def build_specdraft(name: str, ctx: BenchContext) -> Method:
    """specdraft plain or with one of its drafters, or raise Skip."""
    from specdraft.bench import CONTROL, method_profile, method_weights, split_method
    from specdraft.drafters.simulated import parse_profile
    from specdraft.drafters.kinds import AUTO_WITH_DRAFTER, MTP_KINDS, shipped_drafter_path
    from specdraft.engine_builder import build_engine
    from specdraft.loading.presets import PRESETS

    rt = ctx.runtime(method_weights(name))
    base, folder = split_method(name)  # mtp@FOLDER: another drafter than the run's
    if base in ("plain", CONTROL):  # CONTROL: a second plain engine, the run's noise control
        return SpecdraftMethod(name, rt, build_engine(rt, "none"), ctx.sampling, ctx.eos_token_ids)
    path, kind = None, base
    if base in MTP_KINDS:
        # Only preset names have shipped drafters (a folder path would resolve to itself).
        shipped = shipped_drafter_path(rt.name) if rt.name in PRESETS else None
        path = folder or ctx.drafter_path or (str(shipped) if shipped else None)
        if path is None:
            raise Skip(f"no MTP drafter: none ships for {rt.name!r} and --drafter-path was not given")
    if base == "auto" and folder is not None:  # what --drafter auto would do with that drafter shipped
        path, kind = folder, AUTO_WITH_DRAFTER
    if base == "draft-model":
        path = ctx.draft_model
        if path is None:
            raise Skip("no draft model: give --draft-model NAME|PATH")
    # Named drafters run at their fixed K (the draft policy's yardsticks); `auto` is exactly what
    # --drafter auto does: the adaptive policy picks each round's width from measured costs.
    policy = "adaptive" if base == "auto" else "fixed"
    spec = method_profile(name)
    simulate = parse_profile(spec) if spec is not None else None
    try:
        sim = {"simulate": simulate} if simulate is not None else {}
        built, delta = measure_load(lambda: build_engine(rt, kind, path, ctx.draft_tokens, policy, **sim))
    except SpecdraftError as e:
        raise Skip(str(e)) from None
    method = SpecdraftMethod(name, rt, built, ctx.sampling, ctx.eos_token_ids)
    method.load_rss_delta = delta
    if simulate is not None:
        # One plain pass per prompt for every simulated method on this target, not one each.
        built.engine.drafter.references = ctx.shared.setdefault(("simulation references", id(rt)), {})
        method.notes.append(f"SIMULATED acceptance {simulate.name} (cumulative by position "
                            f"{', '.join(f'{p:g}' for p in simulate.cumulative)}: {simulate.source}); the drafter "
                            "runs and is paid for, its drafts match the plain output that often")
    drafter, kind, k = built.engine.drafter, built.drafter, built.draft_tokens
    path = path or built.drafter_path  # `auto`: the drafter it chose (the shipped one, Gemma 4's assistant)
    if base == "auto":
        method.notes.append(f"auto = {kind}" + ("; adaptive draft width per round (0 = plain) from step costs "
                                                 "measured on this machine" if drafter else ""))
    elif drafter is not None and rt.speculate_below:
        method.notes.append(f"fixed K; rounds with {rt.speculate_below} or more decoding rows run plain")
    if drafter is None:
        return method
    if base == "draft-model":
        method.own_weight_bytes = sum(p.numel() * p.element_size() for p in drafter.model.parameters())
        method.notes.append(f"draft model {path}, K={k}")
    else:
        method.own_weight_bytes = drafter.nbytes()
        method.notes.append(f"drafter {path}, K={k}" if path else f"K={k}")
        if drafter.mixes_lookups:
            method.notes.append(f"prompt lookup up to {drafter.lookup_tokens} tokens where the last "
                                f"{drafter.min_match}-{drafter.max_ngram} tokens occurred before")
    return method
