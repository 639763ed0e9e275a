"""Simulated acceptance (drafters/simulated.py): the real drafter runs, its drafts land as often as a
profile says, and the output is still the target's; the draft policy at those acceptances."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, prompts_of
from specdraft.drafters.mtp import drafter_config_for, init_network, save_network
from specdraft.drafters.simulated import AcceptanceProfile, SimulatedAcceptance, parse_profile, shipped_profiles
from specdraft.engine_builder import build_engine
from specdraft.errors import SpecdraftError
from specdraft.runtime import Runtime
from specdraft.speculative import acceptance
from specdraft.speculative.engine import Engine
from specdraft.speculative.policy import AdaptivePolicy
from specdraft.speculative.request import Request
from specdraft.speculative.simulation import prepare_references

# What a verify of width w costs at Gemma 4 E2B size over a plain step (BENCHMARKS.md, "What a
# verify costs at E2B size"), and its assistant's draft step (~0.015 plain steps).
E2B_VERIFY = {1: 1.0, 2: 1.07, 3: 1.16, 4: 1.24, 5: 1.45, 6: 1.55, 7: 1.55, 8: 1.61, 9: 1.75}
E2B_DRAFT = 0.015


class TableCosts:
    """The policy's cost interface read from a table of plain-step multiples."""

    def __init__(self, table: dict[int, float] = E2B_VERIFY, draft: float = E2B_DRAFT):
        self.table, self.step = table, draft

    def ensure(self, model, drafter, rows, k, width) -> None:
        pass

    def verify(self, n, w, alive=None, block=None) -> float:
        lo = min(max(1, math.floor(w)), max(self.table) - 1)
        return self.table[lo] + (w - lo) * (self.table[lo + 1] - self.table[lo])

    def draft(self, n, steps) -> float:
        return self.step * steps


@pytest.fixture(scope="module")
def rt(tmp_path_factory) -> Runtime:
    folder = make_tiny(tmp_path_factory.mktemp("sim") / "tiny", "llama", seed=5, max_position_embeddings=1024).folder
    return Runtime.load(str(folder), "float32", "cpu", progress=False)


