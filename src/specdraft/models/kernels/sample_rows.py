"""sampling.sample in one C call per batch of rows (sample_rows.c), where the kernels run.

torch's float64 cumsum, which sampling.sample draws with, took 0.8 ms for one row of Gemma 3's
262144 probabilities, 2.3-6.7 ms for four and 47-54 ms for 32 on a 2-core AVX2 EPYC (inference
mode): a sampled verification or a batch of sampled rows paid it every round. The kernel takes
0.14, 0.23 and 2.2 ms, from the same uniforms (the same tokens but where float64 rounding differs).
"""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import applies, library
from specdraft.sampling import RowStreams, inverse_cdf, row_uniforms


def draw_tokens(probs: torch.Tensor, generator: torch.Generator | RowStreams | None) -> torch.Tensor:
    """sampling.sample(probs, generator): one token per row of probs [..., V] (non-negative
    weights, normalised or not), taking the same uniforms from `generator` (or each row's stream)."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = row_uniforms(flat, generator)
    if not applies(flat) or flat.shape[-1] == 0:
        return inverse_cdf(flat, u).reshape(probs.shape[:-1])
    flat, u = flat.contiguous(), u.contiguous()
    out = torch.empty(flat.shape[0], dtype=torch.long)
    library().sample_rows(flat.data_ptr(), flat.shape[0], flat.shape[1], u.data_ptr(), out.data_ptr(),
                          torch.get_num_threads())
    return out.reshape(probs.shape[:-1])
