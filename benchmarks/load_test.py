"""Load and fault test for `specdraft serve`, on this machine only (127.0.0.1).

For each drafter it starts a server, warms it up, then sends a fixed number of requests at each
concurrency level: valid ones (completions and chat, streamed and not, greedy and seeded
sampling), malformed or oversized ones (must get a 4xx JSON error), and clients that hang up
mid-stream (their rows must be freed). It reports throughput, latency percentiles, tau, the
server's resident memory before and after, and every failure. Bounded in count and time.

    python benchmarks/load_test.py --requests 2000 --drafter auto --drafter none
    python benchmarks/load_test.py --requests 100 --concurrency 1 4 --max-tokens 16   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"  # never anything else: this test only talks to the server it started
PROMPTS = [
    "def fibonacci(n):",
    "Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):",
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system in order:\n1.",
    "import numpy as np\n\ndef normalize(x):",
    "Q: What is 17 * 23?\nA:",
    "Rewrite this sentence in the passive voice: The cat chased the mouse.",
]
BAD_BODIES = [
    ("bad JSON", "{\"prompt\": \"hi\", "),
    ("not an object", "[1, 2, 3]"),
    ("missing prompt", {"max_tokens": 8}),
    ("prompt of the wrong type", {"prompt": 12}),
    ("max_tokens as a string", {"prompt": "hi", "max_tokens": "8"}),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -5}),
    ("absurd max_tokens", {"prompt": "hi", "max_tokens": 10**9}),
    ("temperature out of range", {"prompt": "hi", "temperature": 50}),
    ("NaN temperature", "{\"prompt\": \"hi\", \"temperature\": NaN}"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}),
    ("n > 1", {"prompt": "hi", "n": 4}),
    ("empty stop", {"prompt": "hi", "stop": ""}),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}),
    ("prompt longer than the context", {"prompt": "word " * 5000, "max_tokens": 8}),
    ("body over the size limit", {"prompt": "x" * (5 * 1024 * 1024)}),
    ("chat without messages", {"messages": []}),
]


@dataclass
class Outcome:
    kind: str  # valid | bad | disconnect
    ok: bool
    seconds: float = 0.0
    tokens: int = 0
    forwards: int = 0
    detail: str = ""


@dataclass
class Level:
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_server(args, drafter: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdraft", "serve", "--model", args.model, "--drafter", drafter, "--dtype",
           args.dtype, "--host", HOST, "--port", str(port), "--max-batch-size", str(args.max_batch_size),
           "--max-queue", str(args.max_queue), "--max-context", str(args.max_context)]
    log = open(args.out.with_suffix(f".{drafter}.server.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode} while starting (see its log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become healthy in time")


def valid_body(rng: random.Random, max_tokens: int, chat: bool) -> tuple[str, dict]:
    body = {"max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens), "temperature": 0.0}
    if rng.random() < 0.25:
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(10**6)}
    if rng.random() < 0.5:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    prompt = rng.choice(PROMPTS)
    if chat and rng.random() < 0.3:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


async def send_valid(client: httpx.AsyncClient, path: str, body: dict) -> Outcome:
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return Outcome("valid", False, detail=f"{path} -> {r.status_code}: {r.text[:200]}")
        data = r.json()
        ext = data.get("specdraft", {})
        return Outcome("valid", True, time.perf_counter() - t0, data["usage"]["completion_tokens"],
                       ext.get("target_forwards", 0))
    usage = ext = None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return Outcome("valid", False, detail=f"{path} stream -> {r.status_code}: {(await r.aread())[:200]!r}")
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome("valid", False, detail=f"{path} stream error: {chunk['error']}")
                if chunk.get("usage"):
                    usage, ext = chunk["usage"], chunk.get("specdraft", {})
    if not done or usage is None:
        return Outcome("valid", False, detail=f"{path} stream ended without usage or [DONE]")
    return Outcome("valid", True, time.perf_counter() - t0, usage["completion_tokens"], ext.get("target_forwards", 0))


async def send_bad(client: httpx.AsyncClient, name: str, body) -> Outcome:
    path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = await client.post(path, content=content, headers={"Content-Type": "application/json"})
    try:
        err = r.json()["error"]
        shaped = isinstance(err["message"], str) and "type" in err
    except (ValueError, KeyError, TypeError):
        shaped = False
    ok = 400 <= r.status_code < 500 and r.status_code != 429 and shaped
    return Outcome("bad", ok, detail="" if ok else f"{name}: {r.status_code} {r.text[:200]}")


async def send_disconnect(client: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> Outcome:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens * 4, "temperature": 0.0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Outcome("disconnect", False, detail=f"disconnect stream -> {r.status_code}")
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= 2:
                    break  # hang up mid-stream
    return Outcome("disconnect", True)


async def run_level(url: str, concurrency: int, count: int, args, rng: random.Random, deadline: float,
                    chat: bool) -> Level:
    jobs = []
    for _ in range(count):
        x = rng.random()
        jobs.append("bad" if x < 0.2 else "disconnect" if x < 0.3 else "valid")
    level = Level(concurrency)
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.time() < deadline:
            kind = queue.get_nowait()
            try:
                if kind == "valid":
                    out = await send_valid(client, *valid_body(rng, args.max_tokens, chat))
                elif kind == "bad":
                    out = await send_bad(client, *rng.choice(BAD_BODIES))
                else:
                    out = await send_disconnect(client, rng, args.max_tokens)
            except httpx.HTTPError as e:
                out = Outcome(kind, False, detail=f"{kind}: {type(e).__name__}: {e}")
            level.outcomes.append(out)

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
    level.wall = time.perf_counter() - t0
    return level


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(level: Level) -> dict:
    valid = [o for o in level.outcomes if o.kind == "valid" and o.ok]
    tokens = sum(o.tokens for o in valid)
    forwards = sum(o.forwards for o in valid)
    lat = [o.seconds for o in valid]
    return {
        "concurrency": level.concurrency,
        "requests": len(level.outcomes),
        "by_kind": {k: sum(o.kind == k for o in level.outcomes) for k in ("valid", "bad", "disconnect")},
        "failures": [o.detail for o in level.outcomes if not o.ok],
        "wall_seconds": round(level.wall, 2),
        "valid_tokens_per_second": round(tokens / level.wall, 2) if level.wall else None,
        "valid_requests_per_second": round(len(valid) / level.wall, 3) if level.wall else None,
        "latency_p50": percentile(lat, 50), "latency_p90": percentile(lat, 90), "latency_p99": percentile(lat, 99),
        "tau": round(tokens / forwards, 3) if forwards else None,
    }


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def run_drafter(args, drafter: str, rng: random.Random, deadline: float) -> dict:
    port = free_port()
    url = f"http://{HOST}:{port}"
    proc = start_server(args, drafter, port)
    try:
        wait_healthy(url, proc, args.start_timeout)
        # Base models have no chat template (the server says 400): send them completions only.
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1}, timeout=60).status_code == 200
        # Warm-up at the highest concurrency, not reported: the RSS baseline then already has
        # every batch shape's buffers, so growth after the run means a leak, not a first use.
        top = max(args.concurrency)
        asyncio.run(run_level(url, top, 3 * top, args, random.Random(0), deadline, chat))
        rss_before = rss_bytes(proc.pid)
        per_level = max(1, args.requests // (len(args.drafter) * len(args.concurrency)))
        levels = []
        for c in args.concurrency:
            if time.time() >= deadline:
                break
            level = summarize(asyncio.run(run_level(url, c, per_level, args, rng, deadline, chat)))
            level["server_alive"] = proc.poll() is None
            levels.append(level)
            print(f"  {drafter:>9} c={c}: {level['valid_tokens_per_second']} tok/s, p50 {level['latency_p50']}, "
                  f"tau {level['tau']}, failures {len(level['failures'])}", file=sys.stderr)
        time.sleep(1.0)  # let aborted rows drain
        drained = {"batch_size": metric(url, "specdraft_batch_size"), "queue_depth": metric(url, "specdraft_queue_depth")}
        rss_after = rss_bytes(proc.pid)
        return {"drafter": drafter, "chat": chat, "levels": levels, "rss_before": rss_before, "rss_after": rss_after,
                "rss_growth": round(rss_after / rss_before - 1, 4) if rss_before else None,
                "after_load": drained, "server_alive": proc.poll() is None}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--drafter", action="append", help="repeatable (default: auto and none)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=2000, help="total over drafters and concurrency levels")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--max-tokens", type=int, default=32, help="valid requests ask for max_tokens/4..max_tokens")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--time-limit", type=float, default=3 * 3600, help="seconds; the test stops by itself")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("load_test.json"))
    args = p.parse_args(argv)
    args.drafter = args.drafter or ["auto", "none"]
    deadline = time.time() + args.time_limit
    rng = random.Random(args.seed)
    results = [run_drafter(args, d, rng, deadline) for d in args.drafter]
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    failures = sum(len(lv["failures"]) for r in results for lv in r["levels"])
    crashed = [r["drafter"] for r in results if not r["server_alive"]]
    for r in results:
        growth = r["rss_growth"]
        print(f"{r['drafter']}: RSS {r['rss_before'] / 2**20:.0f} -> {r['rss_after'] / 2**20:.0f} MiB "
              f"({growth:+.1%}), after load {r['after_load']}")
        for lv in r["levels"]:
            print(f"  c={lv['concurrency']}: {lv['requests']} requests {lv['by_kind']}, "
                  f"{lv['valid_tokens_per_second']} tok/s, {lv['valid_requests_per_second']} req/s, "
                  f"latency p50/p90/p99 {lv['latency_p50']}/{lv['latency_p90']}/{lv['latency_p99']} s, tau {lv['tau']}")
            for f in lv["failures"]:
                print(f"    FAIL {f}")
    print(f"{failures} failures, crashed: {crashed or 'none'}; details in {args.out}")
    return 1 if failures or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
