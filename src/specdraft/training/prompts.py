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

SHINGLE = 13
BASE_TEMPLATE = "Question: {prompt}\nAnswer:"


def _prompt_of(obj: dict) -> str | None:
    """The prompt text of one JSONL record, for the formats we know."""
    if isinstance(obj.get("prompt"), str):
        return obj["prompt"]
    if isinstance(obj.get("instruction"), str):  # self-instruct seed tasks
        inputs = [i.get("input", "") for i in obj.get("instances", []) if isinstance(i, dict)]
        extra = inputs[0].strip() if inputs else ""
        return obj["instruction"] + ("\n\n" + extra if extra else "")
    if isinstance(obj.get("turns"), list) and obj["turns"]:  # Spec-Bench / MT-bench layout
        return str(obj["turns"][0])
    if isinstance(obj.get("text"), str):
        return obj["text"]
    return None


def read_prompt_file(path: Path) -> list[str]:
    """JSONL (prompt / instruction+instances / turns / text) or plain text, one prompt per line."""
    if not path.is_file():
        raise SpecdraftError(f"prompts file {path} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    if not lines:
        raise SpecdraftError(f"prompts file {path} is empty")
    if path.suffix != ".jsonl" and not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for n, line in enumerate(lines, 1):
        try:
            text = _prompt_of(json.loads(line))
        except json.JSONDecodeError as e:
            raise SpecdraftError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if text is None:
            raise SpecdraftError(f"{path}:{n}: no prompt field (prompt, instruction, turns or text)")
        if text.strip():
            prompts.append(text)
    return prompts


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
        text = _prompt_of(obj)
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
                    limit: int | None = None) -> PromptSet:
    prompts: list[str] = []
    for f in files:
        prompts.extend(read_prompt_file(f))
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


def format_prompt(tokenizer, text: str, template: str | None) -> list[int]:
    """Token ids for a prompt: the chat template when the model has one, else `template`
    (e.g. BASE_TEMPLATE) or the raw text when template is None."""
    if tokenizer.chat_template is not None:
        return tokenizer.encode_prompt(text, chat=True)
    return tokenizer.encode(template.format(prompt=text) if template else text)
