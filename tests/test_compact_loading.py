"""Loading straight into compact formats (q8 / q4, MoE experts included) and the memory check
that runs before any weight is read.

Tiny random Gemma 4 checkpoints (transformers' own classes, save_pretrained), one with PLE and
KV sharing, one with routed experts and an untied head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemma4_tiny import moe_overrides, randomize_, target_text_config  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.kv_cache import PREFILL_CHUNK  # noqa: E402
from specdraft.loading import describe_folder, load_folder  # noqa: E402
from specdraft.loading.footprint import check_fits, estimate  # noqa: E402
from specdraft.models.formats import q8_act_linear  # noqa: E402
from specdraft.models.formats.quant import compact_weights  # noqa: E402

pytestmark = pytest.mark.skipif(not q8_act_linear.kernel_available(), reason="q8 kernels need x86 AVX2 and a C compiler")

CONFIGS = {
    "ple_kv_shared": {},
    "moe_untied": dict(moe_overrides(), attention_k_eq_v=False, num_global_key_value_heads=None,
                       tie_word_embeddings=False, final_logit_softcapping=None),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**CONFIGS[request.param])), seed=1)
    out = tmp_path_factory.mktemp(request.param)
    ref.to(torch.bfloat16).save_pretrained(out)  # the published checkpoints are bf16
    return out


def _load(folder: Path, fmt: str, stream: bool):
    model, _, _ = load_folder(folder, torch.float32, "cpu", fmt if stream else "dtype")
    compact_weights(model, fmt)
    return model


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
    with torch.inference_mode():
        return model.logits(model(ids, cache))


IDS = torch.randint(3, 250, (2, 21), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_compacting_while_reading_equals_compacting_after(folder: Path, fmt: str) -> None:
    streamed, loaded = _load(folder, fmt, True), _load(folder, fmt, False)
    assert torch.equal(_logits(streamed, IDS), _logits(loaded, IDS))
    kinds = {type(m).__name__ for m in streamed.layers.modules()}
    assert "Q8ActLinear" in kinds and type(streamed.packed_head).__name__ == "Q8ActLinear"
    assert not any(n.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3 for n, p in streamed.named_parameters())


def test_tables_stay_as_the_checkpoint_stores_them(folder: Path) -> None:
    model = _load(folder, "q8", True)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    if getattr(model, "embed_tokens_per_layer", None) is not None:
        assert model.embed_tokens_per_layer.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("top", [127, 7])
def test_block_codes_round_each_weight_to_the_nearest_step(top: int) -> None:
    """q8 / q4 codes: w = s * c with |c| <= top and s = max|w| / top per 32 inputs, so every weight
    is within half a step of its code (the arithmetic's own bound; model-level drift on random
    weights says nothing about real ones). Rows past a chunk boundary round the same way."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 96)
    blocks = q8_act_linear.symmetric_blocks(w, top, chunk=16)
    step = blocks.scales.repeat_interleave(32, dim=1)
    assert int(blocks.codes.abs().max()) <= top
    assert bool(((w - blocks.dequantized()).abs() <= step / 2 * (1 + 1e-6)).all())
    assert torch.equal(blocks.codes, q8_act_linear.symmetric_blocks(w, top).codes)


def test_speculative_equals_plain_in_q8(folder: Path, monkeypatch) -> None:
    from exactness import noisy_oracle, speculative_equals_plain

    model = _load(folder, "q8", True)
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(3, 250, (6,), generator=gen).tolist()
    prompts = [base * 3, base[:4] * 4 + base]
    # Noisy oracle drafts: the MoE model's text gives prompt lookup nothing it accepts.
    speculative_equals_plain(model, prompts, 2, 16, monkeypatch, noisy_oracle(model.config.vocab_size))


def test_estimate_counts_formats_and_context(folder: Path) -> None:
    _, shape = describe_folder(folder)
    q8, q4 = estimate(shape, "q8", torch.float32, 1024), estimate(shape, "q4", torch.float32, 1024)
    assert q4.weights < q8.weights < estimate(shape, "dtype", torch.float32, 1024).weights
    per_position = {False: 0, True: 0}  # bytes per cached position: full layers, sliding layers
    element = 2  # Gemma 4's cache holds float16 on the CPU (kv_cache.kv_storage_dtype)
    for layer in shape.kv_layers():
        lay = shape.attention_layout(layer)
        per_position[lay.window is not None] += 2 * lay.num_kv_heads * lay.head_dim * element
    ring = shape.config.sliding_window + PREFILL_CHUNK  # sliding layers keep a ring (kv_cache.py)
    for context in (16, 1024, 2048):
        kv = estimate(shape, "q8", torch.float32, context).kv
        assert kv == per_position[False] * context + per_position[True] * min(context, ring)
    assert estimate(shape, "q8", torch.float32, 1024, batch_size=4).kv == 4 * q8.kv


