"""act(gate) * up for the gated MLP, in one C call (gated_act.c)."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library

KINDS = {"silu": 0, "gelu_pytorch_tanh": 1}  # activations the kernel computes (by config name)


def gated_act(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """gate_up [..., 2I] float32 (gate, then up) -> act(gate) * up [..., I]."""
    gate_up = gate_up.contiguous()
    i = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], i, dtype=torch.float32)
    library().gated_act(gate_up.data_ptr(), gate_up.numel() // (2 * i), i, KINDS[kind], out.data_ptr(),
                        torch.get_num_threads())
    return out
