"""Gemma 4's short forwards in one C call (models/kernels/gemma4_layer.c) under q8 / q4.

The fused layers must agree with the eager layers (the same model, the same int8 matrices; the
norms, GeGLU and attention are each computed in another order, so within float32 rounding), and
every row of a verify must carry the bits of a one-token step (speculative == plain). Tiny random
Gemma 4 checkpoints with PLE, KV sharing, attention_k_eq_v, double-wide MLPs and rings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemma4_tiny import moe_overrides, randomize_, target_text_config  # noqa: E402
from specdraft.drafters.ngram import NgramDrafter  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.models.architectures import gemma4_fused  # noqa: E402
from specdraft.models.formats import q8_act_linear  # noqa: E402
from specdraft.models.kernels import build  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

pytestmark = pytest.mark.skipif(not q8_act_linear.kernel_available(), reason="q8 kernels need x86 AVX2 and a C compiler")

# The PLE width is 32 so its projection takes int8 rows (inputs in blocks of 32).
PLE = dict(hidden_size_per_layer_input=32)
CONFIGS = {
    "ple_kv_shared": PLE,  # k_eq_v on full layers, double-wide MLPs in the shared layers
    "own_v": dict(PLE, attention_k_eq_v=False, num_global_key_value_heads=None, use_double_wide_mlp=False),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**CONFIGS[request.param])), seed=1)
    out = tmp_path_factory.mktemp(request.param)
    ref.to(torch.bfloat16).save_pretrained(out)
    return out


def _load(folder: Path, fmt: str):
    model, _, _ = load_folder(folder, torch.float32, "cpu", fmt)
    return model


def _steps(model, prompt: torch.Tensor, new: torch.Tensor, widths: list[int], rings: bool = True) -> list[torch.Tensor]:
    """Hidden states of `new` [B, N] fed in forwards of the given widths after a prompt."""
    b = prompt.shape[0]
    cache = model.new_cache(b, prompt.shape[1] + new.shape[1] + 1, 24 if rings else None)
    out = []
    with torch.inference_mode():
        model(prompt, cache)
        at = 0
        for w in widths:
            out.append(model(new[:, at : at + w], cache))
            at += w
    return out


PROMPT = torch.randint(3, 250, (2, 21), generator=torch.Generator().manual_seed(3))
NEW = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_fused_layers_are_taken_and_agree_with_the_eager_layers(folder: Path, fmt: str, monkeypatch) -> None:
    """Each forward from the same cache, fused and eager: most agree to float32 rounding (~1e-6).
    A rounding difference can flip an int8 activation code (1/127 of its block's scale) and move
    that forward's states a little: well under what int8 rows themselves move them against
    float32 (0.3-0.6 here)."""
    model = _load(folder, fmt)
    cache = model.new_cache(2, 40, 24)
    diffs = []
    with torch.inference_mode():
        model(PROMPT, cache)
        for at, w in [(0, 1), (1, 3), (4, 4), (8, 4)]:
            tokens, length = NEW[:, at : at + w], cache.host_lengths
            fused = model(tokens, cache)
            assert model._fused._built[1] is not None  # the C path ran
            cache.rollback(length)
            with monkeypatch.context() as m:
                m.setattr(gemma4_fused.FusedLayers, "weights", lambda *a: None)
                eager = model(tokens, cache)
            diffs += [(fused[:, i] - eager[:, i]).abs().max().item() for i in range(w)]
    assert max(diffs) > 0  # a different computation ran (the control for the checks below)
    assert sum(d <= 1e-4 for d in diffs) >= 0.75 * len(diffs) and max(diffs) <= 0.2, diffs


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("rings", [True, False])
def test_every_row_of_a_verify_has_the_bits_of_a_one_token_step(folder: Path, fmt: str, rings: bool) -> None:
    model = _load(folder, fmt)
    one = torch.cat(_steps(model, PROMPT, NEW, [1] * 12, rings), dim=1)
    for widths in ([3, 4, 5], [12], [2, 8, 1, 1]):
        assert torch.equal(torch.cat(_steps(model, PROMPT, NEW, widths, rings), dim=1), one)
    # and a row's bits do not depend on the other rows of the batch
    alone = torch.cat(_steps(model, PROMPT[1:], NEW[1:], [4, 4, 4], rings), dim=1)
    assert torch.equal(alone[0], one[1])


def test_speculative_equals_plain_through_the_fused_layers(folder: Path) -> None:
    model = _load(folder, "q8")
    base = PROMPT[0, :6].tolist()
    prompts = [base * 3, base[:4] * 4 + base]  # repeats give the lookup drafter something to propose
    plain = Engine(model).generate(prompts, max_new_tokens=24, eos_token_ids=[])
    drafted = Engine(model, drafter=NgramDrafter(), draft_tokens=4).generate(prompts, max_new_tokens=24,
                                                                            eos_token_ids=[])
    assert model._fused._built[1] is not None
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]


def test_routed_experts_keep_the_eager_layers(tmp_path: Path) -> None:
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**moe_overrides())), seed=1)
    ref.to(torch.bfloat16).save_pretrained(tmp_path)
    model = _load(tmp_path, "q8")
    _steps(model, PROMPT, NEW, [1, 2])
    assert model._fused._built[1] is None


@pytest.mark.skipif(not build.avx512_here(), reason="needs an AVX-512 CPU to compare the AVX2 loops against")
def test_the_avx2_build_gives_the_avx512_build_bits(folder: Path, monkeypatch) -> None:
    """A fused step's bits are the same on AVX2 and AVX-512 VNNI machines (each packs its own codes)."""
    outs = []
    for avx512 in (True, False):
        monkeypatch.setattr(build, "library", lambda avx512=avx512: build.library_for(avx512))
        model = _load(folder, "q8")
        outs.append(torch.cat(_steps(model, PROMPT, NEW, [1, 4]), dim=1))
        assert model._fused._built[1] is not None
    assert torch.equal(outs[0], outs[1])


def test_the_breakdown_times_each_op_class_only_when_asked(folder: Path) -> None:
    from specdraft.bench.breakdown import step_breakdown
    from specdraft.models.kernels.gemma4_layer import TIMED_OPS, read_timers

    model = _load(folder, "q8")
    read_timers(False)
    _steps(model, PROMPT, NEW, [1])
    assert not any(read_timers(True).values())  # off: nothing counted
    _steps(model, PROMPT, NEW, [1])
    spent = read_timers(False)
    assert all(spent[name] > 0 for name in TIMED_OPS)
    parts = step_breakdown(model, context=24, repeats=3)
    names = [p.name for p in parts]
    assert names[0].startswith("whole forward") and any("MLP matrices" in n for n in names)
    assert next(p for p in parts if "MLP matrices" in p.name).nbytes > 0
    # a verification's forward is broken down the same way: its matrices take 4 rows a weight
    wide = step_breakdown(model, context=24, repeats=3, width=4)
    assert [p.name for p in wide] == names
    assert wide[0].ms > 0
