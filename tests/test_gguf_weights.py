"""--weights gguf: a GGUF file's own blocks, decoded exactly and multiplied row-invariantly.

Oracles: gguf-py's own dequantisation (bit for bit, on random blocks of every supported format),
float64 products (within the float32 sum's proven error bound), a one-row call (bit for bit at
every call size), and the float32 model converted from the same file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import build_hf, prompts_of
from test_quant import repetitive_prompts, speculative_equals_plain
from specdraft.loading.gguf_blocks import SUPPORTED_BLOCK_FORMATS, decode_blocks
from specdraft.models.formats import block_linear
from specdraft.kv_cache import SHORT_FORWARD
from specdraft.models.formats.block_linear import Blocks, stack_blocks

kernel = pytest.mark.skipif(not block_linear.kernel_available(), reason="no AVX2 CPU or no C compiler here")


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random raw bytes of a [rows, cols] tensor in `fmt`, with every fp16 field a finite number."""
    qtype = gguf.GGMLQuantizationType[fmt]
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    f16 = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}[fmt]
    for at in f16:  # a small positive or negative scale: exponent bits 0b01xxx, never inf or NaN
        raw[:, at + 1] = (raw[:, at + 1] & 0x83) | 0x30
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", SUPPORTED_BLOCK_FORMATS)
def test_blocks_rebuild_gguf_dequantisation_bit_for_bit(fmt: str) -> None:
    raw = random_blocks(fmt, 8, 512, seed=1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).astype(np.float32)
    blocks = decode_blocks(raw, fmt, (8, 512))
    assert blocks.codes.dtype == torch.int8 and blocks.group in (16, 32)
    assert torch.equal(blocks.dequantized(), torch.from_numpy(expected))


def test_stacked_blocks_are_the_stacked_weights() -> None:
    parts = [decode_blocks(random_blocks(f, 4, 256, seed=i), f, (4, 256)) for i, f in enumerate(("Q6_K", "Q4_K", "Q8_0"))]
    stacked = stack_blocks(parts)
    assert stacked.group == 16 and stacked.offsets is not None
    assert torch.equal(stacked.dequantized(), torch.cat([p.dequantized() for p in parts]))


def _blocks(n: int, k: int, group: int, offsets: bool, seed: int) -> Blocks:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02
    offs = torch.rand(n, k // group, generator=gen) * 0.05 if offsets else None
    return Blocks(codes, scales, offs, group)


@pytest.fixture(params=["native", "avx2"])
def isa(request, monkeypatch) -> str:
    """The kernels this CPU loads (AVX-512 loops where it has them), and the AVX2 build, which
    every x86 CPU here can run: so an AVX-512 machine tests both."""
    from specdraft.models.kernels import build, int8_screen

    if request.param == "avx2":
        monkeypatch.setattr(build, "library", lambda: build.library_for(False))
        monkeypatch.setattr(int8_screen, "library", lambda: build.library_for(False))
    return request.param


@kernel
@pytest.mark.parametrize("group,offsets,k", [(32, False, 640), (32, True, 640), (16, False, 640), (16, True, 656)])
def test_kernel_is_within_the_float32_bound_and_row_invariant(group: int, offsets: bool, k: int, isa: str) -> None:
    blocks = _blocks(200, k, group, offsets, seed=group)
    w = blocks.dequantized()
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(0))
    y = block_linear.block_mm(x, blocks.codes, blocks.scales, blocks.offsets, group)
    exact = x.double() @ w.double().T
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    bound = gamma * (x.double().abs() @ w.double().abs().T)  # |sum of k products in float32 - exact|
    assert ((y.double() - exact).abs() <= bound).all()
    alone = torch.cat([block_linear.block_mm(x[i : i + 1], blocks.codes, blocks.scales, blocks.offsets, group)
                       for i in range(13)])
    for m in range(1, 14):  # every call size gives each row the bits it gets alone
        got = block_linear.block_mm(x[:m], blocks.codes, blocks.scales, blocks.offsets, group)
        assert torch.equal(got, alone[:m]), m


