"""The C kernels of the eager CPU step (models/kernels): attention over the cache, RMSNorm, the
q/k norm + RoPE + cache write, and the gated MLP's activation.

Each must (1) compute what PyTorch's ops compute, within float32 rounding of its sums, and (2)
give every row the same bits whatever rows share the call: that is what keeps speculative
output equal to plain output. The model with them matches the model without them (PyTorch's
ops, SPECDRAFT_KERNELS=0), and the reference path keeps its own speculative == plain check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import TinyModel, assert_fp32_close, prompts_of, reduction_depth
from specdraft.loading import load_folder
from specdraft.models.architectures import decoder
from specdraft.models.kernels import build
from specdraft.models.kernels.build import applies
from specdraft.models.kernels.decoder_layer import decoder_layer, decoder_stack
from specdraft.models.formats.quant import compact_weights
from specdraft.models.kernels.argmax import argmax_last
from specdraft.models.kernels.attention import attend_short
from specdraft.models.kernels.gated_act import gated_act
from specdraft.models.kernels.qk_rope import qk_rope_write
from specdraft.models.kernels.sample_rows import draw_tokens
from specdraft.models.kernels.rms_norm import residual_norms, rms_norm
from specdraft.models.architectures.layers import ACTIVATIONS, RMSNorm, _attend_short
from specdraft.models.architectures.rope import RopeTable, apply_rope
from specdraft.config import RopeParams
from specdraft.sampling import sample
from specdraft.speculative.engine import Engine

pytestmark = pytest.mark.skipif(not build.available(), reason="no AVX2 CPU or no C compiler here")


def window_mask(b: int, t: int, s: int, window: int | None, start: int) -> torch.Tensor:
    """Causal mask [B, 1, T, S] for queries at start + i (row b shifted by b), as the cache builds it."""
    pos = torch.arange(t)[None, :] + start - torch.arange(b)[:, None]
    keys = torch.arange(s)
    mask = keys[None, None, :] <= pos[:, :, None]
    if window is not None:
        mask &= keys[None, None, :] > pos[:, :, None] - window
    return mask[:, None]


CASES = [  # b, heads, kv heads, queries, keys, head dim, window, softcap
    (1, 4, 1, 1, 640, 256, None, None),  # Gemma 3 270M's decode step
    (1, 4, 1, 5, 640, 256, 512, None),  # its verification on a sliding layer
    (3, 4, 2, 3, 40, 16, 8, None),  # the tiny test models
    (2, 8, 2, 4, 100, 72, None, 30.0),  # a head size off the 64-wide chunks, softcapping
    (2, 2, 2, 2, 33, 12, 5, None),  # a head size off the 8-wide vectors
]


@pytest.mark.parametrize("b,h,hkv,t,s,d,window,softcap", CASES)
def test_attention_matches_pytorch_and_is_row_invariant(b, h, hkv, t, s, d, window, softcap) -> None:
    gen = torch.Generator().manual_seed(s + d)
    cache_k = torch.randn(b, hkv, s + 7, d, generator=gen)  # the cache is longer than the span read
    cache_v = torch.randn(b, hkv, s + 7, d, generator=gen)
    k, v = cache_k[:, :, :s], cache_v[:, :, :s]
    q = torch.randn(b, t, h, d, generator=gen).transpose(1, 2)  # as the projection leaves it: strided
    mask = window_mask(b, t, s, window, start=s - t)
    with torch.no_grad():
        got = attend_short(q, k, v, mask, d**-0.5, softcap)
        ref = _attend_short(q, k, v, mask, d**-0.5, softcap)
    assert got.shape == ref.shape
    assert_fp32_close(got, ref, depth=d + s)
    for i in range(t):  # one query alone gets the bits it gets among the others
        assert torch.equal(attend_short(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1], d**-0.5, softcap),
                           got[:, :, i : i + 1])
    for r in range(b):  # and one batch row alone
        assert torch.equal(attend_short(q[r : r + 1], k[r : r + 1], v[r : r + 1], mask[r : r + 1], d**-0.5, softcap),
                           got[r : r + 1])


def test_attention_does_not_depend_on_masked_keys_past_the_last_visible_one() -> None:
    """A plain step's key span ends sooner than a verification's (spans end on 128-key blocks): the
    chunks past a query's last visible key must not change its bits."""
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(1, 1, 640, 64, generator=gen), torch.randn(1, 1, 640, 64, generator=gen)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    full = window_mask(1, 1, 640, None, start=300)  # sees keys 0..300
    ref = attend_short(q, k, v, full, 0.125, None)
    for s in (301, 384, 512):
        assert torch.equal(attend_short(q, k[:, :, :s], v[:, :, :s], full[..., :s], 0.125, None), ref)
    k[:, :, 301:], v[:, :, 301:] = float("nan"), float("inf")  # unwritten cache slots hold anything
    assert torch.equal(attend_short(q, k, v, full, 0.125, None), ref)


