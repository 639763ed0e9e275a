"""`specdraft serve` with the MTP drafter in place, under faults in drafting, tokenizing,
detokenizing and the streaming callback: the request concerned fails in OpenAI's error shape
(500, or an error event then [DONE] when streamed), and afterwards a fresh request gets what a
fresh server gives it: the same text and the same speculative statistics. Text alone could
not tell a drafter left in a stale state after the engine's reset (greedy output is exact
whatever is drafted); its acceptance counts can.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from test_server import PROMPTS, metric_values, served, serving, tiny, wait_for_metric  # noqa: E402
from test_server_faults import assert_internal_error, complete, run_in_thread  # noqa: E402
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network  # noqa: E402
from specdraft.serve import create_app, prepare  # noqa: E402
from specdraft.serve import worker as serve_worker  # noqa: E402
from specdraft.serve.text import TextStream  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402

__all__ = ["tiny"]  # the module-scoped fixture, shared

K = 3
PROBES = [(PROMPTS[2], 16), (PROMPTS[5], 16)]  # (prompt, max tokens) asked after each fault


@pytest.fixture(scope="module")
def mtp_folder(tiny, tmp_path_factory):
    """A random MTP drafter for the tiny target with its copy gate open (as in test_engine.py):
    it drafts every round, and its copies of the text are accepted where the text repeats."""
    cfg = drafter_config_for(tiny.ours, hidden=32, layers=2, heads=4, head="target", clustered=True,
                             num_centroids=16, top_k_clusters=4)
    cfg.copy_gate = True
    net = init_network(cfg, tiny.ours, seed=3, std=0.1)
    with torch.no_grad():
        net.copy_gate.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        net.copy_gate.proj.bias.fill_(3.0)
    folder = tmp_path_factory.mktemp("mtp")
    save_network(net, folder)
    return folder


def mtp_model(tiny, folder, max_batch_size: int = 4):
    drafter = load_mtp_drafter(folder, tiny.ours, torch.float32, "cpu")
    return served(tiny, drafter, K, max_batch_size=max_batch_size, max_context=256)


def answers(url: str) -> list[tuple[str, dict]]:
    """Text and speculative statistics of the probe requests, one at a time."""
    out = []
    for prompt, n in PROBES:
        r = complete(url, prompt, n)
        assert r.status_code == 200, r.text
        out.append((r.json()["choices"][0]["text"], counts(r.json()["specdraft"])))
    return out


def counts(ext: dict) -> dict:
    """The `specdraft` extension without its times."""
    return {k: v for k, v in ext.items() if k not in ("ttft", "seconds")}


@pytest.fixture(scope="module")
def fresh(tiny, mtp_folder) -> list[tuple[str, dict]]:
    """What a fresh server with a fresh drafter answers the probes."""
    model = mtp_model(tiny, mtp_folder)
    with serving(create_app(lambda: model)) as (u, _):
        got = answers(u)
    stats = [ext for _, ext in got]
    assert all(ext["drafter"] == "mtp" for ext in stats)
    assert sum(ext["drafted"] for ext in stats) > 0 and sum(ext["accepted"] for ext in stats) > 0
    return got


def assert_answers_like_a_fresh_server(url: str, fresh) -> None:
    assert answers(url) == fresh
    assert httpx.get(url + "/health").json()["status"] == "ok"
    values = metric_values(httpx.get(url + "/metrics").text)
    assert values["specdraft_batch_size"] == 0 and values["specdraft_queue_depth"] == 0


def once(fn, armed: list[int], what: str):
    """`fn`, failing with RuntimeError while armed[0] > 0 (each failure disarms one)."""
    def wrapped(*args, **kwargs):
        if armed[0] > 0:
            armed[0] -= 1
            raise RuntimeError(f"injected fault in {what}")
        return fn(*args, **kwargs)
    return wrapped


def error_of(r: httpx.Response, stream: bool) -> dict:
    """The OpenAI error a failed request got: the body's, or the stream's last event before [DONE]."""
    if not stream:
        assert r.status_code == 500, r.text
        return r.json()["error"]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text
    return json.loads(events[-2])["error"]


# Where a fault is injected: (what to patch, how the request reports it).
FAULTS = ["draft", "tokenize", "detokenize", "stream-detokenize", "stream-callback"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_fails_its_request_and_the_next_ones_equal_a_fresh_servers(tiny, mtp_folder, fresh, fault,
                                                                           monkeypatch) -> None:
    model = mtp_model(tiny, mtp_folder)
    armed = [0]
    stream = fault.startswith("stream")
    if fault == "draft":  # the MTP drafter's propose, mid-step: the engine is reset
        drafter = model.engine.drafter
        drafter.propose = once(drafter.propose, armed, "drafting")
    elif fault == "tokenize":  # the prompt's encoding, off the event loop
        monkeypatch.setattr(prepare, "encode", once(prepare.encode, armed, "tokenizing"))
    elif fault == "detokenize":  # the engine's final text of a request
        monkeypatch.setattr(Tokenizer, "decode", once(Tokenizer.decode, armed, "detokenizing"))
    elif fault == "stream-detokenize":  # the streamed text's increments, on the event loop
        monkeypatch.setattr(TextStream, "push", once(TextStream.push, armed, "detokenizing"))
    else:  # the engine's on_tokens callback handing tokens to a streamed request
        real_put = serve_worker.Sink.put
        monkeypatch.setattr(serve_worker.Sink, "put", lambda self, *event: (
            once(real_put, armed, "the stream callback") if event[0] == "tokens" else real_put)(self, *event))
    with serving(create_app(lambda: model)) as (u, _):
        assert_answers_like_a_fresh_server(u, fresh)  # the drafter has drafted before the fault
        armed[0] = 1
        r = complete(u, PROMPTS[3], 24, stream=stream)
        assert armed[0] == 0, "the fault was never reached"
        err = error_of(r, stream)
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "server_error" and err["code"] == "internal_error", err
        assert_answers_like_a_fresh_server(u, fresh)


def test_a_drafting_fault_with_a_request_queued_keeps_the_queue_and_its_drafts(tiny, mtp_folder, fresh,
                                                                               monkeypatch) -> None:
    """One row: A decodes, a probe waits in the queue. The drafter fails mid-batch: A fails, the
    engine and the drafter are reset, and the queued probe then runs as on a fresh server,
    acceptance counts included."""
    model = mtp_model(tiny, mtp_folder, max_batch_size=1)
    armed = [0]
    drafter = model.engine.drafter
    drafter.propose = once(drafter.propose, armed, "drafting")
    real_add = model.engine.add

    def add_long(req, group=None):  # A never meets EOS: it stays in flight while the probe queues
        if req.max_new_tokens >= 100:
            req.eos_token_ids = []
        real_add(req, group)

    model.engine.add = add_long
    real_step = model.engine.step
    model.engine.step = lambda: (time.sleep(0.02), real_step())[1]  # paced: the probe queues while A runs
    with serving(create_app(lambda: model)) as (u, _):
        a, a_out = run_in_thread(complete, u, PROMPTS[0], 200)
        wait_for_metric(u, "specdraft_batch_size", 1)
        (prompt, n), want = PROBES[0], fresh[0]
        b, b_out = run_in_thread(complete, u, prompt, n)
        wait_for_metric(u, "specdraft_queue_depth", 1)
        armed[0] = 1
        a.join(60), b.join(60)
        assert armed[0] == 0
        assert_internal_error(a_out[0], "generating")
        assert b_out[0].status_code == 200
        assert (b_out[0].json()["choices"][0]["text"], counts(b_out[0].json()["specdraft"])) == want
        assert_answers_like_a_fresh_server(u, fresh)



def test_negative_control_a_changed_drafter_gives_the_same_text_and_other_counts(tiny, mtp_folder, fresh) -> None:
    """Why the check compares acceptance counts: a drafter left in another state (here its copy
    gate closed) gives the same text, which greedy verification guarantees, but other counts."""
    model = mtp_model(tiny, mtp_folder)
    with torch.no_grad():
        model.engine.drafter.net.copy_gate.proj.bias.fill_(-3.0)
    with serving(create_app(lambda: model)) as (u, _):
        got = answers(u)
    assert [text for text, _ in got] == [text for text, _ in fresh]
    with pytest.raises(AssertionError):
        assert got == fresh
