"""`specdraft generate`: text in, text out, with or without a drafter."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specdraft.cli.args import (add_drafter_args, add_max_context_arg, add_model_args, add_policy_arg,
                                add_sampling_args, add_simulation_arg, add_stop_arg, check_generation_args,
                                load_target)
from specdraft.errors import SpecdraftError

# What holds today (README, "Exactness", says the same): rewrite both once bf16 verify is exact.
EXACTNESS = ("Greedy text is identical with and without a drafter, token for token, in float32 and in the "
             "default CPU configurations (float32 with the GGUF file's blocks for the presets and .gguf files; "
             "for other models bfloat16 with int8 weights, or float32 with fp16 weights on CPUs without bf16 "
             "units: their kernels compute each row the same way at any width). With --weights dtype in "
             "bfloat16, or on CUDA, a multi-token verify pass can "
             "round differently from a one-token step, so at a near-tie greedy text can part from plain "
             "decoding (about 1 prompt in 3 on Spec-Bench with bf16 weights). Sampled text follows the "
             "target's distribution.")


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
    add_simulation_arg(p)
    add_stop_arg(p)
    p.add_argument("--prompts-file", type=Path,
                   help="one prompt per line, or JSONL with a \"prompt\" field (Spec-Bench files: first turn)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    add_max_context_arg(p)
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


def summary_line(result_stats, seconds: float, drafter: str, k: int, simulated: str | None = None) -> str:
    s = result_stats
    rate = s.new_tokens / seconds if seconds > 0 else 0.0
    line = f"[specdraft] {s.new_tokens} tokens in {seconds:.2f} s ({rate:.1f} tok/s)"
    if drafter == "none":
        return line + " | plain decoding"
    acc = " ".join("-" if a is None else f"{a:.2f}" for a in s.acceptance_by_position)
    sim = f" (SIMULATED: {simulated})" if simulated else ""
    return line + f" | drafter {drafter} K={k} | tau {s.mean_accepted:.2f} | acceptance by position {acc}{sim}"


def run(args) -> int:
    from specdraft.engine_builder import build_engine
    from specdraft.sampling import SamplingParams
    from specdraft.speculative.simulation import prepare_references, simulated_drafter
    from specdraft.speculative.stats import merge

    if args.batch_size < 1:
        raise SpecdraftError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_generation_args(args)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    profile = _simulation(args, sampling)
    prompts = collect_prompts(args)
    rt = load_target(args)
    built = build_engine(rt, args.drafter, args.drafter_path, args.draft_tokens, args.draft_policy, progress=True,
                         **({"simulate": profile} if profile is not None else {}))
    chat = args.chat and rt.tokenizer.chat_template is not None
    encoded = [rt.tokenizer.encode_prompt(p, chat) for p in prompts]
    _check_lengths(rt, encoded, args.max_new_tokens, args.max_context)
    # The adaptive policy's one-time step timings happen here, outside the speed summary.
    built.engine.prepare_policy(min(args.batch_size, len(prompts)))
    engine, kind, k = built.engine, built.drafter, built.draft_tokens
    simulated = profile.name if profile is not None else None
    for note in ignored_flags(args, kind):
        print(f"specdraft: note: {note}", file=sys.stderr)
    if args.chat and rt.tokenizer.chat_template is None:
        print(f"specdraft: note: {args.model} has no chat template; using plain text", file=sys.stderr)
    stream = not args.json and args.batch_size == 1
    all_stats = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        ids = encoded[start : start + args.batch_size]
        on_tokens = _streamer(rt.tokenizer) if stream else None
        prepare_references(engine, ids, args.max_new_tokens, tuple(args.stop))  # simulated runs only: untimed
        t0 = time.perf_counter()
        results = engine.generate(ids, args.max_new_tokens, sampling, tuple(args.stop), on_tokens=on_tokens,
                                  on_prefill=_prefill_progress(sum(map(len, ids))))
        for j, (prompt, r) in enumerate(zip(batch, results)):
            all_stats.append(r.stats)
            if args.json:
                record = {**_record(prompt, r, rt, kind, k), "memory": memory_split(rt, engine)}
                if (sim := simulated_drafter(engine)) is not None:
                    record["simulated_acceptance"] = {**sim.profile.describe(), "diverged_requests": sim.diverged}
                print(json.dumps(record), flush=True)
            elif stream:
                print(flush=True)
                print(summary_line(r.stats, r.seconds, kind, k, simulated), file=sys.stderr)
            else:
                print(f"=== prompt {start + j + 1} ===\n{r.text}", flush=True)
        if not args.json and not stream:
            total = merge([r.stats for r in results])
            print(summary_line(total, time.perf_counter() - t0, kind, k, simulated), file=sys.stderr)
    return 0


def _simulation(args, sampling):
    """--simulate-acceptance parsed and checked before anything loads (None: not asked for)."""
    from specdraft.drafters.simulated import parse_profile

    if args.simulate_acceptance is None:
        return None
    if not sampling.greedy:
        raise SpecdraftError("--simulate-acceptance needs greedy decoding (--temperature 0)")
    if args.drafter == "none":
        raise SpecdraftError("--simulate-acceptance needs a drafter whose cost to pay (--drafter none runs none)")
    return parse_profile(args.simulate_acceptance)


LONG_PROMPT = 4096  # prompt tokens from which the prefill's progress is shown (tens of seconds at E2B size)


def _prefill_progress(tokens: int):
    """on_prefill for long prompts: a line on stderr every few seconds, and one when done."""
    if tokens < LONG_PROMPT:
        return None
    t0, last = time.perf_counter(), [0.0]

    def show(done: int, total: int) -> None:
        now = time.perf_counter() - t0
        if done < total and now - last[0] < 5:
            return
        last[0] = now
        rate = done / now if now > 0 else 0.0
        eta = f", ~{(total - done) / rate:.0f} s left" if done < total and rate > 0 else ""
        print(f"specdraft: prefill {done:,} / {total:,} prompt tokens in {now:.0f} s ({rate:.0f} tok/s{eta})",
              file=sys.stderr, flush=True)

    return show


def _check_lengths(rt, encoded: list[list[int]], max_new_tokens: int, max_context: int | None) -> None:
    """Refuse a prompt that cannot fit before the policy's step timings (seconds on a real model;
    the engine would refuse it only after them). It runs after the drafter loads, so that a bad
    drafter flag is named first, as it was when the engine alone checked lengths."""
    for n in map(len, encoded):
        if n == 0:
            raise SpecdraftError("a prompt is empty (no tokens after tokenization)")
        if n + max_new_tokens > rt.context:
            limit = _context_limit(rt, max_context) if rt.context < rt.config.max_position_embeddings \
                else f"the model's context of {rt.context} tokens"
            raise SpecdraftError(f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds {limit}")


def _context_limit(rt, asked: int | None) -> str:
    """--max-context, in the words that say how to change it."""
    if asked is None:
        return f"the default --max-context of {rt.context} tokens (raise it with --max-context)"
    return f"--max-context {rt.context}"


def ignored_flags(args, kind: str) -> list[str]:
    """Flags the chosen drafter does not read (`kind` is what --drafter resolved to)."""
    from specdraft.drafters.kinds import KINDS

    notes = []
    if args.drafter_path is not None and KINDS[args.drafter].path is None:
        used = " (it uses the drafter shipped for the model)" if args.drafter == "auto" else ""
        readers = [name for name, kind in KINDS.items() if kind.path is not None]
        notes.append(f"--drafter-path is ignored with --drafter {args.drafter}{used}; it applies to "
                     f"{', '.join(readers[:-1])} and {readers[-1]}")
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


def memory_split(rt, engine) -> dict[str, float]:
    """Resident memory in MB and what holds it: the target's weights in memory, its tables read
    from the checkpoint file a row at a time (resident only as read), the KV cache, the drafter."""
    from specdraft.bench.memory import max_rss_bytes, rss_bytes

    mb = 1 << 20
    cache = engine.cache_bytes
    drafter = engine.drafter.nbytes() if engine.drafter is not None else 0
    return {"rss_mb": round(rss_bytes() / mb), "rss_peak_mb": round(max_rss_bytes() / mb),
            "weights_mb": round((rt.nbytes() - rt.mapped_bytes) / mb), "mapped_tables_mb": round(rt.mapped_bytes / mb),
            "kv_cache_mb": round(cache / mb, 1), "drafter_mb": round(drafter / mb, 1)}


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
