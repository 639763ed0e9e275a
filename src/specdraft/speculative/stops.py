"""Stop strings, checked token by token on a bounded tail of the text.

Plain decoding checks after every token, so speculative decoding must too: a round may emit
several tokens past the one that completes a stop string, and none of them may be kept. A stop
string that the newest token completes lies inside the last few tokens' text, so each check
decodes only a fixed window of tokens, never the whole output (which would cost O(n^2) over a
long generation). The full text is decoded once, when a stop string is found, to cut it.
"""

from __future__ import annotations

from typing import Callable

# Tokens of context per character of the longest stop string: a byte-fallback tokenizer may
# spend up to 4 tokens on one character; the margin keeps the stop string clear of the window's
# left edge, where a decoder may drop a leading space or show half a character.
TOKENS_PER_CHAR = 4
MARGIN = 8


class StopChecker:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.window = TOKENS_PER_CHAR * max(len(s) for s in stops) + MARGIN

    def first_hit(self, ids: list[int], checked: int) -> int | None:
        """ids[:checked] hold no stop string; the smallest end > checked whose text ids[:end]
        contains one, or None."""
        for end in range(checked + 1, len(ids) + 1):
            tail = self.decode(ids[max(0, end - self.window) : end])
            if any(s in tail for s in self.stops):
                return end
        return None

    def text_before(self, ids: list[int]) -> str:
        """The text of ids up to the first stop string (called once, when one was found)."""
        text = self.decode(ids)
        cut = min((text.find(s) for s in self.stops if s in text), default=len(text))
        return text[:cut]
