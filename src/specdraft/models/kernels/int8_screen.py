"""The greedy head's int8 screen (int8_screen.c): approximate scores and what bounds their error."""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import library

GROUP = 32  # inputs per scale, for the table and the hidden rows alike


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [M, K] float32 -> int8 codes [M, K], scales [M, K/32], and per row in float64 the
    norms ||rows - scales * codes|| and ||scales * codes||."""
    m, k = rows.shape
    q = torch.empty(m, k, dtype=torch.int8)
    t = torch.empty(m, k // GROUP, dtype=torch.float32)
    residual = torch.empty(m, dtype=torch.float64)
    quantised = torch.empty(m, dtype=torch.float64)
    library().q8_quantize_rows(rows.data_ptr(), m, k, q.data_ptr(), t.data_ptr(), residual.data_ptr(),
                               quantised.data_ptr(), torch.get_num_threads())
    return q, t, residual, quantised


def int8_scores(q: torch.Tensor, t: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Scores [M, N] of quantised rows (q, t) against the int8 table (codes [N, K], scales [N, K/32])."""
    m, k = q.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    library().q8_gemv(q.data_ptr(), t.data_ptr(), codes.data_ptr(), scales.data_ptr(), out.data_ptr(), m, n, k,
                      torch.get_num_threads())
    return out


def screen_candidates(scores: torch.Tensor, bound: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For scores [M, N] float32 within bound [M] of the exact ones: (tokens [M, cap], counts [M])
    with the first min(count, cap) entries of row m the tokens n, increasing, whose score is
    >= max - 2 bound (the only ones whose exact score can be the row's maximum); counts go past
    cap; a row with a NaN has none."""
    m, n = scores.shape
    tokens = torch.empty(m, cap, dtype=torch.long)
    counts = torch.empty(m, dtype=torch.long)
    bound = bound.float().contiguous()
    library().screen_candidates(scores.data_ptr(), bound.data_ptr(), m, n, cap, tokens.data_ptr(), counts.data_ptr(),
                                torch.get_num_threads())
    return tokens, counts


def rescore_candidates(rows: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [M] over its candidates (screen_candidates' tokens [M, cap] and counts)
    of the exact scores of rows [M, K] against the float32 table [N, K] (float64 products summed
    with compensation; the lowest token on a tie); -1 for a row with no candidates or more than
    cap."""
    m, k = rows.shape
    choice = torch.empty(m, dtype=torch.long)
    library().rescore_candidates(rows.data_ptr(), table.data_ptr(), m, k, tokens.data_ptr(), counts.data_ptr(),
                                 tokens.shape[1], choice.data_ptr(), torch.get_num_threads())
    return choice


def quantize_table(weight: torch.Tensor, block: int = 8192) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """A table [N, K] (float32 or fp16) -> int8 codes [N, K] and float32 scales [N, K/32], quantised
    as the hidden rows are, with the max over rows of ||w - s c|| and of ||s c|| (the screen's
    bound). A block of rows at a time, widened to float32 (exactly, from fp16)."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GROUP, dtype=torch.float32)
    err = norm = 0.0
    for start in range(0, n, block):
        rows = weight[start : start + block].float().contiguous()
        m = rows.shape[0]
        residual, quantised = torch.empty(m, dtype=torch.float64), torch.empty(m, dtype=torch.float64)
        library().q8_quantize_rows(rows.data_ptr(), m, k, codes[start:].data_ptr(), scales[start:].data_ptr(),
                                   residual.data_ptr(), quantised.data_ptr(), torch.get_num_threads())
        err, norm = max(err, residual.max().item()), max(norm, quantised.max().item())
    return codes, scales, err, norm
