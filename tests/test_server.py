"""`specdraft serve` over real HTTP (uvicorn on 127.0.0.1), driven by the official `openai`
client and plain httpx: completions and chat, streamed and not (streamed text = non-streamed
text, greedy), usage and the speculative statistics extension, 16 concurrent greedy requests =
the same requests one at a time, seeded sampling, stop strings, every user mistake a 4xx in
OpenAI's error shape, 429 on a full queue, a disconnecting client's row freed, bearer auth,
Prometheus metrics. Tiny random models (fp32, CPU); one smoke test on the real default model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from conftest import make_tiny  # noqa: E402
from specdraft.drafters.ngram import NgramDrafter  # noqa: E402
from specdraft.serve import ServedModel, create_app  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w99 {% endif %}")
PROMPTS = ["w1 w2 w3", "The quick brown fox", "w5 w6 w5 w6 w5", "def return w7 w8 w9 w10 w11 w12 w13 w14",
           "w20", "fox fox brown w30 w31", "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52", "quick w3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    t = make_tiny(tmp_path_factory.mktemp("serve") / "tiny", "llama", seed=41, max_position_embeddings=256)
    (t.folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return t


def served(tiny, drafter=None, k: int = 3, max_batch_size: int = 8, max_context: int = 128) -> ServedModel:
    tok = Tokenizer(tiny.folder, tiny.cfg.eos_token_ids)
    engine = Engine(tiny.ours, tok, drafter, k, max_batch_size=max_batch_size, capacity=max_context)
    return ServedModel("tiny", engine, tok, drafter.kind if drafter else "none", k if drafter else 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: ServedModel, **app_kwargs):
    """A real uvicorn server in a thread; yields its base URL once /health says ok."""
    with serving(create_app(lambda: model, **app_kwargs)) as (url, _):
        yield url


@contextlib.contextmanager
def serving(app, make_server=None):
    """`app` served by uvicorn in a thread (or by make_server(app, port)); yields (URL, server)."""
    port = free_port()
    server = (make_server(app, port) if make_server is not None else
              uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health").status_code == 200:
                break
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.05)
    try:
        yield url, server
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="module")
def url(tiny):
    with running_server(served(tiny, NgramDrafter())) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def expected_text(tiny, prompt: str, n: int) -> tuple[str, list[int]]:
    tok = Tokenizer(tiny.folder, tiny.cfg.eos_token_ids)
    r = Engine(tiny.ours, tok).generate([tok.encode(prompt)], n)[0]
    return r.text, r.token_ids


def test_completion_equals_plain_decoding_and_streaming_equals_not(client, tiny) -> None:
    for prompt in PROMPTS[:4]:
        text, ids = expected_text(tiny, prompt, 20)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == text
        assert r.usage.completion_tokens == len(ids)
        assert r.usage.prompt_tokens == len(Tokenizer(tiny.folder).encode(prompt))
        assert r.choices[0].finish_reason == ("stop" if ids[-1] in tiny.cfg.eos_token_ids else "length")
        ext = r.model_extra["specdraft"]
        assert ext["drafter"] == "ngram" and ext["draft_tokens"] == 3 and len(ext["acceptance_by_position"]) == 3
        assert ext["mean_accepted"] == pytest.approx(len(ids) / ext["target_forwards"], abs=1e-3)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
        assert all(c.usage is None for c in chunks[:-1])
        assert [c.choices[0].finish_reason for c in chunks[:-1]].count(None) == len(chunks) - 2
        # Per-token sources: one 'target' per target forward, the rest accepted lookups.
        pieces = [p for c in chunks[:-1] for p in c.model_extra["specdraft"]["pieces"]]
        assert "".join(t for t, _ in pieces) == text
        assert {s for _, s in pieces} <= {"target", "lookup"}


def test_chat_streamed_equals_not(client, tiny) -> None:
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w3"}]
    tok = Tokenizer(tiny.folder, tiny.cfg.eos_token_ids)
    ids = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    want = Engine(tiny.ours, tok).generate([ids], 15)[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sixteen_concurrent_requests_equal_one_at_a_time(url, tiny) -> None:
    prompts = PROMPTS * 2
    lengths = [5 + 3 * i for i in range(16)]
    sequential = [expected_text(tiny, p, n)[0] for p, n in zip(prompts, lengths)]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*[aclient.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                                    for p, n in zip(prompts, lengths)])
        await aclient.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(together()) == sequential


def test_seeded_sampling_repeats_alone_and_in_company(client, url) -> None:
    def ask(seed):
        return client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=1.0,
                                         seed=seed).choices[0].text

    alone = ask(7)
    assert ask(7) == alone and ask(8) != alone

    async def crowd():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        others = [aclient.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0.8, seed=i)
                  for i, p in enumerate(PROMPTS[1:6])]
        rs = await asyncio.gather(aclient.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24,
                                                             temperature=1.0, seed=7), *others)
        await aclient.close()
        return rs[0].choices[0].text

    assert asyncio.run(crowd()) == alone


def test_stop_strings_cut_the_same_streamed_and_not(client, tiny) -> None:
    text, _ = expected_text(tiny, PROMPTS[2], 30)
    words = text.split()
    stop = " ".join(words[3:5])
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop, "zz"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


BAD_REQUESTS = [
    # (body, status, words in the message)
    ("{not json", 400, "invalid JSON"),
    ("", 400, "request body"),
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": "w1", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "w1", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "w1", "temperature": 7}, 400, "temperature"),
    ({"prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    ('{"prompt": "w1", "temperature": NaN}', 400, "temperature"),
    ({"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ({"prompt": "w1", "stream": "yes"}, 400, "stream"),
    ({"prompt": "w1", "n": 3}, 400, "n"),
    ({"prompt": "w1", "stop": ""}, 400, "stop"),
    ({"prompt": "w1", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "w1", "seed": -1}, 400, "seed"),
    ({"prompt": 17}, 400, "prompt"),
    ({"prompt": ["w1", "w2"]}, 400, "one prompt"),
    ({"prompt": "w1", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "w1", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": "w1 " * 200, "max_tokens": 4}, 400, "context"),
    ({"prompt": "w1", "max_tokens": 100000}, 400, "context"),
    ({"prompt": "w1", "model": "gpt-4"}, 404, "not found"),
    # Text must be valid Unicode: a lone surrogate is the client's mistake, not a tokenizer crash.
    ('{"prompt": "w1 \\ud800"}', 400, "lone surrogate"),
    ('{"prompt": ["\\udfff"]}', 400, "lone surrogate"),
    ('{"prompt": "w1", "stop": "\\ud800"}', 400, "lone surrogate"),
    # Parameters that would change the output and are not implemented: refused, not ignored.
    ({"prompt": "w1", "logit_bias": {"5": 100}}, 400, "logit_bias is not supported"),
    ({"prompt": "w1", "suffix": "w2"}, 400, "suffix is not supported"),
    ({"prompt": "w1", "best_of": 3}, 400, "best_of is not supported"),
    ({"prompt": "w1", "best_of": True}, 400, "best_of is not supported"),
    ({"prompt": "w1", "min_p": 0.1}, 400, "min_p is not supported"),
    ({"prompt": "w1", "response_format": {"type": "json_object"}}, 400, "response_format is not supported"),
    ({"prompt": "w1", "top_logprobs": 2}, 400, "top_logprobs is not supported"),
    # Malformed in ways a parser can trip on.
    ("[" * 100_000 + "]" * 100_000, 400, "invalid JSON"),
    (b'{"prompt": "w1 \xff"}', 400, "invalid JSON"),
    ('{"prompt": "w1", "max_tokens": ' + "9" * 5000 + "}", 400, "invalid JSON"),
    ("[1, 2]", 400, "request body"),
]


@pytest.mark.parametrize("body,status,words", BAD_REQUESTS, ids=lambda x: str(x)[:40] if isinstance(x, (str, bytes)) else None)
def test_user_mistakes_are_4xx_in_openai_shape(url, body, status, words) -> None:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert "Traceback" not in r.text


def test_neutral_values_of_refused_parameters_are_accepted(client, tiny) -> None:
    text, _ = expected_text(tiny, PROMPTS[0], 6)
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, best_of=1,
                                  suffix="", logit_bias={}, extra_body={"min_p": 0.0, "tools": None})
    assert r.choices[0].text == text


@pytest.mark.parametrize("fields", [{"temperature": 1e-38}, {"temperature": 5e-324}, {"temperature": 1e-31},
                                    {"temperature": 1.0, "top_p": 1e-46}, {"temperature": 0.7, "top_p": 1e-38}])
def test_settings_that_underflow_in_float32_are_greedy(url, tiny, fields) -> None:
    # Sampling runs in float32: these once became 0 there, and the row sampled from NaN (empty text).
    text, ids = expected_text(tiny, PROMPTS[1], 12)
    for stream in (False, True):
        body = {"prompt": PROMPTS[1], "max_tokens": 12, "seed": 3, "stream": stream} | fields
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"] if not stream else "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
            if line.startswith("data: {"))
        assert got == text and text


def test_the_context_limit_is_max_model_len(url, tiny) -> None:
    room = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert room == 128 - NgramDrafter().max_drafts(3) - 1  # --max-context less the widest round + 1
    n = len(Tokenizer(tiny.folder).encode(PROMPTS[0]))
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": room - n, "temperature": 0})
    assert r.status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": room - n + 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"context of {room} tokens" in r.json()["error"]["message"]


def test_other_http_mistakes(url) -> None:
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("POST", "/v1/models", 405)]:
        r = httpx.request(method, url + path)
        assert r.status_code == status and "message" in r.json()["error"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "w1"}]})
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    big = "w1 " * (2 * 1024 * 1024)
    r = httpx.post(url + "/v1/completions", json={"prompt": big})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_models_health_metrics(url, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = httpx.get(url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["drafter"] == "ngram"
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    m = httpx.get(url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    values = metric_values(m.text)
    assert values["specdraft_generation_tokens_total"] >= 8
    assert values['specdraft_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["specdraft_mean_accepted_length"] >= 1.0
    assert values['specdraft_drafted_tokens_total{position="1"}'] >= values['specdraft_accepted_tokens_total{position="1"}']
    assert values['specdraft_phase_seconds_total{phase="verify"}'] > 0
    assert values["specdraft_batch_size"] == 0 and values["specdraft_queue_depth"] == 0


def metric_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class SlowEngine(Engine):
    """Steps take a while and EOS never comes: a request stays in flight as long as a test needs."""

    def add(self, req, group=None) -> None:
        req.eos_token_ids = []
        super().add(req, group)

    def step(self):
        time.sleep(0.02)
        return super().step()


def test_full_queue_is_429_and_a_disconnect_frees_the_row(tiny) -> None:
    model = served(tiny, max_batch_size=1, max_context=256)
    model.engine = SlowEngine(tiny.ours, model.tokenizer, None, max_batch_size=1, capacity=256)
    with running_server(model, max_queue=0) as u:
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", u + "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep the iterator: dropping it closes the stream
            assert next(lines).startswith("data: ")  # generating now
            r = httpx.post(u + "/v1/completions", json={"prompt": "w1", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        # The client went away mid-stream: its row is aborted and the server serves again.
        deadline = time.time() + 10
        while metric_values(httpx.get(u + "/metrics").text).get(
                'specdraft_finished_requests_total{reason="abort"}', 0) < 1:
            assert time.time() < deadline, "the disconnected request was never aborted"
            time.sleep(0.05)
        values = metric_values(httpx.get(u + "/metrics").text)
        assert values["specdraft_generation_tokens_total"] < 200
        assert values["specdraft_batch_size"] == 0  # updated by the abort itself, not the next request
        r = httpx.post(u + "/v1/completions", json={"prompt": "w1", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def wait_for_metric(url: str, name: str, at_least: float, timeout: float = 10) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        values = metric_values(httpx.get(url + "/metrics").text)
        if values.get(name, 0) >= at_least:
            return values
        assert time.time() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.05)


def test_a_non_streamed_request_whose_client_hangs_up_frees_its_row(tiny) -> None:
    model = served(tiny, max_batch_size=1, max_context=256)
    model.engine = SlowEngine(tiny.ours, model.tokenizer, None, max_batch_size=1, capacity=256)
    with running_server(model, max_queue=0) as u:
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", int(u.rsplit(":", 1)[1]))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for_metric(u, "specdraft_batch_size", 1)  # generating now
        values = wait_for_metric(u, 'specdraft_finished_requests_total{reason="abort"}', 1)
        assert values["specdraft_generation_tokens_total"] < 200
        assert metric_values(httpx.get(u + "/metrics").text)["specdraft_batch_size"] == 0
        r = httpx.post(u + "/v1/completions", json={"prompt": "w1", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200  # the row is free again (the batch holds one)


def test_api_key(tiny) -> None:
    with running_server(served(tiny), api_key="sekret") as u:
        assert httpx.get(u + "/health").status_code == 200  # health stays open for probes
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(u + "/v1/completions", json={"prompt": "w1", "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=u + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="w1", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=u + "/v1", api_key="nope", max_retries=0).models.list()
        # Non-ASCII credentials are a wrong key (401), not a crash in the comparison.
        r = httpx.post(u + "/v1/completions", json={"prompt": "w1"}, headers={"Authorization": "Bearer clé".encode()})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # Everything but /health and the page needs the key: metrics and the API's schema too.
        for path in ("/metrics", "/openapi.json", "/v1/models"):
            assert httpx.get(u + path).status_code == 401, path
            assert httpx.get(u + path, headers={"Authorization": "Bearer sekret"}).status_code == 200, path
        assert httpx.get(u + "/").status_code == 200
        schema = httpx.get(u + "/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
        assert "prompt" in schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]["properties"]


def test_chat_without_a_template_is_400(tmp_path) -> None:
    t = make_tiny(tmp_path / "plain", "llama", seed=42, max_position_embeddings=64)
    with running_server(served(t, max_context=64)) as u:
        r = httpx.post(u + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


@pytest.mark.slow
def test_real_model_smoke(real_runtime) -> None:
    """The default model with its shipped drafter (mtp+ngram): the server's text is the engine's."""
    from specdraft.drafters import load_drafter

    rt = real_runtime
    drafter, kind, k = load_drafter(rt, "auto", None, None)
    engine = Engine(rt.model, rt.tokenizer, drafter, k, max_batch_size=2, capacity=256)
    prompt = "def fibonacci(n):"
    want = Engine(rt.model, rt.tokenizer).generate([rt.tokenizer.encode(prompt)], 24)[0]
    with running_server(ServedModel("gemma3-270m", engine, rt.tokenizer, kind, k)) as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want.text
        assert r.model_extra["specdraft"]["drafter"] == "mtp+ngram"
