"""A lookup table kept as a GGUF file stores it: rows of quantised blocks, a view of the mapped
file, dequantised exactly (llama.cpp's roundings) when they are looked up.

Gemma 4 E2B's per-layer table is 262144 x 8960: 2.5 GB as Q8_0 blocks, 9.4 GB as float32. A
token reads one row of it, so the table stays in the file and only the rows read become
resident (the kernel drops clean file pages under pressure, unlike anonymous memory).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn


class GGUFEmbedding(nn.Embedding):
    """An nn.Embedding whose `weight` is the table's raw bytes, uint8 [V, bytes per row] (so what
    counts a table's rows or asks its device reads it as any table); `forward` returns float32
    rows. `decode` turns raw rows [n, bytes per row] into float32 values [n, width] exactly as
    llama.cpp dequantises them (loading/ knows the formats)."""

    def __init__(self, raw: torch.Tensor, width: int, decode: Callable[[np.ndarray], torch.Tensor], fmt: str):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = raw.shape[0], width
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = nn.Parameter(raw, requires_grad=False)
        self.decode, self.format = decode, fmt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1).to(self.weight.device)
        rows = self.weight.index_select(0, flat)  # reads only these rows' pages of the file
        values = self.decode(rows.numpy())
        return values.view(*tokens.shape, self.embedding_dim).to(tokens.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.format} blocks"
