"""What the benchmark asks: Spec-Bench question files or plain prompt files, and prompt formatting.

Spec-Bench files are JSONL with question_id, category and turns; only the first turn is used
(multi-turn would make each method's second prompt depend on its own first answer). Plain
files (one prompt per line, or JSONL with "prompt") get the category "all".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.prompts import BASE_TEMPLATE, prompt_text, read_records

# Base models have no chat template; this is what they see instead (shared with training).
PLAIN_TEMPLATE = BASE_TEMPLATE
# Spec-Bench's 480 questions, shipped with the repository (benchmarks/spec_bench/, Apache-2.0):
# what the bench measures unless told otherwise (a source checkout has it; an installed wheel not).
DEFAULT_QUESTIONS = Path(__file__).resolve().parents[3] / "benchmarks" / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Question:
    qid: str
    category: str
    text: str


def read_questions(path: Path, what: str = "questions file") -> list[Question]:
    """Spec-Bench JSONL, JSONL with "prompt", or plain text with one prompt per line; `what`
    names the file in errors (the flag the user gave it with)."""
    records, lines = read_records(path, what)
    if records is None:
        return [Question(str(n), "all", line) for n, line in enumerate(lines)]
    questions = []
    for n, obj in enumerate(records):
        text = prompt_text(obj)
        if text is None:
            raise SpecdraftError(f"{path}:{n + 1}: expected \"turns\" (Spec-Bench) or a \"prompt\" string")
        qid = str(obj.get("question_id", obj.get("id", n)))
        questions.append(Question(qid, str(obj.get("category") or "all"), text))
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
    return tokenizer.encode(PLAIN_TEMPLATE.format(prompt=question.text))
