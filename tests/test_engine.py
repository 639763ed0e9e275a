"""The speculative engine in greedy fp32: output identical to plain decoding, token for token,
for every drafter kind, K, batch size, with ragged prompts, EOS mid-batch and the length limit
reached mid-round; an oracle drafter reaches tau = K + 1; the statistics add up.

Target: the tiny Gemma 3 model (sliding window 8, so every run goes past the window).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TinyModel, OracleDrafter, load_ours, prompts_of
from specdraft.drafters.base import DraftInput
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.drafters.mtp_lookup import MTPWithLookup
from specdraft.drafters.ngram import NgramDrafter
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine

MAX_NEW = 30
LENGTHS = {1: [9], 3: [4, 13, 1], 8: [6, 2, 15, 9, 1, 11, 4, 7]}
KS = [1, 3, 7]
DRAFTERS = ["ngram", "draft-model-self", "draft-model-noisy", "mtp-dense-own", "mtp-dense-target",
            "mtp-clustered-own", "mtp-clustered-target", "mtp+ngram", "oracle-noisy", "mtp-early-stop",
            "mtp-early-stop+ngram", "mtp-copy", "mtp-gate"]
# The clustered drafter stopping each row after a draft it gave less than EARLY_STOP: ragged widths.
EARLY_STOP = 0.038  # this random drafter's confidences sit around 1/32 (its candidates): about half stop


def batch_prompts(tiny: TinyModel, b: int) -> list[list[int]]:
    prompts = prompts_of(LENGTHS[b], tiny.cfg.vocab_size, seed=100 + b)
    # Give the n-gram drafter something to find: repeat a chunk inside the longer prompts.
    return [p + p[:5] if len(p) > 8 else p for p in prompts]


@pytest.fixture(scope="module")
def plain(gemma_tiny: TinyModel):
    """Plain greedy outputs per batch size, long enough for an oracle to look K ahead."""
    engine = Engine(gemma_tiny.ours)
    out = {}
    for b in LENGTHS:
        prompts = batch_prompts(gemma_tiny, b)
        results = engine.generate(prompts, MAX_NEW + 8, eos_token_ids=[])
        out[b] = (prompts, [r.token_ids for r in results])
    return out


@pytest.fixture(scope="module")
def drafter_factory(gemma_tiny: TinyModel, tmp_path_factory):
    target = gemma_tiny.ours
    folder = tmp_path_factory.mktemp("drafters")
    mtp = {}
    for name, head, clustered in [("mtp-dense-own", "own", False), ("mtp-dense-target", "target", False),
                                  ("mtp-clustered-own", "own", True), ("mtp-clustered-target", "target", True)]:
        cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head=head, clustered=clustered,
                                 num_centroids=16 if clustered else None, top_k_clusters=4)
        save_network(init_network(cfg, target, seed=len(mtp), std=0.1), folder / name)
        mtp[name] = load_mtp_drafter(folder / name, target, torch.float32, "cpu")
    # The clustered drafter with an open copy gate: a bonus of ~3 on the text's continuations.
    cfg = drafter_config_for(target, hidden=32, layers=2, heads=4, head="target", clustered=True, num_centroids=16,
                             top_k_clusters=4)
    cfg.copy_gate = True
    net = init_network(cfg, target, seed=3, std=0.1)
    with torch.no_grad():
        net.copy_gate.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        net.copy_gate.proj.bias.fill_(3.0)
    save_network(net, folder / "mtp-gate")
    mtp["mtp-gate"] = load_mtp_drafter(folder / "mtp-gate", target, torch.float32, "cpu")
    # A draft model that often agrees with the target: the target with every weight scaled by
    # 1 + N(0, 0.07) (acceptance ~50% at position 1, falling with position).
    noisy, _ = load_ours(gemma_tiny.folder)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.mul_(1 + torch.randn(p.shape, generator=gen) * 0.07)

    def make(name: str, sequences: list[list[int]]):
        if name == "ngram":
            return NgramDrafter()
        if name == "draft-model-self":
            return DraftModelDrafter(target)  # the target as its own draft model: all accepted
        if name == "draft-model-noisy":
            return DraftModelDrafter(noisy)
        if name == "mtp+ngram":
            return MTPWithLookup(mtp["mtp-clustered-target"])
        if name == "mtp-copy":  # every unsure draft copied from the text where it can be
            base = mtp["mtp-clustered-target"]
            return MTPDrafter(base.net, base.target, base.sources, min_confidence=EARLY_STOP, copy_below=0.05)
        if name.startswith("mtp-early-stop"):
            base = mtp["mtp-clustered-target"]
            early = MTPDrafter(base.net, base.target, base.sources, min_confidence=EARLY_STOP)
            return MTPWithLookup(early) if name.endswith("+ngram") else early
        if name.startswith("mtp"):
            return mtp[name]
        if name == "oracle-noisy":
            return OracleDrafter(sequences, noise=0.3, seed=1, vocab=gemma_tiny.cfg.vocab_size)
        raise KeyError(name)

    return make


def full_sequences(prompts, outputs):
    return [list(p) + list(o) for p, o in zip(prompts, outputs)]


class Recorder:
    """on_tokens callback: the tokens each round emitted, per row."""

    def __init__(self, b: int):
        self.calls: list[list[list[int]]] = [[] for _ in range(b)]

    def __call__(self, row: int, ids: list[int]) -> None:
        self.calls[row].append(list(ids))


def check_stats(results, rec: Recorder, k: int, max_new: int) -> None:
    """Statistics agree with what was actually emitted round by round."""
    for i, r in enumerate(results):
        s, calls = r.stats, rec.calls[i]
        assert [t for c in calls for t in c] == r.token_ids
        assert s.new_tokens == len(r.token_ids) <= max_new
        # One target forward (prefill or verify) per emitting round; each emits 1..K+1 tokens.
        assert s.target_forwards == len(calls)
        assert all(1 <= len(c) <= k + 1 for c in calls) and len(calls[0]) == 1
        assert s.new_tokens == s.accepted + s.target_forwards
        assert s.accepted == sum(len(c) - 1 for c in calls)
        assert len(s.drafted_by_position) == len(s.accepted_by_position) == k
        # Acceptance is a prefix: counts never increase with position, never exceed drafted.
        acc, dr = s.accepted_by_position, s.drafted_by_position
        assert all(a <= d for a, d in zip(acc, dr))
        assert all(acc[j + 1] <= acc[j] for j in range(k - 1))
        # Per position, rounds whose emission shows >= j+1 accepted drafts; only the final round
        # can have accepted more than it emitted (cut by EOS or the length limit).
        for j in range(k):
            shown = sum(1 for c in calls[1:] if len(c) - 1 > j)
            assert shown <= acc[j] <= shown + 1
        assert sum(acc) >= s.accepted
        assert s.mean_accepted == pytest.approx(s.new_tokens / s.target_forwards)


@pytest.mark.parametrize("b", list(LENGTHS))
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculative_equals_plain(name: str, k: int, b: int, gemma_tiny, plain, drafter_factory) -> None:
    prompts, outputs = plain[b]
    expected = [o[:MAX_NEW] for o in outputs]
    drafter = drafter_factory(name, full_sequences(prompts, outputs))
    rec = Recorder(b)
    engine = Engine(gemma_tiny.ours, None, drafter, k)
    results = engine.generate(prompts, MAX_NEW, eos_token_ids=[], on_tokens=rec)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    check_stats(results, rec, engine.width, MAX_NEW)
    if name == "mtp-early-stop" and k > 1:
        # Some rounds stopped before K drafts, some went on past the first.
        drafted = [sum(r.stats.drafted_by_position[j] for r in results) for j in range(k)]
        assert drafted[0] > drafted[1] > 0, drafted
    if name in ("mtp-copy", "mtp-gate") and k > 1 and b > 1:
        # The tiny target's greedy texts repeat (the one-row prompt's does not within 30 tokens):
        # copies are accepted where the random drafter's own drafts are not.
        same = Engine(gemma_tiny.ours, None, drafter_factory("mtp-early-stop", []), k)
        without = same.generate(prompts, MAX_NEW, eos_token_ids=[])
        assert sum(r.stats.accepted for r in results) > 2 * sum(r.stats.accepted for r in without) + 2
    if name == "draft-model-self":
        # Drafts are the target's own greedy tokens: every draft accepted, tau = K + 1.
        for r in results:
            assert r.stats.target_forwards == 1 + math.ceil((MAX_NEW - 1) / (k + 1))


@pytest.mark.parametrize("name", ["ngram", "draft-model-noisy", "mtp-clustered-target", "mtp+ngram", "oracle-noisy",
                                  "none"])
def test_eos_mid_batch(name: str, gemma_tiny, plain, drafter_factory) -> None:
    prompts, outputs = plain[8]
    # An EOS id that one row emits mid-way (and not before).
    row = max(range(8), key=lambda i: len(set(outputs[i][:MAX_NEW])))
    j = next(j for j in range(MAX_NEW // 3, MAX_NEW) if outputs[row][j] not in outputs[row][:j])
    eos = outputs[row][j]
    expected, reasons = [], []
    for o in outputs:
        o = o[:MAX_NEW]
        cut = o.index(eos) + 1 if eos in o else MAX_NEW
        expected.append(o[:cut])
        reasons.append("eos" if eos in o else "length")
    assert "eos" in reasons and "length" in reasons, "the batch should mix rows ending by EOS and by length"
    drafter = None if name == "none" else drafter_factory(name, full_sequences(prompts, outputs))
    rec = Recorder(8)
    engine = Engine(gemma_tiny.ours, None, drafter, 3)
    results = engine.generate(prompts, MAX_NEW, eos_token_ids=[eos], on_tokens=rec)
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason for r in results] == reasons
    check_stats(results, rec, engine.width, MAX_NEW)


@pytest.mark.parametrize("k", KS)
def test_oracle_reaches_k_plus_one(k: int, gemma_tiny, plain) -> None:
    prompts, outputs = plain[3]
    max_new = 2 + 3 * (k + 1)  # 1 prefill token, 3 full rounds, then a partial round of 1
    oracle = OracleDrafter(full_sequences(prompts, outputs))
    rec = Recorder(3)
    results = Engine(gemma_tiny.ours, None, oracle, k).generate(prompts, max_new, eos_token_ids=[], on_tokens=rec)
    for i, r in enumerate(results):
        assert r.token_ids == outputs[i][:max_new]
        assert [len(c) for c in rec.calls[i]] == [1, k + 1, k + 1, k + 1, 1]  # last round cut by the limit
        s = r.stats
        assert s.target_forwards == 5
        assert s.drafted_by_position == s.accepted_by_position == [4] * k
        assert s.acceptance_by_position == [1.0] * k
        assert s.mean_accepted == pytest.approx(max_new / 5)
    check_stats(results, rec, k, max_new)


def test_max_new_tokens_reached_mid_round(gemma_tiny, plain) -> None:
    """Every limit from 1 to 17 with K = 7: most end inside a round; output = plain prefix."""
    prompts, outputs = plain[3]
    for max_new in range(1, 18):
        oracle = OracleDrafter(full_sequences(prompts, outputs))
        results = Engine(gemma_tiny.ours, None, oracle, 7).generate(prompts, max_new, eos_token_ids=[])
        assert [r.token_ids for r in results] == [o[:max_new] for o in outputs]
        assert all(r.stats.target_forwards == 1 + math.ceil((max_new - 1) / 8) for r in results)


def test_rows_finishing_early_do_not_disturb_others(gemma_tiny, plain) -> None:
    """One row stops at its first token (EOS), others keep drafting with a perfect oracle."""
    prompts, outputs = plain[3]
    eos = outputs[0][0]
    expected = [o[: o.index(eos) + 1] if eos in o[:MAX_NEW] else o[:MAX_NEW] for o in outputs]
    oracle = OracleDrafter(full_sequences(prompts, outputs))
    results = Engine(gemma_tiny.ours, None, oracle, 3).generate(prompts, MAX_NEW, eos_token_ids=[eos])
    assert [r.token_ids for r in results] == expected
    assert results[0].token_ids == [eos] and results[0].stats.target_forwards == 1
    # The finished row was never counted as drafted after it stopped.
    assert results[0].stats.drafted_by_position == [0, 0, 0]


def test_stop_strings_and_tokenizer_path(tmp_path) -> None:
    """Through a real tokenizer: EOS comes from tokenizer_config.json, stop strings cut text."""
    from conftest import make_tiny
    from specdraft.tokenizer import Tokenizer

    tiny = make_tiny(tmp_path / "m", "llama", seed=21)
    tok = Tokenizer(tiny.folder, tiny.cfg.eos_token_ids)
    assert tok.eos_token_ids == [1]
    engine = Engine(tiny.ours, tok, NgramDrafter(), 3)
    prompt = tok.encode("w1 w2 w3 w1 w2")
    base = engine.generate([prompt], 20)[0]
    if base.finish_reason == "eos":
        assert base.token_ids[-1] == 1
    words = tok.decode(base.token_ids).split()
    assert len(words) >= 4
    stop = " ".join(words[2:4])
    cut = engine.generate([prompt], 20, stop=(stop,))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    full = tok.decode(base.token_ids)
    assert cut.text == full[: full.find(stop)]  # the text before the stop string, exactly
    assert cut.token_ids == base.token_ids[: len(cut.token_ids)]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_stop_string_cuts_at_the_same_token_with_any_drafter(tmp_path, k) -> None:
    """A round may emit several tokens past a stop string; none of them may be kept: token_ids,
    text and counts equal plain decoding's (which checks after every token)."""
    from conftest import make_tiny
    from specdraft.tokenizer import Tokenizer

    tiny = make_tiny(tmp_path / "m", "llama", seed=21)
    tok = Tokenizer(tiny.folder, tiny.cfg.eos_token_ids)
    prompt = tok.encode("w1 w2 w3 w1 w2")
    base = Engine(tiny.ours, tok).generate([prompt], 20, eos_token_ids=[])[0]
    words = tok.decode(base.token_ids).split()
    truth = [prompt + base.token_ids + [0] * 8]
    for stop in (words[0], words[2], f"{words[5]} {words[6]}", "w"):
        plain = Engine(tiny.ours, tok).generate([prompt], 20, stop=(stop,), eos_token_ids=[])[0]
        assert plain.finish_reason == "stop"
        for drafter in (OracleDrafter(truth), NgramDrafter()):
            spec = Engine(tiny.ours, tok, drafter, k).generate([prompt], 20, stop=(stop,), eos_token_ids=[])[0]
            assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, "stop")
            assert spec.stats.new_tokens == len(plain.token_ids)


