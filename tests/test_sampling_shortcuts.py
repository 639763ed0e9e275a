"""The shortcuts in sampling.probabilities and verify_sampling's residual give the same laws as
the plain computations they replace, on vocabularies large enough to take every path.

probabilities: top-k over the k best values only (no V-wide mask, no sort), top-p searched among
the best 256, then 4096, then a full sort. The reference here masks and sorts the whole
vocabulary (what probabilities did before). verify_sampling: the residual max(P - Q, 0) written
only where Q > 0, against the dense subtraction. The end-to-end chi-square tests
(test_sampling_exact.py) cover the engine; these cover the paths a 16-token vocabulary never
reaches. Each has a negative control: a deliberately wrong variant is detected.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import sampling
from specdraft.drafters.base import SparseProbs
from specdraft.sampling import SamplingParams, probabilities
from specdraft.speculative import verify

V = 20_000  # > 16 x NUCLEUS_FIRST: a flat enough row takes the full sort


def full_sort_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k as a V-wide mask (ties at the k-th kept), then top-p over the whole
    sorted vocabulary (the token crossing top_p kept), then the softmax."""
    x = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.softmax(x, dim=-1)


def rows(scale: float, seed: int, n: int = 3) -> torch.Tensor:
    """Random logits whose spread `scale` sets the nucleus size (small scale: flat rows)."""
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


# (logits scale, params, the nucleus sizes the case must reach: smallest row's, largest row's)
CASES = {
    "top-p-peaked (nucleus in the first 256)": (6.0, SamplingParams(1.0, top_p=0.9), (1, 256)),
    "top-p-medium (widened to 4096)": (3.0, SamplingParams(1.0, top_p=0.95), (257, 4096)),
    "top-p-flat (full sort)": (0.3, SamplingParams(1.0, top_p=0.95), (4097, V)),
    "top-k-64": (2.0, SamplingParams(1.0, top_k=64), None),
    "top-k-64-top-p-0.95": (2.0, SamplingParams(1.0, top_k=64, top_p=0.95), None),
    "top-k-500-top-p-0.5-temp-0.7": (1.0, SamplingParams(0.7, top_k=500, top_p=0.5), None),
    "temperature-1.3-only": (2.0, SamplingParams(1.3), None),
}


def assert_same_law(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got > 0, want > 0), f"supports differ in {int(((got > 0) != (want > 0)).sum())} tokens"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_probabilities_match_the_full_sort(case: str, monkeypatch) -> None:
    scale, params, nucleus = CASES[case]
    logits = rows(scale, seed=len(case))
    asked = []  # the k of every torch.topk call: which search paths ran
    topk = torch.topk
    monkeypatch.setattr(sampling.torch, "topk", lambda x, k, **kw: asked.append(k) or topk(x, k, **kw))
    got = probabilities(logits, params)
    searched = list(asked)  # before the reference's own top-k
    want = full_sort_reference(logits, params)
    assert_same_law(got, want)
    if nucleus is not None:  # the case reaches the search path it is named for
        sizes = (want > 0).sum(-1)
        lo, hi = nucleus
        assert lo <= int(sizes.max()) <= hi, sizes
    if params.top_k:
        assert searched == [params.top_k]  # the k best only: no V-wide search
    elif case.startswith("top-p-peaked"):
        assert searched == [256]
    elif case.startswith("top-p-medium"):
        assert searched == [256, 4096]
    elif case.startswith("top-p-flat"):
        assert searched == [256, 4096]  # then the full sort, bit for bit the reference's
        assert torch.equal(got, want)


def test_top_k_ties_at_the_kth_keep_them_all() -> None:
    """Tokens tied with the k-th best are all kept (the V-wide path), with or without top-p."""
    logits = rows(2.0, seed=7)
    logits[:, :5] = 10.0  # five tied best tokens, top-k 3
    for params in (SamplingParams(1.0, top_k=3), SamplingParams(1.0, top_k=3, top_p=0.9)):
        got = probabilities(logits, params)
        assert_same_law(got, full_sort_reference(logits, params))
        assert int((got > 0).sum(-1).min()) >= 5


def test_negative_control_a_nucleus_without_its_crossing_token_is_detected(monkeypatch) -> None:
    """The comparison catches a top-p that drops the token crossing top_p."""

    def wrong(sorted_probs, top_p):
        drop = sorted_probs.cumsum(-1) >= top_p
        drop[..., 0] = False
        return drop

    monkeypatch.setattr(sampling, "_drop_past_nucleus", wrong)
    for case in ("top-p-peaked (nucleus in the first 256)", "top-k-64-top-p-0.95"):
        scale, params, _ = CASES[case]
        logits = rows(scale, seed=len(case))
        with pytest.raises(AssertionError, match="supports differ"):
            assert_same_law(probabilities(logits, params), full_sort_reference(logits, params))


