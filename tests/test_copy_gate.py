"""The drafter's copy gate (drafters/mtp/copy.py): the copy candidates read off the text, and
the bonus added to the head's logits without counting a token twice."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.drafters.mtp.copy import NONE, RoundCopies, add_copies, sequence_copies


def copies_by_hand(tokens: list[int], j: int) -> list[int]:
    """Position j's copy candidates by a plain backwards scan."""
    one = two = NONE
    for i in range(j - 1, -1, -1):
        if tokens[i] == tokens[j]:
            if one == NONE:
                one = tokens[i + 1]
            if two == NONE and i >= 1 and j >= 1 and tokens[i - 1] == tokens[j - 1]:
                two = tokens[i + 1]
    return [one, two]


def test_sequence_copies_small_example() -> None:
    #         0  1  2  3  4  5  6  7
    tokens = [5, 6, 7, 5, 6, 8, 5, 5]
    got = sequence_copies(tokens).tolist()
    assert got[:3] == [[NONE, NONE]] * 3  # nothing repeats yet
    assert got[3] == [6, NONE]  # 5 was followed by 6; the pair (7, 5) is new
    assert got[4] == [7, 7]  # 6 -> 7, and the pair (5, 6) -> 7
    assert got[5] == [NONE, NONE]
    assert got[6] == [6, NONE]  # the latest earlier 5 (position 3) was followed by 6
    assert got[7] == [5, NONE]  # the latest earlier 5 is position 6, followed by this very 5


@pytest.mark.parametrize("seed", range(5))
def test_sequence_copies_match_a_backwards_scan(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(60)]
    got = sequence_copies(tokens).tolist()
    assert got == [copies_by_hand(tokens, j) for j in range(len(tokens))]


def test_round_copies_match_sequence_copies_round_after_round() -> None:
    """Rows of different lengths, rounds of drafts: the host index (synced with each round's new
    tokens) plus the drafts so far gives every step's current token the copies of the full text."""
    rng = random.Random(1)
    rows = [[rng.randrange(5) for _ in range(n)] for n in (40, 55, 30)]
    width = 64
    tokens = torch.full((len(rows), width), 3, dtype=torch.long)  # padding that would match if read
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    copies = RoundCopies()
    copies.index.reset(len(rows))
    lengths = [1, 2, 1]
    checked = 0
    while all(n + 3 <= len(r) for n, r in zip(lengths, rows)):
        copies.start(tokens, torch.tensor(lengths))
        for step in range(3):  # drafts are the texts' next tokens
            got = copies.copies(torch.device("cpu"))
            want = torch.stack([sequence_copies(r[: n + step])[-1] for r, n in zip(rows, lengths)])
            assert torch.equal(got, want), (lengths, step)
            checked += int((want >= 0).sum())
            copies.extend(torch.tensor([r[n + step] for r, n in zip(rows, lengths)]))
        lengths = [n + 1 + rng.randrange(3) for n in lengths]  # accepted drafts + the target's token
    assert checked > 20  # copies of both kinds occurred


def dense_with_bonus(vectors, table, copies, bonus) -> torch.Tensor:
    out = vectors @ table.T
    for n in range(copies.shape[0]):
        for c in range(copies.shape[1]):
            if copies[n, c] >= 0:
                out[n, copies[n, c]] += bonus[n, c]
    return out


def test_add_copies_dense_head() -> None:
    gen = torch.Generator().manual_seed(0)
    vectors, table = torch.randn(4, 8, generator=gen), torch.randn(20, 8, generator=gen)
    copies = torch.tensor([[3, 3], [5, NONE], [NONE, NONE], [7, 2]])
    bonus = torch.randn(4, 2, generator=gen)
    logits, cands = add_copies(vectors @ table.T, None, copies, bonus, vectors, table)
    assert cands is None
    torch.testing.assert_close(logits, dense_with_bonus(vectors, table, copies, bonus))


