"""What the server serves: the engine over a loaded target, its tokenizer and drafter."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.speculative.engine import Engine
from specdraft.tokenizer import Tokenizer


@dataclass
class ServedModel:
    name: str
    engine: Engine
    tokenizer: Tokenizer
    drafter: str  # the drafter kind actually used ("none" for plain decoding)
    k: int
