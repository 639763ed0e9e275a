"""Turning logits into the distribution tokens are drawn from: temperature, top-k, top-p.

The same function filters the target's and the drafter's logits, so the Q a draft was drawn
from and the P it is verified against are shaped by the same rules (lossless sampling needs
the drafter's Q to be exactly what it sampled from; it does not need Q to resemble P).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # `not` around each range check so NaN (which fails every comparison) is refused too.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SpecdraftError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecdraftError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecdraftError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shaping(self) -> tuple[float, int, float]:
        """What shapes the distribution (temperature, top-k, top-p), the seed left out: requests
        alike here can share one Q."""
        return self.temperature, self.top_k, self.top_p


# Below this, logit / temperature may overflow float32 (inf - inf is NaN in the softmax).
MIN_SCALED_TEMPERATURE = 1e-30


# top-p without top-k first looks for its nucleus among this many best tokens, then 16 times as
# many, and sorts the whole vocabulary only where that misses (a full sort of Gemma 3's 262144
# logits took 21 ms on a 2-core Zen 4, a top-256 0.5 ms).
NUCLEUS_FIRST = 256


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k and top-p.

    top-k keeps the k best logits, ties at the k-th all kept; top-p then keeps the shortest
    best-first prefix whose mass reaches top_p (the token crossing it included). Where no tie
    reaches past the k-th, the k best (torch.topk, best first) are all that top-p and the
    softmax need: k values instead of V, the same law."""
    logits = _scaled(logits, params.temperature)
    vocab = logits.shape[-1]
    if params.top_k and params.top_k < vocab:
        values, ids = torch.topk(logits, params.top_k, dim=-1)
        kept = None if bool(((logits >= values[..., -1:]).sum(-1) > params.top_k).any()) \
            else _nucleus(values, params.top_p)
        if kept is not None:
            # The softmax over the whole row (-inf elsewhere): the bits of the V-wide mask's.
            return torch.softmax(torch.full_like(logits, float("-inf")).scatter_(-1, ids, kept), dim=-1)
        logits = logits.masked_fill(logits < values[..., -1:], float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature; no copy at temperature 1 (x / 1 is x, bit for bit)."""
    if temperature < MIN_SCALED_TEMPERATURE:
        # The limit as the temperature goes to 0: the argmax, ties sharing the mass.
        logits = logits.float()
        return torch.where(logits == logits.amax(-1, keepdim=True), 0.0, float("-inf"))
    if temperature == 1.0:
        return logits.float()
    return logits.float() / temperature


def _drop_past_nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Best-first probabilities -> which to drop: those whose mass before them reaches top_p."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = mass_before >= top_p
    drop[..., 0] = False  # a top_p that rounds to 0 in float32 still keeps the top token
    return drop


def _nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """Best-first logits with those past the top-p nucleus set to -inf (all kept at top_p 1);
    None where a tie crosses the cut (the V-wide path then decides as a full sort does)."""
    if top_p >= 1.0:
        return sorted_logits
    drop = _drop_past_nucleus(torch.softmax(sorted_logits, dim=-1), top_p)
    return None if _tie_at_cut(sorted_logits, drop) else sorted_logits.masked_fill(drop, float("-inf"))


def _tie_at_cut(sorted_logits: torch.Tensor, drop_sorted: torch.Tensor) -> bool:
    """Whether in some row the last kept logit equals the first dropped one."""
    n = sorted_logits.shape[-1]
    kept = (~drop_sorted).sum(-1, keepdim=True)  # >= 1: the top token is always kept
    last = sorted_logits.gather(-1, kept - 1)
    first_out = sorted_logits.gather(-1, kept.clamp(max=n - 1))
    return bool(((last == first_out) & (kept < n)).any())


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits with every token past the top-p nucleus set to -inf. The nucleus is searched among
    the NUCLEUS_FIRST best, then 16 times as many, until the mass before the last of them reaches
    top_p in every row (every token past it is then dropped too), the whole vocabulary last. A
    tie across the cut (which of equal logits is kept depends on the sort's order) goes to the
    full sort too, so the tokens kept are those of a full sort's (bfloat16 logits tie often)."""
    probs = torch.softmax(logits, dim=-1)
    vocab, n = logits.shape[-1], min(NUCLEUS_FIRST, logits.shape[-1])
    while True:
        if n == vocab:  # the softmax of the sorted row, as before: its sum in the sort's order
            best, order = torch.sort(logits, -1, descending=True)
            drop_sorted = _drop_past_nucleus(torch.softmax(best, dim=-1), top_p)
            break
        best, order = torch.topk(logits, n, dim=-1)
        drop_sorted = _drop_past_nucleus(probs.gather(-1, order), top_p)
        if bool(drop_sorted[..., -1].all()) and not _tie_at_cut(best, drop_sorted):
            break
        n = min(16 * n, vocab)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, ~drop_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | RowStreams | None) -> torch.Tensor:
    """Draw one token per row from probs [..., V] (non-negative weights, normalised or not).

    By the inverse CDF: u uniform in [0, 1) times the row's total, the first token whose
    cumulative weight exceeds it. Cumulated in float64, so rounding cannot shift mass between
    tokens by more than ~1e-16 of the total; a token of weight 0 is never drawn. On a CPU this is
    16x cheaper than torch.multinomial over a 262k vocabulary (0.56 vs 9.3 ms a row), which
    validates and normalises in several passes. models/kernels/sample_rows.py draws from the same
    uniforms in a C loop where it runs (what the decoding loop and training use)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return inverse_cdf(flat, row_uniforms(flat, generator)).reshape(probs.shape[:-1])


# One random stream per row (a server's requests each keep their own seed's stream); None for a
# row that draws nothing this time (its token is not used).
RowStreams = list


def row_uniforms(flat: torch.Tensor, generator: torch.Generator | RowStreams | None) -> torch.Tensor:
    """[M, 1] float64 uniforms in [0, 1): one draw per row of flat [M, V], from `generator`, or
    row i's from generator[i] (RowStreams; a None entry draws nothing and reads 0)."""
    if not isinstance(generator, list):
        return torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator, device=flat.device)
    if len(generator) != flat.shape[0]:
        raise ValueError(f"{len(generator)} random streams for {flat.shape[0]} rows")
    zero = torch.zeros(1, dtype=torch.float64, device=flat.device)
    return torch.stack([zero if g is None else torch.rand(1, dtype=torch.float64, generator=g, device=flat.device)
                        for g in generator])


def inverse_cdf(flat: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """flat [M, V] weights, u [M, 1] -> [M]: the first token whose float64 cumulative weight
    exceeds u times the row's total."""
    cdf = flat.double().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=flat.shape[-1] - 1).squeeze(-1)
