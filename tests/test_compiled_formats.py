"""The compiled step (models/compile.py) on the CPU with q8, q4 and gguf-q8 weights: speculative
output equals plain output, drafts accepted, and the compiled graphs really ran (the MTP drafter
with a compiled target: test_quant.py). Slow (torch.compile): batch 1 only (two graphs: width 1
and wider), on one tiny Llama whose graphs are alike in the three formats, so Inductor's cache
serves the later ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactness import noisy_oracle, speculative_equals_plain
from specdraft.loading import load_folder
from specdraft.models.compile import compile_steps
from specdraft.models.formats import q8_act_linear
from specdraft.models.formats.quant import compact_weights

pytestmark = pytest.mark.slow
# test_gguf_weights.write_quantised_gguf's Llama
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, head_dim=16,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
BATCH_1_GRAPHS = {(True, True), (True, False)}  # (batch 1, width 1): decode and verify


def assert_graphs_ran(model) -> None:
    step = model.compiled_step
    assert step.compile_seconds > 0 and BATCH_1_GRAPHS <= step._seen, step._seen


q8_kernels = pytest.mark.skipif(not q8_act_linear.kernel_available(), reason="q8 kernels need x86 AVX2 and a C compiler")


@pytest.fixture(scope="module", params=["q8", "q4"])
def compiled_compact(request, tmp_path_factory):
    """A tiny Llama loaded straight into q8 / q4 (Q8ActLinear layers), compiled."""
    if not q8_act_linear.kernel_available():
        pytest.skip("q8 kernels need x86 AVX2 and a C compiler")
    from conftest import build_hf, save_hf

    folder = save_hf(build_hf("llama", seed=5, **TINY_LLAMA), tmp_path_factory.mktemp("llama"))
    model, _, _ = load_folder(folder, torch.float32, "cpu", request.param)
    compact_weights(model, request.param)
    assert type(model.layers[0].mlp.down_proj) is q8_act_linear.Q8ActLinear
    compile_steps(model, announce=False)
    return model


def test_compiled_q8_and_q4_speculative_equals_plain(compiled_compact, monkeypatch) -> None:
    from conftest import prompts_of

    model = compiled_compact
    prompts = prompts_of([11], model.config.vocab_size, seed=9)
    speculative_equals_plain(model, prompts, 1, 20, monkeypatch, noisy_oracle(model.config.vocab_size))
    assert_graphs_ran(model)


@q8_kernels
def test_compiled_gguf_q8_speculative_equals_plain(tmp_path: Path, monkeypatch) -> None:
    from conftest import prompts_of
    from specdraft.runtime import Runtime
    from test_gguf_weights import write_quantised_gguf

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = write_quantised_gguf(tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    rt = Runtime.load(str(path), dtype="float32", weights="gguf-q8", compile=True, progress=False)
    assert rt.weights == "gguf-q8"
    prompts = prompts_of([11], rt.config.vocab_size, seed=9)
    speculative_equals_plain(rt.model, prompts, 1, 20, monkeypatch, noisy_oracle(rt.config.vocab_size))
    assert_graphs_ran(rt.model)