def test_a_model_that_cannot_fit_is_refused_before_any_weight_is_read(folder: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    from specdraft.runtime import Runtime

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(b"not a safetensors file" if f.suffix == ".safetensors" else f.read_bytes())
    _, shape = describe_folder(folder)
    need = estimate(shape, "q8", torch.float32, 4096).total
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str(need // 2))
    with pytest.raises(SpecdraftError, match=r"needs ~.* GB \(weights .* as q8, KV cache .* GB for \d+ tokens.*is available"):
        Runtime.load(str(broken), weights="q8", progress=False, context=4096)


def test_the_refusal_names_a_setting_that_fits(folder: Path) -> None:
    _, shape = describe_folder(folder)
    q8 = estimate(shape, "q8", torch.float32, 65536)
    short = estimate(shape, "q8", torch.float32, 512)
    with pytest.raises(SpecdraftError, match=r"--max-context \d+ fits"):
        check_fits(shape, "tiny", "q8", torch.float32, 65536, available=(q8.total + short.total) // 2)
    with pytest.raises(SpecdraftError, match=r"--weights q4 fits \(~"):
        check_fits(shape, "tiny", "q8", torch.float32, 512, available=short.total - 1)
    with pytest.raises(SpecdraftError, match=r"no smaller format or context"):
        check_fits(shape, "tiny", "q8", torch.float32, 512, available=1 << 20)


def test_a_step_reads_one_row_of_each_lookup_table(folder: Path) -> None:
    """`specdraft steps` divides these bytes by the bandwidth for its floor: a per-layer table a
    step gathers one row of must not count whole (E2B's is 4.7 GB, a step reads 18 KB of it)."""
    from specdraft.bench.steps import weight_bytes_per_step

    model = _load(folder, "q8", True)
    before = weight_bytes_per_step(model)
    table = model.embed_tokens.weight
    grown = torch.nn.Embedding(table.shape[0] * 64, table.shape[1], dtype=table.dtype)
    model.embed_tokens = grown  # the q8 head is packed apart: the token table is looked up only
    assert weight_bytes_per_step(model) == before
    packed = sum(b.numel() * b.element_size() for b in model.packed_head.buffers())
    assert before >= packed + table[0].numel() * table.element_size()


def test_a_step_reads_the_routed_experts_only(folder: Path) -> None:
    """A one-token step of a MoE layer reads the top_k experts its token is routed to: routing
    to every expert instead adds exactly the other experts' stored bytes."""
    from specdraft.bench.steps import weight_bytes_per_step

    model = _load(folder, "q8", True)
    layers = [m for m in model.modules() if getattr(m, "moe", False)]
    if not layers:
        pytest.skip("no MoE block in this config")
    routed = weight_bytes_per_step(model)
    skipped = 0
    for layer in layers:
        experts, n = layer.experts, layer.router.proj.out_features
        stored = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers()))
        assert stored > 0
        skipped += stored * (n - layer.router.top_k) // n
        layer.router.top_k = n
    assert weight_bytes_per_step(model) == routed + skipped


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_q8_and_q4_load_streamed_for_decoders_that_fuse_projections(tiny_factory, family: str, monkeypatch) -> None:
    """Llama-style and Gemma 3 decoders fuse q/k/v and gate/up before packing; a streamed q8 / q4
    load has compacted them one by one already, and they stay so (it used to fail on them). Each
    output row is the same blocks' dot product either way, so the logits are those of the model
    fused and compacted after loading up to float32 rounding (the fused one runs whole layers in
    one C call), and drafting changes no token."""
    from conftest import assert_fp32_close, reduction_depth
    from exactness import noisy_oracle, speculative_equals_plain

    tiny = tiny_factory(family)
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(11))
    for fmt in ("q8", "q4"):
        streamed, fused = _load(tiny.folder, fmt, True), _load(tiny.folder, fmt, False)
        assert type(streamed.layers[0].self_attn.q_proj) is q8_act_linear.Q8ActLinear
        assert fused.layers[0].self_attn.qkv_proj is not None
        assert_fp32_close(_logits(streamed, ids), _logits(fused, ids), reduction_depth(streamed.config))
        speculative_equals_plain(streamed, [ids[0].tolist()], 1, 12, monkeypatch,
                                 noisy_oracle(streamed.config.vocab_size), k=3)
