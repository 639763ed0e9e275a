"""Balanced clustering of head rows: C clusters of exactly V/C tokens (`token_ordering`).

Balanced because the clustered head gathers the same number of rows for every kept cluster:
fixed shapes, and no cluster so large that keeping it costs like the dense head. We use
recursive balanced bisection: split a group along its principal direction at the median (the
size split that keeps every part a whole number of clusters), and recurse. Gemma's 262k-row
table clusters in under a minute on two cores; balanced k-means from random seeds was several
times slower here, spending its time on huge clumps of near-identical unused tokens.
"""

from __future__ import annotations

import torch
from tqdm import tqdm


def _principal_direction(x: torch.Tensor, iters: int = 6, seed: int = 0) -> torch.Tensor:
    centered = x - x.mean(0, keepdim=True)
    v = torch.randn(x.shape[1], generator=torch.Generator().manual_seed(seed))
    for _ in range(iters):
        v = centered.T @ (centered @ v)
        v = v / (v.norm() + 1e-12)
    return v


def _bisect(x: torch.Tensor, ids: torch.Tensor, clusters: int, size: int, out: list[torch.Tensor], bar) -> None:
    if clusters == 1:
        out.append(ids)
        bar.update(1)
        return
    left = clusters // 2
    proj = x[ids] @ _principal_direction(x[ids], seed=len(out))
    order = ids[torch.argsort(proj)]
    _bisect(x, order[: left * size], left, size, out, bar)
    _bisect(x, order[left * size :], clusters - left, size, out, bar)


def balanced_clusters(rows: torch.Tensor, num_clusters: int, hot: torch.Tensor | None = None,
                      progress: bool = True) -> torch.Tensor:
    """token_ordering [V]: cluster c holds ordering[c * V/C : (c + 1) * V/C].

    `hot` (token ids, most frequent first) are the tokens the target actually emits; they are
    clustered among themselves, the rest separately. Otherwise frequent tokens end up spread
    thinly over clusters full of tokens the target never produces, and the kept clusters miss
    the target's token far more often (cluster recall).
    """
    v = rows.shape[0]
    if v % num_clusters:
        raise ValueError(f"{v} rows do not split into {num_clusters} equal clusters")
    size = v // num_clusters
    x = torch.nn.functional.normalize(rows.float(), dim=1)
    parts = [(torch.arange(v), num_clusters)]
    if hot is not None and len(hot):
        n_hot = min(num_clusters - 1, -(-len(hot) // size))  # whole clusters, rounded up
        is_hot = torch.zeros(v, dtype=torch.bool)
        is_hot[hot] = True
        # Fill the last hot cluster with the tokens most like the hot set's mean direction.
        missing = n_hot * size - int(is_hot.sum())
        if missing > 0:
            sims = (x @ x[is_hot].mean(0)).masked_fill(is_hot, float("-inf"))
            is_hot[torch.topk(sims, missing).indices] = True
        elif missing < 0:
            is_hot[hot[n_hot * size :]] = False
        parts = [(is_hot.nonzero().squeeze(1), n_hot), ((~is_hot).nonzero().squeeze(1), num_clusters - n_hot)]
    groups: list[torch.Tensor] = []
    with tqdm(total=num_clusters, desc="balanced clustering", unit="cluster", disable=not progress) as bar:
        for ids, count in parts:
            _bisect(x, ids, count, size, groups, bar)
    return torch.cat(groups)


def cluster_of(token_ordering: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Inverse map: token id -> cluster id."""
    size = token_ordering.numel() // num_clusters
    out = torch.empty_like(token_ordering)
    out[token_ordering] = torch.arange(token_ordering.numel()) // size
    return out
