"""Synthetic prompts: the target writes new prompts in the style of the training prompts.

Prompt files people have at hand rarely look like what the drafter will face (ours are NLP
benchmark templates with short answers; users ask open questions). A base model continues a
list of questions with more questions of the same kind, so a few-shot list of single-line
training prompts, sampled a line at a time, gives as many new prompts as wanted, in the
target's own words. They are cached one per line in a JSONL file and appended batch by batch,
so an interrupted run resumes where it stopped and a rerun with the same seed gives the same
prompts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.training.data import record_answers

HEADER = "Below are questions and requests that people asked an assistant, one per line.\n\n"
LINE = "Question: {prompt}\n"


@dataclass
class SyntheticConfig:
    shots: int = 4  # example prompts in each few-shot list
    max_tokens: int = 64  # a new prompt longer than this is cut and dropped
    temperature: float = 0.9
    batch_size: int = 32
    min_words: int = 4
    max_chars: int = 300
    seed: int = 0


def exemplars(prompts: list[str], max_chars: int) -> list[str]:
    """Training prompts that fit on one line of the few-shot list."""
    return [p.strip() for p in prompts if "\n" not in p.strip() and 0 < len(p.strip()) <= max_chars]


def few_shot_text(examples: list[str]) -> str:
    return HEADER + "".join(LINE.format(prompt=e) for e in examples) + "Question:"


def line_end_ids(tokenizer) -> set[int]:
    """Every token whose text holds a line break: sampling stops at the end of the line."""
    return {i for i in range(tokenizer.vocab_size) if "\n" in tokenizer.decode([i], skip_special_tokens=False)}


def clean(text: str, ended: bool, cfg: SyntheticConfig) -> str | None:
    """The new prompt (its first line), or None when the line was cut off by the token limit, or
    is too short or too long."""
    if not ended:
        return None
    line = text.split("\n", 1)[0].strip()
    if len(line.split()) < cfg.min_words or len(line) > cfg.max_chars:
        return None
    return line


def synthesize_prompts(rt, seeds: list[str], count: int, path: Path, cfg: SyntheticConfig,
                       refuse=None) -> list[str]:
    """`count` new prompts in path (JSONL, {"prompt": ...} per line), generating only what is
    missing. `refuse(prompt) -> bool` drops prompts (e.g. EvalGuard.contaminated)."""
    pool = exemplars(seeds, cfg.max_chars)
    if len(pool) < cfg.shots:
        raise SpecdraftError(f"--synthetic-prompts needs at least {cfg.shots} single-line training prompts of at "
                             f"most {cfg.max_chars} characters to show the target; the prompt files have {len(pool)}")
    have = _read(path)
    if len(have) >= count:
        return have[:count]
    seen = set(have) | set(pool)
    stops = line_end_ids(rt.tokenizer) | set(rt.tokenizer.eos_token_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(total=count, initial=len(have), desc="synthetic prompts", unit="prompt") as bar, \
            path.open("a", encoding="utf-8") as out:
        # Batch b always draws the same few-shot lists and sampling seed, so reruns agree; a
        # resumed run starts at the batch after the last one whose prompts were written.
        batch = _batches_done(path)
        while len(have) < count:
            if batch > 50 * (count // cfg.batch_size + 1):
                raise SpecdraftError(f"the target wrote only {len(have)} usable new prompts in {batch} batches; "
                                     "give more single-line training prompts or lower --synthetic-prompts")
            rng = random.Random(cfg.seed * 1_000_003 + batch)
            shots = [rt.tokenizer.encode(few_shot_text(rng.sample(pool, cfg.shots))) for _ in range(cfg.batch_size)]
            records = record_answers(rt.model, shots, cfg.max_tokens, cfg.temperature, rng.randrange(2**31), [], 1,
                                     stops)
            new = []
            for r in records:
                answer = r["tokens"][r["prompt_length"]:].tolist()
                text = clean(rt.tokenizer.decode(answer), bool(answer) and answer[-1] in stops, cfg)
                if text is not None and text not in seen and not (refuse and refuse(text)):
                    seen.add(text)
                    new.append(text)
            new = new[: count - len(have)]
            out.write("".join(json.dumps({"prompt": p, "batch": batch}) + "\n" for p in new))
            out.write(json.dumps({"batch_done": batch}) + "\n")
            out.flush()  # the batch's lines reach the disk before a later batch is begun
            os.fsync(out.fileno())
            out.flush()
            have += new
            bar.update(len(new))
            batch += 1
    return have


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by an interruption; its batch is redone
            continue
    return rows


def _read(path: Path) -> list[str]:
    rows = _lines(path)
    done = {r["batch_done"] for r in rows if "batch_done" in r}
    # A batch cut short is redone with the same seed, so its first lines may appear twice.
    return list(dict.fromkeys(r["prompt"] for r in rows if "prompt" in r and r.get("batch") in done))


def _batches_done(path: Path) -> int:
    done = [r["batch_done"] for r in _lines(path) if "batch_done" in r]
    return max(done) + 1 if done else 0


