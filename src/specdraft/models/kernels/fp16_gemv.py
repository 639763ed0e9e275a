"""The fp16-weight matmul of --weights fp16 for decode and verify widths (fp16_gemv.c), and its weight layout."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library

OUTS = 4  # outputs per tile
BLOCK = 8  # inputs per block: K must be a multiple


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel's layout holds this [N, K] weight (K a multiple of 8)."""
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> its fp16 values (rounded to nearest) as tiles [ceil(N/4), K/8, 4, 8]; the
    last tile padded with zero outputs."""
    n, k = weight.shape
    count = -(-n // OUTS)
    w16 = torch.zeros(count * OUTS, k, dtype=torch.float16)
    w16[:n] = weight.detach()
    return w16.view(count, OUTS, k // BLOCK, BLOCK).transpose(1, 2).contiguous()


def unpack_rows(tiles: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the weight as float32 [stop - start, K] (exact: fp16 widens exactly)."""
    t0, t1 = start // OUTS, -(-stop // OUTS)
    part = tiles[t0:t1].transpose(1, 2).reshape((t1 - t0) * OUTS, -1)
    return part[start - t0 * OUTS : stop - t0 * OUTS].float()


def fp16_matmul(rows: torch.Tensor, tiles: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] float32 @ W^T (+ bias [N]) -> [M, N] float32, W given as `pack_tiles` tiles;
    each row summed in one fixed order, whatever M."""
    rows = rows.float().contiguous()
    m, k = rows.shape
    out = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        library().fp16_gemv(rows.data_ptr(), tiles.data_ptr(), None if bias is None else bias.data_ptr(),
                            out.data_ptr(), m, out_features, k, torch.get_num_threads())
    return out
