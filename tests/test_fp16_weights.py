"""fp16 weights (`--weights fp16`: the C kernel's tiles, FBGEMM where it does not build) and the
screened greedy head: bounded error, rows that do not depend on their neighbours, speculative
output equal to plain output, and a greedy head whose screen never changes the argmax."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel
from specdraft.models.formats.fp16_kernel import fp16_kernel_available
from specdraft.loading import load_folder
from specdraft.models.formats.fp16_kernel import PROBE_ROWS, fp16_mm, prepack_fp16, row_invariant, row_padding
from specdraft.drafters.mtp import network
from specdraft.drafters.mtp.drafter import layer_contexts
from specdraft.models.kernels.decoder_layer import decoder_stack
from specdraft.models.kernels import build as kernels
from specdraft.models.formats.quant import Fp16Linear, compact_weights
from specdraft.models.formats.screened_head import ScreenedHead, screen_head
from specdraft.speculative.engine import Engine
from test_quant import repetitive_prompts, speculative_equals_plain

pytestmark = pytest.mark.skipif(not fp16_kernel_available(), reason="FBGEMM (x86 CPU builds) needed")

U = 2.0**-24


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_fp16_linear_is_the_float32_product_of_the_fp16_weights() -> None:
    """Weights rounded to fp16, products and sums in float32: the error against the exact product
    of the fp16 weights is within the float32 summation bound gamma_K * sum |w16 x|."""
    w, x = rand(300, 640, seed=0, scale=0.05), rand(5, 640, seed=1)
    layer = Fp16Linear(w, None)
    exact = x.double() @ w.half().double().t()
    k = w.shape[1]
    bound = k * U / (1 - k * U) * (x.double().abs() @ w.half().double().abs().t())
    for rows in (1, 2, 5):
        assert ((layer(x[:rows]).double() - exact[:rows]).abs() <= bound[:rows]).all()
    assert layer(x[None, :3]).shape == (1, 3, 300)


@pytest.mark.skipif(not kernels.available(), reason="no AVX2 CPU or no C compiler here")
def test_fp16_kernel_rows_do_not_depend_on_the_number_of_rows(monkeypatch) -> None:
    """The tiled kernel: every row summed in one order whatever M (3-, 2- and 1-row tiles, and the
    24-row panels a prompt is cut into), outputs off a whole tile (301), the bias; within the
    float32 bound of the exact product; and with SPECDRAFT_KERNELS=0 FBGEMM on the same fp16 weights."""
    w, b, x = rand(301, 640, seed=2, scale=0.05), rand(301, seed=3), rand(60, 640, seed=4)
    layer = Fp16Linear(w, b)
    assert layer.tiles is not None
    one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(60)])
    for m in range(1, 61):
        assert torch.equal(layer(x[:m]), one_by_one[:m]), m
    assert torch.equal(layer(x[None])[0], one_by_one)  # 60 tokens of one row: a prompt
    exact = x.double() @ w.half().double().t() + b.double()
    k = w.shape[1]
    bound = k * U / (1 - k * U) * (x.double().abs() @ w.half().double().abs().t()) + 2 * U * exact.abs()
    assert ((one_by_one.double() - exact).abs() <= bound).all()
    monkeypatch.setenv("SPECDRAFT_KERNELS", "0")
    assert ((layer(x[:3]).double() - exact[:3]).abs() <= bound[:3]).all()


def test_padded_rows_do_not_depend_on_the_number_of_rows() -> None:
    """FBGEMM's 1- and 2-row kernels round differently from the rest; with the probed padding a
    row's bits are the same in a call of any size up to PROBE_ROWS (what makes a (K+1)-row
    verify reproduce K+1 one-row steps). Where the raw kernel differs (AVX2; an AVX-512 build
    may not), the probe pads exactly those sizes."""
    assert row_invariant()
    for n, k in [(256, 640), (640, 2048), (1000, 72)]:
        packed = prepack_fp16(rand(n, k, seed=n, scale=0.05))
        x = rand(PROBE_ROWS, k, seed=k)
        one_by_one = torch.cat([fp16_mm(x[i : i + 1], packed) for i in range(PROBE_ROWS)])
        for m in list(range(2, 20)) + [31, 32, 36, 37, 38, 43, 44, 72, PROBE_ROWS]:
            assert torch.equal(fp16_mm(x[:m], packed), one_by_one[:m]), (n, k, m)
    packed = prepack_fp16(rand(256, 640, seed=7, scale=0.05))
    x = rand(45, 640, seed=8)
    canonical = torch.cat([fp16_mm(x[i : i + 3], packed, pad=False) for i in range(0, 45, 3)])
    differs = [m for m in range(1, 45) if not torch.equal(fp16_mm(x[:m], packed, pad=False), canonical[:m])]
    assert all(row_padding()[m] not in (None, m) for m in differs), differs


def near_tie_table(v: int = 64, h: int = 32) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A table where fp16 rounding reverses the top two: row a's fp16 score beats row b's by one
    fp16 step while b's exact score beats a's. Returns (table, hidden, a, b)."""
    table = rand(v, h, seed=3, scale=0.01)
    hidden = torch.zeros(h)
    hidden[:2] = 1.0
    ulp = 2.0**-10  # fp16 spacing in [1, 2)
    a, b = 10, 20
    table[a, :2] = torch.tensor([1 + 0.5001 * ulp, 0.5])  # rounds up to 1 + ulp
    table[b, :2] = torch.tensor([1 + 0.4999 * ulp, 0.5 + 0.0004 * ulp])  # rounds down to 1; 0.5 + tiny -> 0.5
    exact = table.double() @ hidden.double()
    assert exact.argmax().item() == b
    assert (table.half().double() @ hidden.double()).argmax().item() == a
    return table, hidden, a, b