def test_attention_without_mask_and_with_no_visible_key() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 2, 16, generator=gen) for _ in range(3))
    assert_fp32_close(attend_short(q, k, v, None, 0.25, None), _attend_short(q, k, v, None, 0.25, None), depth=18)
    mask = torch.tensor([[True, False], [False, False]])[None, None]  # the second query sees nothing
    got, ref = attend_short(q, k, v, mask, 0.25, None), _attend_short(q, k, v, mask, 0.25, None)
    assert ref[:, :, 1].isnan().all() and got[:, :, 1].isnan().all()  # as softmax over no key gives
    assert torch.equal(got[:, :, 0], v[:, :, 0].expand_as(got[:, :, 0]))  # one visible key: exactly its value


@pytest.mark.parametrize("weighted,residual", [(True, False), (True, True), (False, False)])
def test_rms_norm_matches_pytorch_and_is_row_invariant(weighted: bool, residual: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 640, generator=gen) * 4
    w = torch.randn(640, generator=gen) if weighted else None
    res = torch.randn(3, 5, 640, generator=gen) if residual else None
    got = rms_norm(x, w, 1e-6, res)
    ref = F.rms_norm(x, (640,), w, 1e-6)
    ref = ref if res is None else res + ref
    assert_fp32_close(got, ref, depth=640)
    assert torch.equal(rms_norm(x[1:2, 2:3], w, 1e-6, None if res is None else res[1:2, 2:3]), got[1:2, 2:3])


@pytest.mark.parametrize("sandwich", [True, False])
def test_residual_norms_match_two_norms(sandwich: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    a, x = torch.randn(2, 3, 640, generator=gen) * 3, torch.randn(2, 3, 640, generator=gen) * 10
    w1, w2 = torch.randn(640, generator=gen), torch.randn(640, generator=gen)
    x_out, h = residual_norms(a, sandwich, w1 if sandwich else None, x, w2, 1e-6)
    ref_x = x + F.rms_norm(a, (640,), w1, 1e-6) if sandwich else x + a
    assert_fp32_close(x_out, ref_x, depth=640)
    assert_fp32_close(h, F.rms_norm(ref_x, (640,), w2, 1e-6), depth=2 * 640)
    one_x, one_h = residual_norms(a[1:, 2:], sandwich, w1 if sandwich else None, x[1:, 2:], w2, 1e-6)
    assert torch.equal(one_x, x_out[1:, 2:]) and torch.equal(one_h, h[1:, 2:])


@pytest.mark.parametrize("qk_norm,d", [(True, 256), (False, 64), (True, 12)])
def test_qk_rope_write_matches_norm_rope_and_cache_write(qk_norm: bool, d: int) -> None:
    """Rows of different lengths (a ragged batch): queries out, keys and values at each row's positions."""
    b, t, h, hkv, capacity = 2, 3, 4, 2, 40
    gen = torch.Generator().manual_seed(d)
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=gen) * 2
    q_scale, k_scale = (torch.randn(d, generator=gen), torch.randn(d, generator=gen)) if qk_norm else (None, None)
    positions = torch.tensor([[5, 6, 7], [30, 31, 32]])
    table = RopeTable(RopeParams(theta=10000.0), d, 64)
    table.ensure(capacity, torch.device("cpu"))
    cos, sin = table.lookup(positions, torch.float32)  # [B, 1, T, D]
    k_cache, v_cache = torch.zeros(b, hkv, capacity, d), torch.zeros(b, hkv, capacity, d)
    q = qk_rope_write(qkv, h, hkv, d, q_scale, k_scale, 1e-6, cos, sin, positions, k_cache, v_cache)

    ref_q, ref_k, ref_v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = ref_q.view(b, t, h, d).transpose(1, 2), ref_k.view(b, t, hkv, d).transpose(1, 2)
    if qk_norm:
        ref_q, ref_k = F.rms_norm(ref_q, (d,), q_scale, 1e-6), F.rms_norm(ref_k, (d,), k_scale, 1e-6)
    ref_q, ref_k = apply_rope(ref_q, cos, sin), apply_rope(ref_k, cos, sin)
    assert_fp32_close(q, ref_q.transpose(1, 2), depth=2 * d)
    for row in range(b):
        at = positions[row]
        assert_fp32_close(k_cache[row][:, at], ref_k[row], depth=2 * d)
        assert torch.equal(v_cache[row][:, at], ref_v[row].view(t, hkv, d).transpose(0, 1))
    untouched = torch.ones(capacity, dtype=torch.bool)
    untouched[positions[0]] = False
    assert (k_cache[0][:, untouched] == 0).all()  # nothing else written
    one = qk_rope_write(qkv[1:, 1:2], h, hkv, d, q_scale, k_scale, 1e-6, cos[1:, :, 1:2], sin[1:, :, 1:2],
                        positions[1:, 1:2], k_cache[1:].clone(), v_cache[1:].clone())
    assert torch.equal(one, q[1:, 1:2])  # a query alone gets the bits it gets among the others


