"""The drafter that ships for the default model: it loads, fits, and changes nothing in the text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.drafters import CPU_LOOKUP_ONLY_BATCH, load_drafter, shipped_drafter_path
from specdraft.runtime import Runtime

PROMPTS = [
    "Question: Name three primary colors.\nAnswer:",
    "def is_even(n):",
    "The history of the printing press",
]


@pytest.fixture(scope="module")
def runtime():
    return Runtime.load("gemma3-270m", "float32", "cpu", progress=False)


def test_a_drafter_ships_for_the_default_model():
    path = shipped_drafter_path("gemma3-270m")
    assert path is not None and (path / "model.safetensors").stat().st_size < 40e6


@pytest.mark.slow
def test_auto_uses_it_and_greedy_text_is_unchanged(runtime):
    drafter, kind, k = load_drafter(runtime, "auto", None, None)
    assert kind == "mtp+ngram" and k >= 1
    assert drafter.nbytes() < 0.1 * runtime.nbytes()  # overhead stays a small fraction of the target
    ids = [runtime.tokenizer.encode(p) for p in PROMPTS]
    plain = runtime.engine().generate(ids, 48)
    fast = runtime.engine(drafter, k).generate(ids, 48)
    for a, b in zip(plain, fast):
        assert a.token_ids == b.token_ids
    # And it drafts something useful, not just losslessly.
    accepted = sum(r.stats.accepted for r in fast)
    assert accepted > 0.5 * sum(r.stats.target_forwards for r in fast)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_default_configuration_is_exact_too(batch: int):
    """What users run by default on a CPU (bfloat16, int8 weights), not just float32: every drafter
    gives plain decoding's greedy tokens, one prompt at a time and batched."""
    rt = default_runtime()
    ids = [rt.tokenizer.encode(p) for p in PROMPTS + ["Repeat after me: one two three, one two three,"]]
    plain = rt.engine().generate(ids, 40)
    for kind in ("mtp+ngram", "mtp", "ngram"):
        drafter, _, k = load_drafter(rt, kind, None, None)
        for start in range(0, len(ids), batch):
            got = rt.engine(drafter, k).generate(ids[start : start + batch], 40)
            for a, b in zip(got, plain[start : start + batch]):
                assert a.token_ids == b.token_ids, (kind, batch)


_DEFAULT: list = []


def default_runtime() -> Runtime:
    if not _DEFAULT:
        _DEFAULT.append(Runtime.load("gemma3-270m", "bfloat16", "cpu", progress=False))
        assert _DEFAULT[0].weights == "int8"
    return _DEFAULT[0]


def test_auto_at_large_cpu_batches_uses_lookup_alone(monkeypatch):
    # The batch sweep in BENCHMARKS.md: from batch 4 on this CPU, prompt lookup alone is faster.
    # A stub target and MTP loader: only the choice is under test, not the weights.
    import specdraft.drafters.mtp as mtp

    monkeypatch.setattr(mtp, "load_mtp_drafter", lambda path, *args: SimpleNamespace(recommended_k=3))
    stub = SimpleNamespace(name="gemma3-270m", device=torch.device("cpu"), model=None, dtype=torch.float32)
    _, kind, k = load_drafter(stub, "auto", None, None, batch_size=CPU_LOOKUP_ONLY_BATCH - 1)
    assert kind == "mtp+ngram" and k == 3
    _, kind, k = load_drafter(stub, "auto", None, None, batch_size=CPU_LOOKUP_ONLY_BATCH)
    assert kind == "ngram" and k == 4