def test_screened_head_finds_the_exact_argmax_where_fp16_rounding_reverses_the_order() -> None:
    table, hidden, a, b = near_tie_table()
    head = ScreenedHead(table)
    assert head(hidden[None]).tolist() == [b]
    head.bound_per_unit_h = 0.0  # negative control: without the bound the screen alone picks a
    assert head(hidden[None]).tolist() == [a]


def test_screened_head_of_fp16_values_scores_the_fp16_table() -> None:
    """--weights fp16: the model's head is the fp16 table, so its exact argmax is a."""
    table, hidden, a, _ = near_tie_table()
    assert ScreenedHead(table, fp16_values=True)(hidden[None]).tolist() == [a]


def test_screened_head_equals_float64_argmax_on_many_rows_and_breaks_ties_low() -> None:
    table = rand(5000, 96, seed=5, scale=0.05)
    table[4000] = table[17]  # an exact tie: the lower id wins, as torch.argmax does
    hidden = rand(40, 96, seed=6, scale=4.0)
    hidden[3] = table[17] * 50
    head = ScreenedHead(table)
    want = (hidden.double() @ table.double().t()).argmax(-1)
    assert torch.equal(head(hidden), want)
    assert head(hidden)[3].item() == 17
    assert torch.equal(torch.cat([head(hidden[i : i + 1]) for i in range(40)]), head(hidden))  # row-invariant
    assert head(hidden.view(4, 10, 96)).shape == (4, 10)


def test_screened_head_falls_back_on_non_finite_rows() -> None:
    table, hidden = rand(100, 16, seed=9), rand(2, 16, seed=10)
    hidden[1, 0] = float("nan")
    got = ScreenedHead(table)(hidden)
    assert got[0].item() == (hidden[0] @ table.t()).argmax().item()
    assert 0 <= got[1].item() < 100


def test_float32_model_gets_the_screened_head_and_greedy_output_is_unchanged(gemma_tiny: TinyModel, monkeypatch) -> None:
    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    prompts = repetitive_prompts(gemma_tiny.cfg.vocab_size, 2)
    reference = Engine(model).generate(prompts, 16, eos_token_ids=[])  # full float32 head
    assert screen_head(model)
    ids = torch.tensor([prompts[0] + reference[0].token_ids])
    with torch.inference_mode():
        hidden = model(ids, model.new_cache(1, ids.shape[1]))
        exact = (hidden.double() @ model.head_weight.double().t()).argmax(-1)
        assert torch.equal(model.greedy_tokens(hidden), exact)
    assert [r.token_ids for r in Engine(model).generate(prompts, 16, eos_token_ids=[])] == [r.token_ids for r in reference]
    speculative_equals_plain(model, prompts, 2, monkeypatch=monkeypatch)


@pytest.mark.parametrize("batch", [1, 4])
def test_fp16_weights_speculative_output_equals_plain(gemma_tiny: TinyModel, batch: int, monkeypatch) -> None:
    """The default on CPUs without bf16 units (float32 activations, fp16 weights) is exact."""
    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(model, "fp16")
    assert screen_head(model) and model.screened_head.fp16_values
    assert any(isinstance(m, Fp16Linear) for m in model.layers.modules())
    speculative_equals_plain(model, repetitive_prompts(gemma_tiny.cfg.vocab_size), batch, monkeypatch=monkeypatch)


