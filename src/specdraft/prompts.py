"""Prompt files and prompt formatting, shared by generate, bench, train-drafter and eval-drafter.

A prompt file is plain text (one prompt per line) or JSONL whose records carry the prompt as
"prompt", "instruction" (+ the first instance's "input", self-instruct style), "turns" (first
turn, Spec-Bench / MT-bench style) or "text". Lines are split on "\\n" only: prompts often
contain other Unicode line separators inside JSON strings.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.errors import SpecdraftError

# What base models (no chat template) see in the benchmark, and in half of the training data.
# Short and neutral: no few-shot examples a drafter could copy from.
BASE_TEMPLATE = "Question: {prompt}\nAnswer:"


def read_records(path: Path, what: str = "prompts file") -> tuple[list[dict] | None, list[str]]:
    """(JSON records, None) for JSONL files, else (None, the non-empty lines)."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    except FileNotFoundError:
        raise SpecdraftError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise SpecdraftError(f"{what} {path} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdraftError(f"cannot read {what} {path}: {e}") from None
    if not lines:
        raise SpecdraftError(f"{what} {path} is empty")
    if path.suffix != ".jsonl" and not lines[0].lstrip().startswith("{"):
        return None, lines
    records = []
    for n, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdraftError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SpecdraftError(f"{path}:{n}: expected a JSON object")
        records.append(obj)
    return records, lines


def prompt_text(obj: dict) -> str | None:
    """The prompt of one JSONL record, for the layouts we know; None if it has none."""
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return str(obj["turns"][0])
    if isinstance(obj.get("prompt"), str):
        return obj["prompt"]
    if isinstance(obj.get("instruction"), str):
        inputs = [i.get("input", "") for i in obj.get("instances", []) if isinstance(i, dict)]
        extra = inputs[0].strip() if inputs else ""
        return obj["instruction"] + ("\n\n" + extra if extra else "")
    if isinstance(obj.get("text"), str):
        return obj["text"]
    return None


def read_prompts(path: Path, what: str = "prompts file") -> list[str]:
    records, lines = read_records(path, what)
    if records is None:
        return lines
    prompts = []
    for n, obj in enumerate(records, 1):
        text = prompt_text(obj)
        if text is None:
            raise SpecdraftError(f"{path}:{n}: no prompt field (prompt, turns, instruction or text)")
        prompts.append(text)
    return prompts


def format_prompt(tokenizer, text: str, template: str | None) -> list[int]:
    """Token ids for a prompt: the chat template when the model has one, else `template`
    (e.g. BASE_TEMPLATE) or the raw text when template is None."""
    if tokenizer.chat_template is not None:
        return tokenizer.encode_prompt(text, chat=True)
    return tokenizer.encode(template.format(prompt=text) if template else text)