@pytest.mark.parametrize("kind", ["silu", "gelu_pytorch_tanh"])
def test_gated_act_matches_pytorch(kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    i = 2048 + 5  # a tail off the 8-wide vectors
    gate = torch.cat([torch.randn(3, i - 6, generator=gen) * 4, torch.tensor([[-90.0, -30.0, -1e-20, 0.0, 30.0, 90.0]] * 3)], dim=1)
    up = torch.randn(3, i, generator=gen)
    got = gated_act(torch.cat([gate, up], dim=-1), kind)
    g = gate.double()
    z = g if kind == "silu" else 2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)  # act(x) = x sigmoid(z)
    ref = g * torch.sigmoid(z) * up.double()  # (in float64 the tanh form rounds to 0 where the value is tiny)
    # exp to ~1 ulp, a division, products: a few roundings of each element's own size; and z itself is
    # rounded in float32, which moves log sigmoid(z) by up to |z| x that rounding (its slope is <= 1)
    assert ((got.double() - ref).abs() <= (8 + 4 * z.abs()) * 2.0**-24 * ref.abs() + 1e-30).all()
    assert_fp32_close(got, ACTIVATIONS[kind](gate) * up, depth=8)  # PyTorch's float32 ops agree
    assert torch.equal(gated_act(torch.cat([gate[1:2], up[1:2]], dim=-1), kind), got[1:2])


@pytest.mark.parametrize("n", [1, 5, 511, 512, 513, 4096, 262144])
def test_draw_tokens_is_sample(n: int) -> None:
    """The C draw (sample_rows.c) takes sampling.sample's uniforms and lands on its token: the
    same token wherever the two float64 cumulative sums (summed in other orders) do not straddle
    the draw; zero weights are never drawn, an all-zero row gives the last token as sample's
    clamp does, and any leading shape works."""
    gen = torch.Generator().manual_seed(n)
    w = torch.softmax(4 * torch.randn(3, 4, n, generator=gen), -1)
    w[0, :, ::3] = 0.0
    w[1, 0] = 0.0
    w[2, 1] = torch.rand(n, generator=gen) * 7  # unnormalised
    with torch.inference_mode():
        assert applies(w)
        got = draw_tokens(w, torch.Generator().manual_seed(1))
    want = sample(w, torch.Generator().manual_seed(1))
    assert got.shape == (3, 4) and got[1, 0] == n - 1
    flat, u = w.reshape(-1, n), torch.rand(12, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cdf = flat.double().cumsum(-1)
    target = (u * cdf[:, -1:]).squeeze(1)
    for row, (a, b) in enumerate(zip(got.flatten().tolist(), want.flatten().tolist())):
        assert flat[row, a] > 0 or cdf[row, -1] == 0
        if a != b:  # only where the draw sits within float64 rounding of a cumulative weight
            assert abs(float(cdf[row, min(a, b)] - target[row])) <= 1e-12 * float(cdf[row, -1])


@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 100, 262144])
def test_argmax_is_torch_argmax(n: int) -> None:
    """The same index as torch.argmax: the first of equal maxima (rounded values tie often), the
    first NaN in a row that has one, -inf rows, and maxima in the tail past the vector loop."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1:4] = x[1:4].round()  # ties
    x[4] = float("-inf")
    x[5, n // 2] = float("nan")
    x[6, -1] = float("inf")
    x[7, n // 3 :] = float("nan")
    x[8] = 0.0
    x[8, n - 1 - n // 4] = -0.0  # equal to 0.0: the first index still wins
    with torch.inference_mode():
        got = argmax_last(x)
        assert torch.equal(got, x.argmax(-1))
        assert torch.equal(argmax_last(x[2:3]), got[2:3])  # a row's answer alone or in a batch
        assert torch.equal(argmax_last(x.view(3, 3, n)), x.view(3, 3, n).argmax(-1))


def test_rms_norm_module_takes_the_kernel_only_without_autograd() -> None:
    norm = RMSNorm(64, 1e-6, offset=True)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 64, requires_grad=True)
    y = norm(x)  # autograd: PyTorch's ops, so training gets gradients
    y.sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        assert_fp32_close(norm(x), norm._reference(x), depth=64)


def _decode_logits(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of a prefill and `steps` greedy one-token steps, and the tokens chosen."""
    cache = model.new_cache(1, len(prompt) + steps + 1)
    with torch.inference_mode():
        logits = [model.logits(model(torch.tensor([prompt]), cache))[0, -1]]
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            logits.append(model.logits(model(torch.tensor([[tokens[-1]]]), cache))[0, -1])
    return torch.stack(logits), tokens


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_model_with_kernels_matches_pytorch_ops(family: str, gemma_tiny: TinyModel, llama_tiny: TinyModel,
                                                monkeypatch) -> None:
    tiny = gemma_tiny if family == "gemma" else llama_tiny
    prompt = prompts_of([12], tiny.cfg.vocab_size, seed=5)[0]
    got, got_tokens = _decode_logits(tiny.ours, prompt, 20)  # past the tiny Gemma's window of 8
    monkeypatch.setenv("SPECDRAFT_KERNELS", "0")
    ref, ref_tokens = _decode_logits(tiny.ours, prompt, 20)
    assert_fp32_close(got, ref, reduction_depth(tiny.cfg))
    assert got_tokens == ref_tokens


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_one_call_layer_gives_the_bits_of_the_per_op_kernels(family: str, gemma_tiny: TinyModel,
                                                             llama_tiny: TinyModel, monkeypatch) -> None:
    """--weights fp16: decoder_layer.c strings together the same kernels as the per-op path, and
    decoder_stack runs it layer after layer, so a decode (prefill, then one-token steps across the
    tiny Gemma's sliding window) gets the same bits every way."""
    tiny = gemma_tiny if family == "gemma" else llama_tiny
    model, _, _ = load_folder(tiny.folder, torch.float32, "cpu")
    compact_weights(model, "fp16")
    assert one_call_bits_equal_per_op(model, prompts_of([20], tiny.cfg.vocab_size, seed=6)[0], monkeypatch)


