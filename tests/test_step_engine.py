"""The step-wise engine: requests join and leave between rounds (continuous batching), long
prompts prefill in chunks, aborts free rows, and a request's output never depends on its
neighbours: 16 concurrent greedy requests (fp32) equal the same requests one at a time, token
for token, with every drafter kind; seeded sampling gives the same tokens alone or in company.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import TinyModel, load_ours, make_tiny, prompts_of
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp_lookup import MTPWithLookup
from specdraft.drafters.ngram import NgramDrafter
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request

LENGTHS = [3, 40, 7, 90, 1, 25, 60, 12, 5, 33, 70, 2, 18, 50, 9, 100]
MAX_NEW = [5, 30, 12, 8, 25, 3, 18, 30, 1, 22, 9, 30, 14, 6, 27, 11]


@pytest.fixture(scope="module")
def prompts(gemma_tiny: TinyModel) -> list[list[int]]:
    ps = prompts_of(LENGTHS, gemma_tiny.cfg.vocab_size, seed=7)
    # Repeats inside the prompts give prompt lookup something to find.
    return [p + p[: len(p) // 2] if len(p) > 10 else p for p in ps]


@pytest.fixture(scope="module")
def make_drafter(gemma_tiny: TinyModel, tmp_path_factory):
    target = gemma_tiny.ours
    folder = tmp_path_factory.mktemp("step_drafters") / "mtp"
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head="target", clustered=True,
                             num_centroids=16, top_k_clusters=4)
    save_network(init_network(cfg, target, seed=3, std=0.1), folder)
    noisy, _ = load_ours(gemma_tiny.folder)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.mul_(1 + torch.randn(p.shape, generator=gen) * 0.07)

    def make(name: str):
        if name == "none":
            return None
        if name == "ngram":
            return NgramDrafter()
        if name == "draft-model":
            return DraftModelDrafter(noisy)
        mtp = load_mtp_drafter(folder, target, torch.float32, "cpu")
        return MTPWithLookup(mtp) if name == "mtp+ngram" else mtp

    return make


def run_concurrently(engine: Engine, requests: list[Request], joins: dict[int, int] | None = None) -> dict:
    """Step until all are done; requests[i] is added before step joins.get(i, 0)."""
    joins = joins or {}
    done, step = {}, 0
    pending = list(range(len(requests)))
    while pending or engine.has_work():
        for i in [i for i in pending if joins.get(i, 0) <= step]:
            engine.add(requests[i])
            pending.remove(i)
        for r in engine.step():
            done[r.request_id] = r
        step += 1
        assert step < 10_000
    return done


@pytest.mark.parametrize("name", ["none", "ngram", "mtp", "mtp+ngram", "draft-model"])
def test_sixteen_concurrent_greedy_requests_equal_one_at_a_time(name, gemma_tiny, prompts, make_drafter) -> None:
    k = 3
    alone = Engine(gemma_tiny.ours, None, make_drafter(name), k)
    expected = [alone.generate([p], m, eos_token_ids=[])[0].token_ids for p, m in zip(prompts, MAX_NEW)]
    # 8 rows for 16 requests, a small prefill chunk, staggered arrivals: requests queue, join
    # as others finish, prefill in several chunks while others decode, and rows get compacted.
    engine = Engine(gemma_tiny.ours, None, make_drafter(name), k, max_batch_size=8, capacity=256, prefill_chunk=16)
    requests = [Request(p, m, eos_token_ids=[]) for p, m in zip(prompts, MAX_NEW)]
    done = run_concurrently(engine, requests, joins={i: (i % 5) * 2 for i in range(16)})
    got = [done[r.id].token_ids for r in requests]
    assert got == expected
    assert all(done[r.id].finish_reason == "length" for r in requests)
    assert not engine.has_work() and engine.num_running == 0
    # And plain decoding agrees (fp32 speculative greedy is exact).
    if name != "none":
        plain = Engine(gemma_tiny.ours)
        assert got == [plain.generate([p], m, eos_token_ids=[])[0].token_ids for p, m in zip(prompts, MAX_NEW)]


def test_sources_and_stats_add_up(gemma_tiny, prompts, make_drafter) -> None:
    """Per token, its source: one 'target' per target forward, the rest accepted drafts."""
    engine = Engine(gemma_tiny.ours, None, make_drafter("mtp+ngram"), 3, max_batch_size=4)
    seen: dict[int, list[str]] = {}
    requests = []
    for i, (p, m) in enumerate(zip(prompts[:6], MAX_NEW[:6])):
        requests.append(Request(p, m, eos_token_ids=[],
                                on_tokens=lambda ids, src, i=i: seen.setdefault(i, []).extend(src)))
    done = run_concurrently(engine, requests)
    kinds = set()
    for i, r in enumerate(requests):
        res, src = done[r.id], seen[i]
        assert len(src) == len(res.token_ids)
        assert src.count("target") == res.stats.target_forwards
        assert len(src) - src.count("target") == res.stats.accepted
        assert set(src) <= {"target", "mtp", "lookup"}
        kinds |= set(src)
    assert "lookup" in kinds


def test_long_prompt_prefills_in_chunks_without_stalling(gemma_tiny, prompts) -> None:
    engine = Engine(gemma_tiny.ours, None, None, max_batch_size=2, prefill_chunk=16)
    emitted: list[int] = []
    short = Request(prompts[0], 40, eos_token_ids=[], on_tokens=lambda ids, src: emitted.append(len(ids)))
    engine.add(short)
    engine.step()
    long_prompt = prompts_of([150], gemma_tiny.cfg.vocab_size, seed=9)[0]
    first: list[int] = []
    long = Request(long_prompt, 4, eos_token_ids=[], on_tokens=lambda ids, src: first.append(len(ids)))
    engine.add(long)
    steps = 0
    while not first:
        before = len(emitted)
        engine.step()
        steps += 1
        assert len(emitted) == before + 1, "the decoding request must emit every step while the other prefills"
    assert steps == -(-150 // 16)  # one chunk of the long prompt per step


def test_generate_reports_the_prefill_as_it_goes(gemma_tiny) -> None:
    """on_prefill(done, total): after steps that prefilled, counts rising to the total, reached once."""
    long_prompts = prompts_of([150, 40], gemma_tiny.cfg.vocab_size, seed=10)
    calls: list[tuple[int, int]] = []
    engine = Engine(gemma_tiny.ours, None, None, max_batch_size=2, prefill_chunk=16)
    out = engine.generate(long_prompts, 3, eos_token_ids=[], on_prefill=lambda d, t: calls.append((d, t)))
    assert all(t == 190 for _, t in calls) and calls[-1] == (190, 190)
    done = [d for d, _ in calls]
    assert done == sorted(set(done)) and len(calls) >= 2
    assert [r.token_ids for r in out] == [r.token_ids for r in Engine(gemma_tiny.ours).generate(
        long_prompts, 3, eos_token_ids=[])]


def test_abort_frees_the_row_and_others_continue(gemma_tiny, prompts) -> None:
    plain = Engine(gemma_tiny.ours)
    expected = [plain.generate([p], 20, eos_token_ids=[])[0].token_ids for p in prompts[:3]]
    engine = Engine(gemma_tiny.ours, None, NgramDrafter(), 3, max_batch_size=3)
    reqs = [Request(p, 20, eos_token_ids=[]) for p in prompts[:3]]
    for r in reqs:
        engine.add(r)
    done = {}
    for _ in range(3):
        done.update((r.request_id, r) for r in engine.step())
    assert engine.num_running == 3
    aborted = engine.abort(reqs[0].id)
    assert aborted.finish_reason == "abort" and aborted.token_ids == expected[0][: len(aborted.token_ids)]
    assert engine.num_running == 2
    assert engine.abort(reqs[0].id) is None  # gone
    waiting = Request(prompts[3], 5, eos_token_ids=[])
    engine.add(waiting)
    assert engine.abort(waiting.id).finish_reason == "abort"  # aborted while queued
    while engine.has_work():
        done.update((r.request_id, r) for r in engine.step())
    assert [done[r.id].token_ids for r in reqs[1:]] == expected[1:]


def test_seeded_sampling_is_the_same_alone_and_in_company(gemma_tiny, prompts, make_drafter) -> None:
    """At a fixed width, a seeded request's tokens do not depend on other requests sampling with
    the same settings (each row's drafts and verdicts draw from its own stream, and only while it
    drafts). Among greedy or differently filtered requests its drafts fall back to argmax ones
    (one Q cannot serve them all): the same law (tests/test_sampling_exact.py), other tokens."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    drafter = make_drafter("mtp+ngram")

    def alone(seed_params):
        engine = Engine(gemma_tiny.ours, None, drafter, 3)
        return run_concurrently(engine, [req := Request(prompts[5], 25, seed_params, eos_token_ids=[])])[req.id]

    a = alone(params)
    assert a.seed == 1234
    engine = Engine(gemma_tiny.ours, None, drafter, 3, max_batch_size=6)
    others = [Request(p, 25, replace(params, seed=i), eos_token_ids=[]) for i, p in enumerate(prompts[:3])]
    others += [Request(p, 25, replace(params, seed=10 + i), eos_token_ids=[]) for i, p in enumerate(prompts[6:8])]
    mine = Request(prompts[5], 25, params, eos_token_ids=[])
    done = run_concurrently(engine, others + [mine], joins={len(others): 2})
    assert done[mine.id].token_ids == a.token_ids
    assert alone(SamplingParams(temperature=1.0, top_p=0.95, seed=1235)).token_ids != a.token_ids


