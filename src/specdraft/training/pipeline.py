"""`specdraft train-drafter` from a loaded target on: the drafter's shape, the prompts, the
target's answers (recorded to disk, resumable), training and export.

    check_context, check_recorded   the flags against the target
    drafter_config                  the drafter's shape: derived, resumed, continued or deepened
    train_drafter                   prompts -> recorded answers -> Trainer -> OUT/ (drafter, training.json)

`args` is the train-drafter command's settings (cli/train.py), read by their flag names, and
every refusal names the flag to change. Under torchrun, rank 0 records the data and the other
ranks wait for it (trainer.barrier).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdraft.errors import SpecdraftError

if TYPE_CHECKING:
    from specdraft.drafters.mtp.config import MTPConfig

# Longer prompts are left out by default: answers after ~300-1000-token documents moved no
# Spec-Bench category (BENCHMARKS.md, "Answers after documents: no gain for the drafter"), and
# every answer keeps its prompt's hidden states and K/V in memory while training (~6.6 KB a
# token on gemma3-270m).
DEFAULT_MAX_PROMPT_TOKENS = 256


def drafter_config(rt, args, recommended_k: int | None) -> MTPConfig:
    """The drafter config for the loaded target: flags the user left out are derived from the
    target's config, and every given flag is checked against it, each refusal naming the flag
    and a value that works (the flags alone were checked before the target loaded). Runs before
    any data is generated."""
    from specdraft.drafters.mtp import drafter_config_for
    from specdraft.drafters.mtp.checkpoint import (DEFAULT_HIDDEN, DEFAULT_LAYERS, cluster_count_near,
                                                    default_clusters, default_heads, default_layer_types,
                                                    default_top_k_clusters, kv_head_group, nearest_head_counts)

    vocab = rt.config.vocab_size
    hidden = args.hidden if args.hidden is not None else DEFAULT_HIDDEN
    layers = args.layers if args.layers is not None else DEFAULT_LAYERS
    layer_types = default_layer_types(rt.model, layers)
    group = kv_head_group(rt.model, layer_types)
    heads = args.heads if args.heads is not None else default_heads(group)
    if heads % group:
        raise SpecdraftError(f"--heads {heads} must be a multiple of the target's {group} KV heads (try "
                             + " or ".join(map(str, nearest_head_counts(heads, group))) + ")")
    clusters = args.clusters if args.clusters is not None else default_clusters(vocab)
    if clusters and vocab % clusters:
        near = cluster_count_near(vocab)
        hint = f"try {near}, or 0 for a dense head" if near else "try 0 for a dense head"
        raise SpecdraftError(f"--clusters {clusters} does not divide the target's vocabulary of {vocab} ({hint})")
    top_k = args.top_k_clusters if args.top_k_clusters is not None else default_top_k_clusters(clusters)
    if clusters and top_k > clusters:
        raise SpecdraftError(f"--top-k-clusters {top_k} exceeds --clusters {clusters} "
                             f"(try {default_top_k_clusters(clusters)})")
    cfg = drafter_config_for(rt.model, hidden=hidden, layers=layers, heads=heads, intermediate=args.intermediate,
                             layer_types=layer_types, head=args.head or "target", clustered=bool(clusters),
                             num_centroids=clusters or None, top_k_clusters=top_k, recommended_k=recommended_k)
    cfg.copy_gate = args.copy_gate
    return cfg


def check_context(rt, args) -> None:
    """Answers must fit the target's context after the longest prompt allowed; without
    --max-prompt-tokens that is DEFAULT_MAX_PROMPT_TOKENS or what the context leaves after an answer."""
    context = rt.config.max_position_embeddings
    room = context - args.answer_tokens - 1  # for a prompt of at least one token
    if room < 1:
        raise SpecdraftError(f"--answer-tokens {args.answer_tokens} does not fit the target's {context}-token "
                             f"context after a prompt (try {max(context - 2, 1)})")
    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = min(DEFAULT_MAX_PROMPT_TOKENS, room)
    elif args.max_prompt_tokens > room:
        raise SpecdraftError(f"--max-prompt-tokens {args.max_prompt_tokens} with --answer-tokens "
                             f"{args.answer_tokens} does not fit the target's {context}-token context (try "
                             f"--max-prompt-tokens {room})")
    if args.min_prompt_tokens > args.max_prompt_tokens:
        raise SpecdraftError(f"--min-prompt-tokens {args.min_prompt_tokens} is above the longest prompt allowed, "
                             f"{args.max_prompt_tokens} tokens (--max-prompt-tokens): no prompt could be used")


def _long_enough(rt, prompts: list[str], args) -> list[str]:
    """--min-prompt-tokens: the prompts of at least that many tokens (without a template), chosen
    before --skip/--num-prompts so those count the prompts used. Without it nothing is filtered
    here, so earlier recipes' --skip-prompts still name the same prompts; prompts over
    --max-prompt-tokens are left out when they are answered (data.py, template included)."""
    if not args.min_prompt_tokens:
        return prompts
    return [p for p in prompts if len(rt.tokenizer.encode(p)) >= args.min_prompt_tokens]


def check_recorded(rt, folders: list[Path]) -> None:
    """--data-from folders must hold answers of this target in this dtype: hidden states and K/V
    from another model or precision would teach the drafter inputs it never sees."""
    for folder in folders:
        meta = json.loads((folder / "data" / "train" / "data.json").read_text())
        if (meta.get("model"), meta.get("dtype")) != (rt.name, rt.dtype_name):
            raise SpecdraftError(f"--data-from {folder}: recorded with {meta.get('model')} in {meta.get('dtype')}, "
                                 f"this run trains for {rt.name} in {rt.dtype_name}")


def _recorded_elsewhere(folders: list[Path]) -> list:
    """The answers --data-from folders recorded (checked by check_recorded)."""
    from specdraft.training.data import load_sequences

    from specdraft.training import durable

    seqs = []
    for folder in folders:
        recorded = folder / "data" / "train"
        # Another run's answers are read, never remade here: a shard its manifest does not vouch for is refused.
        problem = durable.manifest_problem(recorded) if (recorded / durable.MANIFEST).exists() else None
        if problem:
            raise SpecdraftError(f"--data-from {folder}: {problem}; rerun that run's command to remake it")
        shards = sorted(recorded.glob("shard-*.safetensors"))
        seqs += load_sequences(shards)
        print(f"--data-from {folder}: {len(shards)} shards, {len(seqs)} answers so far", file=sys.stderr)
    return seqs


def _init_folder(rt, args) -> Path | None:
    """The drafter folder --init-from names ('shipped': the one shipped for the target)."""
    from specdraft.drafters import shipped_drafter_path

    if args.init_from is None:
        return None
    if args.init_from == "shipped":
        path = shipped_drafter_path(rt.name)
        if path is None:
            raise SpecdraftError(f"--init-from shipped: no drafter ships for {rt.name!r}; give a drafter folder")
        return Path(path)
    path = Path(args.init_from)
    if not (path / "config.json").is_file():
        raise SpecdraftError(f"--init-from {path}: not a drafter folder (no config.json)")
    return path


def _resumed_config(rt, args, folder: Path | None = None, what: str = "the checkpoint") -> MTPConfig:
    """On --resume (or --init-from) that drafter is continued: check it fits this target, and
    refuse shape flags that contradict it (they would be silently ignored otherwise)."""
    from specdraft.drafters.mtp.checkpoint import kv_sources, read_drafter_config

    ckpt = folder or args.out / "checkpoint"
    cfg = read_drafter_config(ckpt)
    kv_sources(cfg, rt.model)
    saved = {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
             "intermediate": cfg.intermediate_size, "head": cfg.head,
             "clusters": cfg.num_centroids if cfg.clustered else 0, "top_k_clusters": cfg.top_k_clusters}
    if folder is None and getattr(args, "copy_gate", False) and not cfg.copy_gate:
        raise SpecdraftError(f"--copy-gate: the checkpoint in {ckpt} has no copy gate; drop it to resume, "
                             "or choose another --out")
    for name, value in saved.items():
        given = getattr(args, name)
        deepened = name == "layers" and folder is not None and given is not None and given > value  # grow.py
        if given is not None and given != value and not deepened and not (name == "top_k_clusters"
                                                                           and not cfg.clustered):
            flag = "--" + name.replace("_", "-")
            hint = "to resume, or choose another --out" if folder is None else "to continue that drafter"
            if name == "layers" and folder is not None:
                hint += f", or give more than {value} to deepen it"
            raise SpecdraftError(f"{flag} {given} differs from {what} in {ckpt} ({flag} {value}); drop it {hint}")
    return cfg


def _synthetic(rt, args, examples: list[str]) -> list[str]:
    from specdraft.training.prompts import EvalGuard, load_prompt_set
    from specdraft.training.synthetic import SyntheticConfig, synthesize_prompts

    guard = EvalGuard(args.exclude_eval) if args.exclude_eval else None
    if args.synthetic_from:
        examples = load_prompt_set(args.synthetic_from, args.exclude_eval, held_out_fraction=0.0,
                                   what="--synthetic-from file").train
    made = synthesize_prompts(rt, examples, args.synthetic_prompts, args.out / "data" / "synthetic_prompts.jsonl",
                              SyntheticConfig(seed=args.seed), refuse=guard.contaminated if guard else None)
    print(f"synthetic prompts: {len(made)} written by the target", file=sys.stderr)
    return made


def _describe(cfg: MTPConfig) -> str:
    head_dim = cfg.head_dim[cfg.layer_types[-1]]
    clusters = f"{cfg.num_centroids} clusters (top {cfg.top_k_clusters})" if cfg.clustered else "dense head"
    return (f"drafter: hidden {cfg.hidden_size}, {cfg.num_layers} layers ({', '.join(cfg.layer_types)}), "
            f"{cfg.num_heads} heads of {head_dim}, MLP {cfg.intermediate_size}, head {cfg.head}, {clusters}")


def train_drafter(rt, args, started: float) -> int:
    """Check the flags against the target, record the target's answers, train, export.
    `started`: when the command began (the recipe records the seconds spent)."""
    from specdraft.training import data, durable
    from specdraft.training.trainer import TrainConfig, Trainer, barrier, is_first_rank

    check_context(rt, args)
    check_recorded(rt, args.data_from)
    init_from = _init_folder(rt, args)
    # After a kill: the newest complete checkpoint, verified against its manifest (durable.py).
    resuming = is_first_rank() and durable.recover_dir(args.out / "checkpoint", lambda m: print(m, file=sys.stderr))
    resuming = resuming or (args.out / "checkpoint" / "state.json").exists()
    drafter_cfg = _shape(rt, args, resuming, init_from)
    prompts, held, corpus = _prompts(rt, args)
    print(_describe(drafter_cfg) + (" (from the checkpoint)" if resuming else ""), file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    durable.write_text_atomic(args.out / "held_out_prompts.jsonl",
                              "".join(json.dumps({"prompt": p}) + "\n" for p in held))
    if is_first_rank():
        _record(rt, args, prompts.train, held, corpus)
    if args.data_only:
        return 0
    barrier()
    train = _shards(args.out, "train")
    train = data.answer_window(train + _recorded_elsewhere(args.data_from), args.answer_window)
    corpus_seqs = _shards(args.out, "corpus") if corpus else []
    held_seqs = data.answer_window(_shards(args.out, "held_out"), args.answer_window)
    data_seconds = time.time() - started
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, anchors_per_seq=args.anchors,
                      k_steps=args.draft_tokens, lr=args.lr, loss=args.loss, eval_every=args.eval_every,
                      save_every=args.eval_every, seed=args.seed, shortlist_size=args.shortlist,
                      corpus_fraction=args.corpus_fraction if args.corpus else None,
                      anchors_where=args.anchors_where)
    trainer = Trainer(rt, args.out, cfg, drafter_cfg, train + corpus_seqs, held_seqs,
                      log=lambda m: print(m, file=sys.stderr), init_from=init_from)
    final = trainer.train()
    # The command as typed, without the path the executable was run from.
    recipe = {"command": " ".join(["specdraft", *sys.argv[1:]]), "model": args.model, "seed": args.seed,
              "train_sequences": len(train), "corpus_sequences": len(corpus_seqs),
              "init_from": None if init_from is None else str(init_from),
              "target_tokens": sum(len(q.tokens) - q.prompt_length for q in train)
              + sum(len(q.tokens) for q in corpus_seqs),
              "held_out_sequences": len(held_seqs), "data_seconds_this_run": round(data_seconds, 1),
              "total_seconds_this_run": round(time.time() - started, 1), "device": str(rt.device), "dtype": rt.dtype_name}
    final = trainer.export(args.out, recipe) or final
    if is_first_rank():
        size = trainer.net.nbytes() / 2  # exported in bf16
        written = f"drafter written to {args.out}: {size / 1e6:.1f} MB ({100 * size / rt.nbytes():.1f}% of the target); "
        if final.get("tau") is None:  # --held-out 0: nothing was evaluated, so no number is printed
            print(written + "no held-out evaluation (--held-out 0); `specdraft eval-drafter` measures it",
                  file=sys.stderr)
            return 0
        print(written + f"held-out at K={args.draft_tokens} (step {final.get('step')}, the best decoding tau): "
              f"teacher-forced tau {final.get('tau')} (every anchor), "
              f"decoding tau {final.get('decoding_tau')} (greedy decoding replayed), acceptance by position "
              f"{final.get('acceptance_by_position')}; `specdraft eval-drafter` measures the engine itself", file=sys.stderr)
    return 0


def _shape(rt, args, resuming: bool, init_from: Path | None) -> MTPConfig:
    """The drafter's config: the checkpoint's on --resume, the --init-from drafter's (deepened
    with more --layers), else derived from the target and the shape flags."""
    from specdraft.drafters.mtp.checkpoint import kv_sources
    from specdraft.training.grow import grown_config

    if resuming:
        return _resumed_config(rt, args)
    if init_from is None:
        return drafter_config(rt, args, args.draft_tokens)
    cfg = _resumed_config(rt, args, init_from, "the drafter given to --init-from")
    cfg.copy_gate |= args.copy_gate
    if args.layers is not None and args.layers > cfg.num_layers:
        cfg = grown_config(cfg, args.layers, rt.model.config.layer_types)
        kv_sources(cfg, rt.model)
    return cfg


def _prompts(rt, args):
    """(training prompts, held-out prompts, corpus or None), checked and chosen; the synthetic
    prompts last, once every other input has been checked (rank 0 writes them, the others wait
    and read its file)."""
    from specdraft.training.prompts import load_prompt_set
    from specdraft.training.trainer import barrier, is_first_rank

    prompts = load_prompt_set(args.prompts, args.exclude_eval, held_out_fraction=0.05)
    examples = prompts.train  # the few-shot pool for --synthetic-prompts: every training prompt
    prompts.train, prompts.held_out = (_long_enough(rt, ps, args) for ps in (prompts.train, prompts.held_out))
    if not prompts.train:
        raise SpecdraftError(f"no training prompt is at least {args.min_prompt_tokens} tokens long "
                             "(--min-prompt-tokens)")
    end = None if args.num_prompts is None else args.skip_prompts + args.num_prompts
    prompts.train = prompts.train[args.skip_prompts : end]
    if not prompts.train:
        raise SpecdraftError(f"--skip-prompts {args.skip_prompts} leaves no training prompts")
    held = prompts.held_out[: args.held_out]
    # The same held-out split by content hash: a held-out prompt never enters the corpus.
    corpus = load_prompt_set(args.corpus, args.exclude_eval, held_out_fraction=0.05, limit=args.corpus_texts,
                             what="corpus file") if args.corpus else None
    if args.synthetic_prompts:
        if not is_first_rank():
            barrier()
        prompts.train += _synthetic(rt, args, examples)
        if is_first_rank():
            barrier()
    print(f"prompts: {len(prompts.train)} train, {len(held)} held out, {len(prompts.refused)} refused as "
          f"overlapping the evaluation files", file=sys.stderr)
    if corpus is not None:
        print(f"corpus: {len(corpus.train)} texts, {len(corpus.refused)} refused as overlapping the evaluation "
              "files", file=sys.stderr)
    return prompts, held, corpus


def _record(rt, args, train: list[str], held: list[str], corpus) -> None:
    """The target's answers to the training and held-out prompts, and the corpus's prefill
    labels, recorded under OUT/data (resumable)."""
    from specdraft.training import data
    from specdraft.training.corpus import CorpusConfig, build_corpus_dataset

    cfg = data.DataConfig(max_new_tokens=args.answer_tokens, max_prompt_tokens=args.max_prompt_tokens,
                          temperatures=tuple(args.answer_temperatures), top_p=args.answer_top_p,
                          seed=args.seed, first_prompt=args.skip_prompts)
    data.build_dataset(rt, train, args.out / "data" / "train", cfg)
    data.build_dataset(rt, held, args.out / "data" / "held_out", replace(cfg, first_prompt=0), desc="held-out data")
    if corpus is not None:
        build_corpus_dataset(rt, corpus.train, args.out / "data" / "corpus", CorpusConfig())


def _shards(out: Path, part: str) -> list:
    """The sequences recorded under OUT/data/`part`."""
    from specdraft.training.data import load_sequences

    return load_sequences(sorted((out / "data" / part).glob("shard-*.safetensors")))
