"""Scores of vectors against gathered table rows in one C call (score_rows.c)."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library


def score_rows(vectors: torch.Tensor, table: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """vectors [N, d] float32, table [V, d] float32 or fp16, candidates [N, M] ids -> [N, M] float32."""
    vectors, table = vectors.contiguous(), table.contiguous()
    candidates = candidates.to(torch.int64).contiguous()
    n, m = candidates.shape
    out = torch.empty(n, m, dtype=torch.float32)
    library().score_rows(vectors.data_ptr(), table.data_ptr(), int(table.dtype == torch.float16),
                         candidates.data_ptr(), out.data_ptr(), n, m, vectors.shape[1], torch.get_num_threads())
    return out
