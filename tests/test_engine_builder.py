"""One path builds an engine: `generate`, `serve` and `bench` all call engine_builder.build_engine,
and what it builds is what its arguments say."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_tiny
from specdraft import engine_builder
from specdraft.cli.main import main
from specdraft.runtime import Runtime


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("builder") / "tiny", "llama", seed=5, max_position_embeddings=64).folder


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Every build_engine call from here on: its drafter, policy and rows to prepare."""
    seen, original = [], engine_builder.build_engine

    def spy(rt, drafter="auto", drafter_path=None, draft_tokens=None, policy="adaptive", prepare_rows=None,
            progress=False, **engine_kwargs):
        seen.append({"drafter": drafter, "draft_tokens": draft_tokens, "policy": policy, "rows": prepare_rows,
                     **engine_kwargs})
        return original(rt, drafter, drafter_path, draft_tokens, policy, prepare_rows, progress, **engine_kwargs)

    monkeypatch.setattr(engine_builder, "build_engine", spy)
    return seen


def test_generate_builds_through_it(model_dir, calls, capsys, monkeypatch, tmp_path):
    """generate prepares the policy itself, after checking the prompts' lengths (as bench does)."""
    from specdraft.speculative.engine import Engine

    (tmp_path / "two.txt").write_text("w1 w2 w3\nw4 w5\n")
    prepared, original = [], Engine.prepare_policy
    monkeypatch.setattr(Engine, "prepare_policy", lambda self, rows: (prepared.append(rows), original(self, rows)))
    code = main(["generate", "--prompts-file", str(tmp_path / "two.txt"), "--model", str(model_dir),
                 "--dtype", "float32", "--device", "cpu", "--drafter", "ngram", "--draft-tokens", "3",
                 "--max-new-tokens", "4", "--batch-size", "4", "--json"])
    assert code == 0, capsys.readouterr().err
    assert calls == [{"drafter": "ngram", "draft_tokens": 3, "policy": "adaptive", "rows": None}]
    assert prepared == [2]  # the widest batch it runs: min(--batch-size, prompts)


def test_serve_builds_through_it(model_dir, calls):
    pytest.importorskip("fastapi")
    from specdraft.serve import load_served

    served = load_served(str(model_dir), "ngram", "float32", "cpu", max_batch_size=2, max_context=48,
                         draft_tokens=2, draft_policy="fixed")
    assert calls == [{"drafter": "ngram", "draft_tokens": 2, "policy": "fixed", "rows": 2, "max_batch_size": 2,
                      "capacity": 48}]
    assert served.engine.max_batch_size == 2 and served.drafter == "ngram" and served.k == 2


def test_bench_builds_through_it(model_dir, calls):
    from specdraft.bench.methods import BenchContext
    from specdraft.bench.runner import build_method
    from specdraft.sampling import SamplingParams

    ctx = BenchContext(Runtime.load(str(model_dir), "float32", "cpu", progress=False), SamplingParams())
    for name in ("plain", "ngram", "auto"):
        build_method(name, ctx)
    assert [(c["drafter"], c["policy"]) for c in calls] == [("none", "adaptive"), ("ngram", "fixed"),
                                                            ("auto", "adaptive")]


def test_what_it_builds(model_dir):
    rt = Runtime.load(str(model_dir), "float32", "cpu", progress=False)
    plain = engine_builder.build_engine(rt, "none", draft_tokens=None)
    assert plain.engine.drafter is None and (plain.drafter, plain.draft_tokens) == ("none", 0)
    fixed = engine_builder.build_engine(rt, "ngram", draft_tokens=3, policy="fixed", max_batch_size=3)
    assert (fixed.drafter, fixed.draft_tokens, fixed.engine.k, fixed.engine.max_batch_size) == ("ngram", 3, 3, 3)
    assert type(fixed.engine.policy).__name__ == "FixedPolicy"
    assert fixed.engine.policy.speculate_below == rt.speculate_below
    adaptive = engine_builder.build_engine(rt, "ngram", draft_tokens=2, prepare_rows=1)
    assert type(adaptive.engine.policy).__name__ == "AdaptivePolicy" and adaptive.engine.policy.costs.target
