"""The drafter that ships for the default model: it loads, fits, and changes nothing in the text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.drafters import load_drafter, shipped_drafter_path
from specdraft.engine_builder import engine_for
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
    plain = engine_for(runtime).generate(ids, 48)
    fast = engine_for(runtime, drafter, k).generate(ids, 48)
    for a, b in zip(plain, fast):
        assert a.token_ids == b.token_ids
    # And it drafts something useful, not just losslessly.
    accepted = sum(r.stats.accepted for r in fast)
    assert accepted > 0.5 * sum(r.stats.target_forwards for r in fast)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_default_configuration_is_exact_too(batch: int):
    """What users run by default on this CPU (bfloat16 with int8 weights where it has bf16 units,
    float32 with the GGUF file's blocks where not), not just float32: every drafter gives plain decoding's
    greedy tokens, one prompt at a time and batched."""
    rt, ids, plain = default_runtime_and_plain()
    for kind in ("mtp+ngram", "mtp", "ngram"):
        drafter, _, k = load_drafter(rt, kind, None, None)
        for start in range(0, len(ids), batch):
            got = engine_for(rt, drafter, k).generate(ids[start : start + batch], 40)
            for a, b in zip(got, plain[start : start + batch]):
                assert a.token_ids == b.token_ids, (kind, batch)


_DEFAULT: list = []


def default_runtime_and_plain() -> tuple[Runtime, list[list[int]], list]:
    """The default runtime, the test's prompts and their plain greedy outputs (computed once)."""
    if not _DEFAULT:
        rt = Runtime.load("gemma3-270m", "auto", "cpu", progress=False)
        from specdraft.models.formats import q8_act_linear
        from specdraft.models.kernels import build

        # the preset comes from a GGUF file: its blocks, with int8 rows where the CPU has AVX-512 VNNI
        float32_default = ("gguf-q8" if q8_act_linear.kernel_available() else "gguf") if build.available() else "fp16"
        assert rt.weights == ("int8" if rt.dtype == torch.bfloat16 else float32_default)
        ids = [rt.tokenizer.encode(p) for p in PROMPTS + ["Repeat after me: one two three, one two three,"]]
        _DEFAULT.extend([rt, ids, engine_for(rt).generate(ids, 40)])
    return tuple(_DEFAULT)


def test_full_cpu_batches_run_plain_rounds(gemma_tiny):
    """Runtime.speculate_below: from that many decoding rows a round verifies no drafts (a wide
    verify for many rows costs more than it returns on a CPU); fewer rows draft again."""
    from conftest import prompts_of
    from specdraft.drafters.ngram import NgramDrafter
    from specdraft.runtime import CPU_SPECULATE_BELOW
    from specdraft.speculative.engine import Engine

    model = gemma_tiny.ours
    prompts = [p + p for p in prompts_of([6] * CPU_SPECULATE_BELOW, gemma_tiny.cfg.vocab_size, seed=4)]
    engine = Engine(model, drafter=NgramDrafter(), draft_tokens=3, speculate_below=CPU_SPECULATE_BELOW)
    full = engine.generate(prompts, 12, eos_token_ids=[])
    assert all(r.stats.drafted == 0 for r in full)
    alone = engine.generate(prompts[:1], 12, eos_token_ids=[])
    assert alone[0].stats.drafted > 0
    assert alone[0].token_ids == full[0].token_ids
    stub = SimpleNamespace(device=torch.device("cpu"))
    from specdraft.runtime import Runtime

    assert Runtime.speculate_below.fget(stub) == CPU_SPECULATE_BELOW