def test_engine_rejects_bad_arguments(gemma_tiny) -> None:
    with pytest.raises(SpecdraftError, match="between 1 and 32"):
        Engine(gemma_tiny.ours, None, NgramDrafter(), 0)
    with pytest.raises(SpecdraftError, match="between 1 and 32"):
        Engine(gemma_tiny.ours, None, NgramDrafter(), 33)
    engine = Engine(gemma_tiny.ours, None, NgramDrafter(), 3)
    with pytest.raises(SpecdraftError, match="no prompts"):
        engine.generate([], 4)
    with pytest.raises(SpecdraftError, match="empty"):
        engine.generate([[5], []], 4)
    with pytest.raises(SpecdraftError, match="max_new_tokens"):
        engine.generate([[5]], 0)
    ctx = gemma_tiny.cfg.max_position_embeddings
    with pytest.raises(SpecdraftError, match="exceeds the model's context"):
        engine.generate([[5] * (ctx - 3)], 4)


def two_rows_input(target) -> DraftInput:
    """Two rows at the start of a round: the first ends in "3 4", which occurred before (then
    5 6 7 ...); the second ends in tokens never seen before."""
    rows = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    cache = target.new_cache(2, 32)
    with torch.inference_mode():
        hidden = target(rows[:, :-1], cache)[:, -1]
    tokens = torch.zeros(2, 32, dtype=torch.long)
    tokens[:, :11] = rows
    return DraftInput(rows[:, -1], hidden, torch.tensor([9, 9]), cache, tokens, torch.tensor([True, True]))


