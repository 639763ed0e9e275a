"""Flags several commands share, and the checks they get before anything loads."""

from __future__ import annotations

import argparse
import sys

from specdraft.errors import SpecdraftError


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device, shared by every subcommand that loads a target."""
    from specdraft.models.formats.choice import WEIGHT_CHOICES
    from specdraft.loading.presets import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset name (see `specdraft models`), a Hugging Face folder (config.json + "
                        f"*.safetensors + tokenizer.json), a .gguf file, or a Hugging Face id org/name[@revision] "
                        f"(fetched into the Hugging Face cache after the memory check; HF_TOKEN, HF_HUB_OFFLINE "
                        f"apply) (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and activations; auto = float32 on a CPU for a model from a GGUF file (with "
                        "--weights auto: its own blocks, the fastest CPU path measured) or with --weights fp16/gguf; "
                        "else bfloat16 on CUDA or on CPUs with AMX/AVX512-BF16, else float32 (float32 is the "
                        "exactness reference)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (auto = cuda when available)")
    p.add_argument("--weights", default="auto", choices=list(WEIGHT_CHOICES),
                   help="how weights are stored: auto = the file's own blocks for a model from a GGUF file (the "
                        "presets) on a CPU with --dtype auto (gguf-q8; gguf without a C compiler); q8 for models "
                        "over 1B matrix parameters on an x86 CPU; else int8 on a CPU in bfloat16, fp16 where --dtype "
                        "auto chose float32 (CPUs without bf16 units); otherwise as --dtype; "
                        "q8 / q4: 8-bit / 4-bit codes per 32 inputs made from the checkpoint as it is read (loading "
                        "never holds the float32 model), int8 activations as llama.cpp's Q8_0 (x86 with AVX2, "
                        "float32); int8: one scale per row, near-lossless (KL 0.005 vs bf16 "
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
    from specdraft.engine_builder import check_drafter_fits_target
    from specdraft.runtime import Runtime

    _, note = set_threads(args.threads)
    if getattr(args, "drafter", None):
        check_drafter_fits_target(args.model, args.drafter, getattr(args, "drafter_path", None))
    rt = Runtime.load(args.model, args.dtype, args.device, progress=progress, weights=args.weights,
                      compile=args.compile, prefill_dtype=args.prefill_dtype,
                      batch_size=max(1, getattr(args, "batch_size", None) or 1),
                      context=getattr(args, "max_context", None))
    if note and progress:  # after loading: a bad --model stays a one-line error
        print(f"specdraft: note: {note}", file=sys.stderr)
    return rt


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """--drafter/--drafter-path/--draft-tokens: the drafter an engine runs (drafters/kinds.py)."""
    from specdraft.drafters.kinds import DRAFTER_KINDS

    p.add_argument("--drafter", default="auto", choices=DRAFTER_KINDS,
                   help="auto: mtp+ngram with the drafter shipped for this model if there is one, or for a Gemma 4 "
                        "target Google's google/gemma-4-*-it-assistant (from the Hugging Face cache, or fetched "
                        "unless HF_HUB_OFFLINE), else prompt lookup (ngram) "
                        "(each round drafts only as many tokens as pay on this machine, see --draft-policy); "
                        "mtp: a Gemma-4-style MTP drafter from --drafter-path (default: the one shipped for the "
                        "model); ngram: prompt lookup (no weights); mtp+ngram: prompt lookup (up to 8 tokens, 3 "
                        "with packed weights) where the last 2-3 tokens "
                        "occurred before, the MTP drafter elsewhere; draft-model: a small model sharing the "
                        "tokenizer, from --drafter-path; none: plain decoding")
    p.add_argument("--drafter-path", default=None,
                   help="mtp, mtp+ngram: drafter folder (config.json + model.safetensors) or its Hugging Face id "
                        "(e.g. google/gemma-4-E2B-it-assistant); draft-model: a model name or path as for --model")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="tokens drafted per round, K (default: the drafter's recommended K, else 4; "
                        "mtp+ngram: the MTP drafter's K, lookups propose up to 8); with the adaptive "
                        "--draft-policy the most a round drafts")


def add_policy_arg(p: argparse.ArgumentParser) -> None:
    """--draft-policy: how many drafts each round verifies (speculative/policy.py)."""
    from specdraft.speculative.policy import DRAFT_POLICIES

    p.add_argument("--draft-policy", default="adaptive", choices=list(DRAFT_POLICIES),
                   help="adaptive (default): each round drafts the number of tokens (0 = a plain step) that "
                        "maximises expected tokens per second, from step costs measured once on this machine "
                        "(cached under $SPECDRAFT_CACHE/costs) and the acceptance each request has seen; "
                        "fixed: K every round (on a CPU, plain rounds from 4 decoding rows on)")


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    """--max-new-tokens and the sampling flags."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"stop after this many new tokens (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")


def add_stop_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stop", action="append", default=[], help="stop when this string appears (repeatable)")


def add_max_context_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-context", type=int, default=None,
                   help="most positions (prompt + new tokens) a prompt may use; the memory check before loading "
                        "counts a KV cache this long for each of --batch-size rows, and longer requests are "
                        "refused (default 4096, capped at the model's context)")


def check_draft_tokens(draft_tokens: int | None) -> None:
    """--draft-tokens judged before the model loads (the engine checks it again)."""
    from specdraft.speculative.engine import MAX_DRAFT_TOKENS

    if draft_tokens is not None and draft_tokens < 1:
        raise SpecdraftError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    if draft_tokens is not None and draft_tokens > MAX_DRAFT_TOKENS:
        raise SpecdraftError(f"--draft-tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {draft_tokens}")


def add_simulation_arg(p: argparse.ArgumentParser) -> None:
    """--simulate-acceptance: the drafter's cost with a chosen acceptance (drafters/simulated.py)."""
    from specdraft.drafters.simulated import PROFILE_NAMES

    p.add_argument("--simulate-acceptance", default=None, metavar="PROFILE|P1,P2,...",
                   help="SIMULATED acceptance, for weights whose drafter cannot land (random weights at real "
                        "sizes): the drafter runs and is paid for, but draft i matches the target's own plain "
                        "continuation (decoded first, untimed) as often as the profile says; the output is still "
                        "the target's. A profile (" + ", ".join(PROFILE_NAMES) + ": published acceptance, "
                        "sources in specdraft/drafters/acceptance_profiles.json) or per-position shares of "
                        "rounds whose first i drafts were all accepted, e.g. 0.84,0.60,0.39,0.27. Greedy only; "
                        "every report marks the run as simulated")


def check_generation_args(args: argparse.Namespace) -> None:
    """The flags generate and chat share, judged before the model loads."""
    if args.max_new_tokens < 1:
        raise SpecdraftError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_context is not None and args.max_context < 16:
        raise SpecdraftError(f"--max-context must be >= 16, got {args.max_context}")
    if any(s == "" for s in args.stop):
        raise SpecdraftError("--stop needs a non-empty string (an empty one would stop at once)")
    check_draft_tokens(args.draft_tokens)
