"""Measured acceptance of a drafter with the real engine: tau and per-position acceptance for
a range of K, greedy and sampled, on held-out prompts."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from specdraft.sampling import SamplingParams
from specdraft.speculative.stats import merge
from specdraft.training.prompts import BASE_TEMPLATE, format_prompt


@dataclass
class EvalRow:
    k: int
    temperature: float
    tau: float
    acceptance_by_position: list[float | None]
    tokens_per_second: float
    new_tokens: int


def encode_eval_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    # Same mix as training data: raw text and the Q/A template, alternating.
    return [format_prompt(tokenizer, p, BASE_TEMPLATE if i % 2 else None) for i, p in enumerate(prompts)]


def evaluate_drafter(rt, drafter, prompts: list[str], ks: list[int], temperatures: list[float],
                     max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0) -> list[EvalRow]:
    ids = encode_eval_prompts(rt.tokenizer, prompts)
    rows = []
    runs = [(k, t) for t in temperatures for k in ks]
    with tqdm(total=len(runs) * len(ids), desc="eval-drafter", unit="prompt") as bar:
        for k, temp in runs:
            engine = rt.engine(drafter, k)
            stats, seconds = [], 0.0
            for start in range(0, len(ids), batch_size):
                t0 = time.perf_counter()
                params = SamplingParams(temperature=temp, seed=seed + start)
                results = engine.generate(ids[start : start + batch_size], max_new_tokens, params)
                seconds += time.perf_counter() - t0
                stats.extend(r.stats for r in results)
                bar.update(len(results))
            total = merge(stats)
            rows.append(EvalRow(k, temp, total.mean_accepted, total.acceptance_by_position,
                                total.new_tokens / seconds if seconds else 0.0, total.new_tokens))
    return rows
