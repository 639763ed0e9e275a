"""The int8 LM head as one compiled loop: each weight row is read and widened once per 4 query rows.

The head of a small model is most of a CPU decode step (Gemma 3 270M: 262144 x 640, 168 MB in
int8). `aten._weight_int8pack_mm` reads it at a fraction of the memory bandwidth, and a 5-row
verify costs it twice a 4-row one. Here the product is written as a plain reduction that Inductor
turns into one C++ loop over the vocabulary: for each weight row, widen the int8 values to
float32 once and accumulate them against up to 4 float32 query rows. Measured on 2 AMD EPYC
cores (BENCHMARKS.md): 6.6 ms vs 13.3 ms for one row, 11.6 vs 18.6 ms for four.

Exactness: every output is the same fixed-order float32 reduction over the inputs whatever the
number of rows (the loop for r rows is the loop for one row, r times over), so a row's scores do
not depend on how many rows are scored together, which speculative == plain output relies on
(tested). Rows go in groups of at most 4, one compiled function per group size, each with
dynamic sizes so that any head shape reuses it.
"""

from __future__ import annotations

import functools

import torch

ROW_GROUP = 4  # query rows that share one pass over the weights


@functools.cache
def _kernel(rows: int):
    """The compiled scorer for a group of `rows` query rows (one per group size, built once)."""

    def scores(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x float32 [rows, K], qweight int8 [V, K], scales float32 [V] -> float32 [rows, V]."""
        return torch.stack([(qweight * x[i]).sum(-1) * scales for i in range(rows)])

    return torch.compile(scores, dynamic=True, fullgraph=True)


def int8_head_scores(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [N, K] (any float dtype), qweight int8 [V, K], scales float32 [V] -> float32 scores [N, V]."""
    groups = [_kernel(len(g))(g, qweight, scales) for g in x.float().split(ROW_GROUP)]
    return groups[0] if len(groups) == 1 else torch.cat(groups)


def warm_up(in_features: int) -> None:
    """Compile the four group sizes now (a few seconds once, then Inductor's disk cache), so no
    generation is timed with a compile in it."""
    q, s = torch.zeros(8, in_features, dtype=torch.int8), torch.ones(8)
    with torch.inference_mode():
        for rows in range(1, ROW_GROUP + 1):
            int8_head_scores(torch.zeros(rows, in_features), q, s)
