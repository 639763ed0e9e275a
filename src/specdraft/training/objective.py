"""The K-step unrolled drafter loss (design note section 6), all anchors of a batch at once.

For anchor position t of a sequence x and step k = 0..K-1:
    input token  x(t+1+k)   (teacher forced: what an all-accepted round would have fed)
    state        s0 = target final hidden at t,  s(k+1) = post_projection(z_k)
    query        position t, keys 0..t (sliding layers: the last `window`)
    label        the target's next token at position t+1+k: x(t+2+k) ("ce"; the target's argmax
                 on corpus text), or the target's top-k distribution there ("kl")
Step 0 pairs (embed(x(t+1)), h_t) and predicts x(t+2): exactly what inference does with
b = x(p+1) and the hidden at p.

Token logits are computed over a shortlist (the tokens the target actually produces in the
data) instead of all V: the softmax over 262k Gemma tokens would dominate training cost, and
tokens the target never emits carry no signal. The centroid scorer of the clustered head is
trained to predict the cluster of the target's token (a cheap C-way softmax).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.drafters.mtp.copy import KINDS, sequence_copies
from specdraft.drafters.mtp.drafter import layer_contexts
from specdraft.drafters.mtp.network import MTPNetwork
from specdraft.models.architectures.target import AttentionLayout
from specdraft.training.data import Sequence


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L]
    lengths: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, L, H]
    keys: dict[int, torch.Tensor]  # slot -> [B, Hkv, L, D]
    values: dict[int, torch.Tensor]
    topk_ids: torch.Tensor  # [B, L, k]
    topk_logp: torch.Tensor  # [B, L, k]
    anchors: torch.Tensor  # [B, A] positions t
    anchor_valid: torch.Tensor  # [B, A]
    corpus: torch.Tensor  # [B] bool: prefill-distilled text, whose tokens are not the target's
    copies: torch.Tensor  # [B, L, 2]: each position's copy candidates (drafters/mtp/copy.py)


def pick_anchors(s: Sequence, count: int, rng: random.Random, where: str = "uniform") -> list[int]:
    """Up to `count` anchor positions of a sequence, sorted. Anchors are positions whose target
    prediction is part of the answer, with x(t+1) known and a recorded target prediction at t+1
    (the last position has none). "uncertain" draws them without replacement with weight
    0.1 + (1 - the target's top-1 probability at t): in decoding a round starts right after the
    target corrected the drafter, mostly where the target itself was unsure of x(t+1), and there
    the first draft is accepted far less often (BENCHMARKS.md, "the gap explained")."""
    choices = list(range(s.prompt_length - 1, len(s.tokens) - 2))
    count = min(count, len(choices))
    if where == "uniform" or count == len(choices):
        return sorted(rng.sample(choices, count))
    weight = 1.1 - s.topk_logp[choices, 0].float().exp()
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    picked = torch.multinomial(weight, count, replacement=False, generator=gen)
    return sorted(choices[i] for i in picked.tolist())


def collate(seqs: list[Sequence], anchors_per_seq: int, kv_heads: dict[int, int], rng: random.Random,
            dtype: torch.dtype, anchors_where: str = "uniform") -> Batch:
    """Pad sequences into a batch and pick up to `anchors_per_seq` anchors in each answer
    (`pick_anchors`)."""
    b, length = len(seqs), max(len(s.tokens) for s in seqs)
    tokens = torch.zeros(b, length, dtype=torch.long)
    hidden = torch.zeros(b, length, seqs[0].hidden.shape[1], dtype=dtype)
    k_ids = torch.zeros(b, length, seqs[0].topk_ids.shape[1], dtype=torch.long)
    k_logp = torch.full((b, length, seqs[0].topk_ids.shape[1]), float("-inf"))
    keys = {s: torch.zeros(b, length, t.shape[1], dtype=dtype) for s, t in seqs[0].keys.items()}
    values = {s: torch.zeros(b, length, t.shape[1], dtype=dtype) for s, t in seqs[0].values.items()}
    anchors = torch.zeros(b, anchors_per_seq, dtype=torch.long)
    valid = torch.zeros(b, anchors_per_seq, dtype=torch.bool)
    copies = torch.full((b, length, KINDS), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        tokens[i, :n], hidden[i, :n] = s.tokens, s.hidden
        copies[i, :n] = sequence_copies(s.tokens.tolist())
        k_ids[i, :n], k_logp[i, :n] = s.topk_ids, s.topk_logp
        for slot in keys:
            keys[slot][i, :n], values[slot][i, :n] = s.keys[slot], s.values[slot]
        picked = pick_anchors(s, anchors_per_seq, rng, anchors_where)
        anchors[i, : len(picked)] = torch.tensor(picked, dtype=torch.long)
        valid[i, : len(picked)] = True
    # [B, L, Hkv * D] -> [B, Hkv, L, D], the KV cache layout.
    def heads(t: torch.Tensor, slot: int) -> torch.Tensor:
        return t.view(b, length, kv_heads[slot], -1).transpose(1, 2).contiguous()

    return Batch(tokens, torch.tensor([len(s.tokens) for s in seqs]), hidden,
                 {s: heads(t, s) for s, t in keys.items()}, {s: heads(t, s) for s, t in values.items()},
                 k_ids, k_logp, anchors, valid, torch.tensor([s.corpus for s in seqs], dtype=torch.bool), copies)


def to_device(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(device))
        elif isinstance(value, dict):
            setattr(batch, name, {k: v.to(device) for k, v in value.items()})
    return batch


@dataclass
class HeadSpace:
    """Where the drafter's token logits live during training."""

    shortlist: torch.Tensor  # [S] token ids scored in the softmax
    index: torch.Tensor  # [V] token id -> shortlist position, -1 if not in it
    cluster_of: torch.Tensor | None  # [V] token id -> cluster (clustered head only)

    def to(self, device: torch.device) -> "HeadSpace":
        cluster_of = None if self.cluster_of is None else self.cluster_of.to(device)
        return HeadSpace(self.shortlist.to(device), self.index.to(device), cluster_of)


def make_head_space(shortlist: torch.Tensor, vocab: int, cluster_of: torch.Tensor | None) -> HeadSpace:
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[shortlist] = torch.arange(len(shortlist))
    return HeadSpace(shortlist, index, cluster_of)


class UnrolledLoss(nn.Module):
    """The loss as a module, so DistributedDataParallel can wrap it (its forward is what DDP
    tracks). The frozen target is held outside the module tree: DDP must not sync it."""

    def __init__(self, net: MTPNetwork, target: torch.nn.Module, sources: list[AttentionLayout], space: HeadSpace,
                 k_steps: int, loss_kind: str = "ce", step_decay: float = 0.8, cluster_weight: float = 0.2):
        super().__init__()
        self.net = net
        self._frozen = (target,)
        self.sources, self.space, self.k_steps = sources, space, k_steps
        self.loss_kind, self.step_decay, self.cluster_weight = loss_kind, step_decay, cluster_weight

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return unrolled_loss(self.net, self._frozen[0], self.sources, batch, self.k_steps, self.space,
                             self.loss_kind, self.step_decay, self.cluster_weight)


def add_copy_bonus(logits: torch.Tensor, bonus: torch.Tensor, copies: torch.Tensor, pos: torch.Tensor,
                   space: HeadSpace) -> torch.Tensor:
    """Shortlist logits [B, A, S] with the copy gate's bonus [B, A, 2] added at the copy candidates
    of the input tokens at `pos` [B, A] (those in the shortlist), as the drafter adds them."""
    cp = copies.gather(1, pos[:, :, None].expand(-1, -1, copies.shape[2]))
    idx = space.index[cp.clamp(min=0)]
    ok = (cp >= 0) & (idx >= 0)
    return logits.scatter_add(2, idx.clamp(min=0), torch.where(ok, bonus, 0.0).to(logits.dtype))


def distribution_loss(logits: torch.Tensor, idx: torch.Tensor, top_logp: torch.Tensor, ok: torch.Tensor,
                      overlap: bool = False, overlap_weight: float = 1.0) -> torch.Tensor:
    """The token loss against the target's top-k distribution: cross-entropy -sum p log q (KL to p
    up to p's entropy), with p renormalised over its top-k ids inside the shortlist; with
    `overlap`, plus overlap_weight * (1 - sum min(p, q)).

    sum min(p, q) is the chance that a draft sampled from q is accepted by speculative sampling
    against p (one minus their total variation distance), what decoding at temperature 1 gains
    per draft. KL spreads q over p's whole support; with a small drafter the mass it puts on
    p's tail is mass a sampled draft wastes, and the overlap term pays for exactly what is
    accepted (DistillSpec, Zhou et al. 2023, found total-variation objectives help sampled
    acceptance). logits [B, A, S] over the shortlist; idx [B, A, k] the top-k ids' shortlist
    indices (-1 outside); top_logp [B, A, k]; ok [B, A] the anchors that count."""
    if not ok.any():
        return logits.sum() * 0
    p = torch.softmax(top_logp.masked_fill(idx < 0, float("-inf")), dim=-1).nan_to_num(0.0)
    logq = torch.log_softmax(logits, dim=-1).gather(2, idx.clamp(min=0))
    loss = -(p * logq).sum(-1)
    if overlap:
        q = logq.exp().masked_fill(idx < 0, 0.0)
        loss = loss + overlap_weight * (1 - torch.minimum(p, q).sum(-1))
    return loss[ok].mean()


def unrolled_loss(net: MTPNetwork, target: torch.nn.Module, sources: list[AttentionLayout], batch: Batch, k_steps: int,
                  space: HeadSpace, loss_kind: str = "ce", step_decay: float = 0.8, cluster_weight: float = 0.2
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over steps (weighted by step_decay**k) of token loss + cluster loss; plus metrics.

    Metrics per step k: `correct[k]` = anchors whose drafter argmax (over the shortlist) equals
    the target's argmax, among anchors still valid at k; `recall[k]` = target token inside the
    kept clusters.
    """
    dtype = batch.hidden.dtype
    contexts = layer_contexts(sources, batch.keys, batch.values, batch.anchors, dtype)
    state = batch.hidden.gather(1, batch.anchors[:, :, None].expand(-1, -1, batch.hidden.shape[2]))
    own = net.config.head == "own"
    table = (net.model.embed_tokens.weight if own else target.head_weight)[space.shortlist].to(dtype)
    total, weight_sum = 0.0, 0.0
    metrics = {"correct": [], "count": [], "recall": []}
    for k in range(k_steps):
        pos = batch.anchors + 1 + k  # position of the input token x(t+1+k)
        valid = batch.anchor_valid & (pos <= batch.lengths[:, None] - 2)
        pos = pos.clamp(max=batch.tokens.shape[1] - 1)
        with torch.no_grad():
            embeds = target.embed(batch.tokens.gather(1, pos)).to(dtype)
        z, state = net.step(embeds, state, contexts)
        logits = F.linear(z if own else state, table.to(state.dtype)).float()  # [B, A, S]
        if net.copy_gate is not None:
            logits = add_copy_bonus(logits, net.copy_gate(z), batch.copies, pos, space)
        top_ids = batch.topk_ids.gather(1, pos[:, :, None].expand(-1, -1, batch.topk_ids.shape[2]))
        top_logp = batch.topk_logp.gather(1, pos[:, :, None].expand(-1, -1, batch.topk_logp.shape[2]))
        greedy_label = top_ids[:, :, 0]
        if loss_kind == "ce":
            nxt = (pos + 1).clamp(max=batch.tokens.shape[1] - 1)
            # An answer's next token is what the target emitted; a corpus text's is not the
            # target's, so there the label is the target's argmax.
            label = torch.where(batch.corpus[:, None], greedy_label, batch.tokens.gather(1, nxt))
            idx = space.index[label]
            ok = valid & (idx >= 0)
            token_loss = F.cross_entropy(logits[ok], idx[ok]) if ok.any() else logits.sum() * 0
        else:
            idx = space.index[top_ids]  # [B, A, k]
            ok = valid & (idx[:, :, 0] >= 0)
            token_loss = distribution_loss(logits, idx, top_logp, ok, overlap=loss_kind == "kl+tv")
        loss_k = token_loss
        if space.cluster_of is not None and net.masked_embedding is not None:
            centroid_logits = net.masked_embedding.centroids(z).float()
            clabel = space.cluster_of[greedy_label]
            if valid.any():
                loss_k = loss_k + cluster_weight * F.cross_entropy(centroid_logits[valid], clabel[valid])
            kept = torch.topk(centroid_logits, net.masked_embedding.top_k, dim=-1).indices
            metrics["recall"].append(((kept == clabel[:, :, None]).any(-1) & valid).sum())
        w = step_decay**k
        total, weight_sum = total + w * loss_k, weight_sum + w
        with torch.no_grad():
            pick = space.shortlist[logits.argmax(-1)]
            metrics["correct"].append(((pick == greedy_label) & valid).sum())
            metrics["count"].append(valid.sum())
    return total / weight_sum, {k: torch.stack(v) for k, v in metrics.items() if v}
