"""Where teacher-forced and engine acceptance part (`eval-drafter --gap`): the same prompts
scored both ways, each engine round recorded, and the first draft's acceptance broken down by
the target's confidence and by copies."""

from __future__ import annotations

import math

import torch

from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.sampling import SamplingParams
from specdraft.speculative.stats import merge
from specdraft.training.data import Sequence
from specdraft.training.evaluate import encode_eval_prompts, fixed_k_engine, teacher_forced_acceptance


class RecordingDrafter(MTPDrafter):
    """An MTPDrafter that drafts exactly as the one it wraps and records every round: the anchor
    p, the token b, the drafts, and per draft step the clusters ranked first by the centroid
    scorer (the top `record_clusters`, best first). Cluster recall in real decoding is read off
    these records against the text the target emitted (`decoding_records`). It never copies
    from the text (copy_below 0): the gap is about the drafter's own drafts."""

    def __init__(self, base: MTPDrafter, record_clusters: int = 64, min_confidence: float | None = None):
        super().__init__(base.net, base.target, base.sources,
                         base.min_confidence if min_confidence is None else min_confidence, copy_below=0.0)
        self.recommended_k = base.recommended_k
        self.record_clusters = record_clusters
        self.rounds: list[dict] = []
        self._steps: list[torch.Tensor] = []

    def greedy_pick(self, step, copies):
        """None: greedy drafts go through `logits`, which records the clusters (the head's one C
        call, which skips it, picks the same drafts: test_mtp_internals.py)."""
        return None

    def logits(self, z: torch.Tensor, state: torch.Tensor, copies: torch.Tensor | None = None, sampled: bool = False,
               step=None):
        head = self.net.masked_embedding
        if head is not None:
            n = min(max(self.record_clusters, head.top_k), head.num_centroids)
            self._steps.append(torch.topk(head.centroids(z).float(), n, dim=-1).indices.cpu())
        return super().logits(z, state, copies, sampled, step)

    def propose(self, inp, k, sampling, generator):
        self._steps = []
        draft = super().propose(inp, k, sampling, generator)
        self.rounds.append({"position": inp.position.tolist(), "last_token": inp.last_token.tolist(),
                            "drafts": draft.tokens.tolist(), "num_valid": draft.num_valid.tolist(),
                            "clusters": [s.tolist() for s in self._steps]})
        return draft


def decoding_records(rounds: list[dict], sequence: list[int], k: int, top_ks: tuple[int, ...],
                     cluster_of_token: torch.Tensor | None) -> dict:
    """Counts over one row's rounds (batch 1) given the row's whole greedy text `sequence`
    (prompt + output): per draft position j, rounds that reached it (drafts 1..j-1 right) and
    had a target token there, drafts accepted, and target tokens inside the top-n clusters of
    that step for each n in top_ks; plus each round's accepted drafts by anchor."""
    reached = [0] * k
    right = [0] * k
    inside = {n: [0] * k for n in top_ks}
    miss_outside = {n: [0] * k for n in top_ks}  # rejected drafts whose target token was outside the top n
    by_anchor: dict[int, int] = {}
    first: dict[int, int | None] = {}
    for r in rounds:
        p, b = r["position"][0], r["last_token"][0]
        if p + 1 >= len(sequence) or sequence[p + 1] != b:
            raise AssertionError(f"round at p={p}: b={b} is not the emitted token at p+1")
        drafts = r["drafts"][0][: r["num_valid"][0]]
        n_ok = 0
        for j, d in enumerate(drafts):
            if p + 2 + j >= len(sequence):
                break
            want = sequence[p + 2 + j]
            reached[j] += 1
            if cluster_of_token is not None and j < len(r["clusters"]):
                ranked = r["clusters"][j][0]
                c = int(cluster_of_token[want])
                for n in top_ks:
                    hit = c in ranked[:n]
                    inside[n][j] += hit
                    miss_outside[n][j] += (d != want) and not hit
            if d != want:
                break
            right[j] += 1
            n_ok += 1
        by_anchor[p] = n_ok
        first[p] = drafts[0] if drafts else None
    return {"reached": reached, "right": right, "inside": inside, "miss_outside": miss_outside, "by_anchor": by_anchor,
            "first_draft": first}


