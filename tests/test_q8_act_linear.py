"""--weights gguf-q8: GGUF blocks against int8 activations, row-invariant.

Oracles: float64 products of the float32 weights and rows, within the proven error of rounding
each row to int8 per 32 inputs (|x - t q| <= t / 2); a one-row call (bit for bit at every call
size and thread count); the per-op path against the one-call layer; plain decoding against
speculative decoding (token for token).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import prompts_of
from test_gguf_weights import write_quantised_gguf
from test_quant import repetitive_prompts, speculative_equals_plain
from specdraft.models.formats import q8_act_linear
from specdraft.models.kernels import build
from specdraft.loading.gguf_blocks import decode_blocks
from specdraft.models.formats.block_linear import Blocks, TwoLevel
from specdraft.models.formats.q8_act_linear import Q8ActLinear

kernel = pytest.mark.skipif(not q8_act_linear.kernel_available(), reason="no AVX2 CPU or no C compiler here")


def random_blocks(n: int, k: int, group: int, low: int, high: int, offsets: bool, seed: int) -> Blocks:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, high + 1, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02
    offs = torch.rand(n, k // group, generator=gen) * 0.05 if offsets else None
    return Blocks(codes, scales, offs, group)


def quantisation_bound(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """[M, N] bound on |x W^T - y|: the rounding of each row to int8 per 32 inputs, t / 2 per input
    (t = max|x| / 127 of its block), times |w|; plus float32's share of the sums (1e-5 of the
    magnitudes the kernel adds: the codes' products, the offsets and the base's)."""
    t = x.abs().view(x.shape[0], -1, 32).amax(-1) / 127
    per_input = (t / 2).repeat_interleave(32, dim=1).double()
    w = blocks.dequantized().double()
    s = blocks.scales.double().repeat_interleave(blocks.group, dim=1)
    o = 0 if blocks.offsets is None else blocks.offsets.double().repeat_interleave(blocks.group, dim=1)
    magnitude = (s * blocks.codes.double()).abs() + 128 * s + (o.abs() if blocks.offsets is not None else 0)
    return per_input @ w.abs().T + 1e-5 * (x.double().abs() @ magnitude.T)


@kernel
@pytest.mark.parametrize("group,low,high,offsets,k", [
    (32, -16, 15, False, 640),  # Q5_0
    (32, -127, 127, False, 192),  # Q8_0
    (16, -32, 31, False, 256),  # Q6_K
    (32, 0, 15, True, 320),  # Q4_K (4-bit codes, kept two a byte)
    (32, -8, 7, False, 64),  # Q4_0
    (16, -8, 7, False, 128),  # 4-bit codes in groups of 16
    (32, 0, 100, False, 96),  # codes spanning 101 values: every product pair widened on AVX2
])
def test_kernel_is_within_the_quantisation_bound_and_row_invariant(group, low, high, offsets, k) -> None:
    blocks = random_blocks(48, k, group, low, high, offsets, seed=k)
    bias = torch.randn(48)
    layer = Q8ActLinear(blocks, bias)
    assert layer.nibbles == (high - low <= 15)
    x = torch.randn(9, k) * torch.linspace(0.1, 3.0, k)  # scales that differ block to block
    x[4, :32] = 0.0  # an all-zero block: scale 0
    y = layer(x)
    exact = x.double() @ blocks.dequantized().double().T + bias.double()
    err = (y.double() - exact).abs()
    assert (err <= quantisation_bound(x, blocks)).all()
    assert err.max() > 0  # int8 rows do change the result: the bound is what is tested
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, threads):
            torch.set_num_threads(n_threads)
            for m in range(1, 10):  # every call size gives each row the bits of a one-row call
                assert torch.equal(layer(x[:m]), y[:m])
            for i in range(9):
                assert torch.equal(layer(x[i:i + 1]), y[i:i + 1])
    finally:
        torch.set_num_threads(threads)


@kernel
@pytest.mark.parametrize("group,low,high", [(32, -127, 127), (32, -16, 15), (32, -8, 7), (16, -32, 31)])
def test_fp16_scales_give_the_float32_scales_bits(group: int, low: int, high: int) -> None:
    """Scales that fp16 holds exactly (Q8_0's: the file stores them so) are kept as fp16, half the
    bytes, and the kernel widens them to the same float32 numbers: the same outputs bit for bit at
    every row count; scales fp16 does not hold, or offsets, stay float32."""
    blocks = random_blocks(48, 256, group, low, high, False, seed=group + high)
    exact = Blocks(blocks.codes, blocks.scales.half().float(), None, group)
    layer = Q8ActLinear(exact, None)
    assert layer.scales.dtype == torch.float16 and layer.kernel_layout & q8_act_linear.HALF_SCALES
    wide = Q8ActLinear(exact, None)
    wide.scales = layer.scales.float()  # the same numbers in float32
    assert not wide.kernel_layout & q8_act_linear.HALF_SCALES
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    for m in range(1, 10):
        assert torch.equal(layer(x[:m]), wide(x[:m]))
    assert Q8ActLinear(blocks, None).scales.dtype == torch.float32  # not all fp16-exact
    offsets = torch.zeros_like(exact.scales)
    assert Q8ActLinear(Blocks(exact.codes, exact.scales, offsets, group), None).scales.dtype == torch.float32


def two_level_blocks(n: int, k: int, group: int, low: int, high: int, offsets: bool, seed: int) -> Blocks:
    """Blocks whose scales (and offsets) are K-quant style: an int8 multiplier per group times an fp16
    factor per 256 inputs, with the parts kept beside the products."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, high + 1, (n, k), dtype=torch.int8, generator=gen)

    def parts(top: int) -> TwoLevel:
        multipliers = torch.randint(-top if group == 16 else 0, top + 1, (n, k // group), dtype=torch.int8, generator=gen)
        return TwoLevel(multipliers, (torch.rand(n, k // 256, generator=gen) * 1e-3).half())

    def values(p: TwoLevel) -> torch.Tensor:
        return p.multipliers.float() * p.factors.float().repeat_interleave(256 // group, dim=1)

    scale_parts = parts(127 if group == 16 else 63)
    offset_parts = parts(63) if offsets else None
    return Blocks(codes, values(scale_parts), None if offset_parts is None else values(offset_parts), group,
                  scale_parts, offset_parts)


@kernel
@pytest.mark.parametrize("group,low,high,offsets", [(32, 0, 15, True), (16, -32, 31, False), (32, -127, 127, False)])
def test_k_quant_scales_kept_two_level_give_the_float32_scales_bits(group, low, high, offsets) -> None:
    """Q4_K / Q6_K scales kept as the file keeps them (6-bit or int8 multipliers and an fp16 factor
    per 256 inputs): a quarter of float32's bytes, the same float32 numbers in the kernel, so the
    same outputs bit for bit; parts that do not multiply back exactly are not used."""
    blocks = two_level_blocks(48, 512, group, low, high, offsets, seed=group + high)
    layer = Q8ActLinear(blocks, None)
    assert layer.kernel_layout & q8_act_linear.TWO_LEVEL
    plain = Q8ActLinear(Blocks(blocks.codes, blocks.scales, blocks.offsets, group), None)
    assert not plain.kernel_layout & q8_act_linear.TWO_LEVEL
    assert layer.scales.numel() * layer.scales.element_size() * 3 < plain.scales.numel() * plain.scales.element_size()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    for m in range(1, 10):
        assert torch.equal(layer(x[:m]), plain(x[:m]))
    off = Blocks(blocks.codes, blocks.scales * 1.5, blocks.offsets, group, blocks.scale_parts, blocks.offset_parts)
    assert not Q8ActLinear(off, None).kernel_layout & q8_act_linear.TWO_LEVEL  # parts disagree: float32


@kernel
def test_six_bit_codes_in_two_planes_give_the_byte_layouts_bits() -> None:
    """Codes of at most 64 values (Q6_K, Q5_0) are kept as a nibble plane and a 2-bit plane (0.75
    bytes a code): each output equals the byte layout's, which a wider code span elsewhere forces."""
    blocks = random_blocks(48, 256, 16, -32, 31, False, seed=5)
    six = Q8ActLinear(blocks, None)
    assert six.layout == q8_act_linear.SIXBITS and six.packed_codes.numel() == 48 * 256 * 3 // 4
    wider = Blocks(torch.cat([blocks.codes, torch.full((16, 256), 100, dtype=torch.int8)]),
                   torch.cat([blocks.scales, blocks.scales[:16]]), None, 16)
    bytes_layout = Q8ActLinear(wider, None)
    assert bytes_layout.layout in (q8_act_linear.BYTES, q8_act_linear.SIGNED)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    for m in (1, 4, 5, 9):
        assert torch.equal(six(x[:m]), bytes_layout(x[:m])[:, :48])


@kernel
@pytest.mark.parametrize("group,span", [(32, 15), (16, 15), (32, 31), (16, 63), (32, 64), (32, 65), (32, 128)])
def test_16_bit_sums_at_their_largest_stay_exact(group: int, span: int) -> None:
    """The AVX2 loop adds as many pair sums in 16 bits as the codes' span allows before widening
    them: at the extreme (codes at the top of the span, activations at +-127 with one sign) the
    sums reach that bound, and an overflow would be off by 65536 code units or saturate."""
    n, k, low = 16, 256, -(span // 2)
    codes = torch.full((n, k), low + span, dtype=torch.int16)
    codes[:, ::7] = low  # the smallest code: unsigned codes u = c - low reach `span`
    blocks = Blocks(codes.to(torch.int8), torch.full((n, k // group), 1.0 / 1024), None, group)
    layer = Q8ActLinear(blocks, None)
    assert layer.code_max == span
    x = torch.stack([torch.ones(k), -torch.ones(k), torch.linspace(-1, 1, k)])  # q = +-127 per input
    exact = x.double() @ blocks.dequantized().double().T
    assert torch.allclose(layer(x).double(), exact, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not (q8_act_linear.kernel_available() and build.avx512_here()),
                    reason="needs an AVX-512 VNNI CPU to compare the AVX2 loops against")
@pytest.mark.parametrize("group,low,high,offsets,k", [
    (32, -16, 15, False, 640), (32, -127, 127, False, 192), (32, -128, 127, False, 64), (16, -32, 31, False, 256),
    (32, 0, 15, True, 320),
])
def test_the_avx2_loops_give_the_vnni_loops_bits(group, low, high, offsets, k, monkeypatch) -> None:
    """Both take the same integer sums and the same float32 epilogue per output, so a model gives
    the same tokens on AVX2 and AVX-512 machines (wide codes, split into nibbles on AVX2, included)."""
    blocks, bias = random_blocks(48, k, group, low, high, offsets, seed=k + 1), torch.randn(48)
    x = torch.randn(9, k) * torch.linspace(0.1, 3.0, k)
    kquant = two_level_blocks(48, 512, group, low, high, offsets, seed=k) if k % 64 == 0 else None
    outs = []
    for avx512 in (True, False):  # each build packs the codes its own way (signed ones on AVX2)
        monkeypatch.setattr(build, "library", lambda avx512=avx512: build.library_for(avx512))
        outs.append(Q8ActLinear(blocks, bias)(x))
        if kquant is not None:
            outs.append(Q8ActLinear(kquant, None)(torch.randn(9, 512, generator=torch.Generator().manual_seed(4))))
    for vnni, avx2 in zip(outs[: len(outs) // 2], outs[len(outs) // 2:]):
        assert torch.equal(vnni, avx2)


def random_gguf_bytes(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of a format with small, finite fp16 scales (d, dmin)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = np.random.default_rng(seed).integers(0, 256, size=(n * k // values, nbytes), dtype=np.uint8)
    for at in {"Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[fmt]:
        raw[:, at:at + 2] = np.frombuffer(np.float16(0.004 + at / 1e4).tobytes(), np.uint8)
    return raw


@kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("avx512", [True, False])
def test_matrices_laid_out_from_the_files_bytes_give_the_decoded_blocks_bits(fmt: str, avx512: bool,
                                                                               monkeypatch) -> None:
    """gguf_repack.c lays a Q8_0 / Q4_K / Q6_K matrix out straight from the file's bytes: the same
    outputs, bit for bit at every row count, as packing the decoded blocks; bytes of another
    length are not taken."""
    if avx512 and not build.avx512_here():
        pytest.skip("no AVX-512 VNNI here")
    monkeypatch.setattr(build, "library", lambda: build.library_for(avx512))
    n, k = 48, 512
    raw = random_gguf_bytes(fmt, n, k, seed=len(fmt))
    decoded = Q8ActLinear(decode_blocks(raw, fmt, (n, k)), None)
    laid_out = Q8ActLinear.from_file(torch.from_numpy(raw.reshape(-1)), fmt, n, k)
    assert laid_out.kernel_layout == decoded.kernel_layout
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(6))
    for m in (1, 2, 4, 5, 9):
        assert torch.equal(laid_out(x[:m]), decoded(x[:m]))
    assert Q8ActLinear.from_file(torch.from_numpy(raw.reshape(-1)[:-1]), fmt, n, k) is None
    assert Q8ActLinear.from_file(torch.from_numpy(raw.reshape(-1)), "Q5_0", n, k) is None


def test_the_kernel_refuses_shapes_it_does_not_take() -> None:
    assert Q8ActLinear.takes(random_blocks(32, 64, 32, -16, 15, False, seed=1))
    assert not Q8ActLinear.takes(random_blocks(24, 64, 32, -16, 15, False, seed=1))  # outputs not in 16s
    assert not Q8ActLinear.takes(random_blocks(32, 48, 16, -16, 15, False, seed=1))  # inputs not in 32s
    wide = random_blocks(32, 64, 32, -16, 15, False, seed=1)
    wide.codes[0, 0], wide.codes[0, 1] = -128, 127
    assert Q8ActLinear.takes(wide)  # 256 codes: still unsigned bytes
    with pytest.raises(ValueError, match="gguf-q8"):
        Q8ActLinear(random_blocks(24, 64, 32, -16, 15, False, seed=1), None)


@kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q5_0"])
def test_gguf_q8_decodes_near_the_float32_model_and_speculation_is_exact(tmp_path: Path, monkeypatch,
                                                                         fmt: str) -> None:
    from test_cpu_kernels import one_call_bits_equal_per_op
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = write_quantised_gguf(tmp_path / f"tiny-{fmt}.gguf", fmt)
    q8 = Runtime.load(str(path), dtype="float32", weights="gguf-q8", progress=False)
    exact = Runtime.load(str(path), dtype="float32", weights="gguf", progress=False)
    kinds = {type(m).__name__ for m in q8.model.layers.modules()}
    assert "Q8ActLinear" in kinds and "BlockLinear" not in kinds and "Linear" not in kinds
    assert q8.weights == "gguf-q8" and q8.notes == []
    vocab = q8.config.vocab_size
    ids = torch.tensor([prompts_of([12], vocab, seed=2)[0]])
    with torch.inference_mode():
        cache_q, cache_e = q8.model.new_cache(1, 40), exact.model.new_cache(1, 40)
        q8.model(ids, cache_q), exact.model(ids, cache_e)
        for token in prompts_of([6], vocab, seed=3)[0]:
            t = torch.tensor([[token]])
            lq, le = q8.model.logits(q8.model(t, cache_q)), exact.model.logits(exact.model(t, cache_e))
            # each linear is within its proven bound (above); through a random tiny model's layers
            # int8 rows move the logits by up to ~14% of their spread and the distribution by a
            # KL of ~1e-3 (measured): twice that fails
            assert 0 < (lq - le).abs().max().item() < 0.3 * le.std().item()
            assert torch.nn.functional.kl_div(lq.log_softmax(-1), le.log_softmax(-1), log_target=True,
                                              reduction="batchmean").item() < 2.5e-3
    for batch in (1, 4):  # wide verifications give each row its one-row bits: output equals plain
        speculative_equals_plain(q8.model, repetitive_prompts(vocab), batch, monkeypatch=monkeypatch)
    assert one_call_bits_equal_per_op(q8.model, prompts_of([20], vocab, seed=6)[0], monkeypatch, 10)


def test_gguf_q8_is_refused_clearly_without_the_kernel(tmp_path: Path, monkeypatch) -> None:
    from specdraft.errors import SpecdraftError
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = write_quantised_gguf(tmp_path / "tiny.gguf", "Q8_0")
    monkeypatch.setattr(q8_act_linear, "kernel_available", lambda: False)
    with pytest.raises(SpecdraftError, match="AVX2"):
        Runtime.load(str(path), dtype="float32", weights="gguf-q8", progress=False)
    with pytest.raises(SpecdraftError, match="float32"):
        Runtime.load(str(path), dtype="bfloat16", weights="gguf-q8", progress=False)


def test_int8_blocks_round_each_weight_to_the_nearest_code() -> None:
    from specdraft.models.formats.q8_act_linear import int8_blocks

    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 2.0, 96)
    w[3, 32:64] = 0.0  # an all-zero group: scale 0, codes 0
    blocks = int8_blocks(w)
    assert blocks.codes.dtype == torch.int8 and blocks.codes.abs().max() == 127 and blocks.offsets is None
    assert blocks.scales.shape == (16, 3) and blocks.scales[3, 1] == 0
    step = blocks.scales.repeat_interleave(32, dim=1)
    assert ((blocks.dequantized() - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert Q8ActLinear.takes(blocks)


def _gguf_q8_target_and_drafter(tmp_path: Path, monkeypatch):
    """A tiny Q8_0 GGUF target under --weights gguf-q8 and a 2-layer clustered MTP drafter for it."""
    from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(write_quantised_gguf(tmp_path / "tiny.gguf", "Q8_0")), dtype="float32", weights="gguf-q8",
                      progress=False)
    cfg = drafter_config_for(rt.model, hidden=64, layers=2, head="target", clustered=True, num_centroids=16,
                             top_k_clusters=4)
    save_network(init_network(cfg, rt.model, seed=3, std=0.2), tmp_path / "d")
    return rt, load_mtp_drafter(tmp_path / "d", rt.model, torch.float32, "cpu")


@kernel
def test_an_mtp_drafter_next_to_gguf_q8_reads_int8_weights_and_speculation_is_exact(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """Next to --weights gguf-q8 the drafter's linears are int8 blocks too (a draft step reads
    ~half of fp16's bytes); its steps stay near the float32 drafter's, and output equals plain."""
    from specdraft.drafters.mtp import load_network
    from specdraft.drafters.mtp.drafter import layer_contexts
    from specdraft.speculative.engine import Engine

    rt, drafter = _gguf_q8_target_and_drafter(tmp_path, monkeypatch)
    model = rt.model
    int8 = [n for n, m in drafter.net.named_modules() if type(m) is Q8ActLinear]
    assert {"pre_projection", "post_projection", "masked_embedding.centroids",
            "model.layers.0.mlp.gate_up_proj", "model.layers.1.self_attn.q_proj"} <= set(int8)
    float32_net, _ = load_network(tmp_path / "d", model, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    h = model.config.hidden_size
    embeds, state = torch.randn(2, 1, h, generator=gen), torch.randn(2, 1, h, generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(2, 8)
        model(torch.randint(0, model.config.vocab_size, (2, 6), generator=gen), cache)
        contexts = layer_contexts(drafter.sources, cache.k, cache.v, torch.full((2, 1), 5), torch.float32)
        z8, s8 = drafter.net.step(embeds, state, contexts)
        z32, s32 = float32_net.step(embeds, state, contexts)
    # int8 weights and rows through two blocks: a few percent of the outputs' spread, not more
    assert 0 < (s8 - s32).abs().max().item() < 0.1 * s32.std().item()
    assert (z8 - z32).abs().max().item() < 0.1 * z32.std().item()
    prompts = repetitive_prompts(model.config.vocab_size, 3)
    plain = Engine(model).generate(prompts, 16, eos_token_ids=[])
    for batch in (1, 3):
        spec = []
        for start in range(0, len(prompts), batch):
            spec += Engine(model, drafter=drafter, draft_tokens=3).generate(prompts[start:start + batch], 16,
                                                                             eos_token_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


@kernel
@pytest.mark.parametrize("weights", ["gguf-q8", "gguf"])
def test_a_draft_step_in_one_c_call_gives_the_modules_bits(tmp_path: Path, monkeypatch, weights: str) -> None:
    """draft_step.c runs a draft step from the token to its clustered head's inputs (embedding,
    pre-projection, blocks, norm, post-projection, centroid scores, copy bonus) in one call: the
    bits of the drafter's modules called one by one (int8 linears next to gguf-q8, fp16 tiles
    next to gguf), and the engine's drafts go through it."""
    from dataclasses import replace

    from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
    from specdraft.drafters.mtp import network
    from specdraft.drafters.mtp.drafter import layer_contexts
    from specdraft.runtime import Runtime
    from specdraft.speculative.engine import Engine

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(write_quantised_gguf(tmp_path / "tiny.gguf", "Q8_0")), dtype="float32", weights=weights,
                      progress=False)
    model = rt.model
    model.config = replace(model.config, embed_scale=8.0)  # a Llama's is 1: scale its rows as Gemma's are
    cfg = replace(drafter_config_for(model, hidden=64, layers=2, head="target", clustered=True, num_centroids=16,
                                     top_k_clusters=4), copy_gate=True)
    net = init_network(cfg, model, seed=3, std=0.2)
    torch.nn.init.normal_(net.copy_gate.proj.weight, std=0.3, generator=torch.Generator().manual_seed(4))
    save_network(net, tmp_path / "d")
    drafter = load_mtp_drafter(tmp_path / "d", model, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tokens, state = torch.randint(0, vocab, (2,), generator=gen), torch.randn(2, model.config.hidden_size, generator=gen)
    calls = []
    real_call = network.draft_step
    monkeypatch.setattr(network, "draft_step", lambda *a: calls.append(1) or real_call(*a))
    with torch.inference_mode():
        cache = model.new_cache(2, 8)
        model(torch.randint(0, vocab, (2, 6), generator=gen), cache)
        contexts = layer_contexts(drafter.sources, cache.k, cache.v, torch.full((2, 1), 5), torch.float32)
        fused = drafter.net.draft_step(model, tokens, state, contexts)
        assert calls == [1]
        z, next_state = drafter.net.step(model.embed(tokens[:, None]), state[:, None], contexts)
        z, next_state = z[:, 0], next_state[:, 0]
        head, gate = drafter.net.masked_embedding, drafter.net.copy_gate
        assert torch.equal(fused.z, z) and torch.equal(fused.state, next_state)
        assert torch.equal(fused.centroid_scores, head.centroids(z)) and torch.equal(fused.copy_bonus, gate(z))
        assert fused.copy_bonus.abs().min() > 0
        monkeypatch.setenv("SPECDRAFT_KERNELS", "0")  # no kernels: the modules' path, no scores computed ahead
        assert drafter.net.draft_step(model, tokens, state, contexts).centroid_scores is None
    monkeypatch.delenv("SPECDRAFT_KERNELS")
    prompts = repetitive_prompts(vocab, 2)
    plain = Engine(model).generate(prompts, 16, eos_token_ids=[])
    calls.clear()
    spec = Engine(model, drafter=drafter, draft_tokens=3).generate(prompts, 16, eos_token_ids=[])
    assert calls and [r.token_ids for r in spec] == [r.token_ids for r in plain]


@kernel
def test_a_drafter_weight_written_between_rounds_reaches_the_one_call_step(tmp_path: Path, monkeypatch) -> None:
    """The one-call draft step keeps its view of the drafter's weights across rounds: a norm's
    weight written in place (or a projection replaced) between rounds gives the next round the
    modules' new bits, not the kept view's old ones."""
    from specdraft.drafters.mtp.drafter import layer_contexts

    rt, drafter = _gguf_q8_target_and_drafter(tmp_path, monkeypatch)
    model = rt.model
    net, gen, vocab = drafter.net, torch.Generator().manual_seed(0), model.config.vocab_size
    tokens, state = torch.randint(0, vocab, (2,), generator=gen), torch.randn(2, model.config.hidden_size, generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(2, 8)
        model(torch.randint(0, vocab, (2, 6), generator=gen), cache)

    def one_round() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            contexts = layer_contexts(drafter.sources, cache.k, cache.v, torch.full((2, 1), 5), torch.float32)
            fused = net.draft_step(model, tokens, state, contexts)
            z, _ = net.step(model.embed(tokens[:, None]), state[:, None], contexts)
        assert fused.centroid_scores is not None  # the one-call path ran
        return fused.z, z[:, 0]

    before, modules = one_round()
    assert torch.equal(before, modules)
    with torch.no_grad():
        net.model.layers[1].post_feedforward_layernorm.weight.mul_(1.5)
    after, modules = one_round()
    assert torch.equal(after, modules) and not torch.equal(after, before)
    net.model.layers[0].mlp.down_proj = copy.deepcopy(net.model.layers[0].mlp.down_proj)
    with torch.no_grad():
        for t in [*net.model.layers[0].mlp.down_proj.parameters(), *net.model.layers[0].mlp.down_proj.buffers()]:
            t.zero_()
    replaced, modules = one_round()
    assert torch.equal(replaced, modules) and not torch.equal(replaced, after)
