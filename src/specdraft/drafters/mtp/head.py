"""The drafter's output head: dense, or clustered ("efficient embedder").

Scoring all V tokens dominates a small drafter's cost when V is large (Gemma: 262144). The
clustered head splits the vocabulary into C clusters of V/C tokens (`token_ordering`, a
permutation of 0..V-1 read as C rows), scores the C centroids, keeps the top clusters and
computes logits only for their tokens. Greedy drafting takes the argmax among them; sampled
drafting treats every other token as -inf, so Q is exactly the distribution drawn from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.models.kernels.build import applies as kernels_apply
from specdraft.models.kernels.score_rows import score_rows


def checked_token_ordering(order: torch.Tensor, vocab: int) -> torch.Tensor:
    """A checkpoint's `token_ordering` as the int64 tensor the head's C call reads (it indexes
    with 64-bit ids); int32 is accepted and widened. Raises ValueError (one line) for another
    dtype, another shape, or anything but a permutation of 0..vocab-1: a repeated or missing id
    would leave tokens in no cluster, or in two."""
    if order.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ordering has dtype {str(order.dtype).removeprefix('torch.')}; expected int32 or int64")
    if tuple(order.shape) != (vocab,):
        raise ValueError(f"token_ordering has shape {tuple(order.shape)}; expected ({vocab},), one entry per token")
    order = order.to(torch.int64).contiguous()
    outside = int(((order < 0) | (order >= vocab)).sum())
    if outside:
        raise ValueError(f"token_ordering is not a permutation of range({vocab}): {outside} id(s) outside it")
    counts = torch.bincount(order, minlength=vocab)
    repeated = (counts > 1).nonzero().flatten()
    if len(repeated):
        raise ValueError(f"token_ordering is not a permutation of range({vocab}): id {int(repeated[0])} appears "
                         f"{int(counts[repeated[0]])} times and {int((counts == 0).sum())} id(s) never")
    return order


class ClusteredHead(nn.Module):
    """Named `masked_embedding` in checkpoints (Gemma 4 assistant layout)."""

    def __init__(self, hidden: int, vocab: int, num_centroids: int, top_k: int, sampled_top_k: int | None = None):
        super().__init__()
        self.num_centroids, self.top_k = num_centroids, top_k
        self.sampled_top_k = top_k if sampled_top_k is None else sampled_top_k  # for sampled draft steps
        self.cluster_size = vocab // num_centroids
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(vocab, dtype=torch.long))

    def clusters(self) -> torch.Tensor:
        """[C, V/C]: the token ids of each cluster."""
        return self.token_ordering.view(self.num_centroids, self.cluster_size)

    def top_clusters(self, z: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """z [N, h] -> the top-k clusters [N, k], best first (k: top_k unless given)."""
        return torch.topk(self.centroids(z), k or self.top_k, dim=-1).indices

    def candidates(self, z: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
        """z [N, h] -> token ids of the top-k clusters [N, top_k * V/C] (`top`: those clusters, if known)."""
        top = self.top_clusters(z) if top is None else top
        # F.embedding (index_select) rather than advanced indexing: ~20x faster gathers on CPU.
        return F.embedding(top, self.clusters()).flatten(1)

    def slot_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 [V] tensors on the host: each token's cluster and its place in the cluster."""
        order = self.token_ordering.cpu()
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order))
        return (where // self.cluster_size).to(torch.int32), (where % self.cluster_size).to(torch.int32)

    def token_slots(self) -> tuple[list[int], list[int]]:
        """Host lists over token ids: each token's cluster and its place in the cluster (a token's
        column among the candidates is rank of its cluster * V/C + place)."""
        cluster_of, place = self.slot_tensors()
        return cluster_of.tolist(), place.tolist()


def score(vectors: torch.Tensor, table: torch.Tensor, candidates: torch.Tensor | None, chunk: int = 32) -> torch.Tensor:
    """Logits of vectors [N, d] against table rows [V, d]: all rows, or only `candidates` [N, M].

    Candidate rows are gathered `chunk` vectors at a time: evaluation scores thousands of
    anchors at once, and M = 4096 rows of d = 640 per vector would otherwise be gigabytes.
    A table stored narrower than the vectors (the target's fp16 table under --weights fp16) is
    widened row block by row block, exactly. Eager float32 CPU drafting takes a C kernel
    (models/kernels/score_rows.c) that dots each candidate row in place.
    """
    if candidates is not None and kernels_apply(vectors) and table.dtype in (torch.float16, torch.float32):
        return score_rows(vectors, table, candidates)  # one pass over the rows, no gathered copy
    if candidates is None:
        blocks = table.split(16384) if table.dtype != vectors.dtype else (table,)
        return torch.cat([F.linear(vectors, rows.to(vectors.dtype)) for rows in blocks], -1).float()
    out = []
    for start in range(0, vectors.shape[0], chunk):
        rows = F.embedding(candidates[start : start + chunk], table).to(vectors.dtype)  # [n, M, d]
        out.append(torch.bmm(rows, vectors[start : start + chunk, :, None]).squeeze(2).float())
    return torch.cat(out)
