"""The greedy LM head, exact, for a fraction of the bytes: screen in fp16, rescore the few that can win.

Greedy decoding needs only the argmax of each row's V scores, not the scores. A float32 head
(262144 x 640 for Gemma 3: 671 MB) is read once per step, and on a CPU without bf16 units it is
the largest single cost of a step; its fp16 copy reads in a quarter of the time on an fp16-weight kernel
(kernels/fp16_gemv.c, or FBGEMM's in models/formats/fp16_kernel.py).

The screen is exact because its error has a proven bound. For a hidden row h and a vocabulary
row w (float32 or fp16 values) with fp16 copy w16, the exact score e = w . h and the screened
score a (a float32 sum of w16 * h, in any order) satisfy

    |e - a| <= |(w - w16) . h| + |w16 . h - a| <= (||w - w16|| + gamma_K ||w16||) ||h|| =: B

(Cauchy-Schwarz, then the standard bound for a float32 sum of K products, gamma_K = K u /
(1 - K u), u = 2^-24), with the largest row norms of the table. The true argmax can only be a
token with a >= max(a) - 2B; those few (usually one) are rescored in float64, where products of
float32 numbers are exact and sums are 2^29 times finer than float32's (the int8 screen's C
path, int8_screen.c, adds a compensated sum), and the best wins (lowest id on a tie). On Gemma 3
270M, B is about 0.04 logits and one or two tokens pass.

The result is the argmax of the exact scores, computed per row on its own, so it does not
depend on how many rows share the call: a (K+1)-row verification picks what K+1 one-row steps
pick, bit for bit. A float32 `F.linear` does not promise that (on an AVX2 CPU its GEMV and GEMM
round differently); within float32 rounding both are the same argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.models.formats.fp16_kernel import fp16_kernel_available
from specdraft.models.formats.block_linear import BlockLinear
from specdraft.models.formats.fp16_kernel import fp16_mm, prepack_fp16
from specdraft.models.kernels import build as kernels
from specdraft.models.kernels.int8_screen import (GROUP, int8_scores, quantize_rows, quantize_table, rescore_candidates,
                                                  screen_candidates)
from specdraft.models.formats.quant import Fp16Linear

_U = 2.0**-24  # float32 unit roundoff
CROWDED = 2048  # candidates per row past which the int8 screen's row is screened again finely
_SLACK = 1.001  # headroom for computing the bound itself in float32 (a few roundings near B)


def _row_norm_maxima(weight: torch.Tensor, block: int = 8192) -> tuple[float, float]:
    """(max ||w - fp16(w)||, max ||fp16(w)||) over the rows, in float64, a block of rows at a time
    (the whole table in float64 would be 1.3 GB for Gemma 3's head)."""
    err = norm = 0.0
    for rows in weight.split(block):
        w16 = rows.half().double()
        err = max(err, (rows.double() - w16).norm(dim=1).max().item())
        norm = max(norm, w16.norm(dim=1).max().item())
    return err, norm


def _row_norm_max(weight: torch.Tensor, block: int = 8192) -> float:
    """max ||w|| over the rows, in float64."""
    return max(rows.double().norm(dim=1).max().item() for rows in weight.split(block))


class ScreenedHead(nn.Module):
    """argmax(h @ W^T) per row, exact, for a float32 or fp16 table W [V, H] on an x86 CPU."""

    def __init__(self, weight: torch.Tensor, packed: torch.ScriptObject | None = None, fp16_values: bool = False,
                 scorer: nn.Module | None = None, fp16_scores=None):
        """weight: the model's table (shared): float32, or fp16 with fp16_values; packed: its FBGEMM
        fp16 copy when the model has one; fp16_values: the head's exact scores are against the
        fp16-rounded table (--weights fp16); fp16_scores: instead of `packed`, a function rows ->
        float32 sums of rows x the fp16 table (the fp16 head's `matmul`); scorer: instead of an
        fp16 screen, a module whose float32 scores multiply by exactly `weight`'s values, summed
        in float32 (--weights gguf)."""
        super().__init__()
        dtypes = (torch.float32, torch.float16) if fp16_values else (torch.float32,)
        if weight.dtype not in dtypes or weight.device.type != "cpu":
            raise ValueError(f"the screened head takes a float32 CPU table (or fp16 values), not {weight.dtype} "
                             f"on {weight.device}")
        self.weight = weight  # rescoring reads its rows
        self.scorer = scorer
        self.fp16_values = fp16_values
        k = weight.shape[1]
        gamma = _gamma(k)
        self.int8_table = None
        self.crowded = CROWDED
        if scorer is not None:  # the weights are exact: only the float32 sum's rounding is left
            self.packed, self.packed_nbytes = None, 0
            self.weight_norm = _row_norm_max(weight)
            self.bound_per_unit_h = gamma * self.weight_norm * _SLACK
            if _int8_blocks(scorer):  # a Q8_0 table: screen on its bytes (see _int8_screen)
                self.int8_table = (scorer.codes, scorer.scales)
                # w = fl(s c): |w - s c| <= u |s c| elementwise, and ||s c|| <= (1 + u) ||w||
                self._set_int8_bound(_U * (1 + _U) * self.weight_norm, (1 + _U) * self.weight_norm, k)
            return
        self.fp16_scores = fp16_scores
        if fp16_scores is not None:
            self.packed, self.packed_nbytes = None, 0
        else:
            self.packed = packed if packed is not None else prepack_fp16(weight)
            self.packed_nbytes = weight.numel() * 2 if packed is None else 0  # an fp16 copy of its own, or none
        if fp16_values and k % GROUP == 0 and kernels.available():
            # --weights fp16: an int8 copy of the table (0.6x the fp16 bytes) screens greedy steps;
            # the packed fp16 copy stays for sampling, which needs every logit.
            codes, scales, table_err, table_norm = quantize_table(weight)
            self.register_buffer("int8_codes", codes)
            self.register_buffer("int8_scales", scales)
            self.int8_table = (codes, scales)
            self._set_int8_bound(table_err, table_norm, k)
        err, w16_norm = _row_norm_maxima(weight)
        self.bound_per_unit_h = ((0.0 if fp16_values else err) + gamma * w16_norm) * _SLACK  # B / ||h||

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> argmax token ids [...] of the exact scores."""
        rows = hidden.reshape(-1, hidden.shape[-1]).float().contiguous()
        if (self.int8_table is not None and not self.fp16_values and self.weight.dtype == torch.float32
                and self.weight.is_contiguous()):
            # A step's usual case in three C calls: screen, list the candidates, rescore them
            # (as tensor ops, ~0.4 ms a step of small-op overhead on a 2-core CPU).
            tokens, counts = screen_candidates(*self._int8_screen(rows), min(self.crowded, self.weight.shape[0]))
            choice = rescore_candidates(rows, self.weight, tokens, counts)
            redo = (choice < 0).nonzero().flatten()
            if len(redo):  # a crowded row (screened again finely) or one with a NaN
                choice[redo] = self._rescored(rows[redo])
            return choice.view(hidden.shape[:-1])
        return self._rescored(rows).view(hidden.shape[:-1])

    def _rescored(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, H] float32 -> argmax token ids [M]: the candidates of the int8 or fine screen
        rescored in float64 with tensor ops."""
        if self.int8_table is None:
            row_ids, token_ids = _candidates(*self._fine_screen(rows)).nonzero(as_tuple=True)
        else:
            row_ids, token_ids = self._int8_candidates(rows)
        table = self.weight[token_ids]
        table = table.half() if self.fp16_values else table  # the same rounding as the packed copy
        exact = (table.double() * rows[row_ids].double()).sum(-1)
        n, v = rows.shape[0], self.weight.shape[0]
        best = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, row_ids, exact, "amax")
        wins = exact == best[row_ids]
        choice = torch.full((n,), v, dtype=torch.long).scatter_reduce(0, row_ids[wins], token_ids[wins], "amin")
        lost = choice == v  # no candidate: a NaN or inf in the row
        if lost.any():
            choice[lost] = F.linear(rows[lost], self.weight.to(rows.dtype)).argmax(-1)
        return choice

    def _int8_candidates(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) pairs that can be each row's argmax, from the int8 screen (kernels in C: a
        full-vocabulary tensor op per step cost ~0.3 ms a row)."""
        cap = min(self.crowded, self.weight.shape[0])
        tokens, counts = screen_candidates(*self._int8_screen(rows), cap)
        # A flat row (near-uniform scores: random tokens, say) lets thousands of tokens within
        # the int8 bound; rescoring them would cost more than the fine screen, whose bound is
        # ~25x tighter. The choice is the row's own, so rows stay independent.
        is_crowded = counts > self.crowded
        kept = counts.masked_fill(is_crowded, 0)
        row_ids = torch.arange(len(rows)).repeat_interleave(kept)
        token_ids = tokens[torch.arange(cap)[None, :] < kept[:, None]]
        crowded = is_crowded.nonzero().flatten()
        if len(crowded):
            fine_rows, fine_tokens = _candidates(*self._fine_screen(rows[crowded])).nonzero(as_tuple=True)
            row_ids, token_ids = torch.cat([row_ids, crowded[fine_rows]]), torch.cat([token_ids, fine_tokens])
        return row_ids, token_ids

    def _fine_screen(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores from the exact weights (gguf kernel) or the fp16 copy, and their bound per row."""
        if self.scorer is not None:
            scores = self.scorer(rows)
        elif self.fp16_scores is not None:
            scores = self.fp16_scores(rows)
        else:
            scores = fp16_mm(rows, self.packed, pad=False)
        return scores, self.bound_per_unit_h * rows.norm(dim=-1)  # the bound holds for any row blocking

    def _set_int8_bound(self, table_err: float, table_norm: float, k: int) -> None:
        """table_err >= max ||w - s c||, table_norm >= max ||s c|| over the table's rows."""
        self.int8_err, self.int8_norm, self.int8_gamma = table_err, table_norm, _gamma(k // GROUP + 5)

    def _int8_screen(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores from the int8 table (codes c, scales s) and int8-quantised rows (one byte a weight
        read, half of fp16's), and their error bound per row. With r = h - t q the rows'
        quantisation residual (int8_screen.c),

            |w . h - a| <= |(w - s c) . h| + |s c . r| + (float32 rounding of a)
                        <= max||w - s c|| ||h|| + max||s c|| (||r|| + gamma_(G+5) ||t q||)

        (Cauchy-Schwarz twice, and the sum of G group terms in float32 with its scale products
        rounded once)."""
        q, t, residual, quantised = quantize_rows(rows)
        scores = int8_scores(q, t, *self.int8_table)
        h_norm = rows.norm(dim=-1).double()
        bound = (self.int8_err * h_norm + self.int8_norm * (residual + self.int8_gamma * quantised)) * _SLACK
        return scores, bound.float()


def _candidates(scores: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[M, V] bool: the tokens whose exact score can be a row's maximum, given scores within
    `bound` [M] of the exact ones."""
    top = scores.amax(dim=-1)  # values only: a tenth of max()'s cost over 262k scores
    return scores >= (top - 2 * bound)[:, None]


def _gamma(n: int) -> float:
    """The standard bound on a float32 sum of n roundings, relative to the sum of |terms|."""
    return n * _U / (1 - n * _U)


def _int8_blocks(scorer: nn.Module) -> bool:
    """Whether the gguf head's blocks are an int8 table with one scale per 32 inputs (Q8_0) and
    the kernels build here."""
    return (isinstance(scorer, BlockLinear) and scorer.codes is not None and scorer.group == GROUP
            and scorer.offsets is None
            and kernels.available())


def screen_head(model: nn.Module) -> bool:
    """Give `model` a screened greedy head when its head is a dense float32 table or the fp16
    head of --weights fp16, on an x86 CPU (packed int8/int4 heads are their own definition).
    True if it did."""
    packed_head = getattr(model, "packed_head", None)
    weight = model.head_weight
    if isinstance(packed_head, BlockLinear):
        model.screened_head = ScreenedHead(weight, scorer=packed_head)
        return True
    if isinstance(packed_head, Fp16Linear):
        if packed_head.tiles is not None:
            model.screened_head = ScreenedHead(weight, fp16_values=True, fp16_scores=packed_head.matmul)
        else:
            model.screened_head = ScreenedHead(weight, packed_head.packed_fp16, fp16_values=True)
        return True
    if packed_head is not None or weight.dtype != torch.float32:
        return False
    if weight.device.type != "cpu" or not fp16_kernel_available():
        return False
    model.screened_head = ScreenedHead(weight)
    return True
