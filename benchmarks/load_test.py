"""Load and fault test for `specdraft serve`, on this machine only (127.0.0.1 / localhost).

It starts a server per drafter (or targets a running one with --url), warms it up, then sends a
fixed number of requests at each concurrency level: valid ones (completions and chat, streamed
and not, greedy and seeded sampling), malformed ones (bad JSON, wrong types, lone surrogates,
refused parameters, oversized bodies, chunked too; each must get a 4xx JSON error), and clients
that hang up (mid-stream, waiting for a non-streamed answer, or halfway through sending their
body; their rows must be freed). It reports throughput, latency percentiles, tau, failures by
kind (any 5xx, a request that hung, a wrong status, a broken stream, a row left in the batch;
429s, the server's answer when batch and queue are full, are counted but are no fault), and the
server's resident memory before and after. With --sigterm, halfway through the levels
the server gets SIGTERM under load: requests in flight must end with their answer or a 503
"shutting down", the process must exit 0 within the drain; it is then restarted for the rest.
Bounded in count and time.

    python benchmarks/load_test.py --requests 2000 --drafter auto --drafter none
    python benchmarks/load_test.py --requests 100 --concurrency 1 4 --max-tokens 16   # a quick check
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --requests 200         # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

HOST = "127.0.0.1"  # the servers this test starts listen here, and only here
LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}  # all --url may name
MiB = 1024 * 1024
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
    ("deeply nested", "[" * 100_000 + "]" * 100_000),
    ("bad UTF-8", b"{\"prompt\": \"hi \xff\"}"),
    ("missing prompt", {"max_tokens": 8}),
    ("prompt of the wrong type", {"prompt": 12}),
    ("lone surrogate in the prompt", "{\"prompt\": \"hi \\ud800\"}"),
    ("lone surrogate in a stop", "{\"prompt\": \"hi\", \"stop\": [\"\\udfff\"]}"),
    ("max_tokens as a string", {"prompt": "hi", "max_tokens": "8"}),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -5}),
    ("absurd max_tokens", {"prompt": "hi", "max_tokens": 10**9}),
    ("temperature out of range", {"prompt": "hi", "temperature": 50}),
    ("NaN temperature", "{\"prompt\": \"hi\", \"temperature\": NaN}"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}),
    ("n > 1", {"prompt": "hi", "n": 4}),
    ("empty stop", {"prompt": "hi", "stop": ""}),
    ("logit_bias", {"prompt": "hi", "logit_bias": {"1": 5}}),
    ("suffix", {"prompt": "hi", "suffix": "bye"}),
    ("best_of", {"prompt": "hi", "best_of": 3}),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}),
    ("prompt longer than the context", {"prompt": "word " * 5000, "max_tokens": 8}),
    ("body over the size limit", {"prompt": "x" * (5 * MiB)}),
    ("chunked body over the size limit", ("chunked", {"prompt": "x " * (3 * MiB)})),
    ("chat without messages", {"messages": []}),
    ("chat with a lone surrogate", "{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}"),
    ("chat with tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    ("wrong API key", ("key", {"prompt": "hi", "max_tokens": 2})),
]


@dataclass
class Outcome:
    kind: str  # valid | bad | hangup
    ok: bool
    seconds: float = 0.0
    tokens: int = 0
    forwards: int = 0
    failure: str = ""  # 5xx | hung | status | stream | connection | leak; busy (a 429: reported, not a fault)
    detail: str = ""


@dataclass
class Level:
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0
    after: dict = field(default_factory=dict)


def fail(kind: str, failure: str, detail: str) -> Outcome:
    return Outcome(kind, False, failure=failure, detail=detail)


def status_failure(status: int) -> str:
    return "5xx" if status >= 500 else "busy" if status == 429 else "status"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def local_url(url: str) -> str:
    """--url, refused unless it names this machine (this test must never load anyone else's)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOCAL_NAMES or parts.port is None:
        raise SystemExit(f"--url must be http://127.0.0.1:PORT or http://localhost:PORT, got {url!r}")
    return f"http://{parts.netloc}"


def server_command(args, drafter: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "specdraft", "serve", "--model", args.model, "--drafter", drafter, "--dtype",
           args.dtype, "--host", HOST, "--port", str(port), "--max-batch-size", str(args.max_batch_size),
           "--max-queue", str(args.max_queue), "--max-context", str(args.max_context),
           "--shutdown-timeout", str(args.shutdown_timeout)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def start_server(args, drafter: str, port: int, part: int) -> subprocess.Popen:
    log = open(args.out.with_suffix(f".{drafter}.{part}.server.log"), "w")
    return subprocess.Popen(server_command(args, drafter, port), stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
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
            return fail("valid", status_failure(r.status_code), f"{path} -> {r.status_code}: {r.text[:200]}")
        data = r.json()
        ext = data.get("specdraft", {})
        return Outcome("valid", True, time.perf_counter() - t0, data["usage"]["completion_tokens"],
                       ext.get("target_forwards", 0))
    usage = ext = None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread())[:200]
            return fail("valid", status_failure(r.status_code), f"{path} stream -> {r.status_code}: {text!r}")
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return fail("valid", "stream", f"{path} stream error: {chunk['error']}")
                if chunk.get("usage"):
                    usage, ext = chunk["usage"], chunk.get("specdraft", {})
    if not done or usage is None:
        return fail("valid", "stream", f"{path} stream ended without usage or [DONE]")
    return Outcome("valid", True, time.perf_counter() - t0, usage["completion_tokens"], ext.get("target_forwards", 0))


async def chunks_of(data: bytes, size: int = 256 * 1024):
    """A body httpx sends chunked (no Content-Length)."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def send_bad(client: httpx.AsyncClient, name: str, body, api_key: str | None) -> Outcome:
    headers = {"Content-Type": "application/json"}
    mode = None
    if isinstance(body, tuple):
        mode, body = body
    if mode == "key":
        if not api_key:
            return Outcome("bad", True)  # no key to get wrong
        headers["Authorization"] = "Bearer not-" + api_key
    path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
    content = body if isinstance(body, (str, bytes)) else json.dumps(body).encode()
    if mode == "chunked":
        content = chunks_of(content if isinstance(content, bytes) else content.encode())
    r = await client.post(path, content=content, headers=headers)
    try:
        err = r.json()["error"]
        shaped = isinstance(err["message"], str) and "type" in err
    except (ValueError, KeyError, TypeError):
        shaped = False
    if r.status_code >= 500:
        return fail("bad", "5xx", f"{name}: {r.status_code} {r.text[:200]}")
    if not (400 <= r.status_code < 500 and r.status_code != 429 and shaped):
        return fail("bad", "status", f"{name}: {r.status_code} {r.text[:200]}")
    return Outcome("bad", True)


async def hang_up_streamed(client: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> Outcome:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens * 4, "temperature": 0.0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return fail("hangup", status_failure(r.status_code), f"streamed hang-up -> {r.status_code}")
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= 2:
                    break  # hang up mid-stream
    return Outcome("hangup", True)


async def hang_up_raw(url: str, rng: random.Random, max_tokens: int, api_key: str | None, halfway: bool) -> Outcome:
    """A non-streamed request whose client leaves before the answer (`halfway`: before even
    sending its whole body)."""
    parts = urlsplit(url)
    body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens * 4, "temperature": 0.0}).encode()
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n" % (parts.netloc.encode(), auth, len(body)))
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head + (body[: len(body) // 2] if halfway else body))
        await writer.drain()
        try:  # an answer this fast must not be a 5xx
            first = await asyncio.wait_for(reader.read(64), rng.uniform(0.05, 0.3))
        except asyncio.TimeoutError:
            return Outcome("hangup", True)
        status = int(first[9:12]) if first[9:12].isdigit() else 0
        if status >= 400:
            return fail("hangup", status_failure(status), f"hang-up answered early: {first!r}")
        return Outcome("hangup", True)
    finally:
        writer.close()


async def run_level(url: str, concurrency: int, count: int, args, rng: random.Random, deadline: float,
                    chat: bool) -> Level:
    jobs = []
    for _ in range(count):
        x = rng.random()
        jobs.append("bad" if x < 0.2 else ("hangup-stream", "hangup-plain", "hangup-body")[rng.randrange(3)]
                    if x < 0.3 else "valid")
    level = Level(concurrency)
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def one(client: httpx.AsyncClient, kind: str) -> Outcome:
        if kind == "valid":
            return await send_valid(client, *valid_body(rng, args.max_tokens, chat))
        if kind.startswith("bad"):
            return await send_bad(client, *BAD_BODIES[int(kind.split("-")[1])], args.api_key)
        if kind == "hangup-stream":
            return await hang_up_streamed(client, rng, args.max_tokens)
        return await hang_up_raw(url, rng, args.max_tokens, args.api_key, halfway=kind == "hangup-body")

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.time() < deadline:
            kind = queue.get_nowait()
            if kind == "bad":  # named, so that a failure says which case
                case = rng.randrange(len(BAD_BODIES))
                kind = f"bad-{case}-{BAD_BODIES[case][0]}"
            short = kind.split("-")[0]
            try:
                out = await asyncio.wait_for(one(client, kind), args.request_timeout)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                out = fail(short, "hung", f"{kind}: no answer within {args.request_timeout} s")
            except (httpx.HTTPError, OSError) as e:
                out = fail(short, "connection", f"{kind}: {type(e).__name__}: {e}")
            level.outcomes.append(out)

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=headers) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
    level.wall = time.perf_counter() - t0
    level.after = settle(url, args.api_key)
    if level.after["batch_size"] or level.after["queue_depth"]:
        level.outcomes.append(fail("hangup", "leak", f"rows left after the level: {level.after}"))
    return level


def settle(url: str, api_key: str | None, timeout: float = 10.0) -> dict:
    """The batch and queue gauges once aborted rows have had time to leave (0 and 0 if none leaked)."""
    deadline = time.time() + timeout
    while True:
        now = {"batch_size": metric(url, "specdraft_batch_size", api_key),
               "queue_depth": metric(url, "specdraft_queue_depth", api_key)}
        if not (now["batch_size"] or now["queue_depth"]) or time.time() > deadline:
            return now
        time.sleep(0.2)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))], 4)


def summarize(level: Level) -> dict:
    valid = [o for o in level.outcomes if o.kind == "valid" and o.ok]
    tokens = sum(o.tokens for o in valid)
    forwards = sum(o.forwards for o in valid)
    lat = [o.seconds for o in valid]
    failures = [o for o in level.outcomes if not o.ok and o.failure != "busy"]
    return {
        "concurrency": level.concurrency,
        "requests": len(level.outcomes),
        "by_kind": {k: sum(o.kind == k for o in level.outcomes) for k in ("valid", "bad", "hangup")},
        "failures_by_kind": {f: sum(o.failure == f for o in failures) for f in sorted({o.failure for o in failures})},
        "failures": [f"{o.failure}: {o.detail}" for o in failures],
        "busy_429": sum(o.failure == "busy" for o in level.outcomes),
        "wall_seconds": round(level.wall, 2),
        "valid_tokens_per_second": round(tokens / level.wall, 2) if level.wall else None,
        "requests_per_second": round(len(level.outcomes) / level.wall, 3) if level.wall else None,
        "valid_requests_per_second": round(len(valid) / level.wall, 3) if level.wall else None,
        "latency_p50": percentile(lat, 50), "latency_p90": percentile(lat, 90), "latency_p99": percentile(lat, 99),
        "tau": round(tokens / forwards, 3) if forwards else None,
        "after": level.after,
    }


def metric(url: str, name: str, api_key: str | None = None) -> float | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for line in httpx.get(url + "/metrics", timeout=5, headers=headers).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


async def drain_phase(url: str, proc: subprocess.Popen, args, rng: random.Random, chat: bool) -> dict:
    """SIGTERM while `top` requests are in flight: each must end with its answer or a 503
    "shutting down" (JSON or a stream's error event), and the process must exit 0 in time."""
    top = max(args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": args.max_tokens * (1 if i % 2 else 20),
                "temperature": 0.0, "stream": bool(i % 4 >= 2)}
        try:
            if not body["stream"]:
                r = await client.post("/v1/completions", json=body)
                if r.status_code == 200:
                    return "answered"
                code = r.json().get("error", {}).get("code") if r.headers.get("content-type", "").startswith(
                    "application/json") else None
                return "aborted (503 shutting_down)" if (r.status_code, code) == (503, "shutting_down") else \
                    f"bad: {r.status_code} {r.text[:100]}"
            async with client.stream("POST", "/v1/completions", json=body) as r:
                last = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            if len(last) < 2 or last[-1] != "data: [DONE]":
                return "bad: stream without [DONE]"
            chunk = json.loads(last[-2][6:])
            if "error" in chunk:
                return ("aborted (503 shutting_down)" if chunk["error"].get("code") == "shutting_down"
                        else f"bad: {chunk['error']}")
            return "answered"
        except httpx.HTTPError as e:
            return f"bad: {type(e).__name__}: {e}"

    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=top)) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(top)]
        deadline = time.time() + 30
        while time.time() < deadline:  # until every unfinished request is in the server's hands
            await asyncio.sleep(0.05)
            held = sum(metric(url, m, args.api_key) or 0 for m in ("specdraft_batch_size", "specdraft_queue_depth"))
            if held >= sum(not t.done() for t in tasks):
                break
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
        answered_by = time.perf_counter() - t0
    try:
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, args.shutdown_timeout + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed: did not exit"
    exit_seconds = time.perf_counter() - t0
    outcome = {k: results.count(k) for k in sorted(set(results))}
    clean = code == 0 and all(not r.startswith("bad") for r in results)
    return {"in_flight": top, "outcomes": outcome, "exit_code": code, "requests_ended_seconds": round(answered_by, 2),
            "drain_seconds": round(exit_seconds, 2), "shutdown_timeout": args.shutdown_timeout, "clean": clean}


