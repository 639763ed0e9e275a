"""`specdraft weights`: what each weight format costs in quality against unquantised weights."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from specdraft.cli.args import add_model_args, load_target
from specdraft.errors import SpecdraftError


def register(sub) -> None:
    p = sub.add_parser(
        "weights", help="compare weight formats (int8, int4, fp16, gguf, gguf-q8, q8, q4) with unquantised weights: KL, top-1, greedy text",
        description="Load --model once per format and once with --weights dtype (the reference), then report "
                    "per-token KL(reference || format), top-1 agreement and mean NLL over --texts (every position, "
                    "teacher-forced), and the share of --prompts whose greedy continuation is identical.")
    add_model_args(p)
    p.add_argument("--formats", default="int8,int4", help="comma-separated, from int8,int4,fp16,gguf,gguf-q8,q8,q4 (default int8,int4; "
                                                         "fp16 and gguf[-q8] need --dtype float32, gguf[-q8] a model "
                                                         "from a GGUF file)")
    p.add_argument("--texts", type=Path, required=True,
                   help="held-out text: JSONL with \"prompt\" or one text per line (never an evaluation set you train on)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="prompts for the greedy-identical share (Spec-Bench question.jsonl works: first turns)")
    p.add_argument("--limit", type=int, default=32, help="texts and prompts used, at most (default 32)")
    p.add_argument("--text-tokens", type=int, default=128, help="tokens scored per text, at most (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--json", action="store_true", help="one JSON object per format instead of the table")
    p.set_defaults(run=run)


def run(args) -> int:
    from specdraft.bench.questions import encode, prompt_style, read_questions
    from specdraft.bench.weights import compare

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    known = ("int8", "int4", "fp16", "gguf", "gguf-q8", "q8", "q4")
    if not formats or any(f not in known for f in formats):
        raise SpecdraftError(f"--formats takes {', '.join(known)}, got {args.formats!r}")
    if min(args.limit, args.text_tokens, args.max_new_tokens) < 1:
        raise SpecdraftError("--limit, --text-tokens and --max-new-tokens must be >= 1")
    texts_q = read_questions(args.texts, "--texts file")[: args.limit]
    prompts_q = read_questions(args.prompts, "--prompts file")[: args.limit] if args.prompts else []
    args.weights = "dtype"
    reference = load_target(args)
    texts = [reference.tokenizer.encode(q.text)[: args.text_tokens] for q in texts_q]
    texts = [t for t in texts if len(t) > 1]
    prompts = [encode(reference.tokenizer, q, prompt_style(reference.tokenizer)) for q in prompts_q]
    if not args.json:
        print("| weights | MB | KL mean | KL p95 | top-1 agree | NLL (ref) | greedy identical |")
        print("|---|---|---|---|---|---|---|")
    for fmt in formats:
        args.weights = fmt
        rt = load_target(args, progress=False)
        q = compare(reference.model, rt.model, fmt, texts, prompts, args.max_new_tokens)
        if args.json:
            print(json.dumps(asdict(q) | {"megabytes": round(rt.nbytes() / 1e6)}), flush=True)
        else:
            identical = f"{q.greedy_identical:.0%} of {q.prompts}" if q.prompts else "-"
            print(f"| {fmt} | {rt.nbytes() / 1e6:.0f} | {q.kl_mean:.4f} | {q.kl_p95:.4f} | {q.top1_agreement:.3f} | "
                  f"{q.nll:.3f} ({q.reference_nll:.3f}) | {identical} |", flush=True)
        del rt
    return 0