def test_mtp_with_lookup_chooses_per_row(gemma_tiny, drafter_factory) -> None:
    """A row whose last two tokens occurred before gets the 8 tokens that followed them; a row
    without such a match gets the MTP drafter's K drafts, in the same round."""
    target = gemma_tiny.ours
    mtp = drafter_factory("mtp-clustered-target", [])
    inp = two_rows_input(target)
    both = MTPWithLookup(mtp)
    draft = both.propose(inp, 3, SamplingParams(), None)
    alone = mtp.propose(inp, 3, SamplingParams(), None)
    assert draft.num_valid.tolist() == [8, 3]
    assert draft.tokens[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 3]
    assert draft.tokens[1, :3].tolist() == alone.tokens[1].tolist()
    assert both.row_rounds == {"lookup": 1, "mtp": 1}
    assert both.max_drafts(3) == 8 and both.max_drafts(10) == 10
    # K above the lookup length: the MTP row drafts 10, the lookup row still its 8.
    wide = both.propose(inp, 10, SamplingParams(), None)
    assert wide.tokens.shape == (2, 10) and wide.num_valid.tolist() == [8, 10]
    assert wide.tokens[0, :8].tolist() == [5, 6, 7, 8, 9, 10, 11, 3]


def test_mtp_with_lookup_leaves_marked_rows_to_the_mtp_drafter(gemma_tiny, drafter_factory) -> None:
    """A row marked in DraftInput.no_lookup gets the MTP drafter's drafts although its lookup
    matches, and its match does not widen the round; unmarked rows are as before (the control)."""
    target = gemma_tiny.ours
    mtp = drafter_factory("mtp-clustered-target", [])
    inp = two_rows_input(target)
    alone = mtp.propose(inp, 3, SamplingParams(), None)
    both = MTPWithLookup(mtp)
    inp.no_lookup = torch.tensor([True, False])
    draft = both.propose(inp, 3, SamplingParams(), None)
    assert draft.tokens.shape == (2, 3) and draft.num_valid.tolist() == [3, 3]
    assert torch.equal(draft.tokens, alone.tokens) and draft.lookup.tolist() == [False, False]
    assert both.row_rounds == {"lookup": 0, "mtp": 2}
    inp.no_lookup = torch.tensor([False, True])  # the row without a match: nothing changes
    draft = both.propose(inp, 3, SamplingParams(), None)
    assert draft.num_valid.tolist() == [8, 3] and draft.lookup.tolist() == [True, False]
    assert draft.tokens[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 3]


