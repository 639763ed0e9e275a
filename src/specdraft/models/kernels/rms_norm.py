"""RMSNorm (plus a residual) in one C call, the two norms between attention and MLP in another (rms_norm.c)."""

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


def residual_norms(a: torch.Tensor, first: bool, first_weight: torch.Tensor | None, x: torch.Tensor,
                   second_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x_out = x + norm1(a) (first) or x + a (not first); h = norm2(x_out). Both [..., D] float32;
    a weight of None means a norm without a scale."""
    a, x = a.contiguous(), x.contiguous()
    d = x.shape[-1]
    x_out, h = torch.empty_like(x), torch.empty_like(x)
    library().residual_norms(a.data_ptr(), int(first), None if first_weight is None else first_weight.data_ptr(),
                             x.data_ptr(), None if second_weight is None else second_weight.data_ptr(),
                             x_out.data_ptr(), h.data_ptr(), x.numel() // d, d, eps, torch.get_num_threads())
    return x_out, h
