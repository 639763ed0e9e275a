"""`specdraft generate`: text in, text out, with or without a drafter."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdraft.errors import SpecdraftError

DRAFTER_KINDS = ("auto", "none", "mtp", "mtp+ngram", "ngram", "draft-model")
# What holds today (README, "Exactness", says the same): rewrite both once bf16 verify is exact.
EXACTNESS = ("Greedy text is identical with and without a drafter, token for token, in float32 and in the "
             "default CPU configurations (float32 with the GGUF file's blocks for the presets and .gguf files; "
             "for other models bfloat16 with int8 weights, or float32 with fp16 weights on CPUs without bf16 "
             "units: their kernels compute each row the same way at any width). With --weights dtype in "
             "bfloat16, or on CUDA, a multi-token verify pass can "
             "round differently from a one-token step, so at a near-tie greedy text can part from plain "
             "decoding (about 1 prompt in 3 on Spec-Bench with bf16 weights). Sampled text follows the "
             "target's distribution.")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device, shared by every subcommand that loads a target."""
    from specdraft.models.formats.choice import WEIGHT_CHOICES
    from specdraft.loading.presets import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset name (see `specdraft models`), a Hugging Face folder (config.json + "
                        f"*.safetensors + tokenizer.json) or a .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and activations; auto = float32 on a CPU for a model from a GGUF file (with "
                        "--weights auto: its own blocks, the fastest CPU path measured) or with --weights fp16/gguf; "
                        "else bfloat16 on CUDA or on CPUs with AMX/AVX512-BF16, else float32 (float32 is the "
                        "exactness reference)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (auto = cuda when available)")
    p.add_argument("--weights", default="auto", choices=list(WEIGHT_CHOICES),
                   help="how weights are stored: auto = the file's own blocks for a model from a GGUF file (the "
                        "presets) on a CPU with --dtype auto (gguf-q8; gguf without a C compiler); else "
                        "int8 on a CPU in bfloat16, fp16 where --dtype auto chose float32 (CPUs without bf16 units); "
                        "otherwise as --dtype; int8: one scale per row, near-lossless (KL 0.005 vs bf16 "
                        "on gemma3-270m) and half the bytes; int4: a quarter of the bytes, measurably worse (KL 0.24); "
                        "fp16: half of float32's bytes, float32 arithmetic (x86 CPUs, --dtype float32); "
                        "gguf: a GGUF model's own quantised blocks, multiplied as the float32 model's exact weights "
                        "(presets and .gguf files; x86 CPUs with AVX2, float32; builds a small C kernel once); "
                        "gguf-q8: the same blocks against rows rounded to int8 per 32 inputs, as llama.cpp computes "
                        "(x86 with AVX2; the same bits with or without AVX-512 VNNI): KL 0.002 vs float32, a verify "
                        "of 4 tokens ~1.1x a plain step instead of ~1.5x on a VNNI CPU; "
                        "dtype: unquantised (with --dtype float32: the exactness reference)")
    p.add_argument("--prefill-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="arithmetic of prompts with --weights gguf (decode steps and verifications stay float32, so "
                        "speculative output still equals plain output): auto = bfloat16 where --dtype auto chose "
                        "float32 on a CPU with AMX/AVX512-BF16 (prompts ~2x faster there, per-token KL 6e-4 against "
                        "float32 prompts), else float32; with --weights auto, float32 or bfloat16 picks gguf weights "
                        "(gguf-q8 runs prompts on its int8 kernel)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $SPECDRAFT_THREADS, else the physical cores); more threads than free cores makes "
                        "decoding stall")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode/verify step with torch.compile (Inductor): fewer, fused kernels for a "
                        "one-time cost of minutes on a small CPU (cached between runs); on a 2-core CPU with "
                        "int8 weights it measured only ~7%% faster, so it is off by default")


