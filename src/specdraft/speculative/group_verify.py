"""A round's rows verified by sampling group, and the law their drafts are drawn from.

Greedy rows are verified together; each sampling group (generate()'s batch, or one server
request) with its own parameters and random stream, so a request's draws never depend on which
others share its round.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft
from specdraft.models.kernels.truncated_probs import truncated_probabilities
from specdraft.sampling import RowStreams, SamplingParams
from specdraft.speculative.request import SamplingGroup
from specdraft.speculative.rows import ActiveRow
from specdraft.speculative.verify import (HEAD_BLOCK, SAMPLED_HEAD_BLOCK, acceptance_chances, acceptance_uniforms,
                                          draft_likelihoods, sampled_probs_blockwise, verify_greedy_blockwise,
                                          verify_sampling)

GREEDY = SamplingParams()


def draft_sampling(rows: list[ActiveRow]) -> tuple[SamplingParams, torch.Generator | RowStreams | None]:
    """(params, random streams) the round's drafts are drawn with. Sampled from the drafter's
    Q when every row samples with the same temperature, top-k and top-p: from the batch's one
    stream (generate()), else each row from its own request's (a server's requests, whose
    draws then stay their own). Otherwise argmax drafts, verified as a point-mass Q: greedy
    rows need them, and one Q cannot serve rows filtered differently. Sampled drafts are
    accepted far more often than argmax drafts at temperature 1 (BENCHMARKS.md, "The int8-row
    kernel's memory order on AVX2")."""
    group = rows[0].group
    if group.params.greedy or any(r.group.params.shaping != group.params.shaping for r in rows):
        return GREEDY, None
    if group.sample_drafts and all(r.group is group for r in rows):
        return group.params, group.generator
    return group.params, [r.group.generator for r in rows]


def verify_rows(model: torch.nn.Module, hidden: torch.Tensor, draft: Draft, rows: list[ActiveRow],
                block: int | None = None):
    """(accepted count, next token, acceptance chances) per row from the target's hidden
    states [B, K+1, H]: greedy rows together, each sampling group with its own parameters and
    random stream. Chances [B, K] (the probability each draft had of being accepted, for the
    draft policy) are None when every row is greedy, NaN on greedy rows otherwise. `block`: the
    positions scored per head call (the draft policy's head_block; None: HEAD_BLOCK for greedy
    rows, SAMPLED_HEAD_BLOCK for sampled ones); it changes what the round costs, never its verdicts."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(0 if r.group.params.greedy else id(r.group), []).append(i)
    if len(groups) == 1:
        return _verify_group(model, hidden, draft.tokens, draft.num_valid, draft.probs, rows[0].group, block=block)
    device = hidden.device
    accepted = torch.empty(len(rows), dtype=torch.long, device=device)
    nxt = torch.empty_like(accepted)
    chances = torch.full(draft.tokens.shape, float("nan"), device=device)
    sampled = [idx for key, idx in groups.items() if key != 0]
    first = _first_blocks(model, hidden, draft, groups.get(0, []), sampled, block)
    for key, idx in groups.items():
        at = torch.tensor(idx, device=device)
        probs = draft.probs[at] if draft.probs is not None else None
        accepted[at], nxt[at], chance = _verify_group(model, hidden[at], draft.tokens[at], draft.num_valid[at],
                                                      probs, rows[idx[0]].group, first.get(idx[0]), block)
        if chance is not None:
            chances[at, : chance.shape[1]] = chance
    return accepted, nxt, chances


def _first_blocks(model: torch.nn.Module, hidden: torch.Tensor, draft: Draft, greedy: list[int],
                  sampled: list[list[int]], block: int | None = None) -> dict[int, torch.Tensor]:
    """For a round with several groups to verify (a server's requests: greedy ones together,
    each sampled one a group), each group's first block from one head call, keyed by its
    first row: the greedy rows' tokens [rows, positions], each sampling group's logits [rows,
    positions, V]. Scored group by group, the head's table was read once per group and round
    (4 passes for 4 sampled requests where one does). A group gets the positions its own
    verification scores first (`block`, or by default HEAD_BLOCK for greedy rows and
    SAMPLED_HEAD_BLOCK for sampled ones; fewer for fewer drafts), and the head scores each row on
    its own, so they are the tokens and logits it would get alone."""
    greedy_span = min(block or HEAD_BLOCK, hidden.shape[1]) if greedy else 0
    pairs = [(i, j) for i in greedy for j in range(greedy_span)]
    spans = []
    for idx in sampled:
        width = int(draft.num_valid[idx].max()) if draft.tokens.shape[1] else 0
        spans.append(min(block or SAMPLED_HEAD_BLOCK, width + 1))
        pairs += [(i, j) for i in idx for j in range(spans[-1])]
    rows, positions = (torch.tensor(x, device=hidden.device) for x in zip(*pairs))
    tokens, logits = model.head_outputs(hidden[rows, positions], len(greedy) * greedy_span)
    first = {greedy[0]: tokens.view(len(greedy), greedy_span)} if greedy else {}
    blocks = logits.split([len(idx) * n for idx, n in zip(sampled, spans)])
    return first | {idx[0]: block.view(len(idx), n, -1) for idx, n, block in zip(sampled, spans, blocks)}


def _verify_group(model: torch.nn.Module, hidden, drafts, num_valid, q, group: SamplingGroup,
                  first: torch.Tensor | None = None, block: int | None = None):
    """`first`: the group's first block (greedy: tokens, sampled: logits) when it was computed
    with other groups'; `block`: as verify_rows'."""
    if group.params.greedy:  # only the argmax matters: no V-wide float32 logits
        return *verify_greedy_blockwise(model.greedy_tokens, hidden, drafts, num_valid, block or HEAD_BLOCK,
                                        first=first), None
    # Only the group's own drafts: its random draws then never depend on the round's width.
    width = int(num_valid.max()) if drafts.shape[1] else 0
    q = q[:, :width] if q is not None else None
    drafts = drafts[:, :width]
    uniforms = acceptance_uniforms(drafts.shape[0], width, group.generator, drafts.device)
    if first is not None:
        first = truncated_probabilities(first, group.params)
    probs = sampled_probs_blockwise(lambda rows: truncated_probabilities(model.logits(rows), group.params),
                                    hidden[:, : width + 1], drafts, q, num_valid, uniforms,
                                    block or SAMPLED_HEAD_BLOCK, first=first)
    likelihoods = draft_likelihoods(probs, drafts, q)  # P and Q at the drafts, read by both
    accepted, nxt = verify_sampling(probs, drafts, q, num_valid, group.generator, uniforms, likelihoods)
    return accepted, nxt, acceptance_chances(probs, drafts, q, num_valid, likelihoods)