@kernel
@pytest.mark.parametrize("base,offsets", [(0, True), (-8, False)])  # Q4_K / Q4_1 codes, Q4_0 codes
def test_packed_4bit_codes_give_the_int8_kernels_bits(base: int, offsets: bool, isa: str) -> None:
    """4-bit codes packed two a byte (the AVX-512 kernel picks each weight from its group's table;
    the AVX2 build unpacks) multiply by the same weights in the same order as their int8 codes:
    the same bits at every call size, and each row's bits alone."""
    gen = torch.Generator().manual_seed(5)
    n, k = 150, 640
    codes = torch.randint(base, base + 16, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // 32, generator=gen) * 0.02
    offs = torch.rand(n, k // 32, generator=gen) * 0.05 if offsets else None
    nibbles = block_linear.pack_nibbles(codes, base)
    assert nibbles.shape == (n, k // 2) and nibbles.dtype == torch.uint8
    assert torch.equal(block_linear.unpack_nibbles(nibbles, base), codes)
    x = torch.randn(13, k, generator=gen)
    for m in range(1, 14):
        want = block_linear.block_mm(x[:m], codes, scales, offs, 32)
        assert torch.equal(block_linear.block_mm(x[:m], nibbles, scales, offs, 32, base), want), m


@kernel
def test_block_linear_keeps_4bit_codes_packed_where_the_kernel_reads_them(monkeypatch) -> None:
    """On the AVX-512 build a BlockLinear of 4-bit codes keeps them two a byte (0.75 bytes a
    weight with scales and offsets) and computes what the int8-code layer computes, steps and
    prompts alike; codes with more than 16 values stay int8."""
    from specdraft.models.kernels import build

    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (96, 256), dtype=torch.int8, generator=gen)
    blocks = Blocks(codes, torch.rand(96, 8, generator=gen) * 0.02, torch.rand(96, 8, generator=gen) * 0.05, 32)
    bias = torch.randn(96, generator=gen)
    layer = block_linear.BlockLinear(blocks, bias)
    assert (layer.nibbles is not None) == build.library_is_avx512()
    assert block_linear.BlockLinear(_blocks(96, 256, 32, True, seed=1), None).nibbles is None  # 64 code values
    monkeypatch.setattr(block_linear, "packs_nibbles", lambda b: None)
    reference = block_linear.BlockLinear(blocks, bias)
    assert reference.nibbles is None and torch.equal(layer.blocks.codes, codes)
    for width in (1, 2, 5, SHORT_FORWARD, block_linear.KERNEL_ROWS + 1):
        x = torch.randn(3, width, 256, generator=gen)
        assert torch.equal(layer(x), reference(x)), width


@kernel
def test_block_linear_prompts_use_the_dequantised_weights() -> None:
    blocks = _blocks(96, 256, 32, True, seed=3)
    layer = block_linear.BlockLinear(blocks, torch.randn(96))
    x = torch.randn(1, block_linear.KERNEL_ROWS + 1, 256)  # a prompt: more rows than the kernel takes
    assert torch.equal(block_linear.block_dequantize(blocks), blocks.dequantized())
    assert torch.equal(layer(x), F.linear(x, blocks.dequantized(), layer.bias))
    step = layer(x[:, :1])  # a decode step: the kernel, the same numbers up to the sum's order
    assert torch.allclose(step, F.linear(x[:, :1], blocks.dequantized(), layer.bias), atol=1e-5, rtol=1e-5)


@kernel
def test_bf16_prompts_multiply_a_bf16_copy_and_steps_keep_the_kernel() -> None:
    """After set_prompt_dtype(bf16) a prompt's chunk (wider than SHORT_FORWARD) is bf16 x bf16
    with float32 output; verification widths still take the float32 kernel."""
    blocks = _blocks(96, 256, 32, True, seed=3)
    layer = block_linear.BlockLinear(blocks, torch.randn(96))
    w = blocks.dequantized()
    layer.set_prompt_dtype(torch.bfloat16)
    x = torch.randn(2, SHORT_FORWARD + 1, 256)
    assert torch.equal(layer(x), F.linear(x.bfloat16(), w.bfloat16()).float() + layer.bias)
    step = x[:, :SHORT_FORWARD]
    assert torch.allclose(layer(step), F.linear(step, w, layer.bias), atol=1e-5, rtol=1e-5)
    layer.set_prompt_dtype(torch.float32)
    assert layer.prompt_weight is None
    assert torch.allclose(layer(x), F.linear(x, w, layer.bias), atol=1e-5, rtol=1e-5)


def near_tie_q8_table(hidden: torch.Tensor, seed: int) -> tuple[Blocks, list[int]]:
    """A Q8_0 table (scale 0.01) where, for each hidden row m, token 2m + 1 beats token 2m by a
    hair in exact arithmetic while the int8 screen ranks it below, and both beat every other
    token. Token 2m's codes follow h; 2m + 1 adds two code steps where h's own int8 rounding
    hides one and shows the other: +2 at an input i with t/4 < |h_i| < t/2 (rounded to 0) and -1
    at an input j with t/2 <= |h_j| < 2 |h_i| (rounded to +-1), t being the input's group scale.
    Returns the table and the rows it could build such a pair for."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-30, 31, (300, hidden.shape[1]), generator=gen, dtype=torch.int32)
    rows = []
    for m, h in enumerate(hidden):
        t = h.abs().view(-1, 32).amax(-1).repeat_interleave(32) / 127
        hidden_by_rounding = ((h.abs() > t / 4) & (h.abs() < t / 2)).nonzero().flatten()
        if len(hidden_by_rounding) == 0:
            continue
        i = int(hidden_by_rounding[0])
        shown = ((h.abs() >= t / 2) & (h.abs() < 2 * h[i].abs())).nonzero().flatten()
        if len(shown) == 0:
            continue
        j = int(shown[0])
        codes[2 * m] = (h / h.abs().max() * 100).round().int()
        codes[2 * m + 1] = codes[2 * m]
        codes[2 * m + 1, i] += 2 * int(h[i].sign())
        codes[2 * m + 1, j] -= int(h[j].sign())
        rows.append(m)
    scales = torch.full((300, hidden.shape[1] // 32), 0.01)
    return Blocks(codes.to(torch.int8), scales, None, 32), rows


@kernel
@pytest.mark.parametrize("k", [256, 224])  # 8 groups of 32, and an odd 7 (the VNNI loop's last group alone)
def test_int8_screen_is_within_its_bound_and_the_head_stays_exact(k: int, isa: str) -> None:
    from specdraft.models.formats.screened_head import ScreenedHead

    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(40, k, generator=gen) * (0.1 + torch.rand(40, 1, generator=gen) * 5)
    hidden[:5, ::37] *= 40  # outliers: coarse activation scales in their groups
    blocks, rows = near_tie_q8_table(hidden, seed=11)
    assert len(rows) >= 15  # 17 and 15 with these seeds
    weight = blocks.dequantized()
    head = ScreenedHead(weight, scorer=block_linear.BlockLinear(blocks, None))
    assert head.int8_table is not None  # a Q8_0 table takes the int8 screen
    exact = hidden.double() @ weight.double().T
    assert (exact.argmax(-1)[rows] == 2 * torch.tensor(rows) + 1).all()
    scores, bound = head._int8_screen(hidden)
    assert ((scores.double() - exact).abs() <= bound.double()[:, None]).all()
    assert torch.equal(head(hidden), exact.argmax(-1))
    assert torch.equal(torch.cat([head(hidden[i : i + 1]) for i in range(40)]), head(hidden))  # row-invariant
    head.crowded = 1  # rows with more than one candidate are screened again finely: still exact
    assert torch.equal(head(hidden), exact.argmax(-1))
    head.crowded = 10**9
    head.int8_err = head.int8_norm = 0.0  # negative control: the screen alone picks the other token of each pair
    assert (head(hidden)[rows] == 2 * torch.tensor(rows)).all()


@kernel
def test_int8_screen_of_an_fp16_table_is_exact() -> None:
    """--weights fp16: the head quantises its fp16 table to int8 blocks at load and bounds both
    the table's and the rows' quantisation."""
    from specdraft.models.formats.screened_head import ScreenedHead

    gen = torch.Generator().manual_seed(13)
    hidden = torch.randn(40, 256, generator=gen) * (0.1 + torch.rand(40, 1, generator=gen) * 5)
    blocks, rows = near_tie_q8_table(hidden, seed=14)
    table = (blocks.dequantized() * (1 + torch.rand(300, 256, generator=gen) * 1e-3)).half()  # off the int8 grid
    head = ScreenedHead(table, fp16_values=True)
    assert head.int8_table is not None and head.int8_err > 0
    exact = hidden.double() @ table.double().T
    scores, bound = head._int8_screen(hidden)
    assert ((scores.double() - exact).abs() <= bound.double()[:, None]).all()
    assert torch.equal(head(hidden), exact.argmax(-1))
    head.crowded = 1
    assert torch.equal(head(hidden), exact.argmax(-1))
    head.crowded = 10**9
    head.int8_err = head.int8_norm = 0.0  # negative control
    assert not torch.equal(head(hidden), exact.argmax(-1))


def test_exact_block_linear_refuses_weights_the_blocks_do_not_rebuild() -> None:
    blocks = _blocks(8, 64, 32, False, seed=4)
    w = blocks.dequantized().clone()
    assert block_linear.exact_block_linear(w, None, blocks) is not None
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))
    assert block_linear.exact_block_linear(w, None, blocks) is None


# ------------------------------------------------------------------ a quantised tiny GGUF, end to end


def write_quantised_gguf(path: Path, fmt: str) -> Path:
    """A tiny Llama whose matrices are stored in `fmt` (gguf-py quantises them), as llama.cpp writes it."""
    from test_loaders import gguf_name, llama_cpp_permute, write_gguf

    hf = build_hf("llama", seed=5, hidden_size=64, intermediate_size=128, head_dim=16,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    qtype = gguf.GGMLQuantizationType[fmt]
    real_add = gguf.GGUFWriter.add_tensor

    def add_quantised(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            data = gguf.quants.quantize(tensor.astype(np.float32), qtype)
            return real_add(self, name, data, raw_dtype=qtype)
        return real_add(self, name, tensor, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = add_quantised
    try:
        write_gguf(path, hf, "llama")
    finally:
        gguf.GGUFWriter.add_tensor = real_add
    assert gguf_name and llama_cpp_permute  # the writer permutes q/k as llama.cpp does
    return path


@kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q5_0"])
def test_gguf_weights_decode_like_the_float32_model(tmp_path: Path, monkeypatch, fmt: str) -> None:
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = write_quantised_gguf(tmp_path / f"tiny-{fmt}.gguf", fmt)
    packed = Runtime.load(str(path), dtype="float32", weights="gguf", progress=False)
    dense = Runtime.load(str(path), dtype="float32", weights="dtype", progress=False)
    kinds = {type(m).__name__ for m in packed.model.layers.modules()}
    assert "BlockLinear" in kinds and "Linear" not in kinds  # every matrix, q/k unpermuted included
    assert isinstance(packed.model.packed_head, block_linear.BlockLinear)
    assert packed.notes == []
    vocab = packed.config.vocab_size
    ids = torch.tensor([prompts_of([12], vocab, seed=2)[0]])
    with torch.inference_mode():
        cache_p, cache_d = packed.model.new_cache(1, 40), dense.model.new_cache(1, 40)
        packed.model(ids, cache_p), dense.model(ids, cache_d)
        for token in prompts_of([6], vocab, seed=3)[0]:  # decode steps: the kernel against float32 GEMV
            t = torch.tensor([[token]])
            lp, ld = packed.model.logits(packed.model(t, cache_p)), dense.model.logits(dense.model(t, cache_d))
            assert (lp - ld).abs().max().item() < 1e-4
    for batch in (1, 4):  # wide verifications give each row its one-row bits: output equals plain
        speculative_equals_plain(packed.model, repetitive_prompts(vocab), batch, monkeypatch=monkeypatch)


@kernel
def test_bf16_prompts_give_a_row_the_same_tokens_alone_or_batched(tmp_path: Path, monkeypatch) -> None:
    """--prefill-dtype bfloat16: prompts whose chunks take the bf16 GEMM (> SHORT_FORWARD tokens)
    and the decode kernels (<= SHORT_FORWARD), batched together, give each row the tokens it gets
    alone (the engine prefills each long chunk in a forward of its own), and speculative decoding
    still equals plain decoding."""
    from specdraft.runtime import Runtime
    from specdraft.speculative.engine import Engine

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = write_quantised_gguf(tmp_path / "tiny.gguf", "Q8_0")
    rt = Runtime.load(str(path), dtype="float32", weights="gguf", prefill_dtype="bfloat16", progress=False)
    linears = [m for m in rt.model.layers.modules() if isinstance(m, block_linear.BlockLinear)]
    assert rt.prefill_dtype == torch.bfloat16 and linears
    assert all(m.prompt_weight is not None for m in linears) and rt.model.packed_head.prompt_weight is None
    prompts = prompts_of([40, 300, 5, 12, 17], rt.config.vocab_size, seed=4)  # 300: chunks of 256 and 44
    alone = [Engine(rt.model).generate([p], 12, eos_token_ids=[])[0].token_ids for p in prompts]
    shapes = []
    monkeypatch.setattr(type(rt.model), "__call__", lambda self, tokens, cache: (
        shapes.append(tuple(tokens.shape)), torch.nn.Module.__call__(self, tokens, cache))[1])
    batched = Engine(rt.model, max_batch_size=5).generate(prompts, 12, eos_token_ids=[])
    assert [r.token_ids for r in batched] == alone
    # (rows, width) of the prefill forwards: a chunk of > SHORT_FORWARD tokens by itself (its GEMM
    # and attention block their sums by the forward's shape), shorter ones together.
    assert [s for s in shapes if s[1] > 1] == [(1, 40), (1, 256), (2, 12), (1, 17), (1, 44)]
    speculative_equals_plain(rt.model, prompts, 5, 12, monkeypatch)
    exact = Runtime.load(str(path), dtype="float32", weights="gguf", progress=False)
    assert exact.prefill_dtype == torch.float32  # --dtype float32 asked for: float32 prompts
    from specdraft.bench.steps import weight_bytes_per_step

    copies = sum(m.prompt_weight.numel() * 2 for m in linears)
    assert rt.nbytes() == exact.nbytes() + copies  # held, but a decode step does not read them
    assert weight_bytes_per_step(rt.model) == weight_bytes_per_step(exact.model)


@kernel
def test_a_folder_converted_without_blocks_reads_them_once(tmp_path: Path, monkeypatch) -> None:
    from specdraft.loading.gguf_blocks import BLOCKS_FILE
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = write_quantised_gguf(tmp_path / "tiny.gguf", "Q8_0")
    first = Runtime.load(str(path), dtype="float32", weights="gguf", progress=False)
    saved = first.folder / BLOCKS_FILE
    assert saved.exists()
    saved.unlink()  # as in a folder converted by an older specdraft
    again = Runtime.load(str(path), dtype="float32", weights="gguf", progress=False)
    assert saved.exists() and isinstance(again.model.packed_head, block_linear.BlockLinear)


def test_gguf_weights_need_a_gguf_source(tmp_path: Path, gemma_tiny) -> None:
    from specdraft.errors import SpecdraftError
    from specdraft.runtime import Runtime

    with pytest.raises(SpecdraftError, match="not a preset or a .gguf file"):
        Runtime.load(str(gemma_tiny.folder), dtype="float32", weights="gguf", progress=False)
    with pytest.raises(SpecdraftError, match="float32"):
        Runtime.load(str(gemma_tiny.folder), dtype="bfloat16", weights="gguf", progress=False)


@kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_one_call_layer_gives_the_bits_of_the_per_op_blocks(tmp_path: Path, monkeypatch, fmt: str) -> None:
    """decoder_layer.c multiplies by GGUF blocks with block_gemv, as BlockLinear does (offsets: Q4_1)."""
    from test_cpu_kernels import one_call_bits_equal_per_op
    from specdraft.runtime import Runtime

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    model = Runtime.load(str(write_quantised_gguf(tmp_path / "tiny.gguf", fmt)), dtype="float32", weights="gguf",
                         progress=False).model
    assert one_call_bits_equal_per_op(model, prompts_of([20], model.config.vocab_size, seed=6)[0], monkeypatch, 10)


@kernel
def test_screen_candidates_are_what_the_tensor_ops_keep() -> None:
    """screen_candidates against `scores >= amax - 2 bound` row by row: the same tokens in order,
    counts past the cap, none for a row holding a NaN (as the comparison against NaN gives)."""
    from specdraft.models.kernels.int8_screen import screen_candidates

    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(5, 1003, generator=gen)
    scores[1, 17] = scores[1, 900] = 9.0  # a tie at the top
    scores[3, 5] = float("nan")
    bound = torch.tensor([0.5, 0.0, 2.0, 0.1, 0.3])
    tokens, counts = screen_candidates(scores, bound, 40)
    keep = scores >= (scores.amax(-1) - 2 * bound)[:, None]
    assert counts.tolist() == keep.sum(-1).tolist() and counts[3] == 0 and counts[2] > 40
    for m in range(5):
        expected = keep[m].nonzero().flatten()[:40]
        assert tokens[m, : len(expected)].tolist() == expected.tolist()


@kernel
def test_rescore_candidates_picks_the_exact_best_lowest_on_a_tie() -> None:
    """rescore_candidates: the float64 argmax over each row's listed candidates, the lowest token
    of two equal rows, and -1 for a row with no candidates or more than the cap."""
    from specdraft.models.kernels.int8_screen import rescore_candidates

    gen = torch.Generator().manual_seed(8)
    table = torch.randn(50, 96, generator=gen)
    table[31] = table[7]  # equal rows: equal scores
    rows = torch.randn(4, 96, generator=gen)
    rows[1] = table[7] * 3  # row 1's best is token 7 (and 31)
    exact = rows.double() @ table.double().T
    tokens = torch.tensor([[2, 9, 40, 0], [5, 7, 31, 44], [1, 3, 0, 0], [0, 1, 2, 3]])
    counts = torch.tensor([3, 4, 0, 5])
    choice = rescore_candidates(rows, table, tokens, counts)
    want0 = [2, 9, 40][int(exact[0, [2, 9, 40]].argmax())]
    assert choice.tolist() == [want0, 7, -1, -1]
    tokens[1] = torch.tensor([5, 31, 44, 49])
    assert rescore_candidates(rows, table, tokens, counts)[1] == [5, 31, 44, 49][int(exact[1, [5, 31, 44, 49]].argmax())]
