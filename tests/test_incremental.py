"""Per-token work that does not grow with the output: streaming text and prompt lookup.

Counted in work units (ids decoded, n-gram starts indexed), not seconds, over 4,000 tokens.
"""

from __future__ import annotations

import random

import torch

from conftest import write_word_tokenizer
from specdraft.drafters.lookup_index import LookupIndex
from specdraft.tokenizer import StreamDecoder, Tokenizer

LONG = 4000


def latest_match_by_scan(seq: list[int], min_n: int, max_n: int) -> int:
    """The definition: longest suffix n-gram first, latest earlier start with a token after it."""
    for n in range(max_n, min_n - 1, -1):
        if len(seq) < n + 1:
            continue
        for s in range(len(seq) - n - 1, -1, -1):
            if seq[s : s + n] == seq[-n:]:
                return s + n
    return -1


def _rounds(seed: int, total: int) -> list[int]:
    """Round sizes of 1..9 tokens (what the engine emits per round) adding up to `total`."""
    rng, sizes = random.Random(seed), []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, 9), total - sum(sizes)))
    return sizes


def test_lookup_index_equals_a_full_scan() -> None:
    rng = random.Random(0)
    # A small alphabet with copied stretches, so every n-gram length finds matches and misses.
    seqs = []
    for _ in range(3):
        seq = [rng.randrange(6) for _ in range(20)]
        while len(seq) < 300:
            seq += seq[rng.randrange(len(seq) - 5):][: rng.randint(1, 8)] if rng.random() < 0.5 else [rng.randrange(6)]
        seqs.append(seq[:300])
    tokens = torch.tensor(seqs)
    index = LookupIndex(1, 3)
    lengths = [20, 35, 50]
    while max(lengths) < 300:
        got = index.continuation_starts(tokens, torch.tensor(lengths)).tolist()
        assert got == [latest_match_by_scan(s[:n], 1, 3) for s, n in zip(seqs, lengths)]
        lengths = [min(300, n + rng.randint(0, 9)) for n in lengths]  # rows grow unevenly; some wait


def test_lookup_work_per_token_is_constant() -> None:
    seq = torch.randint(0, 50, (1, LONG + 1), generator=torch.Generator().manual_seed(0))
    index, length, work = LookupIndex(1, 3), 16, []
    index.continuation_starts(seq, torch.tensor([length]))  # the prompt, indexed once
    for size in _rounds(1, LONG - 16):
        length += size
        before = index.positions_indexed
        index.continuation_starts(seq, torch.tensor([length]))
        work.append((index.positions_indexed - before) / size)
    # Each new token completes one n-gram per length (3): the same at 4,000 tokens as at 20.
    assert max(work[:20]) <= 3 and max(work[-20:]) <= 3
    assert index.positions_indexed <= 3 * LONG


def test_stream_decoder_work_per_token_is_constant(tmp_path) -> None:
    write_word_tokenizer(tmp_path, 64)
    tok = Tokenizer(tmp_path)
    decoded = []
    original = tok.decode

    def counting_decode(ids, skip_special_tokens=True):
        decoded.append(len(ids))
        return original(ids, skip_special_tokens)

    tok.decode = counting_decode
    ids = torch.randint(4, 64, (LONG,), generator=torch.Generator().manual_seed(0)).tolist()
    stream, pieces, start, per_push = StreamDecoder(tok), [], 0, []
    for size in _rounds(2, LONG):
        decoded.clear()
        pieces.append(stream.push(ids[start : start + size]))
        per_push.append(sum(decoded))
        start += size
    assert "".join(pieces) == original(ids)
    # Two decodes of at most the previous and the new round (9 + 9 ids), at the end as at the start.
    assert max(per_push) <= 2 * (9 + 9)
