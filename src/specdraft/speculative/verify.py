"""Accepting drafts against the target's K+1 next-token distributions from one forward.

Row b of a round verified drafts d1..dK; the target's outputs P0..PK are the distributions
after [b, d1..dK]. Both rules return, per row, how many drafts were accepted (n) and the token
to emit after them (from P_n), so a round emits n + 1 tokens. Drafts past a row's `num_valid`
are never accepted (rows may have fewer drafts than the batch's K).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdraft.drafters.base import SparseProbs
from specdraft.models.kernels.sample_rows import draw_tokens


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, K] bool -> length of the all-True prefix per row [B]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _valid(num_valid: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=num_valid.device)[None, :] < num_valid[:, None]


def verify_greedy(target_tokens: torch.Tensor, drafts: torch.Tensor, num_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix with d(i+1) == argmax P_i, then the target's own argmax: exactly greedy.
    target_tokens [B, K+1]: argmax P_0..P_K (the model's `greedy_tokens`)."""
    choice = target_tokens
    k = drafts.shape[1]
    n = _accepted_prefix((drafts == choice[:, :k]) & _valid(num_valid, k))
    return n, choice.gather(1, n[:, None]).squeeze(1)


HEAD_BLOCK = 4  # positions scored together: the CPU head kernels read their table once per 4 rows
# The same when sampling. There a first draft is accepted about half as often as when greedy (MTP
# at temperature 1: ~45% against ~65%), so a 4-position round mostly scores positions that never
# matter; in blocks of 2 it reads the head's table one more time only when the first two drafts
# were both accepted (a quarter of rounds). Measured on a 2-core AVX2 CPU: 1, 2, 3, 4 head rows
# cost 11.9, 16.0, 20.1, 24.8 ms (BENCHMARKS.md).
SAMPLED_HEAD_BLOCK = 2


