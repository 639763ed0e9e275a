"""Measuring a drafter: teacher-forced acceptance on recorded answers (cheap, used while
training), and real acceptance with the engine for a range of K, greedy and sampled."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from tqdm import tqdm

from specdraft.drafters.mtp.drafter import MTPDrafter, layer_contexts
from specdraft.sampling import SamplingParams
from specdraft.speculative.stats import merge
from specdraft.training.data import Sequence
from specdraft.training.objective import collate, to_device
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


def teacher_forced_acceptance(drafter: MTPDrafter, seqs: list[Sequence], k_steps: int, kv_heads: dict[int, int],
                              device: torch.device, chunk: int = 8) -> dict:
    """For every answer position t: draft K steps from (x(t+1), h_t) with the real inference
    head, count the leading steps whose pick equals the target's argmax. Returns the implied
    tau for this K, acceptance per position, and cluster recall per position.

    Averaging over every anchor overstates what decoding sees: a real round starts right after
    the target corrected the drafter, often in a hard stretch. So on the greedy answers we also
    replay decoding itself (start at the prompt's end, accept the anchor's prefix, jump past
    it) and report that tau as `decoding_tau`; it predicts the engine's greedy tau."""
    if not seqs:
        return {}
    accepted_prefix, anchors_total = 0, 0
    chain_tokens, chain_rounds = 0, 0
    pos_ok = torch.zeros(k_steps)
    pos_seen = torch.zeros(k_steps)
    recall = torch.zeros(k_steps)
    valid_seen = torch.zeros(k_steps)
    target = drafter.target
    dtype = target.head_weight.dtype
    for start in range(0, len(seqs), chunk):
        group = seqs[start : start + chunk]
        # As many anchor slots as the longest answer: every answer position becomes an anchor,
        # which the decoding replay below relies on.
        n_anchor = max(len(s.tokens) - s.prompt_length for s in group)
        batch = to_device(collate(group, n_anchor, kv_heads, random.Random(0), dtype), device)
        contexts = layer_contexts(drafter.sources, batch.keys, batch.values, batch.anchors, dtype)
        state = batch.hidden.gather(1, batch.anchors[:, :, None].expand(-1, -1, batch.hidden.shape[2]))
        alive = batch.anchor_valid.clone()
        prefix = torch.zeros_like(batch.anchors)
        for k in range(k_steps):
            pos = batch.anchors + 1 + k
            valid = batch.anchor_valid & (pos <= batch.lengths[:, None] - 2)
            pos = pos.clamp(max=batch.tokens.shape[1] - 1)
            z, state = drafter.net.step(target.embed(batch.tokens.gather(1, pos)), state, contexts)
            b, a = pos.shape
            logits, cands = drafter.logits(z.reshape(b * a, -1), state.reshape(b * a, -1))
            pick = logits.argmax(-1)
            pick = (pick if cands is None else cands.gather(1, pick[:, None]).squeeze(1)).view(b, a)
            want = batch.topk_ids[:, :, 0].gather(1, pos)
            ok = (pick == want) & valid
            if cands is not None:
                recall[k] += ((cands.view(b, a, -1) == want[:, :, None]).any(-1) & valid).sum()
            valid_seen[k] += valid.sum()
            pos_seen[k] += (alive & valid).sum()
            pos_ok[k] += (alive & ok).sum()
            alive &= ok
            prefix += alive.long()
        accepted_prefix += int(prefix[batch.anchor_valid].sum())
        anchors_total += int(batch.anchor_valid.sum())
        for i, seq in enumerate(group):
            if seq.temperature == 0:
                tokens, rounds = replay_greedy_decoding(batch.anchors[i], batch.anchor_valid[i], prefix[i], seq.prompt_length)
                chain_tokens, chain_rounds = chain_tokens + tokens, chain_rounds + rounds
    seen_any = pos_seen.clamp(min=1)
    return {
        "tau": round(1 + accepted_prefix / max(1, anchors_total), 4),
        "decoding_tau": round(chain_tokens / chain_rounds, 4) if chain_rounds else None,
        "acceptance_by_position": [round(x, 4) for x in (pos_ok / seen_any).tolist()],
        "cluster_recall": [round(x, 4) for x in (recall / valid_seen.clamp(min=1)).tolist()]
        if drafter.net.masked_embedding is not None else None,
        "anchors": anchors_total,
    }


def replay_greedy_decoding(anchors: torch.Tensor, valid: torch.Tensor, prefix: torch.Tensor,
                           prompt_length: int) -> tuple[int, int]:
    """(tokens emitted, rounds) of greedy speculative decoding over one recorded greedy answer,
    given each anchor's accepted draft length: a round at t emits prefix[t] + 1 tokens."""
    accepted = dict(zip(anchors[valid].tolist(), prefix[valid].tolist()))
    tokens = rounds = 0
    t = prompt_length - 1
    while t in accepted:
        rounds, tokens = rounds + 1, tokens + accepted[t] + 1
        t += accepted[t] + 1
    return tokens, rounds