def run_drafter(args, drafter: str, rng: random.Random, deadline: float) -> dict:
    part = 0
    if args.url:
        url, proc = args.url, None
    else:
        port = free_port()
        url = f"http://{HOST}:{port}"
        proc = start_server(args, drafter, port, part)
    pid = proc.pid if proc is not None else args.pid
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    segments, drain = [], None
    try:
        wait_healthy(url, proc, args.start_timeout)
        # Base models have no chat template (the server says 400): send them completions only.
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1}, timeout=60,
                          headers=headers).status_code == 200
        per_level = max(1, args.requests // (len(args.drafter) * len(args.concurrency)))
        middle = (len(args.concurrency) + 1) // 2 if args.sigterm else None
        segment = start_segment(url, pid, args, deadline, chat)
        for i, c in enumerate(args.concurrency):
            if time.time() >= deadline:
                break
            if i == middle and proc is not None and i > 0:
                segment = end_segment(segment, pid)
                segments.append(segment)
                drain = asyncio.run(drain_phase(url, proc, args, rng, chat))
                print(f"  {drafter:>9} SIGTERM: {drain}", file=sys.stderr)
                part += 1
                port = free_port()
                url = f"http://{HOST}:{port}"
                proc = start_server(args, drafter, port, part)
                pid = proc.pid
                wait_healthy(url, proc, args.start_timeout)
                segment = start_segment(url, pid, args, deadline, chat)
            level = summarize(asyncio.run(run_level(url, c, per_level, args, rng, deadline, chat)))
            level["server_alive"] = proc is None or proc.poll() is None
            segment["levels"].append(level)
            print(f"  {drafter:>9} c={c}: {level['valid_tokens_per_second']} tok/s, p50 {level['latency_p50']}, "
                  f"tau {level['tau']}, failures {level['failures_by_kind']}", file=sys.stderr)
        segments.append(end_segment(segment, pid))
        return {"drafter": drafter, "chat": chat, "segments": segments, "sigterm": drain,
                "server_alive": proc is None or proc.poll() is None}
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=args.shutdown_timeout + 30)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_segment(url: str, pid: int | None, args, deadline: float, chat: bool) -> dict:
    """Warm-up at the highest concurrency, not reported: the RSS baseline then already has every
    batch shape's buffers, so growth after the run means a leak, not a first use."""
    top = max(args.concurrency)
    asyncio.run(run_level(url, top, 3 * top, args, random.Random(0), deadline, chat))
    return {"pid": pid, "rss_before": rss_bytes(pid) if pid else None, "levels": []}