def verify_greedy_blockwise(greedy_tokens: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            drafts: torch.Tensor, num_valid: torch.Tensor, block: int = HEAD_BLOCK,
                            first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_greedy with the head's argmax computed `block` positions at a time, and only where
    it can matter: a row's positions past its first rejected draft never reach the head.

    hidden [B, K+1, H]; `greedy_tokens` maps [N, H] rows to their argmax, each row on its own (the
    model's contract, kept by the head kernels), so scoring a subset of rows gives every row the
    token it gets in the full call: the same verdicts. On a CPU the LM head is ~40% of a step
    and costs about the same for 1 to 4 rows (one pass over its table), so a 9-wide lookup
    verification whose first draft fails pays one pass instead of three. `first`: the first
    block's tokens [B, min(block, K+1)] when the caller has them (the engine scores a round's
    greedy and sampled rows' first blocks in one head call)."""
    b, width, h = hidden.shape
    if width <= block:  # one block (plain steps, K < block): the plain call, no row bookkeeping
        return verify_greedy(first if first is not None else greedy_tokens(hidden), drafts, num_valid)
    k = drafts.shape[1]
    valid = _valid(num_valid, k)
    choice = torch.zeros(b, width, dtype=torch.long, device=hidden.device)
    alive = torch.arange(b, device=hidden.device)  # rows whose drafts so far all matched
    for start in range(0, width, block):
        stop = min(start + block, width)
        if start == 0 and first is not None:
            choice[:, :stop] = first
        else:
            rows = hidden[alive, start:stop].reshape(-1, h)
            choice[alive, start:stop] = greedy_tokens(rows).view(len(alive), stop - start)
        if stop > k:
            break
        matched = ((drafts[alive, start:stop] == choice[alive, start:stop]) & valid[alive, start:stop]).all(dim=1)
        alive = alive[matched]
        if len(alive) == 0:
            break
    return verify_greedy(choice, drafts, num_valid)


def verify_sampling(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | SparseProbs | None,
    num_valid: torch.Tensor,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
    likelihoods: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept d(i+1) with probability min(1, P_i(d) / Q_i(d)); at the first rejection draw from
    norm(max(P_i - Q_i, 0)); when every draft is accepted draw the bonus token from P_K.
    `draft_probs` None means the drafts were argmax choices: Q is a point mass on d, so the
    acceptance probability is P_i(d) and the residual is P_i with d removed, renormalised.
    The output is distributed exactly as sampling from the target alone. target_probs: P_0..P_K
    [B, K+1, V], or fewer positions where no row can reach the rest (sampled_probs_blockwise: a
    missing P_i reads as zeros, so its draft is never accepted). `uniforms` [B, K]: the
    acceptance draws, if the caller drew them already (sampled_probs_blockwise needs them first);
    by default they are drawn here, the first thing taken from `generator`. `likelihoods`:
    draft_likelihoods(target_probs, drafts, draft_probs), if the caller has it (acceptance_chances
    reads it too).
    """
    b, k = drafts.shape
    p_draft, q_draft = likelihoods or draft_likelihoods(target_probs, drafts, draft_probs)
    r = acceptance_uniforms(b, k, generator, drafts.device) if uniforms is None else uniforms
    n = _accepted_prefix(_accepts(p_draft, q_draft, r, _valid(num_valid, k)))

    if k == 0:  # a plain round: the draw from P_0 itself (what the residual steps below give)
        return n, draw_tokens(target_probs[:, 0], generator)
    rows = torch.arange(b, device=drafts.device)
    p_at = target_probs[rows, n]  # [B, V]: P_n, a copy (advanced indexing) the residual may overwrite
    rejected = n < num_valid
    if bool(rejected.any()):
        # Q at the rejected position; rows that accepted everything (or whose rejection came from
        # running out of valid drafts) draw from P itself.
        _subtract_clamped(p_at, rejected, drafts, draft_probs, rows, n.clamp(max=k - 1))
        _keep_p_where_empty(p_at, rejected, target_probs, n)
    return n, draw_tokens(p_at, generator)


def _subtract_clamped(p_at: torch.Tensor, rejected: torch.Tensor, drafts: torch.Tensor,
                      draft_probs: torch.Tensor | SparseProbs | None, rows: torch.Tensor, stop: torch.Tensor) -> None:
    """p_at [B, V] -> max(P - Q, 0) in place on the `rejected` rows, Q the draft's law at `stop`.

    max(P - Q, 0) differs from P only where Q > 0: a clustered head's few hundred candidates, or
    the one token of a point mass. Only those entries are touched (a dense [B, V] Q, three
    V-wide passes and a copy of P cost ~1 ms a round on a 2-core CPU for Gemma 3's vocabulary).
    Unnormalised is fine: draw_tokens normalises. Where rounding leaves no mass (P == Q almost
    exactly) the caller puts P back (_keep_p_where_empty)."""
    if draft_probs is None:  # a point mass on the draft: the residual is P without it
        ids, q = drafts[rows, stop][:, None], torch.ones(len(rows), 1, dtype=p_at.dtype, device=p_at.device)
    elif isinstance(draft_probs, SparseProbs):
        ids, q = draft_probs.ids[rows, stop], draft_probs.probs[rows, stop].to(p_at.dtype)
    else:
        q_at = draft_probs[rows, stop]
        p_at[rejected] = (p_at[rejected] - q_at[rejected]).clamp(min=0)
        return
    # Q summed over repeated ids (padding repeats an id with prob 0), then clamped at those ids.
    p_at.scatter_add_(1, ids, -q * rejected[:, None])
    p_at.scatter_(1, ids, p_at.gather(1, ids).clamp(min=0))


def _keep_p_where_empty(p_at: torch.Tensor, rejected: torch.Tensor, target_probs: torch.Tensor, n: torch.Tensor) -> None:
    """Rows whose residual rounded to all zeros (P == Q almost exactly) draw from P_n itself."""
    empty = rejected & (p_at.sum(dim=1) <= 0)
    if bool(empty.any()):
        p_at[empty] = target_probs[empty, n[empty]]


def _accepts(p_draft: torch.Tensor, q_draft: torch.Tensor, uniforms: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Which drafts pass: u < P/Q, as u * Q < P without dividing (Q > 0 for any drawn token)."""
    return (uniforms * q_draft < p_draft) & valid


def acceptance_uniforms(rows: int, k: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The [rows, K] uniform draws `verify_sampling` compares P/Q against."""
    return torch.rand(rows, k, generator=generator, device=device)


def sampled_probs_blockwise(probs_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            drafts: torch.Tensor, draft_probs: torch.Tensor | SparseProbs | None,
                            num_valid: torch.Tensor, uniforms: torch.Tensor,
                            block: int = SAMPLED_HEAD_BLOCK, first: torch.Tensor | None = None) -> torch.Tensor:
    """The target's P_0..P_W [B, W+1, V] for `verify_sampling` (W <= K), computed `block`
    positions at a time and only where they can matter: past a row's first rejected draft its P
    is zeros, and the positions no row reached are left out (verify_sampling reads a missing P as
    zeros: never accepted there, never the correction's row).

    hidden [B, K+1, H]; `probs_of` maps [N, H] rows to their [N, V] probabilities, each row on its
    own (the head kernels' contract), so a subset of rows gets the bits of the full call. Whether
    draft j is accepted depends only on P_j, Q_j and uniforms[j], which `verify_sampling` then
    compares the same way (given the same `uniforms`): the same verdicts and the same correction
    draw as with every P computed. `first`: the first block's P [B, min(block, K+1), V], when the
    caller already has it (the engine scores several sampling groups' first blocks together)."""
    b, width, _ = hidden.shape
    k = drafts.shape[1]
    valid = _valid(num_valid, k)
    alive = torch.arange(b, device=hidden.device)  # rows whose drafts so far were all accepted
    blocks = []  # (rows, start, their P)
    for start in range(0, width, block):
        stop = min(start + block, width)
        if start == 0 and first is not None:
            probs = first
        else:
            rows = hidden[alive, start:stop].reshape(-1, hidden.shape[-1])
            probs = probs_of(rows).view(len(alive), stop - start, -1)
        blocks.append((alive, start, probs))
        if stop > k:
            break
        p_draft, q_draft = draft_likelihoods(probs, drafts[alive, start:stop],
                                              _positions(draft_probs, alive, start, stop))
        accepted = _accepts(p_draft, q_draft, uniforms[alive, start:stop], valid[alive, start:stop])
        alive = alive[accepted.all(dim=1)]
        if len(alive) == 0:
            break
    if len(blocks) == 1:  # every row's rejection in the first block (always, when it spans every position)
        return blocks[0][2]
    reached = blocks[-1][1] + blocks[-1][2].shape[1]
    # Copied into place, and only the (row, position) pairs no block computed are zeroed: a fresh
    # zeroed [B, W+1, V] tensor per round cost ~1 ms a round on a 2-core CPU.
    out = blocks[0][2].new_empty(b, reached, blocks[0][2].shape[-1])
    computed = torch.zeros(b, reached, dtype=torch.bool, device=hidden.device)
    for rows, start, probs in blocks:
        out[rows, start : start + probs.shape[1]] = probs
        computed[rows, start : start + probs.shape[1]] = True
    if not bool(computed.all()):
        out[~computed] = 0.0
    return out


def _positions(draft_probs: torch.Tensor | SparseProbs | None, rows: torch.Tensor, start: int, stop: int):
    """Q of rows `rows` at draft positions start..stop-1 (None stays None: point masses)."""
    if draft_probs is None:
        return None
    return draft_probs[rows][:, start:stop] if isinstance(draft_probs, SparseProbs) else draft_probs[rows, start:stop]


def draft_likelihoods(target_probs: torch.Tensor, drafts: torch.Tensor,
                       draft_probs: torch.Tensor | SparseProbs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P_i(d_i+1), Q_i(d_i+1)) [B, K] each; Q is 1 for point-mass (argmax or lookup) drafts. P given
    for fewer than K positions (sampled_probs_blockwise) reads 0 past them."""
    k = drafts.shape[1]
    have = min(k, target_probs.shape[1])
    p_draft = target_probs[:, :have].gather(2, drafts[:, :have, None]).squeeze(2)
    if have < k:
        p_draft = torch.cat([p_draft, p_draft.new_zeros(p_draft.shape[0], k - have)], 1)
    if draft_probs is None:
        return p_draft, torch.ones_like(p_draft)
    if isinstance(draft_probs, SparseProbs):
        return p_draft, draft_probs.at(drafts)
    return p_draft, draft_probs.gather(2, drafts[:, :, None]).squeeze(2)


def acceptance_chances(target_probs: torch.Tensor, drafts: torch.Tensor,
                       draft_probs: torch.Tensor | SparseProbs | None, num_valid: torch.Tensor,
                       likelihoods: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[B, K]: min(1, P_i(d)/Q_i(d)), the probability with which `verify_sampling` accepts each
    draft once the drafts before it were accepted (0 past a row's valid drafts).

    A P_i of zeros (sampled_probs_blockwise, past a row's first rejection) gives a chance of 0:
    the draft policy reads chances only up to the first rejected draft.
    Its mean over rounds is the acceptance rate without the coin flip's variance, which is what an
    adaptive draft length should learn from at temperature > 0. Reading it never changes what is
    emitted: it is a function of this round's P and Q, and only later rounds' widths depend on it.
    `likelihoods`: as verify_sampling's."""
    p_draft, q_draft = likelihoods or draft_likelihoods(target_probs, drafts, draft_probs)
    chance = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=torch.finfo(q_draft.dtype).tiny), 0.0)
    return chance.clamp(max=1.0) * _valid(num_valid, drafts.shape[1])