@pytest.fixture(scope="module")
def drafter_dir(rt, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sim") / "drafter"
    cfg = drafter_config_for(rt.model, hidden=16, layers=1, heads=2, head="own", clustered=False)
    save_network(init_network(cfg, rt.model, seed=0, std=0.1), folder)
    return folder


def prompts(rt, n: int = 3) -> list[list[int]]:
    return prompts_of([5, 9, 7, 6][:n], rt.model.config.vocab_size)


def simulated_run(rt, drafter_dir, profile: str, ps, max_new: int, policy: str = "fixed", k: int = 4, **kw):
    built = build_engine(rt, "mtp", str(drafter_dir), k, policy, simulate=parse_profile(profile), **kw)
    prepare_references(built.engine, ps, max_new, eos_token_ids=[])
    return built.engine, built.engine.generate(ps, max_new, eos_token_ids=[])


# --- profiles -----------------------------------------------------------------------------------------
def test_shipped_profiles_are_cumulative_and_sourced():
    profiles = shipped_profiles()
    assert {"vllm-26b", "e2b-m4", "code", "prose", "json", "zero"} <= set(profiles)
    assert profiles["vllm-26b"].cumulative == (0.84, 0.60, 0.39, 0.27)  # as vLLM reported them
    for p in profiles.values():
        assert p.source and all(0 <= v <= 1 for v in p.cumulative)
        assert all(b <= a for a, b in zip(p.cumulative, p.cumulative[1:]))


def test_conditional_rates_and_their_continuation():
    p = AcceptanceProfile("x", (0.8, 0.4), "test")
    assert p.conditional(4) == pytest.approx([0.8, 0.5, 0.5, 0.5])  # the last ratio goes on
    assert AcceptanceProfile("z", (0.0,), "test").conditional(3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", ["0.5,0.8", "1.2", "-0.1", "nan", "fast", ""])
def test_bad_profiles_are_one_line_errors(bad):
    with pytest.raises(SpecdraftError, match="simulate-acceptance"):
        parse_profile(bad)


# --- the drafter in the engine ---------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["vllm-26b", "zero", "1"])
def test_output_equals_plain_and_acceptance_follows_the_profile(rt, drafter_dir, profile):
    ps = prompts(rt)
    plain = Engine(rt.model, rt.tokenizer).generate(ps, 40, eos_token_ids=[])
    engine, out = simulated_run(rt, drafter_dir, profile, ps, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    drafted = sum(sum(r.stats.drafted_by_position) for r in out)
    accepted = sum(sum(r.stats.accepted_by_position) for r in out)
    assert drafted > 0 and engine.drafter.diverged == 0
    if profile == "1":  # every draft lands: the real (random) drafter's proposals were replaced
        assert accepted == drafted
    if profile == "zero":
        assert accepted == 0


def test_measured_acceptance_by_position_matches_the_profile(rt, drafter_dir):
    """Fixed seed, fixed K = 4: per position the share of rounds whose first i drafts were all
    accepted lies within 4 binomial standard deviations of the profile; a profile 0.15 off at the
    first position would lie outside (the negative control)."""
    profile = shipped_profiles()["vllm-26b"]
    # 3 rows: from 4 on a fixed policy's CPU rounds run plain (Runtime.speculate_below)
    _, out = simulated_run(rt, drafter_dir, "vllm-26b", prompts(rt, 3), 400)
    drafted = [sum(r.stats.drafted_by_position[j] for r in out) for j in range(4)]
    accepted = [sum(r.stats.accepted_by_position[j] for r in out) for j in range(4)]
    for j, p in enumerate(profile.cumulative):
        n = drafted[j]
        assert n > 250
        bound = 4 * math.sqrt(p * (1 - p) / n)
        assert abs(accepted[j] / n - p) <= bound, (j, accepted[j] / n, p, bound)
    n, got = drafted[0], accepted[0] / drafted[0]
    for off in (profile.cumulative[0] - 0.15, profile.cumulative[0] + 0.15):
        assert abs(got - off) > 4 * math.sqrt(off * (1 - off) / n)


def test_rows_follow_their_references_through_compaction(rt, drafter_dir):
    """Requests that end at different rounds (the engine moves the last row into a finished one's
    slot) each keep matching their own prompt's reference; known references are not decoded again."""
    from specdraft.speculative.request import Request

    ps = prompts(rt, 3)
    built = build_engine(rt, "mtp", str(drafter_dir), 3, "fixed", simulate=parse_profile("1"), max_batch_size=3,
                         capacity=128)
    engine = built.engine
    prepare_references(engine, ps, 30, eos_token_ids=[])
    plain = Engine(rt.model, rt.tokenizer).generate(ps, 30, eos_token_ids=[])
    for p, n in zip(ps, (8, 30, 17)):
        engine.add(Request(p, n, eos_token_ids=[]))
    done = []
    while engine.has_work():
        done += engine.step()
    by_prompt = {tuple(r.prompt_ids): r for r in done}
    for p, ref, n in zip(ps, plain, (8, 30, 17)):
        r = by_prompt[tuple(p)]
        assert r.token_ids == ref.token_ids[:n]
        assert sum(r.stats.accepted_by_position) == sum(r.stats.drafted_by_position) > 0
    assert len(engine.drafter.references) == 3 and engine.drafter.diverged == 0
    prepare_references(engine, ps, 30)  # all known: nothing decoded again
    assert len(engine.drafter.references) == 3


def test_a_row_without_a_reference_is_counted_and_still_exact(rt, drafter_dir):
    built = build_engine(rt, "mtp", str(drafter_dir), 3, "fixed", simulate=parse_profile("1"))
    ps = prompts(rt, 1)
    plain = Engine(rt.model, rt.tokenizer).generate(ps, 20, eos_token_ids=[])
    out = built.engine.generate(ps, 20, eos_token_ids=[])  # no prepare_references
    assert out[0].token_ids == plain[0].token_ids and built.engine.drafter.diverged == 1


def test_sampling_and_no_drafter_are_refused(rt, drafter_dir):
    from specdraft.sampling import SamplingParams

    with pytest.raises(SpecdraftError, match="needs a drafter"):
        build_engine(rt, "none", simulate=parse_profile("zero"))
    engine, _ = simulated_run(rt, drafter_dir, "zero", prompts(rt, 1), 4)
    with pytest.raises(SpecdraftError, match="greedy"):
        engine.generate(prompts(rt, 1), 4, SamplingParams(temperature=1.0, seed=0), eos_token_ids=[])


# --- the draft policy at real costs -------------------------------------------------------------------
def best_width(cumulative: list[float], costs: TableCosts, k: int, margin: float) -> int:
    """The W in 0..k with the most expected tokens per plain-step time (W = 0 needs `margin` less)."""
    rates = [1.0 / (costs.verify(1, 1) * (1 + margin))]
    for w in range(1, k + 1):
        rates.append((1 + sum(cumulative[:w])) / (costs.draft(1, w) + costs.verify(1, w + 1)))
    return max(range(k + 1), key=lambda w: rates[w])


@pytest.mark.parametrize("name", ["vllm-26b", "e2b-m4", "code", "prose", "json", "zero"])
def test_the_policy_picks_the_fastest_width_at_each_profile(name):
    """A row whose estimates have settled at a profile's rates drafts the width (K = 1..8) that is
    fastest at E2B's measured costs."""
    from specdraft.speculative.policy import MARGIN

    profile, costs = shipped_profiles()[name], TableCosts()
    policy = AdaptivePolicy(costs)
    policy.prepare(None, None, 1, 8, 8)
    row = policy.new_row("mtp")
    policy.expected_tokens(row)  # creates the row's estimates
    row.rates["mtp"][:] = profile.conditional(8)
    row.from_prior.clear()  # settled estimates: no narrow start (AcceptanceEstimates.width_cap)
    cumulative = [math.prod(profile.conditional(8)[: i + 1]) for i in range(8)]
    assert policy.choose([row]) == best_width(cumulative, costs, 8, MARGIN)
    if name == "zero":
        assert policy.choose([row]) == 0


def chosen_widths(rt, drafter_dir, profile: str, tokens: int = 128) -> list[int]:
    """The width the adaptive policy (E2B's cost table) chose for each round of one request of
    `tokens` tokens through the real engine with the simulated drafter."""
    widths = []
    built = build_engine(rt, "mtp", str(drafter_dir), 8, "fixed", simulate=parse_profile(profile))
    engine = built.engine
    engine.policy = AdaptivePolicy(TableCosts())
    choose = engine.policy.choose
    engine.policy.choose = lambda states: widths.append(choose(states)) or widths[-1]
    ps = prompts(rt, 1)
    prepare_references(engine, ps, tokens, eos_token_ids=[])
    out = engine.generate(ps, tokens, eos_token_ids=[])
    assert len(out[0].token_ids) == tokens
    return widths


def expected_speed(rt, drafter_dir, profile: str, tokens: int = 128, drafted_round: float | None = None) -> float:
    """Plain steps' time over the time the chosen rounds cost, for one request of `tokens` tokens
    (chosen_widths). Rounds are priced from the policy's own cost table, or each drafted round at
    `drafted_round` plain steps when given."""
    costs = TableCosts()
    widths = chosen_widths(rt, drafter_dir, profile, tokens)
    table = [costs.draft(1, w) + costs.verify(1, w + 1) if w else costs.verify(1, 1) for w in widths]
    spent = sum(drafted_round if w and drafted_round else c for w, c in zip(widths, table))
    return (tokens - 1) * costs.verify(1, 1) / spent  # the prefill emits the first token in both


# What a one-draft round of E2B took in generation against a plain step, host work included
# (BENCHMARKS.md, "The draft policy prices drafted rounds as they run"): the table says 1.07.
E2B_PROBE = 1.25


def test_a_zero_profile_costs_at_most_3_percent_at_what_probes_cost_in_generation(rt, drafter_dir, monkeypatch):
    """A drafter that never lands over 128 tokens: its probes back off (acceptance.PROBE_GAPS_FROM),
    so even priced at what a one-draft round costs in generation it loses at most 3% against
    plain; re-probing whenever the estimate drifts back (the negative control) loses more."""
    widths = chosen_widths(rt, drafter_dir, "zero")
    assert 0 < sum(w > 0 for w in widths) <= 14
    assert expected_speed(rt, drafter_dir, "zero", drafted_round=E2B_PROBE) >= 0.97
    monkeypatch.setattr(acceptance, "PROBE_GAPS_FROM", 10**9)
    monkeypatch.setattr(acceptance, "PROBE_GAPS_FROM_LANDED", 10**9)
    assert sum(w > 0 for w in chosen_widths(rt, drafter_dir, "zero")) > 20
    assert expected_speed(rt, drafter_dir, "zero", drafted_round=E2B_PROBE) < 0.97


def test_a_drafter_that_recovers_mid_request_drafts_again_and_the_output_stays_plain(rt, drafter_dir):
    """No draft lands for the first 60 rounds, then every one does: the engine drafts again within
    MAX_PROBE_GAP rounds of the switch and from then on every round, and every token is plain's."""
    ps = prompts(rt, 1)
    built = build_engine(rt, "mtp", str(drafter_dir), 4, "fixed", simulate=parse_profile("zero"))
    engine, widths = built.engine, []
    engine.policy = AdaptivePolicy(TableCosts())
    choose = engine.policy.choose
    engine.policy.choose = lambda states: widths.append(choose(states)) or widths[-1]
    prepare_references(engine, ps, 160, eos_token_ids=[])
    engine.add(Request(ps[0], 160, eos_token_ids=[]))
    done, switch = [], 60
    while engine.has_work():
        if len(widths) == switch:
            engine.drafter.profile = parse_profile("1")
        done += engine.step()
    assert sum(widths[:switch]) <= 14  # backed off while nothing landed
    found = next(r for r in range(switch, len(widths)) if widths[r] > 0)
    assert found - switch <= acceptance.MAX_PROBE_GAP
    assert all(w > 0 for w in widths[found:])
    assert sum(done[0].stats.accepted_by_position) > 40
    plain = Engine(rt.model, rt.tokenizer).generate(ps, 160, eos_token_ids=[])
    assert done[0].token_ids == plain[0].token_ids and engine.drafter.diverged == 0


@pytest.mark.parametrize("profile", ["zero", "json"])
def test_drafting_that_does_not_pay_costs_at_most_3_percent(rt, drafter_dir, profile):
    assert expected_speed(rt, drafter_dir, profile) >= 0.97


def test_without_a_narrow_start_a_drafter_that_never_lands_costs_more(rt, drafter_dir, monkeypatch):
    """The negative control: a fresh request that drafts as wide as the prior suggests (no
    width_cap) loses over 128 tokens more than twice what a narrow start does for a drafter that
    never lands (without the probes' backoff: more than 3%)."""
    narrow = expected_speed(rt, drafter_dir, "zero")
    monkeypatch.setattr(acceptance.AcceptanceEstimates, "width_cap", lambda self, state, source: None)
    assert 1 - expected_speed(rt, drafter_dir, "zero") > 2 * (1 - narrow)
    monkeypatch.setattr(acceptance, "PROBE_GAPS_FROM", 10**9)
    assert expected_speed(rt, drafter_dir, "zero") < 0.97


@pytest.mark.parametrize("profile, least", [("vllm-26b", 1.8), ("e2b-m4", 1.4)])
def test_drafting_that_pays_is_taken(rt, drafter_dir, profile, least):
    assert expected_speed(rt, drafter_dir, profile) >= least


# --- the commands ----------------------------------------------------------------------------------------
def test_generate_marks_a_simulated_run(rt, drafter_dir, capsys):
    from specdraft.cli.main import main

    base = ["generate", "w1 w2 w3", "--model", str(rt.folder), "--dtype", "float32", "--device", "cpu",
            "--max-new-tokens", "12", "--drafter", "mtp", "--drafter-path", str(drafter_dir)]
    assert main(base + ["--json", "--simulate-acceptance", "vllm-26b"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["simulated_acceptance"]["profile"] == "vllm-26b"
    assert record["simulated_acceptance"]["source"].startswith("vLLM")
    assert main(base + ["--json"]) == 0
    assert "simulated_acceptance" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(base + ["--simulate-acceptance", "vllm-26b", "--temperature", "1"]) != 0
    assert "greedy" in capsys.readouterr().err


def test_bench_names_and_reports_simulated_methods(rt, drafter_dir, tmp_path):
    from specdraft.bench.runner import BenchConfig, run_bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(2)))
    payload = run_bench(BenchConfig(model=str(rt.folder), questions=questions, methods=["mtp~vllm-26b", "mtp~zero"],
                                    drafter_path=str(drafter_dir), max_new_tokens=12, dtype="float32",
                                    device="cpu", out=tmp_path / "out", plots=False, progress=False, ignore_eos=True))
    info = payload["methods"]["mtp~vllm-26b"]
    assert info["simulated_acceptance"]["profile"] == "vllm-26b" and payload["methods"]["plain"][
        "simulated_acceptance"] is None
    methods = payload["summary"]["batch_sizes"]["1"]["methods"]
    assert methods["mtp~vllm-26b"]["overall"]["identical_rate"] == 1.0
    assert methods["mtp~zero"]["overall"]["identical_rate"] == 1.0
    assert "SIMULATED acceptance" in (tmp_path / "out" / "results.md").read_text()


def test_llama_cpp_peers_arguments(tmp_path, monkeypatch):
    """llama-server's flags for each llama.cpp peer, the simulated profile as llama.cpp's own
    unconditional rates; without a native build the plain peers fall back to the wheel and the MTP
    peer is skipped with the command that builds one."""
    from specdraft.bench import llama_native
    from specdraft.bench.llama_server import build_llama_server, server_args
    from specdraft.bench.methods import BenchContext, Skip
    from specdraft.sampling import SamplingParams

    draft = tmp_path / "assistant.gguf"
    draft.write_bytes(b"GGUF")
    ctx = BenchContext(rt=None, sampling=SamplingParams(), draft_tokens=4, drafter_path=str(draft), n_ctx=256)
    args, k = server_args("llama-cpp-mtp", ctx, Path("t.gguf"), 2, shipped_profiles()["e2b-m4"])
    at = args.index("--spec-type")
    assert args[at + 1] == "draft-mtp" and args[args.index("-md") + 1] == str(draft) and k == 4
    rates = [float(r) for r in args[args.index("--spec-synth-rates") + 1].split(",")]
    assert rates[:3] == pytest.approx([0.65, 0.42, 0.28], abs=2e-3) and len(rates) == 4 and rates[3] < rates[2]
    assert server_args("llama-cpp", ctx, Path("t.gguf"), 2) == (["-m", "t.gguf", "-t", "2", "-tb", "2", "-c", "256",
                                                                 "-ngl", "0"], 0)
    missing = BenchContext(rt=None, sampling=SamplingParams(), drafter_path=str(tmp_path / "nowhere"))
    with pytest.raises(Skip, match="convert-assistant"):
        server_args("llama-cpp-mtp", missing, Path("t.gguf"), 2)
    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP_BIN", str(tmp_path / "no-build"))
    assert llama_native.find_binary() is None  # the plain peers then run the wheel (peers.py)
    with pytest.raises(Skip, match="llama_cpp_native.py build"):
        build_llama_server("llama-cpp-mtp", ctx, Path("t.gguf"), 2)
