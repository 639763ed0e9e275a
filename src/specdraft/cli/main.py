"""`specdraft` command line: one subcommand per module in this folder."""

from __future__ import annotations

import argparse
import sys

from specdraft.errors import SpecdraftError


def build_parser() -> argparse.ArgumentParser:
    from specdraft.cli import bench, generate, models, train

    parser = argparse.ArgumentParser(
        prog="specdraft",
        description="Lossless speculative decoding with Gemma-4-style MTP drafters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (generate, models, train, bench):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except SpecdraftError as e:
        print(f"specdraft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