def end_segment(segment: dict, pid: int | None) -> dict:
    time.sleep(1.0)  # let aborted rows drain
    after = rss_bytes(pid) if pid and Path(f"/proc/{pid}").exists() else None
    before = segment["rss_before"]
    return segment | {"rss_after": after, "rss_growth": round(after / before - 1, 4) if before and after else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="test the server running there (127.0.0.1 or localhost only) instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for its memory")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--drafter", action="append", help="repeatable (default: auto and none)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, help="the server's CPU threads (passed to specdraft serve --threads)")
    p.add_argument("--api-key", help="start the server with this key and send it (a wrong one is a bad request)")
    p.add_argument("--requests", type=int, default=2000, help="total over drafters and concurrency levels")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--max-tokens", type=int, default=32, help="valid requests ask for max_tokens/4..max_tokens")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="the server's drain on SIGTERM, seconds")
    p.add_argument("--sigterm", action="store_true",
                   help="halfway through the levels, SIGTERM the server under load and check the drain, then restart it")
    p.add_argument("--time-limit", type=float, default=3 * 3600, help="seconds; the test stops by itself")
    p.add_argument("--request-timeout", type=float, default=120, help="a request with no answer by then has hung")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("load_test.json"))
    args = p.parse_args(argv)
    if args.url:
        args.url = local_url(args.url)
        if args.sigterm:
            raise SystemExit("--sigterm needs a server this test starts (no --url)")
        args.drafter = args.drafter or ["running"]
    args.drafter = args.drafter or ["auto", "none"]
    args.requests = min(args.requests, 1_000_000)
    deadline = time.time() + args.time_limit
    rng = random.Random(args.seed)
    t0 = time.time()
    results = [run_drafter(args, d, rng, deadline) for d in args.drafter]
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "seconds": round(time.time() - t0, 1), "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    return print_report(results, args.out)