def test_unsure_drafts_copy_what_followed_the_current_token_before(gemma_tiny, drafter_factory) -> None:
    """copy_below 1: every greedy draft whose token occurred earlier in the row's text (drafts
    included) is what followed it there last time; elsewhere the drafter's own pick."""
    from specdraft.drafters.mtp.drafter import text_continuation

    assert text_continuation(torch.tensor([3, 4, 5, 3, 9, 3]), 3) == 9  # the most recent occurrence
    assert text_continuation(torch.tensor([3, 4, 5]), 5) is None
    target = gemma_tiny.ours
    base = drafter_factory("mtp-clustered-target", [])
    inp = two_rows_input(target)
    copying = MTPDrafter(base.net, base.target, base.sources, min_confidence=0.0, copy_below=1.0)
    draft = copying.propose(inp, 3, SamplingParams(), None)
    alone = MTPDrafter(base.net, base.target, base.sources, min_confidence=0.0).propose(inp, 3, SamplingParams(), None)
    assert draft.tokens[0].tolist() == [5, 6, 7]  # 4 -> 5 -> 6 -> 7, as the text went on before
    assert draft.tokens[1, 0] == alone.tokens[1, 0]  # 13 never occurred before: the drafter's own
    # Sampling keeps the drafter's own draws (its Q must be what the draft was drawn from).
    sampled = copying.propose(inp, 3, SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    again = MTPDrafter(base.net, base.target, base.sources, min_confidence=0.0).propose(
        inp, 3, SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    assert torch.equal(sampled.tokens, again.tokens)


def test_lookup_in_a_loop_cycles_the_period(gemma_tiny, drafter_factory) -> None:
    """In a loop of period 3 the latest match has 3 tokens after it; mtp+ngram cycles them to
    draft 8, prompt lookup alone (the ngram drafter) proposes the 3 it saw."""
    target = gemma_tiny.ours
    row = torch.tensor([[2, 7, 8, 9, 7, 8, 9, 7, 8]])
    cache = target.new_cache(1, 32)
    with torch.inference_mode():
        hidden = target(row[:, :-1], cache)[:, -1]
    tokens = torch.zeros(1, 32, dtype=torch.long)
    tokens[:, :9] = row
    inp = DraftInput(row[:, -1], hidden, torch.tensor([7]), cache, tokens, torch.tensor([True]))
    both = MTPWithLookup(drafter_factory("mtp-clustered-target", []))
    draft = both.propose(inp, 3, SamplingParams(), None)
    assert draft.num_valid.tolist() == [8] and draft.tokens[0].tolist() == [9, 7, 8, 9, 7, 8, 9, 7]
    alone = NgramDrafter().propose(inp, 8, SamplingParams(), None)
    assert alone.num_valid.tolist() == [3] and alone.tokens[0, :3].tolist() == [9, 7, 8]


# --- greedy verification, the head scored a block of positions at a time --------------------------

def _fake_head(weight: torch.Tensor, seen: list[int]):
    """An argmax head over a fixed random table that records how many rows each call scored."""
    def greedy_tokens(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return (rows @ weight.T).argmax(-1)
    return greedy_tokens


@pytest.mark.parametrize("k", [0, 1, 3, 4, 8, 11])
def test_blockwise_greedy_verification_gives_the_full_verdicts(k: int) -> None:
    from specdraft.speculative.verify import verify_greedy, verify_greedy_blockwise

    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(50, 16, generator=gen)
    for trial in range(20):
        b = 1 + trial % 5
        hidden = torch.randn(b, k + 1, 16, generator=gen)
        choice = (hidden @ weight.T).argmax(-1)
        # drafts right up to a random point per row, then wrong (or right to the end)
        drafts = choice[:, :k].clone()
        for r in range(b):
            cut = int(torch.randint(0, k + 1, (1,), generator=gen))
            drafts[r, cut:] = (drafts[r, cut:] + 1) % 50
        num_valid = torch.randint(0, k + 1, (b,), generator=gen)
        seen: list[int] = []
        got = verify_greedy_blockwise(_fake_head(weight, seen), hidden, drafts, num_valid)
        want = verify_greedy(choice, drafts, num_valid)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert sum(seen) <= b * (k + 1)


def test_blockwise_greedy_verification_stops_scoring_after_a_rejection() -> None:
    from specdraft.speculative.verify import HEAD_BLOCK, verify_greedy_blockwise

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=gen)
    hidden = torch.randn(2, 9, 16, generator=gen)  # a 9-wide lookup verification, 2 rows
    choice = (hidden @ weight.T).argmax(-1)
    drafts = choice[:, :8].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % 50  # row 0 fails its second draft: one block of positions
    seen: list[int] = []
    n, nxt = verify_greedy_blockwise(_fake_head(weight, seen), hidden, drafts, torch.tensor([8, 8]))
    assert n.tolist() == [1, 8] and nxt.tolist() == [int(choice[0, 1]), int(choice[1, 8])]
    assert seen == [2 * HEAD_BLOCK, HEAD_BLOCK, 1]  # row 1 alone past the first block
