"""`specdraft train-drafter`, `eval-drafter` and `init-drafter`."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from specdraft.cli.args import add_model_args, load_target
from specdraft.errors import SpecdraftError
from specdraft.training.pipeline import DEFAULT_MAX_PROMPT_TOKENS, drafter_config



def register(sub) -> None:
    _register_train(sub)
    _register_eval(sub)
    _register_init(sub)


def _add_shape_args(p) -> None:
    # Defaults are None: derived from the target once it is loaded (training.pipeline.drafter_config), so every
    # supported target gets a drafter that fits it; on Gemma 3 270M they are the shipped drafter's.
    p.add_argument("--hidden", type=int, default=None, help="drafter hidden size h (default 384)")
    p.add_argument("--layers", type=int, default=None,
                   help="drafter layers (default 2: sliding then full; all full on targets without sliding layers); "
                        "with --init-from, more than that drafter's layers deepens it: the new blocks go "
                        "in front, starting as the identity")
    p.add_argument("--heads", type=int, default=None,
                   help="drafter attention heads, a multiple of the target's KV heads (default: the smallest such "
                        "multiple >= 4, e.g. 4 for Gemma 3 270M, 6 for SmolLM2's 3 KV heads)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 * hidden)")
    p.add_argument("--head", choices=["target", "own"], default=None,
                   help="target: score tokens with the target's own embedding table (no extra V x h memory; "
                        "default); own: a drafter-owned V x h table, as Gemma 4 assistants")
    p.add_argument("--clusters", type=int, default=None,
                   help="clustered head with C clusters of V/C tokens (default V/128 when V is a multiple of "
                        "128 and at least 4096; 0 = dense head)")
    p.add_argument("--top-k-clusters", type=int, default=None,
                   help="clusters kept per draft step (default 32, at most an eighth of --clusters)")
    p.add_argument("--copy-gate", action="store_true",
                   help="give the drafter a learned copy gate: a bonus on the tokens that followed the current "
                        "token (and the last two tokens) earlier in the text, so it drafts a model's repeats "
                        "itself; with --init-from the gate is added closed (a bonus of 0: the drafter's logits start "
                        "unchanged, though the copies join its candidates)")


def _register_train(sub) -> None:
    p = sub.add_parser(
        "train-drafter", help="train an MTP drafter for a model by self-distillation",
        description="Train a Gemma-4-style MTP drafter for --model. The target first answers the training "
                    "prompts itself (a mix of greedy and sampled answers, cached in OUT/data and resumable), "
                    "then the drafter learns to predict the target's next K tokens from its hidden state and "
                    "KV cache. Interrupt at any time; rerun with --resume to continue. Never train on "
                    "evaluation sets: pass them to --exclude-eval and overlapping prompts are refused.")
    add_model_args(p)
    p.add_argument("--out", type=Path, required=True, help="output folder (drafter, checkpoint, data)")
    p.add_argument("--prompts", type=Path, nargs="+", required=True,
                   help="training prompt files (JSONL with prompt / instruction / text, or one prompt per line)")
    p.add_argument("--exclude-eval", type=Path, nargs="*", default=[],
                   help="evaluation files (e.g. Spec-Bench question.jsonl): prompts sharing a 13-word span with "
                        "them are refused")
    p.add_argument("--num-prompts", type=int, default=None, help="use at most this many training prompts")
    p.add_argument("--min-prompt-tokens", type=int, default=0,
                   help="use only training prompts at least this many tokens long (chosen before --skip-prompts "
                        "and --num-prompts), e.g. 300 with --max-prompt-tokens 1024 to pick the ones that carry "
                        "a document (default 0)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help=f"leave out training prompts longer than this (default {DEFAULT_MAX_PROMPT_TOKENS}, or "
                        "what the target's context leaves after --answer-tokens; training keeps every answer's "
                        "prompt hidden states and K/V in memory, so memory grows with it)")
    p.add_argument("--data-from", type=Path, nargs="+", default=[], metavar="DIR",
                   help="also train on the answers another train-drafter run recorded (its --out folder, for the "
                        "same --model and --dtype): e.g. answers to long prompts from a --data-only run mixed with "
                        "this run's")
    p.add_argument("--skip-prompts", type=int, default=0,
                   help="skip the first N training prompts (in the fixed shuffled order), e.g. the ones the "
                        "drafter given to --init-from was trained on (default 0)")
    p.add_argument("--synthetic-prompts", type=int, default=0, metavar="N",
                   help="the target also writes N new prompts in the style of the single-line --prompts (shown "
                        "four at a time as a list of questions, sampled a line at a time; cached in "
                        "OUT/data/synthetic_prompts.jsonl) and answers them like the others: prompts closer to "
                        "open questions than benchmark templates are (default 0)")
    p.add_argument("--synthetic-from", type=Path, nargs="+", default=None, metavar="FILE",
                   help="prompt files whose single-line prompts --synthetic-prompts shows the target (default: "
                        "--prompts); e.g. a small file of varied instructions when --prompts is dominated by one "
                        "kind of task")
    p.add_argument("--corpus", type=Path, nargs="+", default=[],
                   help="text files for prefill distillation (same formats as --prompts): the target reads each "
                        "text in one forward pass and every position becomes a training example labelled with "
                        "the target's own top-k prediction; cheaper per token than answers, mixed with them. "
                        "Evaluation overlap and held-out prompts are refused as for --prompts")
    p.add_argument("--corpus-texts", type=int, default=None, help="use at most this many --corpus texts")
    p.add_argument("--corpus-fraction", type=float, default=0.5,
                   help="share of each batch's sequences drawn from the corpus; the rest are the target's own "
                        "answers (default 0.5)")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from a trained drafter's weights (a drafter folder, or 'shipped' for the one "
                        "shipped for --model) instead of random ones; its shape is kept")
    p.add_argument("--held-out", type=int, default=48, help="held-out prompts for evaluation (default 48)")
    p.add_argument("--answer-tokens", type=int, default=160, help="tokens per target answer (default 160)")
    p.add_argument("--answer-temperatures", default="0,0,0.7,1", metavar="T,T,...",
                   help="temperatures the target answers at, batch by batch in turn (0 = greedy; default "
                        "0,0,0.7,1: half greedy); prompts go through the model's chat template as one user turn "
                        "when it has one, as chat and serve send them")
    p.add_argument("--answer-top-p", type=float, default=1.0, metavar="P",
                   help="top-p for the sampled answers, e.g. 0.95 as chat clients send it (default 1: the whole "
                        "distribution)")
    p.add_argument("--answer-window", type=int, default=None, metavar="N",
                   help="train and evaluate on the first N tokens of each recorded answer only (default: whole "
                        "answers), e.g. 64 for short replies: later tokens of a small model's long answers "
                        "repeat themselves and are drafted easily")
    p.add_argument("--draft-tokens", type=int, default=4, help="K: unrolled steps trained (default 4)")
    _add_shape_args(p)
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--anchors", type=int, default=64, help="anchor positions per sequence per step (default 64)")
    p.add_argument("--anchors-where", choices=("uniform", "uncertain"), default="uniform",
                   help="uniform: any answer position; uncertain: drawn more often where the target was unsure "
                        "of the next token, which is where decoding rounds start (default uniform)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--shortlist", type=int, default=32768,
                   help="tokens the training softmax scores: the ones the target produces most often in the data "
                        "(default 32768; the softmax over them is most of a step's cost on a CPU)")
    p.add_argument("--loss", choices=["ce", "kl", "kl+tv"], default="ce",
                   help="ce: cross-entropy on the target's emitted tokens; kl: to its top-k distribution; "
                        "kl+tv: kl plus the chance that a draft sampled from the drafter is rejected (1 - sum "
                        "min(p, q)), for sampled decoding")
    p.add_argument("--eval-every", type=int, default=250, help="held-out evaluation interval in steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--data-only", action="store_true", help="only generate (or complete) the training data")
    p.set_defaults(run=run_train)


def _register_eval(sub) -> None:
    p = sub.add_parser("eval-drafter", help="measure a drafter's acceptance with the real engine",
                       description="Run speculative decoding on held-out prompts for K = 1..8, greedy and "
                                   "temperature 1, and report tau (tokens per target forward) and acceptance "
                                   "by draft position.")
    add_model_args(p)
    p.add_argument("--drafter-path", default=None,
                   help="MTP drafter folder (default: the drafter shipped for --model, if one ships)")
    p.add_argument("--drafter", default="mtp", choices=["mtp", "mtp+ngram"],
                   help="mtp: the MTP drafter alone (default); mtp+ngram: with prompt lookup where the text "
                        "repeats (up to 8 looked-up tokens per round)")
    p.add_argument("--prompts", type=Path, required=True, help="held-out prompts (never the training ones)")
    p.add_argument("--limit", type=int, default=32, help="prompts used (default 32)")
    p.add_argument("--ks", default="1-8", help="K values, e.g. 1-8 or 2,4,6 (default 1-8)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="override the drafter's early stop (a row stops drafting after a draft it gave less "
                        "than this probability); 0 drafts K tokens every round (default: the drafter config's)")
    p.add_argument("--top-k-clusters", type=int, default=None,
                   help="override the clusters the clustered head keeps per draft step (default: the drafter's)")
    p.add_argument("--gap", action="store_true",
                   help="explain teacher-forced vs engine acceptance instead (greedy, batch 1, one JSON line per "
                        "K): the target answers each prompt by plain greedy decoding; the drafter is scored "
                        "teacher-forced on those answers (every anchor, and only where replayed decoding starts "
                        "rounds), then the engine decodes the same prompts, reporting acceptance, cluster "
                        "recall at top 32/64 in real decoding and per-anchor agreement with the teacher-forced "
                        "computation, and the first draft's acceptance by the target's own top-1 probability and "
                        "on token pairs the text already repeated (copies); --min-confidence defaults to 0 here")
    p.set_defaults(run=run_eval)


def _register_init(sub) -> None:
    p = sub.add_parser("init-drafter", help="write an untrained (random-weight) MTP drafter for a model",
                       description="Create an MTP drafter with random weights that fits --model. Useful to see "
                                   "that speculative decoding stays lossless even with a useless drafter.")
    add_model_args(p)
    p.add_argument("--out", type=Path, required=True)
    _add_shape_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_init)


def _at_least(args, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            raise SpecdraftError(f"--{name.replace('_', '-')} {value} must be >= {low}")


def _check_shape_args(args) -> None:
    """The drafter-shape flags (and --seed) that can be judged without the target."""
    if not 0 <= args.seed < 2**32:
        raise SpecdraftError(f"--seed {args.seed} must be between 0 and {2**32 - 1} (try 0)")
    _at_least(args, ("hidden", "layers", "heads", "intermediate", "top_k_clusters"), 1)
    _at_least(args, ("clusters",), 0)
    if args.clusters is not None and args.top_k_clusters is not None and args.clusters \
            and args.top_k_clusters > args.clusters:
        raise SpecdraftError(f"--top-k-clusters {args.top_k_clusters} exceeds --clusters {args.clusters} "
                             f"(try {max(1, args.clusters // 8)})")


def run_init(args) -> int:
    from specdraft.drafters.mtp import init_network, save_network

    _check_shape_args(args)  # before the target loads; the rest is checked against it
    rt = load_target(args)
    net = init_network(drafter_config(rt, args, None), rt.model, seed=args.seed)
    if net.masked_embedding is not None:
        from specdraft.training.clustering import balanced_clusters

        net.masked_embedding.token_ordering.copy_(balanced_clusters(rt.model.head_weight.detach().cpu().float(),
                                                                    net.config.num_centroids))
    save_network(net, args.out)
    print(f"wrote an untrained drafter ({net.nbytes() / 1e6:.1f} MB) to {args.out}")
    return 0


def _temperature_list(flag: str, text: str) -> tuple[float, ...]:
    try:
        temps = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise SpecdraftError(f"{flag} expects numbers like 0,0.7,1; got {text!r}") from None
    if not all(math.isfinite(t) and t >= 0 for t in temps):
        raise SpecdraftError(f"{flag} {text} must be numbers >= 0 (0 = greedy), e.g. 0,0.7,1")
    return temps


def _check_train_args(args) -> None:
    """Every train-drafter flag that can be judged without the target, before anything loads."""
    _at_least(args, ("steps", "batch_size", "anchors", "draft_tokens", "answer_tokens", "eval_every", "num_prompts",
                     "shortlist"), 1)
    _at_least(args, ("held_out", "skip_prompts", "synthetic_prompts", "min_prompt_tokens"), 0)
    _at_least(args, ("max_prompt_tokens",), 1)
    for folder in args.data_from:
        if not (folder / "data" / "train" / "data.json").is_file():
            raise SpecdraftError(f"--data-from {folder}: no recorded answers there (expected "
                                 f"{folder / 'data' / 'train' / 'data.json'}, written by train-drafter --out {folder})")
    _at_least(args, ("corpus_texts",), 1)
    if not 0 < args.corpus_fraction < 1:  # NaN fails too
        raise SpecdraftError(f"--corpus-fraction {args.corpus_fraction} must be between 0 and 1 (try 0.5)")
    if args.synthetic_from and not args.synthetic_prompts:
        raise SpecdraftError("--synthetic-from only chooses the examples for --synthetic-prompts N; pass both")
    args.answer_temperatures = _temperature_list("--answer-temperatures", args.answer_temperatures)
    if not 0 < args.answer_top_p <= 1:  # NaN fails too
        raise SpecdraftError(f"--answer-top-p {args.answer_top_p} must be in (0, 1] (try 0.95)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SpecdraftError(f"--lr {args.lr} must be a positive number (try 1e-3)")
    if args.answer_tokens <= args.draft_tokens:
        # Step k of an anchor needs the target's token k + 2 answer positions later (objective.py).
        raise SpecdraftError(f"--answer-tokens {args.answer_tokens} leaves nothing to train --draft-tokens "
                             f"{args.draft_tokens} on: answers need at least K + 1 tokens (try --answer-tokens "
                             f"{max(160, args.draft_tokens + 1)})")
    if args.answer_window is not None and args.answer_window <= args.draft_tokens:
        raise SpecdraftError(f"--answer-window {args.answer_window} leaves nothing to train --draft-tokens "
                             f"{args.draft_tokens} on: the window needs at least K + 1 tokens (try 64)")
    for flag, paths in (("--prompts", args.prompts), ("--corpus", args.corpus or []),
                        ("--synthetic-from", args.synthetic_from or []),
                        ("--exclude-eval", args.exclude_eval or [])):
        for path in paths:  # before the target loads: a typo costs no model load
            if not Path(path).is_file():
                raise SpecdraftError(f"{flag} file {path} does not exist")
    _check_shape_args(args)


def run_train(args) -> int:
    """Every setting is checked before any work: the flags alone here, then (once the target is
    loaded) the drafter's shape and the prompt files against it (training/pipeline.py)."""
    from specdraft.training.pipeline import train_drafter
    from specdraft.training.trainer import init_distributed

    # checkpoint.prev: a run killed while swapping checkpoints (training/durable.py) has it alone.
    if any((args.out / name / "state.json").exists() for name in ("checkpoint", "checkpoint.prev")) \
            and not args.resume:
        raise SpecdraftError(f"{args.out} already has a training checkpoint; pass --resume to continue it "
                             "or choose another --out")
    _check_train_args(args)
    init_distributed()
    started = time.time()
    return train_drafter(load_target(args), args, started)


