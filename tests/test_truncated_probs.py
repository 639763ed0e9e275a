"""The top-k / top-p kernel (kernels/truncated_probs.c) gives sampling.probabilities' law.

Its sums run in another order than torch's softmax (in float64 where torch's cumulative mass is
float32), so values agree to float32 roundings and the kept tokens agree except where a token's
mass before it sits within rounding of top_p; the reference below decides those in float64 and
the comparison lets only them differ. Rows the
kernel leaves to torch (ties across a cut, NaN) must come back exactly as torch computes them.
Each check has a negative control: a kernel run with a wrong top-p is detected.
"""

from __future__ import annotations

import pytest
import torch

from specdraft.models.kernels import build
from specdraft.models.kernels.truncated_probs import truncated_probabilities
from specdraft.sampling import SamplingParams, probabilities

pytestmark = pytest.mark.skipif(not build.available(), reason="the C kernels do not build here")

BORDER = 1e-5  # a token whose float64 mass before it is this close to top_p may go either way


def reference(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, borderline tokens) in float64: temperature, top-k (ties at the k-th kept),
    then top-p over the sorted kept tokens (the token crossing it kept), then the softmax."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    border = torch.zeros_like(x, dtype=torch.bool)
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        before = sorted_p.cumsum(-1) - sorted_p
        drop = before >= p.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        border = torch.zeros_like(drop).scatter(-1, order, (before - p.top_p).abs() < BORDER)
    return torch.softmax(x, dim=-1), border


def assert_law(got: torch.Tensor, logits: torch.Tensor, p: SamplingParams) -> None:
    want, border = reference(logits, p)
    differ = (got > 0) != (want > 0)
    assert not bool((differ & ~border).any()), f"{int((differ & ~border).sum())} kept tokens differ"
    sure = ~border
    torch.testing.assert_close(got.double()[sure], want[sure], rtol=2e-5, atol=1e-8)
    torch.testing.assert_close(got.sum(-1).double(), torch.ones(got.shape[0], dtype=torch.float64), rtol=0, atol=1e-5)


def rows(n: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


PARAMS = {
    "chat (top-k 64, top-p 0.95)": SamplingParams(1.0, top_k=64, top_p=0.95),
    "top-k 64": SamplingParams(1.0, top_k=64),
    "top-k 1000, top-p 0.5, temperature 0.7": SamplingParams(0.7, top_k=1000, top_p=0.5),
    "top-p 0.9 alone": SamplingParams(1.0, top_p=0.9),
    "top-p 0.95, temperature 0.7": SamplingParams(0.7, top_p=0.95),
    "top-k 3 of a small vocabulary": SamplingParams(1.0, top_k=3, top_p=0.8),
}


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("vocab,scale", [(262_144, 3.0), (20_000, 1.0), (40, 2.0)])
def test_the_kernel_gives_the_law_of_probabilities(name: str, vocab: int, scale: float) -> None:
    p = PARAMS[name]
    logits = rows(3, vocab, scale, seed=vocab + len(name))
    with torch.inference_mode():
        got = truncated_probabilities(logits, p)
        assert_law(got, logits, p)


def test_rows_with_ties_at_a_cut_or_a_nan_are_torchs() -> None:
    """Ties at the k-th best, and a NaN: those rows are exactly probabilities' rows; the others
    the kernel's."""
    logits = rows(3, 50_000, 2.0, seed=3)
    logits[0, :5] = 30.0  # five tied best tokens, top-k 3: all five kept
    logits[1, 7] = float("nan")
    p = SamplingParams(1.0, top_k=3, top_p=0.9)
    with torch.inference_mode():
        got = truncated_probabilities(logits, p)
        want = probabilities(logits, p)
    assert torch.equal(got[0], want[0]) and int((got[0] > 0).sum()) == 5
    assert torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(got[1].nan_to_num(), want[1].nan_to_num())
    assert_law(got[2:], logits[2:], p)


def test_negative_control_a_wrong_top_p_is_detected() -> None:
    """The comparison catches a kernel that applies another top-p than the request's."""
    logits = rows(3, 262_144, 3.0, seed=11)
    asked, wrong = SamplingParams(1.0, top_k=64, top_p=0.95), SamplingParams(1.0, top_k=64, top_p=0.6)
    with torch.inference_mode():
        got = truncated_probabilities(logits, wrong)
    with pytest.raises(AssertionError):
        assert_law(got, logits, asked)


def test_requests_the_kernel_does_not_shape_are_probabilities_bit_for_bit() -> None:
    """No top-k or top-p (a softmax alone), and autograd on: torch's own computation."""
    logits = rows(2, 20_000, 2.0, seed=5)
    for p in (SamplingParams(1.0), SamplingParams(0.8)):
        with torch.inference_mode():
            assert torch.equal(truncated_probabilities(logits, p), probabilities(logits, p))
    p = PARAMS["chat (top-k 64, top-p 0.95)"]
    assert torch.equal(truncated_probabilities(logits, p), probabilities(logits, p))  # grad enabled: torch


def test_bfloat16_logits_are_widened_first() -> None:
    """bfloat16 logits (ties common) take the kernel after widening, as sampling does: rows with a
    tie at the k-th are torch's (all tied tokens kept), the others the kernel's; the same law."""
    logits = rows(4, 50_000, 2.0, seed=9).bfloat16()
    p = SamplingParams(1.0, top_k=64)
    with torch.inference_mode():
        got = truncated_probabilities(logits, p)
    assert got.dtype == torch.float32
    assert_law(got, logits.float(), p)
