"""What the benchmark asks: Spec-Bench question files or plain prompt files, and prompt formatting.

Spec-Bench files are JSONL with question_id, category and turns; only the first turn is used
(multi-turn would make each method's second prompt depend on its own first answer). Plain
files (one prompt per line, or JSONL with "prompt") get the category "all".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

# Base models have no chat template; this is what they see instead. Kept short and neutral so
# it does not favour any drafter (no few-shot examples to copy from).
PLAIN_TEMPLATE = "Question: {q}\nAnswer:"


@dataclass(frozen=True)
class Question:
    qid: str
    category: str
    text: str


def _from_json(obj: object, where: str, n: int) -> Question:
    if not isinstance(obj, dict):
        raise SpecdraftError(f"{where}: expected a JSON object")
    category = str(obj.get("category") or "all")
    qid = str(obj.get("question_id", obj.get("id", n)))
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return Question(qid, category, str(obj["turns"][0]))
    if isinstance(obj.get("prompt"), str):
        return Question(qid, category, obj["prompt"])
    raise SpecdraftError(f"{where}: expected \"turns\" (Spec-Bench) or a \"prompt\" string")


def read_questions(path: Path) -> list[Question]:
    """Spec-Bench JSONL, JSONL with "prompt", or plain text with one prompt per line."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    except FileNotFoundError:
        raise SpecdraftError(f"questions file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdraftError(f"cannot read questions file {path}: {e}") from None
    if not lines:
        raise SpecdraftError(f"questions file {path} is empty")
    if path.suffix != ".jsonl" and not lines[0].lstrip().startswith("{"):
        return [Question(str(n), "all", line) for n, line in enumerate(lines)]
    questions = []
    for n, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdraftError(f"{path}:{n + 1}: invalid JSON ({e.msg})") from None
        questions.append(_from_json(obj, f"{path}:{n + 1}", n))
    return questions


def select(questions: list[Question], categories: list[str] | None, limit_per_category: int | None) -> list[Question]:
    """Keep the file's order; filter by category and take the first N of each."""
    known = list(dict.fromkeys(q.category for q in questions))
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpecdraftError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} "
                                 f"(this file has: {', '.join(known)})")
    counts: dict[str, int] = {}
    chosen = []
    for q in questions:
        if categories and q.category not in categories:
            continue
        if limit_per_category is not None and counts.get(q.category, 0) >= limit_per_category:
            continue
        counts[q.category] = counts.get(q.category, 0) + 1
        chosen.append(q)
    if not chosen:
        raise SpecdraftError("no questions selected")
    return chosen


def prompt_style(tokenizer) -> str:
    """"chat" when the model has a chat template, else "plain" (PLAIN_TEMPLATE)."""
    return "chat" if tokenizer.chat_template is not None else "plain"


def encode(tokenizer, question: Question, style: str) -> list[int]:
    """Token ids every method receives (tokenized once, outside any timer)."""
    if style == "chat":
        return tokenizer.encode_prompt(question.text, chat=True)
    return tokenizer.encode(PLAIN_TEMPLATE.format(q=question.text))
