"""`specdraft bench`: Spec-Bench style tokens/s, speedup, acceptance and memory, next to peers."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdraft.cli.args import add_simulation_arg, check_draft_tokens
from specdraft.errors import SpecdraftError


def int_list(text: str) -> list[int]:
    """argparse type: '1,4,8' -> [1, 4, 8] (positive, sorted, unique)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(dict.fromkeys(values))


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(sub) -> None:
    from specdraft.bench import ALL_METHODS, DEFAULT_METHODS, LLAMA_CPP_BUILD
    from specdraft.bench.questions import PLAIN_TEMPLATE
    from specdraft.cli.args import add_model_args

    p = sub.add_parser(
        "bench",
        help="benchmark speculative decoding against plain decoding and peers (Spec-Bench style)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure tokens/s (Spec-Bench: mean of per-prompt rates), speedup over specdraft plain "
                    "decoding in the same run, mean accepted length tau, acceptance by draft position, "
                    "identical-output rate, time to first token, throughput and latency per batch size, and "
                    "memory, for specdraft and for transformers / llama.cpp on the same weights. Methods are "
                    "interleaved batch by batch after one warm-up generation each; only generation is timed.",
        epilog=f"""methods:
  plain          specdraft, no drafter (the reference; always run)
  auto           specdraft exactly as --drafter auto runs (drafter and engine policy)
  mtp            specdraft + MTP drafter (--drafter-path, else the one shipped for --model)
  mtp+ngram      specdraft + prompt lookup where the text repeats, the MTP drafter elsewhere
  ngram          specdraft + prompt lookup
  draft-model    specdraft + a small draft model (--draft-model)
  plain-again    specdraft plain a second time: identical work, so its speedup over plain in
                 each cell is the run's noise floor (shown beside auto's table)
  hf             transformers generate() on the same HF folder, dtype and device
  hf-pld         transformers generate(prompt_lookup_num_tokens=K); batch size 1 only
  llama-cpp      llama-cpp-python on the same GGUF; batch size 1 only; optional, build with:
                 {LLAMA_CPP_BUILD}
  llama-cpp-pld  llama-cpp-python with its prompt-lookup draft model; batch size 1 only
                 (both run llama.cpp's own llama-server instead where a native build is found:
                 python tools/llama_cpp_native.py build SOURCE)
  llama-cpp-mtp  llama-server --spec-type draft-mtp with the assistant (--drafter-path, converted
                 once: python tools/llama_cpp_native.py convert-assistant FOLDER --source SOURCE)
  METHOD~PROFILE a drafter method with SIMULATED acceptance (e.g. auto~vllm-26b; see
                 --simulate-acceptance): the drafter runs, its drafts match the plain output
                 as often as the profile says; the output is still the target's
A method whose dependency is missing is reported as skipped.

prompt format: the model's chat template when it has one, else the plain template
  {PLAIN_TEMPLATE!r}
(Spec-Bench files: the first turn of each question.)""",
    )
    add_model_args(p)
    p.add_argument("--questions", type=Path, default=None,
                   help="Spec-Bench question.jsonl (question_id, category, turns), JSONL with \"prompt\", "
                        "or a text file with one prompt per line (category \"all\"); default: Spec-Bench's 480 questions, which "
                        "ship in the repository (benchmarks/spec_bench)")
    p.add_argument("--categories", type=_name_list, default=None, help="comma-separated categories to keep")
    p.add_argument("--limit-per-category", type=int, default=None, help="first N questions of each category")
    p.add_argument("--methods", type=_name_list, default=list(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(ALL_METHODS)} (default: {','.join(DEFAULT_METHODS)}); "
                        "auto, mtp and mtp+ngram take another drafter as METHOD@FOLDER, e.g. mtp,mtp@runs/more "
                        "compares two drafters in one run; specdraft's methods take another weight format as "
                        "METHOD:WEIGHTS, e.g. plain,auto,plain:gguf-q8,auto:gguf-q8 (its identical column then "
                        "compares with plain:WEIGHTS)")
    p.add_argument("--drafter-path", default=None, help="MTP drafter folder for the mtp and mtp+ngram methods")
    p.add_argument("--draft-model", default=None, help="model name or path for the draft-model method")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="K, tokens drafted per round, for every drafter and peer (default: each its own: "
                        "the MTP drafter's recommended K, 4 for the others)")
    p.add_argument("--gguf", default=None,
                   help="GGUF file for llama-cpp when --model is a HF folder (default: the preset's GGUF)")
    p.add_argument("--batch-sizes", type=int_list, default=[1], help="comma-separated, e.g. 1,4,8 (default 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; identical-output rate is only meaningful then)")
    p.add_argument("--top-k", type=int, default=0,
                   help="with --temperature > 0: sample among the k likeliest tokens (default 0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature > 0: sample from the smallest set holding this mass (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0 (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt, at most (default 128)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens per prompt, past any EOS: at --temperature > 0 "
                        "each method samples its own text, and an answer that ends early is timed mostly "
                        "on its prompt, so rates then compare unlike things (greedy runs need not)")
    p.add_argument("--repeats", type=int, default=1, help="measure each batch R times (default 1)")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="folder for results.json, results.md and the PNG plots (default bench-out)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--report-from", type=Path, default=None, metavar="FOLDER",
                   help="measure nothing: rebuild FOLDER's results.md, plots and the summary in its results.json "
                        "from the run's raw records with this version's tables (e.g. a run from an older version)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_simulation_arg(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from specdraft.bench import ALL_METHODS, DRAFTER_METHODS, SPECDRAFT_METHODS, method_weights, split_method
    from specdraft.models.formats.choice import WEIGHT_CHOICES
    from specdraft.bench.runner import BenchConfig, rebuild_report, run_bench

    if args.report_from is not None:
        _print_outputs("rewrote", args.report_from, rebuild_report(args.report_from, plots=not args.no_plots))
        return 0
    if args.questions is None:
        from specdraft.bench.questions import DEFAULT_QUESTIONS

        if not DEFAULT_QUESTIONS.exists():
            raise SpecdraftError("no --questions file given, and Spec-Bench's questions ship only with a clone of the "
                                 "repository (benchmarks/spec_bench/question.jsonl); pass --questions FILE")
        args.questions = DEFAULT_QUESTIONS
    args.methods = _simulated_methods(args)
    unknown = [m for m in args.methods if split_method(m)[0] not in ALL_METHODS]
    if unknown:
        raise SpecdraftError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(ALL_METHODS)})")
    for m in args.methods:
        base, folder = split_method(m)
        if folder is not None and base not in DRAFTER_METHODS:
            raise SpecdraftError(f"method {m}: only {', '.join(DRAFTER_METHODS)} take a drafter folder after @")
        if folder is not None and not (Path(folder) / "config.json").is_file():
            raise SpecdraftError(f"method {m}: {folder} is not a drafter folder (no config.json)")
        weights = method_weights(m)
        if weights is not None and (base not in SPECDRAFT_METHODS or weights not in WEIGHT_CHOICES[1:]):
            raise SpecdraftError(f"method {m}: METHOD:WEIGHTS takes one of specdraft's methods "
                                 f"({', '.join(SPECDRAFT_METHODS)}) and a format from {', '.join(WEIGHT_CHOICES[1:])}")
    check_draft_tokens(args.draft_tokens)
    cfg = BenchConfig(
        questions=args.questions, model=args.model, categories=args.categories,
        limit_per_category=args.limit_per_category, methods=args.methods, drafter_path=args.drafter_path,
        draft_model=args.draft_model, draft_tokens=args.draft_tokens, gguf=args.gguf,
        batch_sizes=args.batch_sizes, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, repeats=args.repeats, dtype=args.dtype,
        device=args.device,
        threads=args.threads, weights=args.weights, prefill_dtype=args.prefill_dtype, compile=args.compile, out=args.out, progress=not args.no_progress, plots=not args.no_plots,
    )
    _print_outputs("wrote", args.out, run_bench(cfg))
    return 0