# ------------------------------------------------------------------ the residual


def residual_case(seed: int):
    """P [B, 2, V] and a clustered Q over 40 candidates per position, padding repeating an id
    with prob 0; the first draft of rows 0 and 2 is forced out (P(d) < Q(d), uniform ~1), row 1's
    accepted, row 3 has no valid draft."""
    g = torch.Generator().manual_seed(seed)
    b, m = 4, 40
    p = torch.softmax(torch.randn(b, 2, V, generator=g) * 2, -1)
    ids = torch.stack([torch.randperm(V, generator=g)[:m] for _ in range(b * 2)]).view(b, 2, m)
    ids[..., -5:] = ids[..., :1]  # padding: the first id again, prob 0
    q = torch.rand(b, 2, m, generator=g)
    q[..., -5:] = 0
    q = q / q.sum(-1, keepdim=True)
    drafts = ids[:, :, 0].clone()
    p[1, 0, drafts[1, 0]] = 0.5  # row 1's draft: P > Q, accepted at any uniform
    p[1, 0] /= p[1, 0].sum()
    return p, drafts[:, :1], SparseProbs(ids[:, :1], q[:, :1], V), torch.tensor([1, 1, 1, 0])


def captured_weights(monkeypatch, p, drafts, q, num_valid) -> tuple[torch.Tensor, torch.Tensor]:
    seen = []
    monkeypatch.setattr(verify, "draw_tokens", lambda w, g: seen.append(w.clone()) or w.argmax(-1))
    uniforms = torch.tensor([[0.999999], [0.1], [0.999999], [0.5]])  # row 1's u < P(d) = 0.5
    n, _ = verify.verify_sampling(p, drafts, q, num_valid, None, uniforms)
    return n, seen[0]


def dense_residual(p, drafts, q, num_valid, n) -> torch.Tensor:
    """Row b's law to draw from, the dense way: norm(max(P_n - Q_n, 0)) after a rejection, else P_n."""
    dense = q.dense() if isinstance(q, SparseProbs) else q
    out = []
    for row in range(p.shape[0]):
        at = int(n[row])
        if at < int(num_valid[row]):
            out.append((p[row, at] - dense[row, at]).clamp(min=0))
        else:
            out.append(p[row, at])
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["clustered", "point-mass", "dense"])
def test_residual_only_where_q_is_positive_matches_the_dense_one(kind: str, monkeypatch) -> None:
    p, drafts, q, num_valid = residual_case(seed=3)
    if kind == "point-mass":
        q = None
        dense_q = torch.zeros(p.shape[0], 1, V).scatter(2, drafts[:, :, None], 1.0)
    elif kind == "dense":
        q = dense_q = q.dense()
    else:
        dense_q = q.dense()
    n, weights = captured_weights(monkeypatch, p, drafts, q, num_valid)
    assert n.tolist() == [0, 1, 0, 0]  # rows 0 and 2 rejected, 1 accepted, 3 had nothing to verify
    want = dense_residual(p, drafts, dense_q, num_valid, n)
    torch.testing.assert_close(weights, want, rtol=0, atol=0)
    assert not torch.equal(weights[0], p[0, 0])  # the rejected rows really lost Q's mass


def test_residual_that_rounds_to_nothing_draws_from_p(monkeypatch) -> None:
    """Q == P: every draft is accepted unless the uniform says no; a rejected row's residual is
    all zeros and it draws from P itself, as before."""
    p, drafts, q, num_valid = residual_case(seed=4)
    ids, probs = q.ids, q.probs
    p = torch.zeros_like(p).scatter_add_(2, torch.cat([ids, ids], 1), torch.cat([probs, probs], 1))
    uniforms = torch.ones(drafts.shape)  # u * Q < P fails when P == Q: rejected
    seen = []
    monkeypatch.setattr(verify, "draw_tokens", lambda w, g: seen.append(w.clone()) or w.argmax(-1))
    n, _ = verify.verify_sampling(p, drafts, q, num_valid, None, uniforms)
    assert n.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(seen[0], p[:, 0], rtol=0, atol=0)


def test_negative_control_a_residual_without_q_is_detected(monkeypatch) -> None:
    """The comparison catches a verifier that draws a rejected row from P, not P - Q."""
    monkeypatch.setattr(verify, "_subtract_clamped", lambda *a: None)
    p, drafts, q, num_valid = residual_case(seed=3)
    n, weights = captured_weights(monkeypatch, p, drafts, q, num_valid)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(weights, dense_residual(p, drafts, q, num_valid, n), rtol=0, atol=0)
