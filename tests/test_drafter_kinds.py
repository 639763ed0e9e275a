"""The drafter kinds registry: each kind --drafter names is built from its entry, and the CLI, the
bench and the engine read kinds from it rather than from strings of their own."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters.kinds import DRAFTER_KINDS, KINDS, MTP_KINDS, load_drafter
from specdraft.drafters.mtp import drafter_config_for, init_network, save_network
from specdraft.errors import SpecdraftError
from specdraft.runtime import Runtime

SOURCE_OF_PART = {"mtp": "mtp", "ngram": "lookup", "draft-model": "draft"}


@pytest.fixture(scope="module")
def target(gemma_tiny) -> Runtime:
    return Runtime.load(str(gemma_tiny.folder), "float32", "cpu", progress=False)


@pytest.fixture(scope="module")
def drafter_folder(target, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("kinds") / "drafter"
    cfg = drafter_config_for(target.model, hidden=32, layers=1, heads=4, head="target", clustered=False)
    save_network(init_network(cfg, target.model, seed=1), folder)
    return str(folder)


def test_every_kind_builds_from_its_entry(target, drafter_folder):
    paths = {"mtp": drafter_folder, "mtp+ngram": drafter_folder, "draft-model": str(target.folder)}
    for name in DRAFTER_KINDS:
        drafter, kind, k = load_drafter(target, name, paths.get(name), 3, load_runtime=Runtime.load)
        if name == "auto":  # no drafter ships for a test model: prompt lookup
            assert kind == "ngram" and drafter.kind == "ngram" and k == 3
            continue
        assert kind == name
        if not KINDS[name].parts:
            assert drafter is None and k == 0
            continue
        assert drafter.kind == name and k == 3
        # The draft policy tells sources apart by what the kind is made of.
        assert drafter.source == SOURCE_OF_PART[KINDS[name].parts[0]]
        assert drafter.mixes_lookups == (len(KINDS[name].parts) > 1)


def test_kinds_that_read_a_path_say_so(target):
    assert MTP_KINDS == ("mtp", "mtp+ngram")
    assert {name for name, kind in KINDS.items() if kind.path is not None} == {"mtp", "mtp+ngram", "draft-model"}
    with pytest.raises(SpecdraftError, match="--drafter draft-model needs --drafter-path"):
        load_drafter(target, "draft-model", None, None, load_runtime=Runtime.load)
    with pytest.raises(SpecdraftError, match="unknown drafter kind 'tree'"):
        load_drafter(target, "tree", None, None)


def test_the_cli_and_the_bench_list_the_registry():
    from specdraft.bench import DRAFTER_METHODS, SPECDRAFT_METHODS
    from specdraft.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("generate", "serve"):
        flag = next(a for a in sub[command]._actions if "--drafter" in a.option_strings)
        assert tuple(flag.choices) == DRAFTER_KINDS
    assert set(SPECDRAFT_METHODS) >= set(DRAFTER_KINDS) - {"none"}
    assert DRAFTER_METHODS == ("auto", *MTP_KINDS)


def test_the_engine_reads_a_drafters_source_not_its_kind(gemma_tiny):
    """A drafter of a kind the engine has never heard of is tracked by its declared source."""
    from specdraft.drafters.ngram import NgramDrafter
    from specdraft.speculative.engine import Engine
    from specdraft.speculative.policy import AdaptivePolicy
    from specdraft.speculative.request import Request

    class Renamed(NgramDrafter):
        kind = "renamed"

    class Costs:
        def ensure(self, *a): pass
        def verify(self, n, w, alive=None, block=None): return 1.0
        def draft(self, n, steps): return 0.0

    engine = Engine(gemma_tiny.ours, None, Renamed(), 2, policy=AdaptivePolicy(Costs()))
    engine.add(Request(torch.arange(4, 10).tolist(), 4))
    assert engine.waiting[0].acceptance.source == "lookup"


def test_auto_runs_prompt_lookup_where_no_drafter_ships(target):
    """`auto`: the shipped drafter with lookups where one ships (the default model), prompt lookup
    for a preset or a folder without one (it needs no weights; a round without a match is plain)."""
    from specdraft.drafters.kinds import resolve_auto, shipped_drafter_path

    assert resolve_auto("gemma3-270m") == ("mtp+ngram", str(shipped_drafter_path("gemma3-270m")))
    assert resolve_auto("smollm2-135m-instruct") == ("ngram", None)
    assert resolve_auto(target.name, target.folder) == ("ngram", None)
