"""Where each n-gram of a row's text last occurred, kept up to date as the text grows.

Prompt lookup asks, every round, for the latest earlier occurrence of the row's last n tokens.
Rescanning the whole sequence for that costs O(length) per round, O(length^2) per request;
the index adds only the n-grams the round's new tokens complete, so a round's work does not
grow with the text. A row's tokens never change once emitted, so entries never go stale; a
row that got shorter (a new batch without `reset`) is rebuilt from scratch.
"""

from __future__ import annotations

import torch


class _Row:
    def __init__(self, ngrams: range):
        self.tokens: list[int] = []  # host copy of the row's sequence, as far as it is indexed
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ngrams}  # n -> n-gram -> start
        self.next_start: dict[int, int] = {n: 0 for n in ngrams}  # first start not indexed yet


class LookupIndex:
    def __init__(self, min_ngram: int, max_ngram: int):
        self.ngrams = range(min_ngram, max_ngram + 1)
        self.rows: list[_Row] = []
        self.positions_indexed = 0  # n-gram starts added since creation: the index's whole work

    def reset(self, batch_size: int) -> None:
        self.rows = [_Row(self.ngrams) for _ in range(batch_size)]

    def continuation_starts(self, tokens: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """For rows whose sequences are tokens[:, :seq_len]: where the tokens after the latest
        earlier occurrence of the longest suffix n-gram (max_ngram down to min_ngram) begin,
        or -1. An occurrence counts only if at least one known token follows it."""
        starts = [self._find(row) for row in self.sync(tokens, seq_len)]
        return torch.tensor(starts, dtype=torch.long, device=tokens.device)

    def sync(self, tokens: torch.Tensor, seq_len: torch.Tensor) -> list[_Row]:
        """Index rows whose sequences are tokens[:, :seq_len] (one host transfer of the tokens
        new since the last call); their rows, in order."""
        lengths = seq_len.tolist()
        if len(self.rows) < len(lengths):
            self.reset(len(lengths))
        for i, n in enumerate(lengths):
            if n < len(self.rows[i].tokens):
                self.rows[i] = _Row(self.ngrams)
        rows = self.rows[: len(lengths)]  # a step-wise engine's round covers the first n rows
        lo = min(len(row.tokens) for row in rows)
        new = tokens[:, lo : max(lengths)].tolist()  # one transfer for every row's new tokens
        for row, n, fresh in zip(rows, lengths, new):
            row.tokens.extend(fresh[len(row.tokens) - lo : n - lo])
            self._add(row)
        return rows

    @staticmethod
    def follower(row: _Row, extra: list[int], n: int) -> int:
        """The token that followed the latest earlier occurrence of the last n tokens of the text
        row.tokens + extra (tokens not indexed, e.g. a round's drafts), or -1. n must be one of
        the index's n-gram lengths."""
        toks, size = row.tokens, len(row.tokens) + len(extra)
        if size < n + 1:
            return -1

        def at(i: int) -> int:
            return toks[i] if i < len(toks) else extra[i - len(toks)]

        key = tuple(at(i) for i in range(size - n, size))
        for s in range(size - n - 1, row.next_start[n] - 1, -1):  # the starts the index lacks, latest first
            if all(at(s + j) == key[j] for j in range(n)):
                return at(s + n)
        s = row.latest[n].get(key)
        return -1 if s is None else at(s + n)

    def reset_row(self, i: int) -> None:
        self.rows[i] = _Row(self.ngrams)

    def move_row(self, src: int, dst: int) -> None:
        self.rows[dst], self.rows[src] = self.rows[src], _Row(self.ngrams)

    def _add(self, row: _Row) -> None:
        toks = row.tokens
        for n, latest in row.latest.items():
            last = len(toks) - n - 1  # the last start followed by a known token
            for s in range(row.next_start[n], last + 1):
                latest[tuple(toks[s : s + n])] = s
            self.positions_indexed += max(0, last + 1 - row.next_start[n])
            row.next_start[n] = max(row.next_start[n], last + 1)

    def _find(self, row: _Row) -> int:
        toks = row.tokens
        for n in reversed(self.ngrams):
            if len(toks) < n + 1:
                continue
            start = row.latest[n].get(tuple(toks[-n:]))
            if start is not None:
                return start + n
        return -1
