"""`specdraft serve`'s limits, as a hostile or broken client meets them: the body cap holds for
chunked bodies, a slow or truncated body gets 408 instead of holding its connection, /health
answers while a 4 MB prompt is read, the Host header allow-list (DNS rebinding), no malformed
body gets a 5xx (a seeded fuzzer over both request schemas), sampling never sees NaN from a
temperature or top_p that underflows in float32, and the serve command's flags.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")
httpx = pytest.importorskip("httpx")

from test_server import served, serving, tiny  # noqa: E402
from specdraft.sampling import SamplingParams, probabilities  # noqa: E402
from specdraft.serve import create_app  # noqa: E402

__all__ = ["tiny"]  # the module-scoped fixture, shared
MiB = 1024 * 1024


# Body deadlines. The shared server's is generous: bodies of tens of MiB must arrive whole (or
# be capped) however loaded the machine is. The deadline tests get a server of their own whose
# deadline is 0.5 s, against a trickle that lasts 5.4 s: 10.8x.
GENEROUS_BODY_TIMEOUT = 60.0
SHORT_BODY_TIMEOUT = 0.5
TRICKLE_PAUSE = 0.15  # per byte of a 36-byte body


@pytest.fixture(scope="module")
def url(tiny):
    model = served(tiny)
    with serving(create_app(lambda: model, body_timeout=GENEROUS_BODY_TIMEOUT)) as (u, _):
        yield u


@pytest.fixture(scope="module")
def short_deadline_url(tiny):
    model = served(tiny)
    with serving(create_app(lambda: model, body_timeout=SHORT_BODY_TIMEOUT)) as (u, _):
        yield u


def chunked(data: bytes, size: int = 64 * 1024, pause: float = 0.0):
    """A body httpx sends chunked (no Content-Length), `size` bytes at a time."""
    for i in range(0, len(data), size):
        yield data[i : i + size]
        if pause:
            time.sleep(pause)


@pytest.mark.parametrize("mib", [5, 20])
@pytest.mark.parametrize("sent", ["chunked", "with Content-Length"])
def test_the_body_cap_holds_and_the_client_sees_the_413(url, mib, sent) -> None:
    # A client still sending when the server answers sees a reset, not the 413: the server reads
    # (and drops) an oversized body up to 64 MiB before it answers.
    body = json.dumps({"prompt": "w1 " * (mib * MiB // 3)}).encode()

    async def parts():
        for part in chunked(body):
            yield part
            await asyncio.sleep(0.001)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as c:
            return await c.post(url + "/v1/completions", content=parts() if sent == "chunked" else body,
                                headers={"Content-Type": "application/json"})

    for _ in range(3):
        r = asyncio.run(post())
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.get(url + "/health").status_code == 200


def raw_request(url: str, head: bytes, parts: list[bytes], pause: float = 0.0) -> bytes:
    """Send `head` then `parts` (pausing between them) on a socket; the server's whole answer."""
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(head)
        try:
            for part in parts:
                time.sleep(pause)
                s.sendall(part)
        except OSError:
            pass  # the server answered and closed first
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("case", ["truncated", "trickled"])
def test_a_slow_or_truncated_body_gets_408(short_deadline_url, case) -> None:
    body = json.dumps({"prompt": "w1 w2", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    if case == "truncated":  # fewer bytes than Content-Length says, and the client waits
        parts, pause = [body[:10]], 0.0
    else:  # a byte at a time, slower than the deadline allows
        parts, pause = [body[i : i + 1] for i in range(len(body))], TRICKLE_PAUSE
    assert len(body) * TRICKLE_PAUSE >= 10 * SHORT_BODY_TIMEOUT
    # No clock here: a server without the deadline would answer the trickled body in full (200),
    # and the truncated one never (raw_request's socket times out and the test fails).
    answer = raw_request(short_deadline_url, head, parts, pause)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def on_event_loop() -> bool:
    """Whether the calling thread is running an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_health_answers_while_a_4mb_prompt_is_read(url, monkeypatch) -> None:
    """Reading, parsing and tokenizing stay off the event loop: /health and /metrics answer while
    a 4 MB prompt is prepared. No latency bound (a loaded machine would fail one; on the event
    loop, tokenizing this prompt held every answer for ~4 s): the preparation itself waits until
    /health and /metrics, asked while it runs, were answered, which a blocked loop never does
    (the test would then fail on the client's 30 s timeout, not on a clock)."""
    from specdraft.serve import app as serve_app

    real, started, answered, threads = serve_app.prepare, threading.Event(), threading.Event(), []

    def gated(*args):
        threads.append(on_event_loop())
        started.set()
        answered.wait(60)
        return real(*args)

    monkeypatch.setattr(serve_app, "prepare", gated)
    body = json.dumps({"prompt": "w1 " * ((4 * MiB - 100) // 3)}).encode()
    assert len(body) < 4 * MiB
    result: list = []
    post = threading.Thread(target=lambda: result.append(httpx.post(
        url + "/v1/completions", content=chunked(body, pause=0.01), headers={"Content-Type": "application/json"},
        timeout=120)))
    post.start()
    assert started.wait(60), "the prompt was never prepared"
    with httpx.Client(timeout=30) as c:
        for path in ("/health", "/metrics"):
            assert c.get(url + path).status_code == 200
    answered.set()
    post.join()
    assert threads == [False]  # prepared on a worker thread
    assert result[0].status_code == 400 and result[0].json()["error"]["code"] == "context_length_exceeded"
    # The detector itself: inside a running loop it says so.
    assert asyncio.run(_on_loop_inside()) and not on_event_loop()


async def _on_loop_inside() -> bool:
    return on_event_loop()


def test_host_allow_list(tiny, url) -> None:
    port = url.rsplit(":", 1)[1]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.2"):
        r = httpx.post(url + "/v1/completions", json={"prompt": "w1"}, headers={"Host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", host
    model = served(tiny)
    with serving(create_app(lambda: model, allowed_hosts=["api.example", "127.0.0.1"])) as (u, _):
        assert httpx.get(u + "/v1/models", headers={"Host": "api.example:443"}).status_code == 200
        assert httpx.get(u + "/v1/models", headers={"Host": "localhost"}).status_code == 400
    with serving(create_app(lambda: model, allowed_hosts=["*"])) as (u, _):
        assert httpx.get(u + "/v1/models", headers={"Host": "anything.example"}).status_code == 200


# --------------------------------------------------------------------------- fuzzing

FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
          "presence_penalty", "frequency_penalty", "logprobs", "echo", "max_completion_tokens", "logit_bias", "suffix",
          "best_of", "min_p", "tools", "user"]


def random_value(rng: random.Random, depth: int = 0):
    choices = [None, True, False, 0, 1, -1, 2, 3, 17, 0.5, -0.0, 1e-320, 1e-38, 1e308, 2**63, -(2**70), float("nan"),
               float("inf"), "", "w1", "tiny", "\ud800", "w1 \udfff w2", "é", "\x00", "w1" * 50]
    if depth < 3 and rng.random() < 0.3:
        if rng.random() < 0.5:
            return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(FIELDS + ["type", "text", "role", "content"]): random_value(rng, depth + 1)
                for _ in range(rng.randrange(3))}
    return rng.choice(choices)


def random_message(rng: random.Random):
    if rng.random() < 0.2:
        return random_value(rng)
    content = rng.choice(["w1 w2", random_value(rng), [{"type": "text", "text": "w3"}],
                          [{"type": rng.choice(["text", "image_url", 3]), "text": random_value(rng)}]])
    return {"role": rng.choice(["user", "system", "assistant", "tool", "wizard", 5]), "content": content}


def fuzz_case(rng: random.Random) -> tuple[str, bytes]:
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = ({"messages": [random_message(rng) for _ in range(rng.randrange(1, 3))]} if chat else
                  {"prompt": rng.choice(["w1 w2", ["w3"], random_value(rng)])})
    body |= {"max_tokens": rng.randrange(1, 6)} if rng.random() < 0.7 else {}
    for _ in range(rng.randrange(4)):
        body[rng.choice(FIELDS)] = random_value(rng)
    if rng.random() < 0.1:
        del body["messages" if chat else "prompt"]
    text = json.dumps(body).encode()
    x = rng.random()
    if x < 0.1:  # cut short
        text = text[: rng.randrange(len(text))]
    elif x < 0.15:  # flipped bytes
        text = bytes(b ^ 0xFF if rng.random() < 0.05 else b for b in text)
    elif x < 0.2:
        text = rng.choice([b"[" * 5000, b"null", b"\"w1\"", b"\xef\xbb\xbf{}", b"{\"prompt\": \"w1\"" + b" " * 1000])
    return path, text


def test_no_malformed_body_gets_a_5xx(url) -> None:
    rng = random.Random(20240611)
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=30) as c:
        for _ in range(400):
            path, content = fuzz_case(rng)
            r = c.post(url + path, content=content, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, content[:300], r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]")
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 100, statuses  # both kinds were exercised


# --------------------------------------------------------------------------- sampling in float32


def reference_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """probabilities() as it was, for values where it was right."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


LOGITS = torch.randn(6, 2000, generator=torch.Generator().manual_seed(0)) * 4


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 50, 0.5), (0.01, 0, 1.0),
                                                     (2.0, 3, 1.0), (1.0, 0, 1e-6), (1e-29, 0, 1.0)])
def test_sampling_is_unchanged_for_normal_values(temperature, top_k, top_p) -> None:
    params = SamplingParams(temperature, top_k, top_p)
    assert torch.equal(probabilities(LOGITS, params), reference_probabilities(LOGITS, params))
    assert torch.equal(probabilities(LOGITS.bfloat16(), params), reference_probabilities(LOGITS.bfloat16(), params))


@pytest.mark.parametrize("temperature,top_p", [(1e-38, 1.0), (1e-45, 1.0), (5e-324, 1.0), (1e-31, 0.9), (1.0, 1e-46),
                                               (1.0, 5e-324), (0.5, 1e-40), (1e-38, 1e-46)])
def test_settings_that_underflow_in_float32_give_the_argmax_not_nan(temperature, top_p) -> None:
    probs = probabilities(LOGITS, SamplingParams(temperature, 0, top_p))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), LOGITS.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(6))


# --------------------------------------------------------------------------- flags


def parse_serve(*argv: str):
    from specdraft.cli.main import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags() -> None:
    from specdraft.cli.serve import _check, allowed_hosts
    from specdraft.errors import SpecdraftError

    args = parse_serve()
    assert args.shutdown_timeout == 30.0 and allowed_hosts(args) == ["localhost", "127.0.0.1", "::1", "127.0.0.1"]
    assert allowed_hosts(parse_serve("--host", "0.0.0.0")) == ["localhost", "127.0.0.1", "::1"]
    assert "10.1.2.3" in allowed_hosts(parse_serve("--host", "10.1.2.3"))
    assert allowed_hosts(parse_serve("--allowed-hosts", "api.example", "*")) == ["api.example", "*"]
    with pytest.raises(SpecdraftError, match="--shutdown-timeout"):
        _check(parse_serve("--shutdown-timeout", "-1"))
    _check(parse_serve("--shutdown-timeout", "0"))
