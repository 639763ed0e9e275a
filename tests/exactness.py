"""The suite's one check that speculative decoding is exact on a model, and its negative controls.

`speculative_equals_plain` compares speculative with plain greedy output token for token, and
also checks that speculation really happened: drafts were made and some accepted (a round that
emitted more than one token). Without that second half a drafter that stopped proposing, or an
engine that never verified a draft, would pass every exactness test.

`negative_controls` shows, on the same model and prompts, that the check can fail:
- a drafter whose every draft is wrong leaves the output equal but accepts nothing, so the check
  fails on "no draft was accepted";
- a verifier that accepts every draft (monkeypatched in place of the greedy rule) makes the
  output differ from plain, so the check fails on "differs from plain".
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from conftest import OracleDrafter
from specdraft.drafters.base import Draft, Drafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.speculative import group_verify
from specdraft.speculative.engine import Engine
from specdraft.speculative.stats import RequestStats, merge

# Given the plain sequences (prompt + plain continuation) of the rows of one batch, a drafter.
DrafterFactory = Callable[[list[list[int]]], Drafter]


def lookup_drafter(sequences: list[list[int]]) -> Drafter:
    return NgramDrafter()


def noisy_oracle(vocab: int, noise: float = 0.3) -> DrafterFactory:
    """The plain continuation with a share `noise` of drafts corrupted (conftest's oracle): rounds
    that accept several drafts and rounds that reject, where the model's own text gives prompt
    lookup nothing to find."""
    return lambda sequences: OracleDrafter(sequences, noise=noise, seed=1, vocab=vocab)


def speculative_equals_plain(model: torch.nn.Module, prompts: list[list[int]], batch: int, max_new: int = 24,
                             monkeypatch: pytest.MonkeyPatch | None = None,
                             make_drafter: DrafterFactory = lookup_drafter, k: int = 4) -> RequestStats:
    """Greedy speculative output (batches of `batch` prompts) equals plain output, and drafts
    were made and accepted. With `monkeypatch`, the negative controls run too (on the same
    model, prompts and batches). Returns the speculative runs' merged stats."""
    plain = Engine(model).generate(prompts, max_new, eos_token_ids=[])
    stats = []
    for start in range(0, len(prompts), batch):
        chunk, want = prompts[start : start + batch], plain[start : start + batch]
        sequences = [p + r.token_ids for p, r in zip(chunk, want)]
        got = Engine(model, drafter=make_drafter(sequences), draft_tokens=k).generate(chunk, max_new, eos_token_ids=[])
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.token_ids == b.token_ids, f"row {start + i}: speculative output differs from plain"
        stats += [r.stats for r in got]
    total = merge(stats)
    assert total.drafted > 0, "nothing was drafted: the exactness check would be plain against plain"
    # accepted = new tokens - target forwards: > 0 only if some round emitted two tokens or more.
    assert total.accepted > 0, f"no draft was accepted ({total.drafted} drafted): no multi-token round"
    if monkeypatch is not None:
        negative_controls(model, prompts, batch, monkeypatch, max_new, k)
    return total


class WrongDrafter(OracleDrafter):
    """Every draft is the plain continuation's token at its position plus one: never what greedy
    decoding emits there. (conftest's oracle follows the rows; unlike its `propose` this one does
    not assert the history, which a broken verifier is expected to corrupt.)"""

    def propose(self, inp, k, sampling, generator):
        rows = []
        for i in range(inp.last_token.shape[0]):
            seq, p = self.sequences[self.slot_seq[i]], int(inp.position[i])
            cont = (seq[p + 2 : p + 2 + k] + [0] * k)[:k]
            rows.append([(t + 1) % self.vocab for t in cont])
        return Draft(torch.tensor(rows, dtype=torch.long), torch.where(inp.active, k, 0))


def wrong_drafter(vocab: int) -> DrafterFactory:
    return lambda sequences: WrongDrafter(sequences, vocab=vocab)


def accept_every_draft(greedy_tokens, hidden, drafts, num_valid, block=None, first=None):
    """A broken greedy verifier: every valid draft accepted, then the target's token after them."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return num_valid.clone(), greedy_tokens(hidden[rows, num_valid])


def negative_controls(model: torch.nn.Module, prompts: list[list[int]], batch: int,
                      monkeypatch: pytest.MonkeyPatch, max_new: int = 24, k: int = 4) -> None:
    """The check fails for a drafter that lands nothing (output still equal: the verifier
    rejected every wrong draft) and for a verifier that accepts everything (output differs)."""
    wrong = wrong_drafter(model.config.vocab_size)
    with pytest.raises(AssertionError, match="no draft was accepted"):
        speculative_equals_plain(model, prompts, batch, max_new, make_drafter=wrong, k=k)
    with monkeypatch.context() as m:
        m.setattr(group_verify, "verify_greedy_blockwise", accept_every_draft)
        with pytest.raises(AssertionError, match="differs from plain"):
            speculative_equals_plain(model, prompts, batch, max_new, make_drafter=wrong, k=k)