def one_call_bits_equal_per_op(model, prompt: list[int], monkeypatch, steps: int = 14) -> bool:
    """Decode `prompt` (longer than a short forward: its prefill takes the per-op path) three
    ways: every layer in one C call (decoder_stack), each layer in one call, each op its own call;
    True if all give the same logits and tokens, each way having served every step."""
    assert all(layer._fusable() for layer in model.layers)
    stacks, layers = [], []
    monkeypatch.setattr(decoder, "decoder_stack", lambda *a: stacks.append(1) or decoder_stack(*a))
    monkeypatch.setattr(decoder, "decoder_layer", lambda *a: layers.append(1) or decoder_layer(*a))
    got, got_tokens = _decode_logits(model, prompt, steps)
    assert (len(stacks), len(layers)) == (steps, 0)
    monkeypatch.setattr(decoder.Transformer, "_layer_stack", lambda self, x, kv: None)
    one, one_tokens = _decode_logits(model, prompt, steps)
    assert (len(stacks), len(layers)) == (steps, steps * model.config.num_layers)
    monkeypatch.setattr(decoder.DecoderLayer, "_fusable", lambda self: False)
    for layer in model.layers:
        layer._fused = None
    ref, ref_tokens = _decode_logits(model, prompt, steps)
    assert (len(stacks), len(layers)) == (steps, steps * model.config.num_layers)
    return torch.equal(got, ref) and torch.equal(one, ref) and got_tokens == one_tokens == ref_tokens


def test_layer_stack_follows_replaced_and_rewritten_weights(gemma_tiny: TinyModel) -> None:
    """The kept LayerWeights are rebuilt when a projection is replaced or a norm written in place
    (the Snapshot): the stack then computes what a fresh model with those weights computes."""
    from specdraft.models.formats.quant import Fp16Linear

    model, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(model, "fp16")
    prompt = prompts_of([6], gemma_tiny.cfg.vocab_size, seed=8)[0]
    before, _ = _decode_logits(model, prompt, 3)
    with torch.no_grad():
        model.layers[0].input_layernorm.weight.mul_(1.5)
        down = model.layers[1].mlp.down_proj
        model.layers[1].mlp.down_proj = Fp16Linear(torch.randn(down.out_features, down.in_features) * 0.05, None)
    after, _ = _decode_logits(model, prompt, 3)
    fresh, _, _ = load_folder(gemma_tiny.folder, torch.float32, "cpu")
    compact_weights(fresh, "fp16")
    with torch.no_grad():
        fresh.layers[0].input_layernorm.weight.mul_(1.5)
        fresh.layers[1].mlp.down_proj = model.layers[1].mlp.down_proj
    expected, _ = _decode_logits(fresh, prompt, 3)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


