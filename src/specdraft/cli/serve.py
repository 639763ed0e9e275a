"""`specdraft serve`: parse flags, load the model, start the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys

from specdraft.cli.args import check_draft_tokens
from specdraft.errors import SpecdraftError

DEFAULT_MAX_CONTEXT = 2048
DEFAULT_PREFIX_CACHE_MB = 512


def register(sub) -> None:
    from specdraft.cli.args import add_drafter_args, add_model_args, add_policy_arg

    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API, with a playground page",
        description="An OpenAI-compatible server (POST /v1/completions, /v1/chat/completions, streamed or not; "
                    "GET /v1/models, /health, /metrics) with continuous batching of speculative decoding, and a "
                    "playground at / that colours each token by where it came from. Needs the serve extra: "
                    "pip install 'specdraft[serve]'.",
    )
    add_model_args(p)
    add_drafter_args(p)
    add_policy_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a batch row; beyond that the server answers 429 (default 64)")
    p.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                   help="positions per KV cache row, which sizes the cache: max-batch-size rows of this many "
                        f"(default {DEFAULT_MAX_CONTEXT}, capped at the model's context); a request's prompt + "
                        "max_tokens may use this minus the widest draft round + 1 (GET /v1/models: max_model_len)")
    p.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB,
                   help="memory for finished requests' KV cache, kept so that a request starting with the same "
                        "tokens (a conversation's next turn, a shared system prompt) prefills only the rest; least "
                        f"recently used evicted first; outside the KV rows of --max-batch-size (default "
                        f"{DEFAULT_PREFIX_CACHE_MB}; 0: off)")
    p.add_argument("--api-key", default=os.environ.get("SPECDRAFT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on everything but /health and the playground page "
                        "(default: $SPECDRAFT_API_KEY, else none)")
    p.add_argument("--allowed-hosts", nargs="+", metavar="HOST",
                   help="Host header names served, '*' for any (default: localhost, 127.0.0.1, ::1 and the "
                        "--host address); others get 400, so web pages cannot reach the server by DNS rebinding")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight get to finish before they are aborted with a "
                        "503 error (default 30)")
    p.set_defaults(run=run)


def _check(args) -> None:
    if not 0 < args.port < 65536:
        raise SpecdraftError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_batch_size < 1:
        raise SpecdraftError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_queue < 0:
        raise SpecdraftError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_context < 16:
        raise SpecdraftError(f"--max-context must be >= 16, got {args.max_context}")
    if args.prefix_cache_mb < 0:
        raise SpecdraftError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.api_key == "":
        raise SpecdraftError("--api-key must not be empty")
    if not args.shutdown_timeout >= 0:
        raise SpecdraftError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    check_draft_tokens(args.draft_tokens)


def run(args) -> int:
    _check(args)
    try:
        from specdraft.serve import create_app, load_served
        from specdraft.serve.server import serve
    except ImportError as e:
        raise SpecdraftError(f"specdraft serve needs the serve extra ({e.name} is missing): "
                             "pip install 'specdraft[serve]'") from None
    from specdraft.device import set_threads

    _, note = set_threads(args.threads)
    served = load_served(args.model, args.drafter, args.dtype, args.device, args.max_batch_size, args.max_context,
                         args.drafter_path, args.draft_tokens, args.weights,
                         args.compile, args.draft_policy, args.prefill_dtype, args.prefix_cache_mb << 20)
    if note:
        print(f"specdraft: note: {note}", file=sys.stderr)
    print(f"specdraft: serving {served.name} (drafter {served.drafter}) on http://{args.host}:{args.port}/ "
          f"- playground at /, API at /v1", file=sys.stderr)
    app = create_app(lambda: served, args.max_queue, args.api_key, allowed_hosts(args))
    return serve(app, args.host, args.port, args.shutdown_timeout)


def allowed_hosts(args) -> list[str]:
    """--allowed-hosts, else localhost's names plus the address listened on (unless a wildcard)."""
    if args.allowed_hosts:
        return args.allowed_hosts
    from specdraft.serve.limits import LOCAL_HOSTS

    return list(LOCAL_HOSTS) + ([args.host] if args.host not in ("0.0.0.0", "::", "") else [])