def load_target(args, progress: bool = True):
    """The Runtime the --model/--dtype/--device/--weights/--prefill-dtype/--threads/--compile flags describe."""
    from specdraft.device import set_threads
    from specdraft.runtime import Runtime

    _, note = set_threads(args.threads)
    rt = Runtime.load(args.model, args.dtype, args.device, progress=progress, weights=args.weights,
                      compile=args.compile, prefill_dtype=args.prefill_dtype)
    if note and progress:  # after loading: a bad --model stays a one-line error
        print(f"specdraft: note: {note}", file=sys.stderr)
    return rt


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="auto", choices=DRAFTER_KINDS,
                   help="auto: mtp+ngram with the drafter shipped for this model if there is one, else none "
                        "(each round drafts only as many tokens as pay on this machine, see --draft-policy); "
                        "mtp: a Gemma-4-style MTP drafter from --drafter-path (default: the one shipped for the "
                        "model); ngram: prompt lookup (no weights); mtp+ngram: prompt lookup (up to 8 tokens, 3 "
                        "with packed weights) where the last 2-3 tokens "
                        "occurred before, the MTP drafter elsewhere; draft-model: a small model sharing the "
                        "tokenizer, from --drafter-path; none: plain decoding")
    p.add_argument("--drafter-path", default=None,
                   help="mtp, mtp+ngram: drafter folder (config.json + model.safetensors); draft-model: a model "
                        "name or path as for --model")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="tokens drafted per round, K (default: the drafter's recommended K, else 4; "
                        "mtp+ngram: the MTP drafter's K, lookups propose up to 8); with the adaptive "
                        "--draft-policy the most a round drafts")


def add_policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive (default): each round drafts the number of tokens (0 = a plain step) that "
                        "maximises expected tokens per second, from step costs measured once on this machine "
                        "(cached under $SPECDRAFT_CACHE/costs) and the acceptance each request has seen; "
                        "fixed: K every round (on a CPU, plain rounds from 4 decoding rows on)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text, optionally with speculative decoding",
        description="Generate text from a prompt (or a file of prompts). " + EXACTNESS + " Text streams to "
                    "stdout; a one-line speed summary goes to stderr.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt; '-' reads it from stdin")
    add_model_args(p)
    add_drafter_args(p)
    add_policy_arg(p)
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop when this string appears (repeatable)")
    p.add_argument("--prompts-file", type=Path,
                   help="one prompt per line, or JSONL with a \"prompt\" field (Spec-Bench files: first turn)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (a model without one gets plain text)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt per line (no streaming)")
    p.set_defaults(run=run)


def collect_prompts(args) -> list[str]:
    if args.prompts_file and args.prompt:
        raise SpecdraftError("give a PROMPT or --prompts-file, not both")
    if args.prompts_file:
        from specdraft.prompts import read_prompts

        return read_prompts(args.prompts_file)
    if args.prompt == "-":
        return [sys.stdin.read()]
    if args.prompt is None:
        raise SpecdraftError("no prompt: give PROMPT, '-' for stdin, or --prompts-file FILE")
    return [args.prompt]


def summary_line(result_stats, seconds: float, drafter: str, k: int) -> str:
    s = result_stats
    rate = s.new_tokens / seconds if seconds > 0 else 0.0
    line = f"[specdraft] {s.new_tokens} tokens in {seconds:.2f} s ({rate:.1f} tok/s)"
    if drafter == "none":
        return line + " | plain decoding"
    acc = " ".join("-" if a is None else f"{a:.2f}" for a in s.acceptance_by_position)
    return line + f" | drafter {drafter} K={k} | tau {s.mean_accepted:.2f} | acceptance by position {acc}"


def check_draft_tokens(draft_tokens: int | None) -> None:
    """--draft-tokens judged before the model loads (the engine checks it again)."""
    from specdraft.speculative.engine import MAX_DRAFT_TOKENS

    if draft_tokens is not None and draft_tokens < 1:
        raise SpecdraftError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    if draft_tokens is not None and draft_tokens > MAX_DRAFT_TOKENS:
        raise SpecdraftError(f"--draft-tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {draft_tokens}")