def test_pytorch_reference_path_keeps_speculative_equal_to_plain(gemma_tiny: TinyModel, monkeypatch) -> None:
    """Without the kernels (SPECDRAFT_KERNELS=0, or no compiler), the ops' own path stays exact."""
    from exactness import speculative_equals_plain

    monkeypatch.setenv("SPECDRAFT_KERNELS", "0")
    prompts = [p + p[:5] for p in prompts_of([9, 14, 3], gemma_tiny.cfg.vocab_size, seed=7)]
    speculative_equals_plain(gemma_tiny.ours, prompts, 3, 24, monkeypatch)


def test_without_a_compiler_the_model_runs_on_pytorch_ops(gemma_tiny: TinyModel, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))  # no kernel built earlier
    build.library.cache_clear()
    build.library_for.cache_clear()
    build.available.cache_clear()
    try:
        assert not build.available()
        with pytest.raises(build.KernelUnavailable, match="no C compiler"):
            build.library()
        prompt = prompts_of([10], gemma_tiny.cfg.vocab_size, seed=9)[0]
        got, _ = _decode_logits(gemma_tiny.ours, prompt, 3)
        monkeypatch.setenv("SPECDRAFT_KERNELS", "0")
        ref, _ = _decode_logits(gemma_tiny.ours, prompt, 3)
        assert torch.equal(got, ref)  # the same ops: the same bits
    finally:
        build.library.cache_clear()
        build.library_for.cache_clear()
        build.available.cache_clear()


@pytest.mark.parametrize("dtype,d", [(torch.float16, 640), (torch.float32, 640), (torch.float16, 20)])
def test_candidate_scores_match_gather_and_matmul(dtype: torch.dtype, d: int) -> None:
    """The MTP drafter's clustered head: vectors against gathered table rows (fp16 or float32)."""
    from specdraft.drafters.mtp.head import score
    from specdraft.models.kernels.score_rows import score_rows

    gen = torch.Generator().manual_seed(d)
    table = (torch.randn(5000, d, generator=gen) * 0.05).to(dtype)
    vectors = torch.randn(3, d, generator=gen)
    candidates = torch.randint(0, 5000, (3, 700), generator=gen)
    ref = torch.bmm(F.embedding(candidates, table).float(), vectors[:, :, None]).squeeze(2)
    got = score_rows(vectors, table, candidates)
    assert_fp32_close(got, ref, depth=d)
    assert torch.equal(score_rows(vectors[1:2], table, candidates[1:2]), got[1:2])  # rows independent
    with torch.no_grad():
        assert torch.equal(score(vectors, table, candidates), got)  # inference takes the kernel


@pytest.mark.parametrize("window", [None, 50])
def test_long_queries_attend_in_blocks_over_only_the_keys_they_see(window, monkeypatch) -> None:
    """A prompt's attention goes in blocks of queries, each over the keys its mask opens (causal,
    sliding windows, ragged rows): the same values as one call over every key, fewer keys read."""
    from specdraft.kv_cache import attention_span
    from specdraft.models.architectures import layers

    gen = torch.Generator().manual_seed(0)
    b, h, hkv, d, cached, t = 2, 4, 2, 16, 7, 200  # 7 keys already cached, then a 200-token forward
    lengths = torch.tensor([cached, cached - 3])  # the second row is 3 tokens behind
    positions = lengths[:, None] + torch.arange(t)[None, :]
    span = attention_span(positions, int(lengths.min()), cached + t, window)
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, span.hi - span.lo, d, generator=gen) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=0.25, enable_gqa=True)
    read = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, "scaled_dot_product_attention",
                        lambda q, k, *a, **kw: read.append(q.shape[2] * k.shape[2]) or real(q, k, *a, **kw))
    got = layers.attend(q, k, v, span.mask, 0.25)
    assert_fp32_close(got, whole, depth=span.hi - span.lo)  # a softmax and a weighted sum over the keys
    assert len(read) == -(-t // layers.QUERY_BLOCK)
    full = t * (span.hi - span.lo)
    if window is None:
        assert sum(read) < 0.7 * full  # causal: about half the keys
    else:  # a block's queries see their window behind the block (the lagging row 3 keys more)
        assert sum(read) <= t * (layers.QUERY_BLOCK + window + 3) < 0.6 * full
