"""`specdraft serve` under injected faults and at shutdown: an error at any stage of the
engine's thread (add, allocation, step, abort, delivering a result) fails only the requests it
concerns, in OpenAI's error shape, and the next requests are answered exactly as before; an
engine that cannot be reset makes /health say so (503) and the server exit non-zero. On
SIGTERM requests in flight get the drain's time, then a 503 error; short ones finish.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")
httpx = pytest.importorskip("httpx")

from test_server import (PROMPTS, SlowEngine, expected_text, metric_values, served, serving,  # noqa: E402
                         tiny, wait_for_metric)
from specdraft.serve import create_app  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

__all__ = ["tiny"]  # the module-scoped fixture, shared


class FaultyEngine(Engine):
    """Raises once per armed count at a stage: faults["step"] = 1 fails the next step. `slow`:
    steps take 20 ms, and requests for 100 tokens or more never meet EOS (they stay in flight)."""

    def __init__(self, *args, slow: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults: dict[str, int] = {}
        self.slow = slow

    def _maybe_fail(self, stage: str) -> None:
        if self.faults.get(stage, 0) > 0:
            self.faults[stage] -= 1
            raise (MemoryError if stage == "allocate" else RuntimeError)(f"injected fault at {stage}")

    def add(self, req, group=None) -> None:
        self._maybe_fail("add")
        if self.slow and req.max_new_tokens >= 100:
            req.eos_token_ids = []
        super().add(req, group)

    def _allocate(self, rows, capacity, longest_prompt) -> None:
        self._maybe_fail("allocate")
        super()._allocate(rows, capacity, longest_prompt)

    def step(self):
        if self.slow:
            time.sleep(0.02)
        return super().step()

    def _round(self) -> None:  # mid-step: the rows are in the cache by now
        self._maybe_fail("step")
        super()._round()

    def abort(self, request_id):
        self._maybe_fail("abort")
        return super().abort(request_id)

    def reset(self):
        self._maybe_fail("reset")
        return super().reset()


def faulty(tiny, slow: bool = False, max_batch_size: int = 4):
    model = served(tiny, max_batch_size=max_batch_size, max_context=256)
    model.engine = FaultyEngine(tiny.ours, model.tokenizer, None, max_batch_size=max_batch_size, capacity=256,
                                slow=slow)
    return model


def complete(url: str, prompt: str = PROMPTS[0], n: int = 8, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0} | extra,
                      timeout=15)


def assert_internal_error(r: httpx.Response, words: str) -> None:
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["code"] == "internal_error" and words in err["message"], err


def assert_serves_normally(url: str, tiny) -> None:
    for prompt in PROMPTS[:2]:
        r = complete(url, prompt)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text(tiny, prompt, 8)[0]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    values = metric_values(httpx.get(url + "/metrics").text)
    assert values["specdraft_batch_size"] == 0 and values["specdraft_queue_depth"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("stage,words", [("add", "admitting"), ("allocate", "admitting"), ("step", "generating")])
def test_a_fault_fails_its_request_and_the_server_goes_on(tiny, stage, words, stream) -> None:
    model = faulty(tiny)
    with serving(create_app(lambda: model)) as (u, _):
        model.engine.faults[stage] = 1  # the first request allocates the cache
        r = complete(u, stream=stream)
        if not stream:
            assert_internal_error(r, words)
        else:  # an error event, then [DONE]
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "internal_error" and words in err["message"]
        assert model.engine.faults[stage] == 0
        assert_serves_normally(u, tiny)


def test_a_fault_delivering_a_result_fails_that_request_only(tiny) -> None:
    model = faulty(tiny)
    app = create_app(lambda: model)
    with serving(app) as (u, _):
        metrics = app.state.specdraft.metrics
        real, calls = metrics.observe_result, []

        def fail_once(result):
            calls.append(result)
            if len(calls) == 1:
                raise RuntimeError("injected fault at finish")
            real(result)

        metrics.observe_result = fail_once
        assert_internal_error(complete(u), "finishing")
        assert_serves_normally(u, tiny)


def run_in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def test_a_failed_step_fails_the_batch_and_keeps_the_queue(tiny) -> None:
    # One row: A decodes, B waits in the engine's queue. The step fault concerns A only.
    model = faulty(tiny, slow=True, max_batch_size=1)
    with serving(create_app(lambda: model)) as (u, _):
        a, a_out = run_in_thread(complete, u, PROMPTS[0], 200)
        wait_for_metric(u, "specdraft_batch_size", 1)
        b, b_out = run_in_thread(complete, u, PROMPTS[1], 10)
        wait_for_metric(u, "specdraft_queue_depth", 1)
        model.engine.faults["step"] = 1
        a.join(30), b.join(30)
        assert_internal_error(a_out[0], "generating")
        assert b_out[0].status_code == 200
        assert b_out[0].json()["choices"][0]["text"] == expected_text(tiny, PROMPTS[1], 10)[0]
        assert_serves_normally(u, tiny)


def test_a_failed_abort_frees_everything_and_keeps_the_queue(tiny) -> None:
    model = faulty(tiny, slow=True, max_batch_size=1)
    with serving(create_app(lambda: model)) as (u, _):
        b = None
        with httpx.Client(timeout=30) as c, c.stream("POST", u + "/v1/completions", json={
                "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # decoding
            b, b_out = run_in_thread(complete, u, PROMPTS[1], 10)
            wait_for_metric(u, "specdraft_queue_depth", 1)
            model.engine.faults["abort"] = 1
        b.join(30)  # the hang-up's abort failed: the engine was reset, the queued request went on
        assert model.engine.faults["abort"] == 0
        assert b_out[0].status_code == 200
        assert b_out[0].json()["choices"][0]["text"] == expected_text(tiny, PROMPTS[1], 10)[0]
        assert_serves_normally(u, tiny)


def test_an_engine_that_cannot_recover_says_so_and_stops(tiny) -> None:
    model = faulty(tiny)
    app = create_app(lambda: model)
    reasons: list[str] = []
    with serving(app) as (u, _):
        app.state.specdraft.on_fatal = reasons.append
        model.engine.faults.update(step=1, reset=1)
        assert_internal_error(complete(u), "engine failed")
        health = httpx.get(u + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "could not be reset" in health.json()["error"] and len(reasons) == 1
        r = complete(u)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def test_repeated_engine_errors_end_in_a_restart(tiny) -> None:
    model = faulty(tiny)
    app = create_app(lambda: model)
    reasons: list[str] = []
    with serving(app) as (u, _):
        app.state.specdraft.on_fatal = reasons.append
        model.engine.faults["step"] = 3  # three failures with no good step between them
        for _ in range(3):
            assert complete(u).status_code == 500
        assert httpx.get(u + "/health").status_code == 503 and "3 engine errors in a row" in reasons[0]


def test_the_server_exits_non_zero_when_the_engine_gives_up(tiny) -> None:
    from specdraft.serve.server import Server

    model = faulty(tiny)
    with serving(create_app(lambda: model), lambda app, port: Server(app, "127.0.0.1", port, 5)) as (u, server):
        model.engine.faults.update(step=1, reset=1)
        assert complete(u).status_code == 500
        deadline = time.time() + 10
        while not server.started or not server.should_exit:
            assert time.time() < deadline, "the server did not begin to stop"
            time.sleep(0.05)
        assert server.exit_status == 1


def test_sigterm_drains_then_aborts_what_is_left(tiny) -> None:
    from specdraft.serve.server import Server

    model = served(tiny, max_batch_size=4, max_context=256)
    model.engine = SlowEngine(tiny.ours, model.tokenizer, None, max_batch_size=4, capacity=256)
    app = create_app(lambda: model)
    drain = 1.0
    with serving(app, lambda a, port: Server(a, "127.0.0.1", port, drain)) as (u, server):
        long_streamed = httpx.Client(timeout=30).stream("POST", u + "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 250, "temperature": 0, "stream": True})
        response = long_streamed.__enter__()
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        long_plain, long_out = run_in_thread(complete, u, PROMPTS[1], 250)
        short, short_out = run_in_thread(complete, u, PROMPTS[2], 10)
        wait_for_metric(u, "specdraft_batch_size", 3)
        t0 = time.monotonic()  # only a lower bound below: load can lengthen the drain, never shorten it
        server.handle_exit(signal.SIGTERM, None)
        assert app.state.specdraft.health() == (503, {"status": "draining"})
        rest = [line for line in lines if line]
        long_streamed.__exit__(None, None, None)
        long_plain.join(30), short.join(30)
        took = time.monotonic() - t0
        assert short_out[0].status_code == 200 and short_out[0].json()["usage"]["completion_tokens"] == 10
        err = long_out[0].json()["error"]
        assert long_out[0].status_code == 503 and err["code"] == "shutting_down" and "1 s drain" in err["message"]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
        # The drain's end shows in what each request got (the long ones 503, the short one done),
        # not in an upper time bound a loaded machine could break.
        assert took >= drain
    assert server.exit_status == 0
