"""Long prompts for measuring time to first token: documents stacked to a given length, a question last.

The documents are the passages of the T0 training prompts (`t0_prompts.jsonl`, Apache-2.0;
src/specdraft/training/prompt_sets/README.md says where it comes from), never Spec-Bench.
Lengths are counted with the model's own tokenizer, so `--tokens 12000` gives prompts of 12,000
tokens (give or take one passage's tail, cut at a word).

    python benchmarks/long_prompts.py --tokens 12000 --count 2 --out /tmp/long.jsonl
    specdraft bench --questions /tmp/long.jsonl --methods plain,llama-cpp --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.loading.presets import resolve_model
from specdraft.tokenizer import Tokenizer

QUESTION = "\n\nQuestion: Which people, places and dates do the documents above mention most often?\nAnswer:"


def passages(source: Path) -> list[str]:
    out = []
    with source.open() as f:  # by "\n" only: prompts may hold other Unicode line breaks
        lines = [line for line in f if line.strip()]
    for line in lines:
        text = json.loads(line).get("prompt", "")
        if len(text) > 400:  # whole documents, not one-line tasks
            out.append(text.strip())
    return out


def long_prompt(docs: list[str], tokenizer: Tokenizer, tokens: int, rng: random.Random) -> str:
    """Random documents appended until the prompt reaches `tokens` tokens, the last one cut."""
    budget = tokens - len(tokenizer.encode(QUESTION))
    parts: list[str] = []
    used = 0
    while used < budget:
        doc = f"Document {len(parts) + 1}:\n{rng.choice(docs)}\n\n"
        n = len(tokenizer.encode(doc))
        if used + n > budget:  # cut the last document to fit, at a word
            words = doc.split(" ")
            doc = " ".join(words[: max(1, len(words) * (budget - used) // n)])
            n = len(tokenizer.encode(doc))
        parts.append(doc)
        used += n
    return "".join(parts).rstrip() + QUESTION


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=12000, help="prompt length in the model's tokens (default 12000)")
    ap.add_argument("--count", type=int, default=2, help="how many prompts (default 2)")
    ap.add_argument("--model", default="gemma3-270m", help="whose tokenizer counts the tokens (default gemma3-270m)")
    ap.add_argument("--source", type=Path, required=True,
                    help="JSONL of training prompts to take documents from (a T0 prompt file: "
                         "src/specdraft/training/prompt_sets/README.md says how to make one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSONL to write (a `specdraft bench --questions` file)")
    args = ap.parse_args()
    if args.tokens < 100 or args.count < 1:
        ap.error("--tokens must be >= 100 and --count >= 1")
    if not args.source.is_file():
        ap.error(f"no such file: {args.source}")
    if not args.out.parent.is_dir():
        ap.error(f"no such folder for --out: {args.out.parent}")
    try:
        tokenizer = Tokenizer(resolve_model(args.model))
    except SpecdraftError as e:
        ap.error(str(e))
    docs, rng = passages(args.source), random.Random(args.seed)
    with args.out.open("w") as f:
        for i in range(args.count):
            text = long_prompt(docs, tokenizer, args.tokens, rng)
            f.write(json.dumps({"question_id": f"long-{i}", "category": f"long-{args.tokens}", "prompt": text}) + "\n")
            print(f"long-{i}: {len(tokenizer.encode(text))} tokens")


if __name__ == "__main__":
    main()