def run(args) -> int:
    from specdraft.engine_builder import build_engine
    from specdraft.sampling import SamplingParams
    from specdraft.speculative.stats import merge

    if args.batch_size < 1:
        raise SpecdraftError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise SpecdraftError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(s == "" for s in args.stop):
        raise SpecdraftError("--stop needs a non-empty string (an empty one would stop at once)")
    check_draft_tokens(args.draft_tokens)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    prompts = collect_prompts(args)
    rt = load_target(args)
    # The adaptive policy's one-time step timings happen here, outside the speed summary.
    built = build_engine(rt, args.drafter, args.drafter_path, args.draft_tokens, args.draft_policy,
                         prepare_rows=min(args.batch_size, len(prompts)), progress=True)
    engine, kind, k = built.engine, built.drafter, built.draft_tokens
    for note in ignored_flags(args, kind):
        print(f"specdraft: note: {note}", file=sys.stderr)
    if args.chat and rt.tokenizer.chat_template is None:
        print(f"specdraft: note: {args.model} has no chat template; using plain text", file=sys.stderr)
    chat = args.chat and rt.tokenizer.chat_template is not None
    stream = not args.json and args.batch_size == 1
    all_stats = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        ids = [rt.tokenizer.encode_prompt(p, chat) for p in batch]
        on_tokens = _streamer(rt.tokenizer) if stream else None
        t0 = time.perf_counter()
        results = engine.generate(ids, args.max_new_tokens, sampling, tuple(args.stop), on_tokens=on_tokens)
        for j, (prompt, r) in enumerate(zip(batch, results)):
            all_stats.append(r.stats)
            if args.json:
                print(json.dumps(_record(prompt, r, rt, kind, k)), flush=True)
            elif stream:
                print(flush=True)
                print(summary_line(r.stats, r.seconds, kind, k), file=sys.stderr)
            else:
                print(f"=== prompt {start + j + 1} ===\n{r.text}", flush=True)
        if not args.json and not stream:
            total = merge([r.stats for r in results])
            print(summary_line(total, time.perf_counter() - t0, kind, k), file=sys.stderr)
    return 0


def ignored_flags(args, kind: str) -> list[str]:
    """Flags the chosen drafter does not read (`kind` is what --drafter resolved to)."""
    notes = []
    if args.drafter_path is not None and args.drafter in ("auto", "none", "ngram"):
        used = " (it uses the drafter shipped for the model)" if args.drafter == "auto" else ""
        notes.append(f"--drafter-path is ignored with --drafter {args.drafter}{used}; it applies to mtp, "
                     "mtp+ngram and draft-model")
    if args.draft_tokens is not None and kind == "none":
        notes.append(f"--draft-tokens is ignored: no drafter runs (--drafter {args.drafter})")
    return notes


def _streamer(tokenizer):
    from specdraft.tokenizer import StreamDecoder

    decoder = StreamDecoder(tokenizer)

    def on_tokens(row: int, ids: list[int]) -> None:
        sys.stdout.write(decoder.push(ids))
        sys.stdout.flush()

    return on_tokens


def _record(prompt: str, r, rt, kind: str, k: int) -> dict:
    s = r.stats
    return {
        "prompt": prompt,
        "text": r.text,
        "token_ids": r.token_ids,
        "new_tokens": s.new_tokens,
        "seconds": round(r.seconds, 4),
        "tokens_per_second": round(s.new_tokens / r.seconds, 2) if r.seconds > 0 else None,
        "finish_reason": r.finish_reason,
        "model": rt.name,
        "dtype": rt.dtype_name,
        "device": str(rt.device),
        "drafter": kind,
        "draft_tokens": k,
        **s.summary(),
        "time_split": {name: round(t, 4) for name, t in s.times.items()},
        "ttft": round(r.ttft, 4),
        "seed": r.seed,  # the sampling seed used (drawn when --seed was not given), to repeat the run
    }