def count_head_passes(monkeypatch) -> list[int]:
    """Rows per pass over the head's table (every greedy, logits or mixed call goes through
    models.architectures.target.head_scores when there is no screened head), appended as they happen."""
    from specdraft.models.architectures import target

    scored, inner = [], target.head_scores

    def counting(model, hidden):
        scored.append(hidden.shape[:-1].numel())
        return inner(model, hidden)

    monkeypatch.setattr(target, "head_scores", counting)
    return scored


def test_sampled_requests_in_company_share_one_head_pass(gemma_tiny, prompts, monkeypatch) -> None:
    """Three sampled requests, each its own random stream: a decoding round scores their first
    block of positions in one head call over all three rows, not one call per request."""
    scored = count_head_passes(monkeypatch)
    requests = [Request(p, 24, SamplingParams(temperature=1.0, seed=i), eos_token_ids=[]) for i, p in enumerate(prompts[:3])]
    done = run_concurrently(Engine(gemma_tiny.ours, None, None, 3), requests)
    assert all(len(done[r.id].token_ids) == 24 for r in requests)
    assert scored.count(3) >= 20 and scored.count(1) <= 3  # one shared call a round (1-row calls: prefills)


def test_greedy_and_sampled_requests_share_one_head_pass_and_keep_their_tokens(gemma_tiny, prompts,
                                                                                monkeypatch) -> None:
    """Two greedy and two sampled requests decoding together: one head call a round for all four
    rows (the greedy rows' argmax from the same scores), and each request's tokens are those it
    gets alone (greedy: the same argmax; sampled: the same logits and stream)."""
    model = gemma_tiny.ours
    requests = [Request(p, 20, eos_token_ids=[]) for p in prompts[:2]]
    requests += [Request(p, 20, SamplingParams(temperature=1.0, seed=i), eos_token_ids=[])
                 for i, p in enumerate(prompts[2:4])]
    alone = [run_concurrently(Engine(model, None, None, 3), [r])[r.id].token_ids for r in requests]
    scored = count_head_passes(monkeypatch)
    together = run_concurrently(Engine(model, None, None, 3), requests)
    assert [together[r.id].token_ids for r in requests] == alone
    assert scored.count(4) >= 15 and scored.count(2) == 0  # one pass a round, never a greedy/sampled pair


