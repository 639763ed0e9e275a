"""Scores of vectors against gathered table rows in one C call (score_rows.c)."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library
from specdraft.models.kernels.decoder_layer import pointer


def score_rows(vectors: torch.Tensor, table: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """vectors [N, d] float32, table [V, d] float32 or fp16, candidates [N, M] ids -> [N, M] float32."""
    vectors, table = vectors.contiguous(), table.contiguous()
    candidates = candidates.to(torch.int64).contiguous()
    n, m = candidates.shape
    out = torch.empty(n, m, dtype=torch.float32)
    library().score_rows(vectors.data_ptr(), table.data_ptr(), int(table.dtype == torch.float16),
                         candidates.data_ptr(), out.data_ptr(), n, m, vectors.shape[1], torch.get_num_threads())
    return out



def draft_head(vectors: torch.Tensor, table: torch.Tensor, centroid_scores: torch.Tensor, top_k: int,
               clusters: torch.Tensor, cluster_of: torch.Tensor, place: torch.Tensor, copies: torch.Tensor | None,
               bonus: torch.Tensor | None, pick: bool = False):
    """A draft step's clustered head in one C call (score_rows.c): vectors [N, d] float32 against
    table [V, d] (float32 or fp16) over the tokens of each row's top_k clusters by
    centroid_scores [N, C] (clusters [C, S] token ids; cluster_of, place [V] int32: each token's
    cluster and place in it), plus the copy gate's copies [N, 2] with their bonus [N, 2] (or None).
    -> (logits [N, W], candidate ids [N, W]) as MTPDrafter.logits lays them out, and with `pick`
    also (the argmax token [N], its softmax probability [N])."""
    vectors, table = vectors.contiguous(), table.contiguous()
    centroid_scores = centroid_scores.float().contiguous()
    n, d = vectors.shape
    c, s = clusters.shape
    width = top_k * s + (0 if copies is None else copies.shape[1])
    logits, cands = torch.empty(n, width), torch.empty(n, width, dtype=torch.int64)
    top = torch.empty(n, top_k, dtype=torch.int64)
    token, prob = (torch.empty(n, dtype=torch.int64), torch.empty(n)) if pick else (None, None)
    if copies is not None:
        copies, bonus = copies.to(torch.int64).contiguous(), bonus.float().contiguous()
    library().draft_head(vectors.data_ptr(), table.data_ptr(), int(table.dtype == torch.float16),
                         centroid_scores.data_ptr(), c, top_k, clusters.data_ptr(), s, cluster_of.data_ptr(),
                         place.data_ptr(), pointer(copies), pointer(bonus), logits.data_ptr(), cands.data_ptr(),
                         top.data_ptr(), pointer(token), pointer(prob), n, d, torch.get_num_threads())
    return (logits, cands, token, prob) if pick else (logits, cands)
