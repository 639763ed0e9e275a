"""A request may ask for no drafting ("speculative": false in a server request, Request.speculative):
the same output, and the drafter is never asked for its rows."""

from __future__ import annotations

import pytest

from conftest import prompts_of
from specdraft.drafters.ngram import NgramDrafter
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request


class CountingDrafter(NgramDrafter):
    """Prompt lookup that counts the rows it was asked to draft for."""

    def __init__(self):
        super().__init__()
        self.rows_asked = 0

    def propose(self, inp, k, sampling, generator):
        self.rows_asked += int(inp.active.sum())
        return super().propose(inp, k, sampling, generator)


def run(tiny, requests: list[Request], drafter) -> dict[int, list[int]]:
    engine = Engine(tiny.ours, None, drafter, 3, max_batch_size=4, capacity=96)
    for r in requests:
        engine.add(r)
    done = {}
    while engine.has_work():
        done.update({r.request_id: r for r in engine.step()})
    return done


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny

    return make_tiny(tmp_path_factory.mktemp("switch") / "tiny", "llama", seed=41, max_position_embeddings=128)


def test_a_request_that_asks_for_no_drafting_gets_none_and_the_same_output(tiny):
    # Repeating prompts, so that prompt lookup has something to draft (the negative control).
    prompts = [p * 3 for p in prompts_of([4, 5, 6], tiny.cfg.vocab_size, seed=3)]
    plain = Engine(tiny.ours).generate(prompts, 24, eos_token_ids=[])
    drafter = CountingDrafter()
    reqs = [Request(p, 24, eos_token_ids=[], speculative=i != 1) for i, p in enumerate(prompts)]
    done = run(tiny, reqs, drafter)
    assert [done[r.id].token_ids for r in reqs] == [r.token_ids for r in plain]
    assert sum(done[reqs[1].id].stats.drafted_by_position) == 0
    assert sum(sum(done[r.id].stats.drafted_by_position) for r in (reqs[0], reqs[2])) > 0
    alone = CountingDrafter()
    done = run(tiny, [Request(prompts[0], 24, eos_token_ids=[], speculative=False)], alone)
    assert alone.rows_asked == 0 and next(iter(done.values())).token_ids == plain[0].token_ids


def test_the_server_switch(tiny):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from test_server import running_server, served

    with running_server(served(tiny, NgramDrafter())) as url:
        body = {"model": "tiny", "prompt": "w5 w6 w5 w6 w5 w6 w5", "max_tokens": 16, "temperature": 0}
        on = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        off = httpx.post(url + "/v1/completions", json=body | {"speculative": False}, timeout=60).json()
        bad = httpx.post(url + "/v1/completions", json=body | {"speculative": "no"}, timeout=60)
    assert off["choices"][0]["text"] == on["choices"][0]["text"]
    assert off["specdraft"]["drafted"] == 0 and on["specdraft"]["drafted"] > 0
    assert bad.status_code == 400