def print_report(results: list[dict], out: Path) -> int:
    failures = sum(len(lv["failures"]) for r in results for s in r["segments"] for lv in s["levels"])
    crashed = [r["drafter"] for r in results if not r["server_alive"]]
    unclean = [r["drafter"] for r in results if r["sigterm"] is not None and not r["sigterm"]["clean"]]
    for r in results:
        for s in r["segments"]:
            growth = s["rss_growth"]
            rss = (f"RSS {s['rss_before'] / MiB:.0f} -> {s['rss_after'] / MiB:.0f} MiB ({growth:+.1%})"
                   if growth is not None else "RSS not measured")
            print(f"{r['drafter']} (server pid {s['pid']}): {rss}")
            for lv in s["levels"]:
                print(f"  c={lv['concurrency']}: {lv['requests']} requests {lv['by_kind']}, "
                      f"{lv['valid_tokens_per_second']} tok/s, {lv['requests_per_second']} req/s, latency p50/p90/p99 "
                      f"{lv['latency_p50']}/{lv['latency_p90']}/{lv['latency_p99']} s, tau {lv['tau']}, "
                      f"failures {lv['failures_by_kind'] or 0}, 429s {lv['busy_429']}, after {lv['after']}")
                for f in lv["failures"][:20]:
                    print(f"    FAIL {f}")
        if r["sigterm"] is not None:
            print(f"  SIGTERM under load: {r['sigterm']}")
    print(f"{failures} failures, crashed: {crashed or 'none'}, unclean drain: {unclean or 'none'}; details in {out}")
    return 1 if failures or crashed or unclean else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
