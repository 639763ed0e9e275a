"""Logits parity with transformers' own model classes on tiny random configs (fp32).

Each case builds a random HF model, saves it as safetensors, loads it with specdraft's real
loader and compares the logits of one forward over a sequence longer than any sliding window.
Features whose effect could be too small to show (windows, softcaps, RoPE scaling, the query
scale) are also checked to matter: the HF model with the feature switched off must differ by
far more than the tolerance, so a specdraft that ignored the feature would fail.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, assert_fp32_close, prompts_of, reduction_depth, tiny_hf_config

MIN_EFFECT = 1e-2  # a feature under test must move some logit by this much
SEQ = 40  # longer than every sliding window below (6 or 8)


def ours_logits(tiny: TinyModel, ids: list[int]) -> torch.Tensor:
    cache = tiny.ours.new_cache(1, len(ids))
    with torch.inference_mode():
        return tiny.ours.logits(tiny.ours(torch.tensor([ids]), cache))[0]


def use_hf_eager_with_attn_softcap(hf) -> None:
    """transformers' Gemma3Attention never passes `attn_logit_softcapping` to its attention
    function (no Gemma 3 checkpoint sets it), while its shared eager kernel implements it
    (Gemma 2 semantics: tanh(s / cap) * cap before the mask). Route the reference through that
    kernel with the config's cap, the semantics specdraft implements."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    def eager_softcap(module, q, k, v, mask, **kw):
        kw.pop("softcap", None)
        return eager_attention_forward(module, q, k, v, mask, softcap=module.config.attn_logit_softcapping, **kw)

    AttentionInterface.register("eager_softcap", eager_softcap)
    AttentionMaskInterface.register("eager_softcap", eager_mask)
    hf.set_attn_implementation("eager_softcap")


def hf_variant_logits(tiny: TinyModel, ids: list[int], **config_changes) -> torch.Tensor:
    """Logits of the same weights under a changed HF config (the feature switched off)."""
    import transformers

    cfg = tiny_hf_config(tiny.family, **{**tiny.hf.config.to_diff_dict(), **config_changes})
    cls = getattr(transformers, type(tiny.hf).__name__)
    other = cls(cfg).float().eval()
    other.load_state_dict(tiny.hf.state_dict())
    with torch.no_grad():
        return other(torch.tensor([ids])).logits[0]


GEMMA_SW = ["sliding_attention", "sliding_attention", "full_attention"]

CASES = {
    # Gemma 3: sliding/full mix with window 8 < 40, GQA 4 q / 2 kv heads, tied head.
    "gemma3-sliding-gqa-tied": ("gemma3", dict(layer_types=GEMMA_SW, sliding_window=8),
                                dict(sliding_window=1024)),
    # Attention and final logit softcaps small enough to bend most scores.
    "gemma3-softcaps": ("gemma3", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5),
                        dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
    # query_pre_attn_scalar != head_dim, untied head, attention biases (q/k/v/o), MQA like the 270M.
    "gemma3-untied-bias-mqa-scale": ("gemma3", dict(tie_word_embeddings=False, attention_bias=True,
                                                    num_key_value_heads=1, query_pre_attn_scalar=40),
                                     dict(query_pre_attn_scalar=16)),
    # Sliding layers' own RoPE theta differs from the full layers'.
    "gemma3-rope-per-type": ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}}),
        dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    "llama-untied-gqa": ("llama", dict(), None),
    "llama-tied": ("llama", dict(tie_word_embeddings=True), None),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True), None),
    "llama-llama3-rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0})),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}),
                          dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0})),
    # Qwen2: q/k/v biases (no o bias), sliding window on layers >= max_window_layers.
    "qwen2-bias-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
                           dict(layer_types=["full_attention"] * 3)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True), None),
    "qwen3-qknorm": ("qwen3", dict(), None),
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=2),
                      dict(layer_types=["full_attention"] * 3)),
    "mistral-sliding": ("mistral", dict(sliding_window=6), dict(sliding_window=None)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, tiny_factory) -> None:
    family, overrides, switched_off = CASES[case]
    tiny = tiny_factory(family, seed=7, **overrides)
    ids = prompts_of([SEQ], tiny.cfg.vocab_size, seed=11)[0]
    if overrides.get("attn_logit_softcapping"):
        use_hf_eager_with_attn_softcap(tiny.hf)
    ref = tiny.hf_logits(ids)
    ours = ours_logits(tiny, ids)
    assert ours.shape == ref.shape
    assert_fp32_close(ours, ref, reduction_depth(tiny.cfg))
    # Greedy choices agree everywhere too (a cheap check of the whole argmax path).
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    if switched_off is not None:
        other = hf_variant_logits(tiny, ids, **switched_off)
        effect = (other - ref).abs().max().item()
        assert effect > MIN_EFFECT, f"{case}: the feature under test barely changes the logits ({effect:.3g})"