def _parse_ks(text: str) -> list[int]:
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            return list(range(lo, hi + 1))
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise SpecdraftError(f"--ks expects a range like 1-8 or a list like 2,4; got {text!r}") from None


def run_eval(args) -> int:
    from specdraft.drafters import load_drafter, shipped_drafter_path
    from specdraft.prompts import read_prompts
    from specdraft.sampling import SamplingParams
    from specdraft.training.evaluate import evaluate_drafter

    ks = _parse_ks(args.ks)
    if not ks or min(ks) < 1:
        raise SpecdraftError("--ks values must be >= 1")
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise SpecdraftError(f"--temperatures expects numbers like 0,1; got {args.temperatures!r}") from None
    for t in temps:
        SamplingParams(t)  # refuses NaN, infinities and negatives before the model loads
    if args.min_confidence is not None and not 0 <= args.min_confidence <= 1:  # NaN fails too
        raise SpecdraftError(f"--min-confidence {args.min_confidence} must be between 0 and 1 (0: no early stop)")
    if args.top_k_clusters is not None and args.top_k_clusters < 1:
        raise SpecdraftError(f"--top-k-clusters {args.top_k_clusters} must be >= 1")
    rt = load_target(args)
    path = args.drafter_path or shipped_drafter_path(rt.name)
    if path is None:
        raise SpecdraftError(f"no drafter ships for {rt.name!r}: give --drafter-path")
    drafter, _, _ = load_drafter(rt, args.drafter, str(path), None)
    prompts = read_prompts(args.prompts)[: args.limit]
    if args.top_k_clusters is not None:
        try:
            drafter.set_top_k_clusters(args.top_k_clusters)
        except SpecdraftError as e:
            raise SpecdraftError(f"--top-k-clusters: {e}") from None
    if args.gap:
        from specdraft.training.gap import acceptance_gap

        if args.drafter != "mtp":
            raise SpecdraftError("--gap measures the MTP drafter alone: use --drafter mtp")
        min_conf = 0.0 if args.min_confidence is None else args.min_confidence
        for k in ks:
            report = acceptance_gap(rt, drafter, prompts, k, args.max_new_tokens, min_conf,
                                    log=lambda m: print(m, file=sys.stderr))
            print(json.dumps({"weights": rt.weights, "dtype": rt.dtype_name, **report}), flush=True)
        return 0
    if args.min_confidence is not None:
        drafter.set_min_confidence(args.min_confidence)
    rows = evaluate_drafter(rt, drafter, prompts, ks, temps, args.max_new_tokens, args.batch_size)
    for r in rows:
        acc = [None if a is None else round(a, 3) for a in r.acceptance_by_position]
        if args.json:
            print(json.dumps({"k": r.k, "temperature": r.temperature, "tau": round(r.tau, 3),
                              "acceptance_by_position": acc, "tokens_per_second": round(r.tokens_per_second, 1)}))
        else:
            print(f"K={r.k} T={r.temperature:g}  tau {r.tau:.2f}  tok/s {r.tokens_per_second:6.1f}  acceptance "
                  + " ".join("-" if a is None else f"{a:.2f}" for a in acc))
    return 0
