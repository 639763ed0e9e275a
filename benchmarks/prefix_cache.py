"""Time to first token of a request that shares a long prefix with the one before it, with and
without the server's prefix cache, and whether the answers are the same.

For each round a fresh prefix of about --prefix-tokens tokens (documents from a T0 prompt file,
as benchmarks/long_prompts.py builds them) is sent twice, with two different questions after it:
the second request is the one a prefix cache serves. The same rounds go to a server started with
--prefix-cache-mb 0 and to one with the cache (one server at a time, each warmed up first), and
the script reports the second requests' TTFT (the server's own `specdraft.ttft`, from arrival in
the engine to the first token) and the ratio of medians, the tokens the cache restored, and
whether every answer was the same text.

    python benchmarks/prefix_cache.py --source t0_prompts.jsonl --prefix-tokens 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_prompts import passages  # noqa: E402

from specdraft.loading.presets import resolve_model  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = ("\n\nQuestion: Which person do the documents above mention first?\nAnswer:",
             "\n\nQuestion: Summarise the last document above in one sentence.\nAnswer:")


def prefix(docs: list[str], tokenizer: Tokenizer, tokens: int, rng: random.Random) -> str:
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += f"Document:\n{rng.choice(docs)}\n\n"
    words = text.split(" ")
    while len(tokenizer.encode(" ".join(words))) > tokens:
        words = words[: int(len(words) * 0.97)]
    return " ".join(words)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve(args, cache_mb: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdraft", "serve", "--model", args.model, "--port", str(args.port),
           "--threads", str(args.threads), "--max-context", str(args.max_context), "--prefix-cache-mb", str(cache_mb)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def rounds(args, prompts: list[tuple[str, str]], cache_mb: int) -> list[dict]:
    proc = serve(args, cache_mb)
    url = f"http://127.0.0.1:{args.port}"
    try:
        post(url, {"prompt": "Warm-up.", "max_tokens": 4, "temperature": 0})
        out = []
        for a, b in prompts:
            first = post(url, {"prompt": a, "max_tokens": args.max_tokens, "temperature": 0})
            second = post(url, {"prompt": b, "max_tokens": args.max_tokens, "temperature": 0})
            out.append({"first_ttft": first["specdraft"]["ttft"], "first_tokens": first["usage"]["prompt_tokens"],
                        "ttft": second["specdraft"]["ttft"],
                        "cached": second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
                        "prompt_tokens": second["usage"]["prompt_tokens"],
                        "texts": [first["choices"][0]["text"], second["choices"][0]["text"]]})
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True, help="JSONL of T0 training prompts to take documents from")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = Tokenizer(resolve_model(args.model))
    docs, rng = passages(args.source), random.Random(args.seed)
    prompts = []
    for _ in range(args.rounds):
        p = prefix(docs, tokenizer, args.prefix_tokens, rng)
        prompts.append((p + QUESTIONS[0], p + QUESTIONS[1]))
    plain = rounds(args, prompts, 0)
    cached = rounds(args, prompts, 512)
    same = all(p["texts"] == c["texts"] for p, c in zip(plain, cached))
    for i, (p, c) in enumerate(zip(plain, cached)):
        differ = [j for j in (0, 1) if p["texts"][j] != c["texts"][j]]
        print(f"round {i}: second request {c['prompt_tokens']} tokens, {c['cached']} restored; TTFT "
              f"{p['ttft'] * 1000:.0f} ms without the cache, {c['ttft'] * 1000:.0f} ms with it"
              + (f"; answers differ: request {', '.join(str(j + 1) for j in differ)}" if differ else ""))
    a = statistics.median(p["ttft"] for p in plain)
    b = statistics.median(c["ttft"] for c in cached)
    print(f"median TTFT of the second request: {a * 1000:.0f} ms without, {b * 1000:.0f} ms with the prefix cache "
          f"({a / b:.1f}x); same answers: {same}")
    # The first requests share nothing with an earlier one: their prefill speed, with and without the cache
    speed = [statistics.median(r["first_tokens"] / r["first_ttft"] for r in rs) for rs in (plain, cached)]
    print(f"prompt speed of the first requests (median): {speed[0]:.0f} tok/s without, {speed[1]:.0f} tok/s with "
          "the cache")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
