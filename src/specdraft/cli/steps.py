"""`specdraft steps`: the time of one target forward by query width and batch size."""

from __future__ import annotations

import sys

from specdraft.cli.bench import int_list
from specdraft.cli.args import add_model_args, load_target
from specdraft.errors import SpecdraftError


def register(sub) -> None:
    p = sub.add_parser(
        "steps", help="time one target forward per query width and batch size (what a verify costs)",
        description="Median time of one forward of W tokens per row (W = 1 is a plain decode step, W = K+1 a "
                    "verification of K drafts) plus the LM head, over a cache of --context tokens, for each "
                    "batch size; with the ratio to the width-1 step, the weight bytes a step reads and the "
                    "bandwidth that implies against the machine's measured read bandwidth.")
    add_model_args(p)
    p.add_argument("--widths", type=int_list, default=list(range(1, 10)), help="query widths (default 1..9)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 8], help="batch sizes (default 1,4,8)")
    p.add_argument("--context", type=int, default=512, help="cached tokens per row (default 512)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per cell; the median is shown (default 15)")
    p.add_argument("--breakdown", action="store_true",
                   help="also show, for each of --widths at batch 1, where a forward's time goes per op "
                        "class (width 1: a plain step; K+1: a verification of K drafts): matrices by place with "
                        "their bytes and rate, attention, norms, int8 rounding, PLE inputs, LM head, "
                        "and the rest (Python, dispatch); inside Gemma 4's fused layers per C op class")
    p.set_defaults(run=run)


def run(args) -> int:
    from specdraft.bench.runner import read_bandwidth_gbs
    from specdraft.bench.steps import step_times, weight_bytes_per_step

    widths, batches = args.widths, args.batch_sizes
    if 1 not in widths:
        widths = [1] + widths  # the yardstick
    if args.context < 1 or args.repeats < 1:
        raise SpecdraftError("--context and --repeats must be >= 1")
    rt = load_target(args)
    if args.context + max(widths) + 1 > rt.config.max_position_embeddings:
        raise SpecdraftError(f"--context {args.context} exceeds the model's {rt.config.max_position_embeddings} positions")
    gbs = read_bandwidth_gbs(rt.device)
    nbytes = weight_bytes_per_step(rt.model)
    floor_ms = nbytes / (gbs * 1e9) * 1000
    print(f"{rt.name}: {rt.dtype_name}, weights {rt.weights}, compiled {rt.model.compiled_step is not None}, "
          f"{nbytes / 1e6:.0f} MB read per step; measured read bandwidth {gbs:.1f} GB/s -> floor {floor_ms:.1f} ms/step")
    print("| batch | width | ms/forward | x width 1 | ms per row-token | GB/s (weights) |")
    print("|---|---|---|---|---|---|")

    def show(s) -> None:
        print(f"| {s.batch_size} | {s.width} | {s.ms:.1f} | {s.ratio:.2f} | {s.ms / (s.batch_size * s.width):.2f} | "
              f"{nbytes / (s.ms / 1000) / 1e9:.1f} |", flush=True)

    step_times(rt.model, batches, widths, args.context, args.repeats, progress=show)
    if args.breakdown:
        for width in widths:
            show_breakdown(rt.model, args.context, args.repeats, gbs, width)
    if rt.model.compiled_step is not None:
        print(f"(compile time, not in the table: {rt.model.compiled_step.compile_seconds:.0f} s)", file=sys.stderr)
    return 0


def show_breakdown(model, context: int, repeats: int, gbs: float, width: int = 1) -> None:
    from specdraft.bench.breakdown import omp_regions_note, step_breakdown

    parts = step_breakdown(model, context, repeats, width)
    what = "a plain step" if width == 1 else f"a {width}-token forward"
    print(f"\n| part of {what} (batch 1) | ms | weight MB | GB/s | floor ms (bytes / bandwidth) |")
    print("|---|---|---|---|---|")
    for p in parts:
        rate = f"{p.nbytes / (p.ms / 1000) / 1e9:.1f}" if p.nbytes and p.ms > 0 else ""
        floor = f"{p.nbytes / (gbs * 1e9) * 1000:.2f}" if p.nbytes else ""
        mb = f"{p.nbytes / 1e6:.0f}" if p.nbytes else ""
        print(f"| {p.name} | {p.ms:.2f} | {mb} | {rate} | {floor} |")
    note = omp_regions_note(model)
    if note:
        print(note)