def test_unseeded_sampling_leaves_the_global_rng_alone_and_reports_its_seed(gemma_tiny, prompts) -> None:
    engine = Engine(gemma_tiny.ours, None, NgramDrafter(), 3)
    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)
    r = engine.generate([prompts[1]], 12, SamplingParams(temperature=1.0), eos_token_ids=[])[0]
    assert torch.initial_seed() == 99 and torch.equal(torch.rand(3), expected_next)
    assert isinstance(r.seed, int)
    again = engine.generate([prompts[1]], 12, SamplingParams(temperature=1.0, seed=r.seed), eos_token_ids=[])[0]
    assert again.token_ids == r.token_ids


def test_request_checks(gemma_tiny) -> None:
    engine = Engine(gemma_tiny.ours, None, NgramDrafter(), 3, capacity=64)
    with pytest.raises(SpecdraftError, match="engine's context of 60 tokens"):
        engine.add(Request([5] * 50, 20))
    with pytest.raises(SpecdraftError, match="max_new_tokens"):
        engine.add(Request([5], 0))
    with pytest.raises(SpecdraftError, match="empty"):
        engine.add(Request([], 3))
    engine.add(Request([5] * 40, 20))
    with pytest.raises(SpecdraftError, match="idle engine"):
        engine.generate([[5]], 2)


