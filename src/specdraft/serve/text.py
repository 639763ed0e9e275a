"""A request's tokens as streamed text: deltas split into (text, source) pieces for the
playground's colours, with text that may start a stop string held back until it is known.

The engine cuts token ids at a stop string; text is another matter: the characters before the
token that completes a stop string may already have looked safe. So the last
(longest stop - 1) characters wait, and text from a complete stop string on is never sent.
At the end, the engine's final text is authoritative: whatever was not sent yet is.
"""

from __future__ import annotations

import functools

from specdraft.tokenizer import StreamDecoder, Tokenizer

Piece = tuple[str, str]  # (text, source)


def encode(tok: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenizer.encode holds the GIL for the whole call (seconds for megabytes of text); the
    HF tokenizer's batch call releases it, so the event loop keeps answering meanwhile."""
    inner = getattr(tok, "_tok", None)
    if inner is None or not hasattr(inner, "encode_batch"):
        return tok.encode(text, add_special_tokens=add_special_tokens)
    return inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


@functools.lru_cache(maxsize=8)
def longest_token_chars(tok: Tokenizer) -> int | None:
    """Characters in the vocabulary's longest token string (None if unknown). A token's string
    holds at least as many characters as its text (byte-level and byte-fallback tokens more)."""
    inner = getattr(tok, "_tok", None)
    if inner is None or not hasattr(inner, "get_vocab"):
        return None
    return max((len(t) for t in inner.get_vocab(with_added_tokens=True)), default=None)


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending: list[Piece] = []
        self.sent = 0  # characters sent

    def push(self, ids: list[int], sources: list[str]) -> list[Piece]:
        for t, src in zip(ids, sources):
            text = self.decoder.push([t])  # empty while a character is incomplete
            if text:
                self.pending.append((text, src))
        text = "".join(p for p, _ in self.pending)
        cut = min((text.find(s) for s in self.stops if s in text), default=len(text) - self.hold)
        return self._take(max(0, cut))

    def finish(self, final_text: str) -> list[Piece]:
        rest = final_text[self.sent :]
        pending = "".join(p for p, _ in self.pending)
        if pending.startswith(rest):
            return self._take(len(rest))
        if rest.startswith(pending):  # bytes the decoder still held: the target's
            out = self._take(len(pending))
            return out + [(rest[len(pending) :], "target")]
        self.pending = []  # decoders disagree (should not happen): send the authoritative text
        self.sent += len(rest)
        return [(rest, "target")] if rest else []

    def _take(self, n: int) -> list[Piece]:
        """The first n pending characters, as pieces (the last one split if needed)."""
        out: list[Piece] = []
        while n > 0 and self.pending:
            text, src = self.pending[0]
            if len(text) <= n:
                out.append(self.pending.pop(0))
                n -= len(text)
            else:
                out.append((text[:n], src))
                self.pending[0] = (text[n:], src)
                n = 0
        self.sent += sum(len(t) for t, _ in out)
        return out
