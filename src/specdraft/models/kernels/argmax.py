"""Row argmax in one C call (argmax.c): the greedy pick over the head's scores."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import applies, library

MAX_ROW = 2**31 - 1  # the kernel counts positions in int32 lanes


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same index (the first maximum; the first NaN where there is one)."""
    n = x.shape[-1]
    if not applies(x) or not 0 < n <= MAX_ROW:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.long)
    library().argmax_rows(x.data_ptr(), x.numel() // n, n, out.data_ptr(), torch.get_num_threads())
    return out
