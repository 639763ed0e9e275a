"""The float16 KV cache (Gemma 4's default on the CPU, kv_cache.kv_storage_dtype): the attention
kernel's row invariance over 16-bit keys, its error against transformers' attention within the
bound fp16 rounding of K and V allows, speculative decoding equal to plain with drafts accepted,
rings that wrap and roll back, and the memory estimate counting 2 bytes an element."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import OracleDrafter, assert_fp32_close  # noqa: E402
from gemma4_tiny import assistant_config, follow_transitions_, randomize_, target_text_config  # noqa: E402
from specdraft.drafters.mtp import load_mtp_drafter  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.kv_cache import PREFILL_CHUNK  # noqa: E402
from specdraft.loading import describe_folder, load_folder  # noqa: E402
from specdraft.loading.footprint import kv_bytes  # noqa: E402
from specdraft.models.kernels import build  # noqa: E402
from specdraft.models.kernels.attention import attend_prompt, attend_short  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

pytestmark = pytest.mark.skipif(not build.available(), reason="no AVX2 CPU or no C compiler here")

FP32_EPS = torch.finfo(torch.float32).eps
FP16_UNIT = 2.0**-11  # float16 rounds to nearest: each stored element moves by at most 2^-11 of itself


def causal_mask(t: int, s: int, last: int) -> torch.Tensor:
    """[1, 1, T, S]: query i (at position last - t + 1 + i) sees keys 0..its position."""
    pos = torch.arange(t) + last - t + 1
    return (torch.arange(s)[None, :] <= pos[:, None])[None, None]


@pytest.mark.parametrize("h,hkv,t,s,d", [(8, 1, 1, 700, 64), (8, 1, 4, 700, 64), (8, 1, 8, 300, 40),
                                         (4, 2, 5, 130, 16)])
def test_half_kernel_is_row_invariant_and_exact_on_the_stored_values(h, hkv, t, s, d) -> None:
    """E2B's 8 query heads per KV head, verify widths up to 8: a query alone gets the same bits
    as among the others; on the widened fp16 values the kernel is float32 attention (summation
    order only). Negative control: one more visible key changes the bits."""
    gen = torch.Generator().manual_seed(h * s + d)
    q = torch.randn(1, t, h, d, generator=gen).transpose(1, 2)
    k = torch.randn(1, hkv, s, d, generator=gen).half()
    v = torch.randn(1, hkv, s, d, generator=gen).half()
    mask = causal_mask(t, s, s - 20)
    got = attend_short(q, k, v, mask, d**-0.5, None)
    for i in range(t):
        alone = attend_short(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1], d**-0.5, None)
        assert torch.equal(alone, got[:, :, i : i + 1])
        wider = mask[:, :, i : i + 1].clone()
        wider[..., s - 20 - t + 2 + i] = True  # the next key too
        assert not torch.equal(attend_short(q[:, :, i : i + 1], k, v, wider, d**-0.5, None), alone)
    g = h // hkv
    kf, vf = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = (q.double() @ kf.transpose(-1, -2) * d**-0.5).masked_fill(~mask, float("-inf"))
    ref = torch.softmax(scores, -1) @ vf
    assert_fp32_close(got, ref, depth=d + s)
    assert_fp32_close(attend_prompt(q, k, v, mask, d**-0.5), ref, depth=d + s)


def test_half_attention_is_within_the_rounding_bound_of_transformers() -> None:
    """Ours over K/V stored in float16 against transformers' Gemma 4 attention over the float32
    K/V, in float64. The bound, from the arithmetic:
      scores: |k^ - k| <= u|k| elementwise (u = 2^-11), so |s^_j - s_j| <= u sum_i |q_i k_ji| <= u A;
      softmax: shifting every score by at most e moves the probabilities by at most
               e^(2e) - 1 in total (each p_j by a factor within e^(+-2e));
      output:  |o^ - o| <= sum_j |p^_j - p_j| |v^_j| + sum_j p_j |v^_j - v_j|
                        <= (e^(2uA) - 1)(1 + u) max|v| + u max|v|;
      plus float32's own summation error, eps (d + s) (1 + A) max|v|.
    Negative control: a sliding window of 128 keys where the layer is full is outside it."""
    from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

    gen = torch.Generator().manual_seed(3)
    h, hkv, t, s, d = 8, 1, 4, 300, 64
    q = torch.randn(1, h, t, d, generator=gen)
    k = torch.randn(1, hkv, s, d, generator=gen) * 0.5
    v = torch.randn(1, hkv, s, d, generator=gen)
    mask = causal_mask(t, s, s - 2)

    class Module(torch.nn.Module):
        num_key_value_groups, training = h // hkv, False

    def reference(m):
        bias = torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, float("-inf"))
        out, _ = eager_attention_forward(Module(), q.double(), k.double(), v.double(), bias, scaling=1.0)
        return out  # [B, T, H, D]

    ref = reference(mask)
    got = attend_short(q, k.half(), v.half(), mask, 1.0, None).transpose(1, 2)
    a = float((q.abs() @ k.abs().transpose(-1, -2)).max())
    top = float(v.abs().max())
    bound = (math.expm1(2 * FP16_UNIT * a) * (1 + FP16_UNIT) + FP16_UNIT) * top + FP32_EPS * (d + s) * (1 + a) * top
    err = float((got.double() - ref).abs().max())
    assert err <= bound, f"{err:.3g} > {bound:.3g}"
    assert err > FP32_EPS * (d + s) * top  # the rounding shows: float32 alone would be far closer
    windowed = causal_mask(t, s, s - 2) & (torch.arange(s) >= s - 130)  # a sliding window mixed up
    assert float((got.double() - reference(windowed)).abs().max()) > bound


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config()), seed=31)
    folder = tmp_path_factory.mktemp("half_target")
    ref.save_pretrained(folder)
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    return ref, model


def test_gemma4_cache_is_float16_by_default_and_float32_on_request(target, monkeypatch, tmp_path) -> None:
    ref, model = target
    cache = model.new_cache(1, 64, max_forward=4)
    assert {t.dtype for t in cache.k + cache.v} == {torch.float16}
    half = kv_bytes(model, torch.float32, 1000)
    assert half == model.new_cache(1, 1000, max_forward=PREFILL_CHUNK).nbytes()  # the estimate counts 2 bytes
    ref.config.save_pretrained(tmp_path)
    _, shapes = describe_folder(tmp_path)  # what the memory check sizes, before any weight is read
    assert kv_bytes(shapes, torch.float32, 1000) == half
    monkeypatch.setenv("SPECDRAFT_KV_DTYPE", "float32")
    assert {t.dtype for t in model.new_cache(1, 64).k} == {torch.float32}
    assert kv_bytes(model, torch.float32, 1000) == 2 * half
    monkeypatch.setenv("SPECDRAFT_KV_DTYPE", "bfloat17")
    with pytest.raises(SpecdraftError, match="SPECDRAFT_KV_DTYPE"):
        model.new_cache(1, 64)


def _stepped_logits(model, ids: torch.Tensor, rejected_every: int, kept_garbage: int = 0) -> torch.Tensor:
    """Logits of ids one token a forward over rings of 8 + 4 slots; every `rejected_every` steps a
    3-token forward of other tokens first, rolled back (all but `kept_garbage` of them)."""
    cache = model.new_cache(1, ids.shape[1] + 8, max_forward=4)
    assert any(r is not None for r in cache.rings)
    out = []
    for i in range(ids.shape[1]):
        if rejected_every and i % rejected_every == rejected_every - 1:
            model((ids[:, i : i + 3] + 7) % 250, cache)
            cache.rollback([i + kept_garbage])
        out.append(model.logits(model(ids[:, i : i + 1], cache)))
    return torch.cat(out, dim=1)


def test_half_rings_wrap_and_roll_back_to_the_same_bits(target) -> None:
    """40 tokens through rings of 12 slots (wrapped 3 times), with rejected 3-token verifies
    rolled back every 5 steps: every logit has the bits of the run without them. Negative
    control: keeping one rejected token in the cache changes them."""
    _, model = target
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = _stepped_logits(model, ids, 0)
        assert torch.equal(_stepped_logits(model, ids, 5), plain)
        assert not torch.equal(_stepped_logits(model, ids[:, :10], 5, kept_garbage=1), plain[:, :10])


def test_speculative_equals_plain_with_a_half_cache(target, tmp_path_factory) -> None:
    """Greedy with drafts accepted and rejected (verify widths 2-4 over the same float16 cache as
    plain steps; rings of window + 4 that wrap) gives exactly the plain tokens: with the oracle
    drafter (30% of drafts corrupted) and with Gemma 4's MTP assistant reading the 16-bit rings."""
    ref_t, model = target
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 14, 23)]
    plain = Engine(model, prefill_chunk=4).generate(prompts, max_new_tokens=30, eos_token_ids=[])
    expected = [r.token_ids for r in plain]
    oracle = OracleDrafter([p + e for p, e in zip(prompts, expected)], noise=0.3, seed=1, vocab=256)
    spec = Engine(model, drafter=oracle, draft_tokens=3, prefill_chunk=4).generate(prompts, 30, eos_token_ids=[])
    assert [r.token_ids for r in spec] == expected
    assert 0 < sum(r.stats.accepted for r in spec) < sum(r.stats.drafted for r in spec)
    ref_a = transformers.Gemma4AssistantForCausalLM(assistant_config(ref_t.config))
    follow_transitions_(randomize_(ref_a, seed=32), ref_t, [p + e for p, e in zip(prompts, expected)])
    folder = tmp_path_factory.mktemp("half_assistant")
    ref_a.save_pretrained(folder)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    spec = Engine(model, drafter=drafter, draft_tokens=3, prefill_chunk=4).generate(prompts, 30, eos_token_ids=[])
    assert [r.token_ids for r in spec] == expected
    assert sum(r.stats.accepted for r in spec) > 0