def test_add_copies_clustered_head_counts_each_token_once() -> None:
    gen = torch.Generator().manual_seed(1)
    vectors, table = torch.randn(6, 8, generator=gen), torch.randn(20, 8, generator=gen)
    cands = torch.tensor([[0, 1, 2, 3]] * 3 + [[4, 5, 6, 7]] * 3)
    # copy inside the candidates, outside, both the same token, the second a repeat of the first
    # outside, none, and one of each
    copies = torch.tensor([[2, NONE], [9, NONE], [9, 9], [5, 5], [NONE, NONE], [12, 6]])
    bonus = torch.randn(6, 2, generator=gen)
    logits, out_cands = add_copies((table[cands] @ vectors[:, :, None]).squeeze(2), cands, copies, bonus,
                                   vectors, table)
    want = dense_with_bonus(vectors, table, copies, bonus)
    assert out_cands.shape == (6, 6) and torch.equal(out_cands[:, :4], cands)
    for n in range(6):
        finite = torch.isfinite(logits[n])
        ids = out_cands[n][finite].tolist()
        assert len(ids) == len(set(ids))  # no token twice
        expected_ids = set(cands[n].tolist()) | {int(c) for c in copies[n] if c >= 0}
        assert set(ids) == expected_ids
        torch.testing.assert_close(logits[n][finite], want[n, out_cands[n][finite]])


def test_host_copy_columns_equal_the_tensor_ones() -> None:
    from specdraft.drafters.mtp.copy import copy_columns, host_copy_columns
    from specdraft.drafters.mtp.head import ClusteredHead

    head = ClusteredHead(8, 64, 16, 4)  # 16 clusters of 4 tokens, 4 kept
    head.token_ordering.copy_(torch.randperm(64, generator=torch.Generator().manual_seed(0)))
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(40, 8, generator=gen)
    top = head.top_clusters(z)
    cands = head.candidates(z, top)
    copies = torch.randint(-1, 64, (40, 2), generator=gen)
    copies[::3, 1] = copies[::3, 0]  # repeats of the first copy
    column, live = copy_columns(cands, copies)
    cols, lives = host_copy_columns(copies.tolist(), top.tolist(), head.token_slots(), head.cluster_size)
    valid = copies >= 0
    assert torch.equal(torch.tensor(lives), live)
    assert torch.equal(torch.tensor(cols)[valid], column[valid])
    assert live.any() and (valid & ~live).any()  # copies inside and outside the candidates


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_one_call_head_equals_the_tensor_path(half: bool, gated: bool) -> None:
    """The clustered head in one C call (score_rows.c draft_head) lays out and computes the logits
    of the tensor path (top clusters, candidate scores, add_copies) bit for bit, and picks their
    argmax with its softmax probability."""
    from specdraft.drafters.mtp.head import ClusteredHead, score
    from specdraft.models.kernels import build
    from specdraft.models.kernels.score_rows import draft_head
    from specdraft.sampling import SamplingParams, probabilities

    if not build.available():
        pytest.skip("the C kernels do not build here")
    gen = torch.Generator().manual_seed(2)
    head = ClusteredHead(24, 512, 32, 4)  # 32 clusters of 16 tokens, 4 kept
    head.token_ordering.copy_(torch.randperm(512, generator=gen))
    torch.nn.init.normal_(head.centroids.weight, generator=gen)
    table = torch.randn(512, 40, generator=gen)  # d = 40: the dot's 16- and 8-wide loops and its tail
    table = table.half() if half else table
    z, vectors = torch.randn(30, 24, generator=gen), torch.randn(30, 40, generator=gen)
    copies = torch.randint(-1, 512, (30, 2), generator=gen)
    copies[::3, 1] = copies[::3, 0]  # repeats of the first copy
    cands = head.candidates(z)
    copies[1::4, 0] = cands[1::4, 5]  # copies inside the candidates too
    bonus = torch.randn(30, 2, generator=gen) * 3
    with torch.inference_mode():
        want = score(vectors, table, cands)
        if gated:
            want, cands = add_copies(want, cands, copies, bonus, vectors, table)
        q = probabilities(want, SamplingParams(temperature=1.0))
        logits, got_cands, token, prob = draft_head(vectors, table, head.centroids(z), head.top_k, head.clusters(),
                                                    *head.slot_tensors(), copies if gated else None,
                                                    bonus if gated else None, pick=True)
    assert torch.equal(logits, want) and torch.equal(got_cands, cands)
    assert torch.equal(token, cands.gather(1, want.argmax(-1, keepdim=True)).squeeze(1))
    torch.testing.assert_close(prob, q.max(-1).values, rtol=1e-5, atol=1e-6)
    assert (prob < 0.99).any() and (prob > 0.2).any()  # picks of every confidence
