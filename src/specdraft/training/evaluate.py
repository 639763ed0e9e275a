"""Measuring a drafter: teacher-forced acceptance on recorded answers (cheap, used while
training), and real acceptance with the engine for a range of K, greedy and sampled. Where the
two part is gap.py."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from tqdm import tqdm

from specdraft.drafters.mtp.drafter import GREEDY_CONFIDENCE, MTPDrafter, layer_contexts
from specdraft.sampling import SamplingParams, probabilities
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


def fixed_k_engine(rt, drafter, k: int):
    """An engine that drafts K tokens every round (the drafter's own early stop aside): what a
    measurement of a drafter at K means. engine_builder's engines may choose widths by a cost
    model, and their fixed policy runs plain rounds from 4 decoding rows on a CPU: a batch-8
    measurement under that rule would count mostly plain rounds, so this engine never skips
    drafting."""
    from specdraft.speculative.engine import Engine

    return Engine(rt.model, rt.tokenizer, drafter, k, speculate_below=None)


def evaluate_drafter(rt, drafter, prompts: list[str], ks: list[int], temperatures: list[float],
                     max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0) -> list[EvalRow]:
    ids = encode_eval_prompts(rt.tokenizer, prompts)
    rows = []
    runs = [(k, t) for t in temperatures for k in ks]
    with tqdm(total=len(runs) * len(ids), desc="eval-drafter", unit="prompt") as bar:
        for k, temp in runs:
            engine = fixed_k_engine(rt, drafter, k)
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
                              device: torch.device, chunk: int = 8, per_sequence: list | None = None,
                              min_confidence: float | None = None) -> dict:
    """For every answer position t: draft K steps from (x(t+1), h_t) with the real inference
    head, count the leading steps whose pick equals the target's argmax. Returns the implied
    tau for this K, acceptance per position, and cluster recall per position.

    Averaging over every anchor overstates what decoding sees: a real round starts right after
    the target corrected the drafter, often in a hard stretch. So on the greedy answers we also
    replay decoding itself (start at the prompt's end, accept the anchor's prefix, jump past
    it) and report that tau as `decoding_tau`; it predicts the engine's greedy tau. The replay
    runs the drafter as the engine does: with its early stop (`min_confidence`, default the
    drafter's: no drafts after one it gave less probability), and counted as the engine counts
    (tokens per target forward, the prefill and the token it emits included).
    `decoding_acceptance_by_position` is the acceptance by position at those replayed anchors
    only (conditional on the earlier drafts, as `acceptance_by_position`), so with
    min_confidence 0 the two differ only in where rounds start. `tau` and
    `acceptance_by_position` always draft K tokens (the training-time metric). `per_sequence`,
    when a list, receives {anchor t: (drafts the replay accepts, first draft)} for every
    sequence (the per-anchor check against the engine uses it)."""
    if not seqs:
        return {}
    accepted_prefix, anchors_total = 0, 0
    chain_tokens, chain_rounds = 0, 0
    # Counters per draft position, kept where the counts are made (no host sync per step).
    pos_ok, pos_seen, recall, valid_seen, dec_ok, dec_seen = torch.zeros(6, k_steps, device=device)
    min_conf = drafter.min_confidence if min_confidence is None else min_confidence
    target = drafter.target
    dtype = target.dtype
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
        # Decoding as the engine runs it: a step is drafted while no earlier draft was unsure.
        drafting = batch.anchor_valid.clone()
        dec_alive = batch.anchor_valid.clone()
        dec_prefix = torch.zeros_like(batch.anchors)
        reached, accepted = [], []  # per step [b, a]: the step was drafted (earlier ones right) / also right
        first_pick = None
        for k in range(k_steps):
            pos = batch.anchors + 1 + k
            valid = batch.anchor_valid & (pos <= batch.lengths[:, None] - 2)
            pos = pos.clamp(max=batch.tokens.shape[1] - 1)
            z, state = drafter.net.step(target.embed(batch.tokens.gather(1, pos)), state, contexts)
            b, a = pos.shape
            copies = batch.copies.gather(1, pos[:, :, None].expand(-1, -1, batch.copies.shape[2]))
            logits, cands = drafter.logits(z.reshape(b * a, -1), state.reshape(b * a, -1), copies.reshape(b * a, -1))
            pick = logits.argmax(-1)
            pick = (pick if cands is None else cands.gather(1, pick[:, None]).squeeze(1)).view(b, a)
            want = batch.topk_ids[:, :, 0].gather(1, pos)
            if k == 0:
                first_pick = pick
            ok = (pick == want) & valid
            if cands is not None:
                recall[k] += ((cands.view(b, a, -1) == want[:, :, None]).any(-1) & valid).sum()
            valid_seen[k] += valid.sum()
            pos_seen[k] += (alive & valid).sum()
            pos_ok[k] += (alive & ok).sum()
            alive &= ok
            prefix += alive.long()
            reached.append(dec_alive & valid & drafting)
            accepted.append(dec_alive & ok & drafting)
            dec_alive &= ok & drafting
            dec_prefix += dec_alive.long()
            if min_conf > 0:
                q = probabilities(logits, GREEDY_CONFIDENCE).gather(1, logits.argmax(-1, keepdim=True)).view(b, a)
                drafting &= q >= min_conf
        accepted_prefix += int(prefix[batch.anchor_valid].sum())
        anchors_total += int(batch.anchor_valid.sum())
        for i, seq in enumerate(group):
            if per_sequence is not None:
                v = batch.anchor_valid[i]
                per_sequence.append(dict(zip(batch.anchors[i][v].tolist(),
                                             zip(dec_prefix[i][v].tolist(), first_pick[i][v].tolist()))))
            if seq.temperature == 0:
                visited: list[int] = []
                tokens, rounds = replay_greedy_decoding(batch.anchors[i], batch.anchor_valid[i], dec_prefix[i],
                                                        seq.prompt_length, visited)
                if rounds:  # the engine's count: the prefill is a target forward and emits a token
                    chain_tokens, chain_rounds = chain_tokens + tokens + 1, chain_rounds + rounds + 1
                cols = [j for j, t in enumerate(batch.anchors[i].tolist()) if t in set(visited) and batch.anchor_valid[i, j]]
                for k in range(k_steps):
                    dec_seen[k] += reached[k][i, cols].sum()
                    dec_ok[k] += accepted[k][i, cols].sum()
    seen_any = pos_seen.clamp(min=1)
    return {
        "tau": round(1 + accepted_prefix / max(1, anchors_total), 4),
        "decoding_tau": round(chain_tokens / chain_rounds, 4) if chain_rounds else None,
        "acceptance_by_position": [round(x, 4) for x in (pos_ok / seen_any).tolist()],
        "decoding_acceptance_by_position": [round(o / n, 4) if n else None for o, n in
                                            zip(dec_ok.tolist(), dec_seen.tolist())] if chain_rounds else None,
        "cluster_recall": [round(x, 4) for x in (recall / valid_seen.clamp(min=1)).tolist()]
        if drafter.net.masked_embedding is not None else None,
        "anchors": anchors_total,
    }


def replay_greedy_decoding(anchors: torch.Tensor, valid: torch.Tensor, prefix: torch.Tensor,
                           prompt_length: int, visited: list[int] | None = None) -> tuple[int, int]:
    """(tokens emitted, rounds) of greedy speculative decoding over one recorded greedy answer,
    given each anchor's accepted draft length: a round at t emits prefix[t] + 1 tokens.
    `visited`, when a list, receives the anchors where rounds start."""
    accepted = dict(zip(anchors[valid].tolist(), prefix[valid].tolist()))
    tokens = rounds = 0
    t = prompt_length - 1
    while t in accepted:
        if visited is not None:
            visited.append(t)
        rounds, tokens = rounds + 1, tokens + accepted[t] + 1
        t += accepted[t] + 1
    return tokens, rounds