def test_config_is_read_as_intended(tiny_factory) -> None:
    """The normalised config carries the switches the cases above rely on."""
    q2 = tiny_factory("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert q2.cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert q2.cfg.sliding_window == 6 and q2.cfg.qkv_bias and not q2.cfg.o_bias
    g = tiny_factory("gemma3", attn_logit_softcapping=2.0, final_logit_softcapping=1.5, query_pre_attn_scalar=40)
    assert g.cfg.attn_softcap == 2.0 and g.cfg.final_softcap == 1.5
    assert g.cfg.softmax_scale == pytest.approx(40**-0.5)
    assert g.cfg.embed_scale == pytest.approx(64**0.5) and g.cfg.tie_word_embeddings
    m = tiny_factory("mistral", sliding_window=6)
    assert set(m.cfg.layer_types) == {"sliding_attention"} and m.cfg.sliding_window == 6


def test_batched_rows_match_single_rows(gemma_tiny: TinyModel) -> None:
    """A right-padded batch of different lengths gives each row the logits it gets alone."""
    prompts = prompts_of([5, 17, 11], gemma_tiny.cfg.vocab_size, seed=3)
    width = max(map(len, prompts))
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = torch.tensor(p)
    cache = gemma_tiny.ours.new_cache(len(prompts), width)
    with torch.inference_mode():
        logits = gemma_tiny.ours.logits(gemma_tiny.ours(batch, cache))
    for i, p in enumerate(prompts):
        ref = gemma_tiny.hf_logits(p)
        assert_fp32_close(logits[i, : len(p)], ref, reduction_depth(gemma_tiny.cfg))


def _rewrite_config(folder, drop: tuple[str, ...], **set_keys) -> None:
    import json

    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(set_keys)
    path.write_text(json.dumps(cfg))


def test_legacy_gemma3_config_keys(tiny_factory) -> None:
    """Gemma 3 checkpoints in the wild spell RoPE and the layer pattern the old way:
    rope_theta + rope_scaling (full layers only), rope_local_base_freq, sliding_window_pattern."""
    from conftest import load_ours

    tiny = tiny_factory("gemma3", seed=8, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5000.0}})
    _rewrite_config(tiny.folder, ("rope_parameters", "layer_types"), rope_theta=5000.0,
                    rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=100.0,
                    sliding_window_pattern=3)
    ours, cfg = load_ours(tiny.folder)
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg.rope["sliding_attention"].kind == "default" and cfg.rope["full_attention"].factor == 8.0
    ids = prompts_of([SEQ], cfg.vocab_size, seed=12)[0]
    got = ours.logits(ours(torch.tensor([ids]), ours.new_cache(1, SEQ)))[0]
    assert_fp32_close(got, tiny.hf_logits(ids), reduction_depth(cfg))


def test_legacy_llama3_rope_scaling_keys(tiny_factory) -> None:
    """Llama 3.1 style config.json: top-level rope_theta and a rope_scaling dict ("type" key)."""
    from conftest import load_ours

    rope = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    tiny = tiny_factory("llama", seed=9, rope_parameters=rope)
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    _rewrite_config(tiny.folder, ("rope_parameters",), rope_theta=100.0, rope_scaling={"type": "llama3", **scaling})
    ours, cfg = load_ours(tiny.folder)
    assert cfg.rope["full_attention"].kind == "llama3"
    ids = prompts_of([SEQ], cfg.vocab_size, seed=13)[0]
    got = ours.logits(ours(torch.tensor([ids]), ours.new_cache(1, SEQ)))[0]
    assert_fp32_close(got, tiny.hf_logits(ids), reduction_depth(cfg))