def acceptance_gap(rt, drafter: MTPDrafter, prompts: list[str], k: int, max_new_tokens: int = 96,
                   min_confidence: float | None = 0.0, top_ks: tuple[int, ...] = (32, 64), log=None) -> dict:
    """What explains the gap between teacher-forced and engine acceptance, on the same prompts
    and the same target configuration (`rt`: its dtype and weight format), batch 1, greedy:

    - the target answers each prompt by plain greedy decoding, recording hidden states and K/V
      as training data does (`data.record_answers`), and the drafter is scored teacher-forced on
      those answers: tau and acceptance over every anchor, the replayed decoding tau, and the
      acceptance at the replayed anchors only (where rounds start);
    - the engine decodes the same prompts with the same drafter (min_confidence overridden,
      default 0: K drafts every round; None keeps the drafter's; the replay uses the same), recording each round: tau,
      acceptance by position conditional on the earlier drafts (comparable with the
      teacher-forced numbers), and cluster recall at each top-n in top_ks;
    - per anchor: how often the engine accepted exactly as many drafts as the teacher-forced
      computation at the same anchor of the same text (1.0 = the two run the drafter alike).
    """
    from specdraft.training.clustering import cluster_of
    from specdraft.training.data import read_slots, record_answers

    ids = encode_eval_prompts(rt.tokenizer, prompts)
    slots = read_slots(rt.model)
    eos = set(rt.tokenizer.eos_token_ids)
    seqs = []
    for i, p in enumerate(ids):
        rec = record_answers(rt.model, [p], max_new_tokens, 0.0, i, slots, 8, eos)[0]
        seqs.append(Sequence(tokens=rec["tokens"].long(), prompt_length=rec["prompt_length"], temperature=0.0,
                             hidden=rec["hidden"], keys={s: rec[f"k.{s}"] for s in slots},
                             values={s: rec[f"v.{s}"] for s in slots}, topk_ids=rec["topk_ids"].long(),
                             topk_logp=rec["topk_logp"]))
    kv_heads = {s.slot: s.num_kv_heads for s in drafter.sources}
    per_seq: list[dict] = []
    with torch.inference_mode():
        tf = teacher_forced_acceptance(drafter, seqs, k, kv_heads, rt.device, chunk=4, per_sequence=per_seq,
                                       min_confidence=min_confidence)
    if log:
        log(f"teacher-forced: {tf}")
    first_draft = first_draft_breakdown(seqs, per_seq)

    rec = RecordingDrafter(drafter, max(top_ks), min_confidence)
    head = drafter.net.masked_embedding
    clusters = cluster_of(head.token_ordering.cpu(), head.num_centroids) if head is not None else None
    engine = fixed_k_engine(rt, rec, k)
    stats = []
    reached, right = [0] * k, [0] * k
    inside = {n: [0] * k for n in top_ks}
    miss_outside = {n: [0] * k for n in top_ks}
    agree = first_agree = compared = same_text = 0
    for i, p in enumerate(ids):
        rec.rounds = []
        out = engine.generate([p], max_new_tokens, SamplingParams(temperature=0.0, seed=0))[0]
        stats.append(out.stats)
        text = list(p) + list(out.token_ids)
        counts = decoding_records(rec.rounds, text, k, top_ks, clusters)
        for j in range(k):
            reached[j] += counts["reached"][j]
            right[j] += counts["right"][j]
            for n in top_ks:
                inside[n][j] += counts["inside"][n][j]
                miss_outside[n][j] += counts["miss_outside"][n][j]
        recorded = seqs[i].tokens.tolist()
        # Compare anchors only while the engine's text equals the recorded one up to the round's
        # last draft (bf16 with unquantised weights may part from plain decoding at a near-tie).
        same = next((j for j, (a, b) in enumerate(zip(text, recorded)) if a != b), min(len(text), len(recorded)))
        same_text += same == min(len(text), len(recorded))
        for t, n_ok in counts["by_anchor"].items():
            if t in per_seq[i] and t + 2 + k <= same:
                compared += 1
                agree += per_seq[i][t][0] == n_ok
                first_agree += per_seq[i][t][1] == counts["first_draft"][t]
        if log:
            log(f"prompt {i}: engine tau {out.stats.mean_accepted:.3f}, {len(rec.rounds)} rounds, text equal to "
                f"plain decoding: {same == min(len(text), len(recorded))}")
    total = merge(stats)
    rounds = total.target_forwards - len(stats)  # minus the prefills
    acc = [right[j] / reached[j] if reached[j] else None for j in range(k)]
    # tau implied by the engine's own rounds, counted as the replay counts (no prefill, no first token)
    engine_rounds_tau = (total.new_tokens - len(stats)) / rounds if rounds else None
    return {
        "k": k, "prompts": len(ids), "max_new_tokens": max_new_tokens, "min_confidence": rec.min_confidence,
        "top_k_clusters": head.top_k if head is not None else None,
        "teacher_forced_tau": tf.get("tau"), "teacher_forced_acceptance": tf.get("acceptance_by_position"),
        "replay_tau": tf.get("decoding_tau"), "replay_acceptance": tf.get("decoding_acceptance_by_position"),
        "teacher_forced_cluster_recall": tf.get("cluster_recall"),
        "engine_tau": round(total.mean_accepted, 4),
        "engine_tau_rounds_only": round(engine_rounds_tau, 4) if engine_rounds_tau else None,
        "engine_acceptance": [None if a is None else round(a, 4) for a in acc],
        "engine_acceptance_unconditional": [None if a is None else round(a, 4) for a in total.acceptance_by_position],
        "engine_cluster_recall": {n: [round(inside[n][j] / reached[j], 4) if reached[j] else None for j in range(k)]
                                  for n in top_ks} if clusters is not None else None,
        "engine_rejections_outside_clusters": {n: [round(miss_outside[n][j] / (reached[j] - right[j]), 4)
                                                   if reached[j] > right[j] else None for j in range(k)]
                                               for n in top_ks} if clusters is not None else None,
        "anchors_compared": compared, "anchors_agreeing": round(agree / compared, 4) if compared else None,
        "first_drafts_agreeing": round(first_agree / compared, 4) if compared else None,
        "texts_equal_to_plain": f"{same_text}/{len(ids)}",
        "engine_rounds": rounds,
        "first_draft": first_draft,
    }


