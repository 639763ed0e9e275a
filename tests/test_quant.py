"""Packed int8/int4 weights: they compute what their dequantised weights compute, a row's result
does not depend on how many rows are computed with it (what makes speculative output equal plain
output in bfloat16), and a model with packed weights decodes speculatively token for token as
it decodes plainly, eager and compiled.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, prompts_of
from exactness import speculative_equals_plain  # noqa: F401 (other test files import it from here)
from specdraft.models.formats.choice import resolve_dtype, resolve_prefill_dtype, resolve_weights
from specdraft.models.formats.fp16_kernel import fp16_kernel_available
from specdraft.errors import SpecdraftError
from specdraft.loading import load_folder
from specdraft.models.formats.quant import PACKED_MAX_ROWS, Int4Linear, Int8Head, Int8Linear, compact_linear, compact_weights
from specdraft.speculative.engine import Engine

BF16 = torch.bfloat16
PACKED = {"int8": Int8Linear, "int4": Int4Linear, "int8-head": lambda w, b, dtype: Int8Head(w, dtype)}


def weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(BF16)


@pytest.mark.parametrize("fmt", PACKED)
def test_packed_linear_computes_its_dequantised_weight(fmt: str) -> None:
    w = weight()
    layer = PACKED[fmt](w, None, BF16)
    deq = layer.dequantized().float()
    # The quantisation error itself is bounded by half a step of the format.
    step = w.float().abs().amax(1, keepdim=True) / 127 if fmt.startswith("int8") else (w.float().abs().amax() * 2 / 15)
    assert ((deq - w.float()).abs() <= step / 2 + 1e-2).all()
    for rows in (1, 3, PACKED_MAX_ROWS + 4):  # the packed kernel, and the dequantise-then-GEMM path
        x = torch.randn(1, rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(BF16)
        ref = x.float() @ deq.t()
        # bf16 output (float32 from the head, rounded through bf16 scales): a few ulps of the result's magnitude.
        assert (layer(x).float() - ref).abs().max() <= 4 * 2**-8 * ref.abs().max()


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("fmt", PACKED)
def test_a_rows_result_does_not_depend_on_the_number_of_rows(fmt: str, dtype: torch.dtype) -> None:
    """Row i of an M-row product has the same bits for every M up to a verify width: the
    property that lets a K+1-row verification reproduce K+1 one-row steps exactly (bf16 and
    float32 activations; a dense float32 linear lacks it on AVX2-only CPUs)."""
    shapes = [(256, 640), (640, 2048), (4096, 640)] + ([(1000, 72)] if fmt == "int8-head" else [])
    for n, k in shapes:
        layer = PACKED[fmt](weight(n, k, seed=n), None, dtype)
        x = torch.randn(PACKED_MAX_ROWS, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(PACKED_MAX_ROWS)])
        for m in range(2, PACKED_MAX_ROWS + 1):
            assert torch.equal(layer(x[:m]), one_by_one[:m]), (n, k, m)


def test_widths_no_packed_kernel_takes_stay_dense() -> None:
    """_weight_int8pack_mm crashes the process on input widths that are not multiples of 16:
    such layers keep their dense weights (the compiled int8 head takes any width)."""
    odd, even = torch.nn.Linear(72, 32), torch.nn.Linear(64, 32)
    assert compact_linear(odd, "int8", BF16) is odd
    assert isinstance(compact_linear(even, "int8", BF16), Int8Linear)
    assert isinstance(compact_linear(torch.nn.Linear(48, 32), "int4", BF16), Int8Linear)  # 48 % 32: int8
    assert isinstance(compact_linear(even, "int4", BF16), Int4Linear)


def test_weights_choice_is_checked() -> None:
    cpu = torch.device("cpu")
    assert resolve_weights("auto", cpu, BF16) == "int8"
    assert resolve_weights("auto", cpu, torch.float32) == "dtype"  # float32 asked for: the reference
    assert resolve_weights("auto", cpu, torch.float32, dtype_chosen=True) == ("fp16" if fp16_kernel_available() else "dtype")
    # a model from a GGUF file whose blocks the C kernels read: its own blocks
    assert resolve_weights("auto", cpu, torch.float32, dtype_chosen=True, gguf_blocks=True) == "gguf"
    assert resolve_weights("auto", cpu, torch.float32, dtype_chosen=True, gguf_blocks=True, int8_rows=True) == "gguf-q8"
    assert resolve_weights("auto", cpu, torch.float32, gguf_blocks=True, int8_rows=True) == "dtype"
    assert resolve_weights("auto", cpu, torch.float32, gguf_blocks=True) == "dtype"  # float32 asked for
    assert resolve_weights("auto", cpu, BF16, dtype_chosen=True, gguf_blocks=True) == "int8"
    assert resolve_weights("dtype", cpu, torch.float32) == "dtype"
    assert resolve_weights("int8", cpu, torch.float32) == "int8"
    with pytest.raises(SpecdraftError, match="packed CPU kernels"):
        resolve_weights("int8", torch.device("cuda"), BF16)
    with pytest.raises(SpecdraftError, match="fp16 runs on FBGEMM"):
        resolve_weights("fp16", cpu, BF16)
    with pytest.raises(SpecdraftError, match="unknown weights"):
        resolve_weights("int3", cpu, BF16)


@pytest.mark.parametrize("bf16_units", [True, False])
def test_prefill_dtype_choice(monkeypatch, bf16_units: bool) -> None:
    """Prompts in bf16 only with gguf weights, on bf16 units, where --dtype auto chose float32."""
    monkeypatch.setattr("specdraft.models.formats.choice.cpu_has_bf16_units", lambda: bf16_units)
    assert resolve_prefill_dtype("auto", "gguf", dtype_chosen=True) == (BF16 if bf16_units else torch.float32)
    assert resolve_prefill_dtype("auto", "gguf", dtype_chosen=False) == torch.float32  # float32 asked for
    assert resolve_prefill_dtype("float32", "gguf", dtype_chosen=True) == torch.float32
    assert resolve_prefill_dtype("bfloat16", "gguf", dtype_chosen=False) == BF16
    assert resolve_prefill_dtype("auto", "int8", dtype_chosen=True) is None  # prompts run in --dtype
    with pytest.raises(SpecdraftError, match="applies to --weights gguf"):
        resolve_prefill_dtype("bfloat16", "dtype", dtype_chosen=True)
    with pytest.raises(SpecdraftError, match="unknown prefill dtype"):
        resolve_prefill_dtype("float16", "gguf", dtype_chosen=True)


@pytest.mark.parametrize("bf16_units", [True, False])
def test_auto_dtype_is_float32_where_the_weights_run_float32_kernels(monkeypatch, bf16_units: bool) -> None:
    """A model with GGUF blocks the C kernels read gets float32 + gguf on any CPU, bf16 units or not."""
    monkeypatch.setattr("specdraft.models.formats.choice.cpu_has_bf16_units", lambda: bf16_units)
    cpu, default = torch.device("cpu"), BF16 if bf16_units else torch.float32
    assert resolve_dtype("auto", cpu) == default
    assert resolve_dtype("auto", cpu, "int8") == default
    assert resolve_dtype("auto", cpu, "auto", gguf_blocks=True) == torch.float32
    assert resolve_dtype("auto", cpu, "gguf") == torch.float32
    assert resolve_dtype("auto", cpu, "fp16") == torch.float32
    assert resolve_dtype("bfloat16", cpu, "auto", gguf_blocks=True) == BF16  # asked for: kept
    assert resolve_weights("auto", cpu, resolve_dtype("auto", cpu, "auto", True), True, True) == "gguf"
    assert resolve_weights("auto", cpu, resolve_dtype("auto", cpu, "auto", True), True, True, True) == "gguf-q8"


def packed_tiny(tiny: TinyModel, fmt: str, dtype: torch.dtype = BF16):
    model, _, _ = load_folder(tiny.folder, dtype, "cpu")
    compact_weights(model, fmt)
    return model


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_model_stays_close_to_bf16(gemma_tiny: TinyModel, fmt: str) -> None:
    ids = torch.tensor(prompts_of([20], gemma_tiny.cfg.vocab_size, seed=3))
    dense, _, _ = load_folder(gemma_tiny.folder, BF16, "cpu")
    packed = packed_tiny(gemma_tiny, fmt)
    with torch.inference_mode():
        ref = torch.log_softmax(dense.logits(dense(ids, dense.new_cache(1, 24))), -1)
        got = torch.log_softmax(packed.logits(packed(ids, packed.new_cache(1, 24))), -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert kl < (0.01 if fmt == "int8" else 0.2), kl
    assert any(isinstance(m, Int8Linear if fmt == "int8" else Int4Linear) for m in packed.modules())
    assert isinstance(packed.packed_head, Int8Head if fmt == "int8" else Int4Linear)


def repetitive_prompts(vocab: int, n: int = 4) -> list[list[int]]:
    # Repeats give prompt lookup long drafts, so verification runs wide.
    return [p + p[:7] + p for p in prompts_of([9, 14, 11, 6][:n], vocab, seed=11)]


def one_repetitive_prompt(vocab: int) -> list[list[int]]:
    # The one whose repeats prompt lookup finds within 16 new tokens on the tiny Gemma (the
    # first is drafted for but never accepted there: it would test nothing).
    return repetitive_prompts(vocab)[1:2]


@pytest.mark.parametrize("batch", [1, 4])
def test_bf16_int8_speculative_output_equals_plain(gemma_tiny: TinyModel, batch: int, monkeypatch) -> None:
    """The default CPU configuration (bfloat16 activations, int8 weights) is exact, not just fp32."""
    model = packed_tiny(gemma_tiny, "int8")
    speculative_equals_plain(model, repetitive_prompts(gemma_tiny.cfg.vocab_size), batch, monkeypatch=monkeypatch)


@pytest.mark.parametrize("batch", [1, 4])
def test_float32_int8_speculative_output_equals_plain(gemma_tiny: TinyModel, batch: int, monkeypatch) -> None:
    """int8 weights with float32 activations (`--dtype float32 --weights int8`, the fast choice on
    CPUs without bf16 units) are exact too."""
    model = packed_tiny(gemma_tiny, "int8", torch.float32)
    speculative_equals_plain(model, repetitive_prompts(gemma_tiny.cfg.vocab_size), batch, monkeypatch=monkeypatch)


@pytest.mark.slow
def test_compiled_step_matches_eager_in_float32(gemma_tiny: TinyModel, monkeypatch) -> None:
    """Eager is the reference: in float32 the compiled step gives the same logits up to rounding
    and the same greedy tokens, plain and speculative."""
    from specdraft.models.compile import compile_steps

    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    prompts = one_repetitive_prompt(gemma_tiny.cfg.vocab_size)
    eager = Engine(model).generate(prompts, 16, eos_token_ids=[])
    n = len(prompts[0])
    with torch.inference_mode():
        # Made in inference mode and passed as fresh tensors, like the engine's: a tensor made
        # outside inference mode carries another dispatch key, and a slice a storage offset, which
        # Dynamo guards on; either would cost a third graph.
        ids = torch.tensor([prompts[0] + eager[0].token_ids])
        ref = model.logits(model(ids, model.new_cache(1, 64))[:, n:])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        step = compile_steps(model, announce=False)
        cache = model.new_cache(1, 64)
        model(ids[:, :n], cache)  # the prompt: eager
        got = torch.cat([model.logits(model(ids[:, t : t + 4].clone(), cache)) for t in range(n, ids.shape[1], 4)], 1)
    assert step.compile_seconds > 0  # the compiled graph really ran
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert Engine(model).generate(prompts, 16, eos_token_ids=[])[0].token_ids == eager[0].token_ids
    speculative_equals_plain(model, prompts, 1, monkeypatch=monkeypatch)
    # The MTP drafter beside the compiled target reads its cache (written by index in the graph)
    # and hidden states: its drafts are accepted, the output is plain output, no graph is added.
    speculative_equals_plain(model, prompts, 1, monkeypatch=monkeypatch, make_drafter=lambda _: mtp_drafter(model))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2  # batch 1: width 1 and wider


def mtp_drafter(model):
    """A random MTP drafter whose open copy gate gets copies of repeated text accepted (as in
    test_engine.py's "mtp-gate")."""
    import tempfile
    from pathlib import Path

    from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network

    cfg = drafter_config_for(model, hidden=32, layers=2, heads=4, head="target", clustered=True, num_centroids=16,
                             top_k_clusters=4)
    cfg.copy_gate = True
    net = init_network(cfg, model, seed=3, std=0.1)
    with torch.no_grad():
        net.copy_gate.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        net.copy_gate.proj.bias.fill_(3.0)
    with tempfile.TemporaryDirectory() as folder:
        save_network(net, Path(folder))
        return load_mtp_drafter(Path(folder), model, torch.float32, "cpu")


@pytest.mark.slow
def test_compiled_bf16_int8_speculative_output_equals_plain(gemma_tiny: TinyModel, monkeypatch) -> None:
    from specdraft.models.compile import compile_steps

    from specdraft import runtime

    model = packed_tiny(gemma_tiny, "int8")
    runtime._warm_up_int8_head(model.packed_head, progress=False)  # its own graphs, not counted below
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step = compile_steps(model, announce=False)
    speculative_equals_plain(model, one_repetitive_prompt(gemma_tiny.cfg.vocab_size), 1,  # batch-1 graphs only
                             monkeypatch=monkeypatch)
    assert step.compile_seconds > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2


def test_int8_head_without_a_compiler_falls_back_to_the_packed_kernel(gemma_tiny: TinyModel, monkeypatch, capsys) -> None:
    """No C++ compiler for Inductor: the head takes torch's packed kernel for every call (one
    kernel for all widths keeps speculation exact) and the user is told, no stack trace."""
    from specdraft import runtime
    from specdraft.models.formats import int8_head

    model = packed_tiny(gemma_tiny, "int8")

    def no_compiler(in_features: int) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(int8_head, "warm_up", no_compiler)
    runtime._warm_up_int8_head(model.packed_head, progress=True)
    assert not model.packed_head.compiled
    assert "unavailable" in capsys.readouterr().err
    x = torch.randn(3, model.packed_head.in_features).to(BF16)
    packed = torch.ops.aten._weight_int8pack_mm(x, model.packed_head.qweight, model.packed_head.scales)
    assert torch.equal(model.packed_head.packed_mm(x), packed)
    speculative_equals_plain(model, repetitive_prompts(gemma_tiny.cfg.vocab_size, 2), 1, monkeypatch=monkeypatch)


def test_fused_projections_compute_what_the_separate_ones_did(gemma_tiny: TinyModel) -> None:
    """q/k/v and gate/up stacked into one linear each (done before packing): the same logits up
    to float32 rounding, the same greedy tokens; fusing twice changes nothing."""
    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    prompts = repetitive_prompts(gemma_tiny.cfg.vocab_size, 2)
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        ref = model.logits(model(ids, model.new_cache(1, 64)))
        plain = Engine(model).generate(prompts, 16, eos_token_ids=[])
        model.fuse_projections()
        model.fuse_projections()
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
        assert mlp.gate_up_proj is not None and not hasattr(mlp, "gate_proj")
        got = model.logits(model(ids, model.new_cache(1, 64)))
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    assert [r.token_ids for r in Engine(model).generate(prompts, 16, eos_token_ids=[])] == [r.token_ids for r in plain]
