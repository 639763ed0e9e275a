"""`specdraft` command line: one subcommand per module in this folder.

Exit codes: 0 success; 2 a mistake the user can fix (bad flag or value, missing or corrupt
file, a model or drafter that does not fit), reported as one line; 1 anything else (out of
memory, a failure inside torch or specdraft), also one line plus a hint; 130 interrupted.
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from specdraft.errors import SpecdraftError

EXIT_CODES = """exit codes:
  0    success
  1    an unexpected failure (out of memory, an error inside torch); --debug shows the traceback
  2    bad input: a flag, value or file to fix (one line on stderr, no traceback)
  130  interrupted"""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (the full usage is one --help away)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from specdraft.cli import bench, chat, generate, models, serve, steps, train, weights

    parser = OneLineParser(
        prog="specdraft",
        description="Lossless speculative decoding with Gemma-4-style MTP drafters.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (generate, chat, models, train, bench, steps, weights, serve):
        module.register(sub)
    for p in sub.choices.values():  # also after the subcommand; SUPPRESS keeps the global value
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of any error")
    return parser


def _hint(e: BaseException) -> str:
    text = str(e).lower()
    if isinstance(e, MemoryError) or "out of memory" in text:
        return "try a smaller --batch-size or --max-new-tokens, --dtype bfloat16, or another --device"
    return "rerun with --debug for the traceback, and report it if the input looks right"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("specdraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        if isinstance(e, SpecdraftError):
            print(f"specdraft: error: {e}", file=sys.stderr)
            return 2
        message = " ".join(str(e).split()) or "(no message)"  # torch messages span lines
        print(f"specdraft: error: {type(e).__name__}: {message} ({_hint(e)})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