def _simulated_methods(args) -> list[str]:
    """--simulate-acceptance P names every drafter method METHOD~P (plain and the peers stay as they
    are); each METHOD~PROFILE is checked: a specdraft method with a drafter, a known profile, greedy."""
    from specdraft.bench import CONTROL, SIMULATED, SPECDRAFT_METHODS, method_profile, split_method
    from specdraft.drafters.simulated import parse_profile

    def simulated(m: str) -> bool:  # specdraft's drafter methods and llama.cpp's MTP
        base = split_method(m)[0]
        return base == "llama-cpp-mtp" or (base in SPECDRAFT_METHODS and base not in ("plain", CONTROL))

    methods = list(args.methods)
    if args.simulate_acceptance is not None:
        parse_profile(args.simulate_acceptance)
        methods = [f"{m}{SIMULATED}{args.simulate_acceptance}" if simulated(m) and method_profile(m) is None else m
                   for m in methods]
    for m in methods:
        profile = method_profile(m)
        if profile is None:
            continue
        if not simulated(m):
            raise SpecdraftError(f"method {m}: only drafter methods take a simulated acceptance (~PROFILE)")
        parse_profile(profile)
        if args.temperature != 0:
            raise SpecdraftError(f"method {m}: simulated acceptance needs greedy decoding (--temperature 0)")
    return methods


def _print_outputs(verb: str, out: Path, payload: dict) -> None:
    """The short tables, then the files written into `out`."""
    from specdraft.bench.report import text_summary

    print(text_summary(payload))
    print(f"\n{verb} {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {out / p}" for p in payload["plots"]))