def test_fp16_weights_stay_close_to_float32(gemma_tiny: TinyModel) -> None:
    from conftest import prompts_of

    ids = torch.tensor(prompts_of([20], gemma_tiny.cfg.vocab_size, seed=3))
    dense, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    packed, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(packed, "fp16")
    with torch.inference_mode():
        ref = torch.log_softmax(dense.logits(dense(ids, dense.new_cache(1, 24))), -1)
        got = torch.log_softmax(packed.logits(packed(ids, packed.new_cache(1, 24))), -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert 0 < kl < 1e-5, kl


@pytest.mark.slow
def test_compiled_fp16_step_is_exact_and_matches_eager(gemma_tiny: TinyModel, monkeypatch) -> None:
    """A compiled step reaches the fp16 weights through the specdraft::fp16_linear op: same
    greedy tokens as eager, and speculative output equal to plain output."""
    from specdraft.models.compile import compile_steps

    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(model, "fp16")
    screen_head(model)
    # Two rows: the batched graphs, then the batch-1 ones where one row finishes first.
    prompts = repetitive_prompts(gemma_tiny.cfg.vocab_size, 2)
    eager = Engine(model).generate(prompts, 16, eos_token_ids=[])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step = compile_steps(model, announce=False)
    assert [r.token_ids for r in Engine(model).generate(prompts, 16, eos_token_ids=[])] == [r.token_ids for r in eager]
    assert step.compile_seconds > 0
    speculative_equals_plain(model, prompts, 2, monkeypatch=monkeypatch)
    # One graph per shape class (batch 1 or more, width 1 or more): positions, key extents and
    # widths that change between steps, or sizes equal by chance, build none of their own.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 4


def test_fp16_weights_store_one_fp16_token_table(gemma_tiny: TinyModel) -> None:
    """--weights fp16 keeps the token table in fp16 (half the bytes); activations stay float32,
    and the model computes what a float32 model with every weight rounded to fp16 computes."""
    from conftest import prompts_of

    packed, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(packed, "fp16")
    assert packed.embed_tokens.weight.dtype == torch.float16 and packed.dtype == torch.float32
    assert packed.new_cache(1, 8).k[0].dtype == torch.float32
    rounded, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name.endswith(".weight") and p.dim() == 2:  # linears and the table, not the norms
                p.copy_(p.half().float())
    ids = torch.tensor(prompts_of([20], gemma_tiny.cfg.vocab_size, seed=3))
    with torch.inference_mode():
        ref = rounded.logits(rounded(ids, rounded.new_cache(1, 24)))
        got = packed.logits(packed(ids, packed.new_cache(1, 24)))
    # The same fp16 values summed in float32, in FBGEMM's order instead of MKL's.
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_drafter_scores_against_an_fp16_table_as_against_its_float32_values() -> None:
    from specdraft.drafters.mtp.head import score

    table = rand(100, 16, seed=5).half()
    vectors = rand(6, 16, seed=6)
    cands = torch.randint(0, 100, (6, 12), generator=torch.Generator().manual_seed(7))
    assert torch.equal(score(vectors, table, cands), score(vectors, table.float(), cands))
    assert torch.equal(score(vectors, table, None), score(vectors, table.float(), None))


@pytest.mark.parametrize("clustered", [False, True])
def test_mtp_drafter_over_an_fp16_target_is_exact(gemma_tiny: TinyModel, tmp_path, clustered: bool,
                                                   monkeypatch) -> None:
    """The MTP drafter reads the target's fp16 table (clustered head) or its packed head (every
    token); speculative output still equals plain output."""
    from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network

    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(model, "fp16")
    screen_head(model)
    cfg = drafter_config_for(model, hidden=32, layers=1, heads=4, head="target", clustered=clustered,
                             num_centroids=16 if clustered else None, top_k_clusters=4)
    save_network(init_network(cfg, model, seed=3, std=0.2), tmp_path / "d")
    drafter = load_mtp_drafter(tmp_path / "d", model, torch.float32, "cpu")
    # next to fp16 tiles the drafter's linears are fp16 tiles too (and its MLP one projection)
    assert any(isinstance(m, Fp16Linear) for m in drafter.net.modules()) == kernels.available()
    prompts = repetitive_prompts(gemma_tiny.cfg.vocab_size, 2)
    plain = Engine(model).generate(prompts, 16, eos_token_ids=[])
    spec = Engine(model, drafter=drafter, draft_tokens=3).generate(prompts, 16, eos_token_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    if kernels.available():  # fp16 weights move the drafter's outputs by about fp16's rounding only
        from specdraft.drafters.mtp import load_network

        float32_net, _ = load_network(tmp_path / "d", model, torch.float32, "cpu")
        gen = torch.Generator().manual_seed(0)
        embeds, state = torch.randn(2, 1, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
        with torch.inference_mode():
            cache = model.new_cache(2, 8)
            model(torch.randint(0, 100, (2, 6)), cache)
            contexts = layer_contexts(drafter.sources, cache.k, cache.v, torch.full((2, 1), 5), torch.float32)
            calls = []
            monkeypatch.setattr(network, "decoder_stack", lambda *a: calls.append(1) or decoder_stack(*a))
            z16, s16 = drafter.net.step(embeds, state, contexts)  # the blocks one C call ...
            assert len(calls) == 1
            monkeypatch.setattr(network.MTPNetwork, "_round_stack", lambda self, x, ctx: None)
            monkeypatch.setattr(network.DrafterBlock, "_fused_weights", lambda self, x, ctx: None)
            per_op = drafter.net.step(embeds, state, contexts)  # ... with the per-op kernels' bits
            z32, s32 = float32_net.step(embeds, state, contexts)
        assert torch.equal(z16, per_op[0]) and torch.equal(s16, per_op[1])
        assert (s16 - s32).abs().max() <= 2e-3 * s32.abs().max()