CONFIDENCE_EDGES = (0.0, 0.5, 0.7, 0.9, 0.99, 1.0)


def first_draft_breakdown(seqs: list[Sequence], per_seq: list[dict]) -> dict:
    """Teacher-forced first-draft acceptance over every anchor, split two ways.

    By how sure the target itself was of the token drafted (its top-1 probability there): a
    drafter can hardly beat the target's own doubt, so this separates "the text is hard for the
    target too" (many anchors in the low buckets) from "the drafter misses what the target is
    sure of" (low acceptance in the high buckets). And by whether the pair (current token,
    drafted token) already occurred earlier in the text: the continuations prompt lookup could
    copy, which a drafter reading the target's cache has to learn to copy by attention."""
    hits = [[0, 0] for _ in CONFIDENCE_EDGES[1:]]
    pairs = {True: [0, 0], False: [0, 0]}
    for seq, anchors in zip(seqs, per_seq):
        toks = seq.tokens.tolist()
        for t, (_, first) in anchors.items():
            if t + 1 > len(toks) - 2:  # no target prediction recorded there
                continue
            want = int(seq.topk_ids[t + 1, 0])
            p = math.exp(float(seq.topk_logp[t + 1, 0]))
            b = next(i for i, hi in enumerate(CONFIDENCE_EDGES[1:]) if p <= hi or i == len(hits) - 1)
            repeated = any(toks[j] == toks[t + 1] and toks[j + 1] == want for j in range(t + 1))
            for cell in (hits[b], pairs[repeated]):
                cell[0] += 1
                cell[1] += int(first == want)
    total = sum(n for n, _ in hits) or 1

    def rate(cell: list[int]) -> float | None:
        return round(cell[1] / cell[0], 4) if cell[0] else None

    return {
        "by_target_confidence": [{"target_top1": f"{lo:g}-{hi:g}", "share": round(cell[0] / total, 4),
                                  "acceptance": rate(cell)}
                                 for lo, hi, cell in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:], hits)],
        "repeated_pairs": {"share": round(pairs[True][0] / total, 4), "acceptance": rate(pairs[True]),
                           "elsewhere_acceptance": rate(pairs[False])},
    }
