"""RMSNorm, optionally plus a residual, in one C call (rms_norm.c)."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + (x * rsqrt(mean(x^2) + eps)) * weight over the last dimension, float32."""
    x = x.contiguous()
    d = x.shape[-1]
    if residual is not None:
        residual = residual.contiguous()
    out = torch.empty_like(x)
    library().rms_norm_rows(x.data_ptr(), None if weight is None else weight.data_ptr(),
                            None if residual is None else residual.data_ptr(), out.data_ptr(),
                            x.numel() // d, d, eps, torch.get_num_threads())
    return out
