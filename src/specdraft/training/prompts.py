"""Training prompts: reading sources, keeping evaluation sets out, held-out split, formatting.

Evaluation sets must never leak into training. `EvalGuard` refuses any prompt that shares a
13-word span with an evaluation file (the decontamination rule GPT-3 used), which also
catches an evaluation article embedded inside a longer training prompt.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.prompts import BASE_TEMPLATE, format_prompt, prompt_text, read_prompts  # noqa: F401

SHINGLE = 13
def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(text: str) -> set[int]:
    words = _words(text)
    if len(words) < SHINGLE:  # short prompts: the whole normalised text is the unit
        return {hash(" ".join(words))} if words else set()
    return {hash(" ".join(words[i : i + SHINGLE])) for i in range(len(words) - SHINGLE + 1)}


class EvalGuard:
    """Refuses prompts that overlap an evaluation set (any 13-word span in common)."""

    def __init__(self, eval_files: list[Path]):
        self.files = eval_files
        self.shingles: set[int] = set()
        for path in eval_files:
            for record in _eval_texts(path):
                self.shingles |= _shingles(record)

    def contaminated(self, prompt: str) -> bool:
        return not self.shingles.isdisjoint(_shingles(prompt))

    def filter(self, prompts: list[str]) -> tuple[list[str], list[str]]:
        """(kept, refused)."""
        kept, refused = [], []
        for p in prompts:
            (refused if self.contaminated(p) else kept).append(p)
        return kept, refused


def _eval_texts(path: Path) -> list[str]:
    if not path.is_file():
        raise SpecdraftError(f"evaluation file {path} does not exist")
    texts = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            texts.append(line)
            continue
        texts.extend(str(t) for t in obj.get("turns", []))
        text = prompt_text(obj)
        if text and "turns" not in obj:
            texts.append(text)
    return texts


def is_held_out(prompt: str, fraction: float) -> bool:
    """A stable split by content hash, so resumes and reruns agree on it."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass
class PromptSet:
    train: list[str]
    held_out: list[str]
    refused: list[str]


def load_prompt_set(files: list[Path], eval_files: list[Path], held_out_fraction: float = 0.02,
                    limit: int | None = None, what: str = "prompts file") -> PromptSet:
    prompts: list[str] = []
    for f in files:
        prompts.extend(read_prompts(f, what))
    prompts = list(dict.fromkeys(prompts))  # drop exact duplicates
    # A fixed shuffle: sources are grouped by task, and --num-prompts must sample all of them.
    random.Random(0).shuffle(prompts)
    refused: list[str] = []
    if eval_files:
        prompts, refused = EvalGuard(eval_files).filter(prompts)
    train = [p for p in prompts if not is_held_out(p, held_out_fraction)]
    held = [p for p in prompts if is_held_out(p, held_out_fraction)]
    if limit is not None:
        train = train[:limit]
    if not train:
        raise SpecdraftError("no training prompts left (all refused or held out)")
    return PromptSet(train, held, refused)