class CountingTokenizer:
    """Wraps a tokenizer, counting the ids each decode call reads."""

    def __init__(self, inner):
        self.inner, self.eos_token_ids, self.calls = inner, [], []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def test_stop_strings_cost_the_same_per_token_at_the_end_as_at_the_start(tmp_path) -> None:
    from specdraft.tokenizer import Tokenizer

    tiny = make_tiny(tmp_path / "long", "llama", seed=21, max_position_embeddings=4200)
    tok = CountingTokenizer(Tokenizer(tiny.folder))
    n = 4000
    per_token: list[int] = []

    def on_tokens(row, ids):
        per_token.extend([len(tok.calls)] * len(ids))  # decode calls made so far, per new token

    # Stop strings that never occur (checked after every token, to the end).
    engine = Engine(tiny.ours, tok, NgramDrafter(), 3)
    calls_before = len(tok.calls)
    r = engine.generate([tok.inner.encode("w1 w2 w3")], n, stop=("zzz", "qq q"), eos_token_ids=[], on_tokens=on_tokens)[0]
    assert len(r.token_ids) == n and r.finish_reason == "length"
    ids_read = tok.calls[calls_before:]
    # One decode per new token (plus one for the final text), each of a bounded window.
    assert len(ids_read) == n + 1
    first, last = ids_read[:500], ids_read[n - 500 : n]
    assert sum(last) <= sum(first) + 500 * 4
    assert max(ids_read[:n]) <= 4 * len("qq q") + 8


class CheckedLookup(NgramDrafter):
    """Prompt lookup whose incremental index is checked every round against a fresh one, so
    rows moving between slots (compaction, prefill swaps) must carry their index along."""

    rounds = 0

    def propose(self, inp, k, sampling, generator):
        from specdraft.drafters.lookup_index import LookupIndex
        from specdraft.drafters.ngram import prompt_lookup

        got = super().propose(inp, k, sampling, generator)
        ref = prompt_lookup(inp.tokens, inp.position + 2, inp.active, k, LookupIndex(self.min_ngram, self.max_ngram))
        assert torch.equal(got.num_valid, ref.num_valid)
        valid = torch.arange(got.tokens.shape[1])[None, :] < got.num_valid[:, None]
        assert torch.equal(got.tokens[valid], ref.drafts[:, : got.tokens.shape[1]][valid])
        CheckedLookup.rounds += 1
        return got


def test_lookup_index_follows_rows_as_they_move(gemma_tiny, prompts) -> None:
    engine = Engine(gemma_tiny.ours, None, CheckedLookup(), 3, max_batch_size=5, prefill_chunk=16)
    requests = [Request(p, m, eos_token_ids=[]) for p, m in zip(prompts, MAX_NEW)]
    run_concurrently(engine, requests, joins={i: i % 4 for i in range(16)})
    assert CheckedLookup.rounds > 20


def test_generate_json_reports_the_seed_that_repeats_the_run(capsys, tmp_path) -> None:
    import json

    from specdraft.cli.main import main

    folder = make_tiny(tmp_path / "cli", "llama", seed=31, max_position_embeddings=64).folder
    args = ["generate", "w1 w2 w3", "--model", str(folder), "--dtype", "float32", "--device", "cpu",
            "--drafter", "ngram", "--max-new-tokens", "12", "--temperature", "1.0", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert isinstance(first["seed"], int)
    assert main(args + ["--seed", str(first["seed"])]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["seed"] == first["seed"] and again["token_ids"] == first["token_ids"]
    assert main(args[:-3] + ["--json"]) == 0  # greedy without a seed: none to report
    assert json.loads(capsys.readouterr().out)["seed"] is None


def test_greedy_and_sampled_requests_in_company_behind_the_screened_head(tmp_path, monkeypatch) -> None:
    """--weights gguf: the float32 model's screened head finds greedy tokens without scores, so a
    mixed round takes two head calls there; requests still get their tokens alone, sampled-only
    rounds included."""
    from test_gguf_weights import write_quantised_gguf
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(write_quantised_gguf(tmp_path / "tiny.gguf", "Q8_0")), dtype="float32", weights="gguf",
                      progress=False)
    assert rt.model.screened_head is not None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, rt.config.vocab_size, (8,), generator=gen).tolist() for _ in range(4)]
    for greedy in (2, 0):
        def requests():
            return [Request(p, 12, SamplingParams() if i < greedy else SamplingParams(temperature=1.0, seed=i),
                            eos_token_ids=[]) for i, p in enumerate(prompts)]
        alone = [run_concurrently(Engine(rt.model, None, None, 3), [r])[r.id].token_ids for r in requests()]
        reqs = requests()
        together = run_concurrently(Engine(rt.model, None, None, 3), reqs)
        assert [together[r.id].token_ids for r in reqs] == alone
