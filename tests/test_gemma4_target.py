"""Gemma 4 text target: logits and greedy tokens equal transformers' (the reference), in float32.

Tiny random configs built with transformers' own config classes, written with save_pretrained
and read back through specdraft's real loader. Between them the configs exercise: per-layer
input embeddings, KV sharing (fewer cache slots), double-wide MLP in shared layers, different
head_dim and KV heads on full layers, attention_k_eq_v, proportional partial RoPE, q/k/v norms,
layer_scalar, final softcap, plain-weight norms, embedding scaling, the MoE block, an untied
head, and the multimodal wrapper folder. Prompts are longer than the sliding window (8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_fp32_close, reduction_depth  # noqa: E402
from gemma4_tiny import (  # noqa: E402
    greedy_sequences,
    moe_overrides,
    multimodal_config,
    randomize_,
    target_text_config,
)
from specdraft.config import FULL, SLIDING, ConfigError  # noqa: E402
from specdraft.drafters.mtp.source import kv_source  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.models.architectures.gemma4_config import gemma4_params  # noqa: E402
from specdraft.models.architectures.hf_config import read_model_config  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

CONFIGS = {
    # E2B/E4B-like: PLE, KV sharing, double-wide MLP, k_eq_v with 1 global KV head, softcap.
    "ple_kv_shared": {},
    # 26B-A4B-like: routed experts beside the MLP; no PLE or sharing; untied head; V projected
    # on full layers too (no k_eq_v, so full layers keep the sliding KV head count).
    "moe_untied": dict(moe_overrides(), attention_k_eq_v=False, num_global_key_value_heads=None,
                       tie_word_embeddings=False, final_logit_softcapping=None),
}


def _save(tmp_path_factory, name: str, model) -> Path:
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(CONFIGS))
def text_pair(request, tmp_path_factory):
    """(transformers Gemma4ForCausalLM, specdraft model loaded from its saved folder)."""
    torch.manual_seed(0)
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**CONFIGS[request.param])), seed=1)
    folder = _save(tmp_path_factory, request.param, ref)
    model, cfg, notes = load_folder(folder, torch.float32, "cpu")
    assert cfg.family == "gemma4" and notes == []
    return ref, model


def _ours(model, ids: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """Logits for ids [B, T]: one forward, or a prefill of `split` tokens then one token at a time."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
    if split is None:
        return model.logits(model(ids, cache))
    outs = [model.logits(model(ids[:, :split], cache))]
    outs += [model.logits(model(ids[:, t : t + 1], cache)) for t in range(split, ids.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_logits_match_transformers(text_pair):
    ref, model = text_pair
    ids = torch.randint(3, 250, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits
    depth = reduction_depth(model.config)
    assert_fp32_close(_ours(model, ids), expected, depth)
    assert_fp32_close(_ours(model, ids, split=5), expected, depth)  # decode path: windows slide


def test_cache_has_one_slot_per_kv_producer(text_pair):
    ref, model = text_pair
    cfg = ref.config
    shared = cfg.num_kv_shared_layers
    cache = model.new_cache(1, 8)
    assert len(cache.k) == cfg.num_hidden_layers - shared
    for i, t in enumerate(cfg.layer_types):
        slot = model.cache_slot(i)
        assert cache.k[slot].shape[1:] == (cfg.per_layer_config[i].num_key_value_heads, 8,
                                           cfg.per_layer_config[i].head_dim)
        assert model.config.layer_types[slot] == t
    src = kv_source(model, FULL)
    assert (src.scale, src.q_norm, src.window) == (1.0, True, None)
    assert src.layer == max(i for i in range(cfg.num_hidden_layers - shared) if cfg.layer_types[i] == FULL)
    assert kv_source(model, SLIDING).window == cfg.sliding_window


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_batched_ragged_engine_equals_transformers_generate(text_pair):
    ref, model = text_pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 13, 19)]
    expected = [s[len(p):] for s, p in zip(greedy_sequences(ref, prompts, 10), prompts)]
    results = Engine(model).generate(prompts, max_new_tokens=10, eos_token_ids=[])
    assert [r.token_ids for r in results] == expected


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_multimodal_wrapper_folder(tmp_path_factory):
    """A Gemma4ForConditionalGeneration folder: the text decoder loads, towers are ignored with
    a note, and media placeholder ids embed as padding exactly as transformers does."""
    torch.manual_seed(0)
    text = target_text_config(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL])
    ref = randomize_(transformers.Gemma4ForConditionalGeneration(multimodal_config(text)), seed=2)
    folder = _save(tmp_path_factory, "multimodal", ref)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "gemma4" and "text_config" in raw
    model, cfg, notes = load_folder(folder, torch.float32, "cpu")
    assert len(notes) == 1 and "vision/audio" in notes[0]
    ids = torch.randint(3, 240, (1, 20), generator=torch.Generator().manual_seed(5))
    ids[0, 11] = ref.config.audio_token_id
    ids[0, 15] = ref.config.image_token_id
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    assert_fp32_close(_ours(model, ids), expected, reduction_depth(model.config))


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_google_config_spelling_and_extra_shared_kv_tensors(tmp_path_factory):
    """Google's files spell full-layer shapes as global_head_dim / num_global_key_value_heads
    (transformers writes per_layer_config instead), and may keep K/V weights for KV-shared
    layers; both load, to the same model."""
    from safetensors.torch import load_file, save_file

    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config()), seed=6)
    folder = _save(tmp_path_factory, "google_spelling", ref)
    raw = json.loads((folder / "config.json").read_text())
    via_per_layer = read_model_config(raw)
    raw.pop("per_layer_config")
    raw.update(global_head_dim=32, num_global_key_value_heads=1)
    (folder / "config.json").write_text(json.dumps(raw))
    assert read_model_config(raw).extra == via_per_layer.extra
    state = load_file(str(folder / "model.safetensors"))
    last = raw["num_hidden_layers"] - 1  # KV-shared
    state[f"model.layers.{last}.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    state[f"model.layers.{last}.self_attn.k_norm.weight"] = torch.ones(32)
    save_file(state, str(folder / "model.safetensors"))
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ref(ids).logits
    assert_fp32_close(_ours(model, ids), expected, reduction_depth(model.config))


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_full_layers_shaped_like_sliding_ones(tmp_path_factory):
    """Full layers with the sliding layers' head_dim and KV heads: transformers saves an empty
    per_layer_config, which means those shapes (not global_head_dim's default of 512)."""
    shapes = dict(head_dim=32, global_head_dim=32, num_key_value_heads=1, num_global_key_value_heads=1)
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**shapes)), seed=8)
    folder = _save(tmp_path_factory, "same_shapes", ref)
    assert json.loads((folder / "config.json").read_text())["per_layer_config"] == {}
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    assert model.params.head_dim == {SLIDING: 32, FULL: 32}
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = ref(ids).logits
    assert_fp32_close(_ours(model, ids), expected, reduction_depth(model.config))
    # Without the key, the full layers take global_head_dim's default, as transformers reads it.
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("per_layer_config")
    assert gemma4_params(read_model_config(raw)).head_dim[FULL] == 512


@pytest.mark.parametrize("change, message", [
    (dict(use_bidirectional_attention="all"), "bidirectional"),
    (dict(per_layer_config={"2": {"intermediate_size": 7}}), "per_layer_config"),
    (dict(enable_moe_block=True, num_experts=None), "enable_moe_block"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    raw = target_text_config().to_dict()
    raw.update(change)
    with pytest.raises(ConfigError, match=message):
        read_model_config(raw)
    assert issubclass(ConfigError, SpecdraftError)
