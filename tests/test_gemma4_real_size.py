"""tools/gemma4_real_size.py: the published Gemma 4 configs, the tensors they imply, and what the
tool writes (HF shards + index, assistant, Q8_0 GGUF), checked at tiny widths so nothing large
is written. The published depths, layer patterns, KV sharing and MoE layout are kept; only
widths shrink."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import gemma4_real_size as real
from gemma4_real_size import FULL, SLIDING

gguf = pytest.importorskip("gguf")


# ---------------------------------------------------------------- published numbers


def test_published_text_configs():
    e2b, e4b, moe, dense = (real.text_config(s) for s in real.SIZES)
    assert (e2b["hidden_size"], e2b["num_hidden_layers"], e2b["hidden_size_per_layer_input"],
            e2b["vocab_size"], e2b["intermediate_size"], e2b["num_kv_shared_layers"]) == (1536, 35, 256, 262144, 6144, 20)
    assert e2b["use_double_wide_mlp"] and e2b["layer_types"][:5] == [SLIDING] * 4 + [FULL]
    assert (e4b["hidden_size"], e4b["num_hidden_layers"], e4b["num_key_value_heads"], e4b["num_kv_shared_layers"],
            e4b["intermediate_size"]) == (2560, 42, 2, 18, 10240)
    assert (moe["hidden_size"], moe["num_hidden_layers"], moe["num_experts"], moe["top_k_experts"],
            moe["moe_intermediate_size"], moe["intermediate_size"], moe["num_global_key_value_heads"]) == \
        (2816, 30, 128, 8, 704, 2112, 2)
    assert (dense["hidden_size"], dense["num_hidden_layers"], dense["num_attention_heads"],
            dense["num_key_value_heads"], dense["num_global_key_value_heads"], dense["intermediate_size"]) == \
        (5376, 60, 32, 16, 4, 21504)
    for cfg in (e2b, e4b, moe, dense):
        assert cfg["architectures"] == ["Gemma4ForCausalLM"] and cfg["model_type"] == "gemma4_text"
        assert cfg["layer_types"][-1] == FULL and len(cfg["layer_types"]) == cfg["num_hidden_layers"]
        assert (cfg["head_dim"], cfg["global_head_dim"], cfg["final_logit_softcapping"]) == (256, 512, 30.0)
    assert (moe["attention_k_eq_v"], dense["attention_k_eq_v"], e2b["attention_k_eq_v"]) == (True, True, False)
    assert (moe["sliding_window"], e2b["sliding_window"]) == (1024, 512)


def test_published_assistant_configs():
    for size in real.SIZES:
        target, assistant = real.text_config(size), real.assistant_config(size)
        text = assistant["text_config"]
        assert assistant["backbone_hidden_size"] == target["hidden_size"]
        assert text["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL] and text["vocab_size"] == 262144
        assert (text["num_key_value_heads"], text["num_global_key_value_heads"]) == \
            (target["num_key_value_heads"], target["num_global_key_value_heads"])
        assert assistant["use_ordered_embeddings"] == (size in ("e2b", "e4b"))
    assert real.assistant_config("e2b")["text_config"]["hidden_size"] == 256
    assert real.assistant_config("31b")["text_config"]["hidden_size"] == 1024


def test_parameter_counts_from_shapes():
    counts = {s: real.parameter_count(real.target_tensors(real.text_config(s))) for s in real.SIZES}
    # The text decoders of the "5.1B / 8B / 26B / 31B" totals (those include vision and audio towers).
    assert counts == {"e2b": 4_628_569_379, "e4b": 7_463_013_418, "26b-a4b": 25_233_141_790,
                      "31b": 30_697_345_340}
    # E2B: the PLE table alone is vocab x 35 layers x 256.
    ple = next(s for s in real.target_tensors(real.text_config("e2b")) if s.name == "model.embed_tokens_per_layer.weight")
    assert ple.shape == (262144, 35 * 256)
    # The E4B assistant's published size: 78.5 M parameters.
    assert real.parameter_count(real.assistant_tensors(real.assistant_config("e4b"))) == 78_517_764


def test_fewer_layers_keeps_pattern_and_a_valid_kv_boundary():
    cfg = real.text_config("e2b", layers=8)
    assert cfg["layer_types"] == [SLIDING] * 4 + [FULL, SLIDING, SLIDING, FULL]
    first = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
    assert cfg["num_kv_shared_layers"] == 3 and cfg["layer_types"][first - 1] == FULL
    assert cfg["layer_types"][first - 2] == SLIDING
    assert real.text_config("e2b", layers=4)["num_kv_shared_layers"] == 0  # too short to share
    moe = real.text_config("26b-a4b", layers=4)
    assert moe["layer_types"] == [SLIDING] * 3 + [FULL] and moe["num_experts"] == 128
    with pytest.raises(ValueError):
        real.text_config("31b", layers=61)


# ---------------------------------------------------------------- tiny widths


def shrink(size: str, layers: int | None = None) -> dict:
    """The published config at tiny widths: same depth, layer pattern, KV sharing, MoE layout."""
    cfg = real.text_config(size, layers)
    cfg.update(hidden_size=64, intermediate_size=64, head_dim=16, global_head_dim=32, vocab_size=512,
               num_attention_heads=4 if cfg["num_attention_heads"] < 16 else 8,
               num_key_value_heads=min(cfg["num_key_value_heads"], 2), sliding_window=16,
               max_position_embeddings=256)
    if cfg["num_global_key_value_heads"]:
        cfg["num_global_key_value_heads"] = 1
    if cfg["hidden_size_per_layer_input"]:
        cfg.update(hidden_size_per_layer_input=32, vocab_size_per_layer_input=512)
    if cfg["enable_moe_block"]:
        cfg.update(num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    return cfg


def tiny_assistant(cfg: dict, size: str) -> dict:
    return real.assistant_for(cfg, size, hidden_size=32, intermediate_size=64)


def _hf_text(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")}


@pytest.mark.parametrize("size", real.SIZES)
@pytest.mark.parametrize("layers", [None, 8])
def test_tensor_list_is_transformers_state_dict(size, layers):
    transformers = pytest.importorskip("transformers")
    cfg = shrink(size, layers)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**_hf_text(cfg)))
    expected = [(k, tuple(v.shape)) for k, v in model.state_dict().items() if k != "lm_head.weight"]
    assert [(s.name, s.shape) for s in real.target_tensors(cfg)] == expected
    acfg = tiny_assistant(cfg, size)
    top = {k: v for k, v in acfg.items() if k not in ("architectures", "model_type", "dtype", "text_config")}
    text = transformers.Gemma4TextConfig(**_hf_text(acfg["text_config"]))
    assistant = transformers.Gemma4AssistantForCausalLM(transformers.Gemma4AssistantConfig(text_config=text, **top))
    expected = [(k, tuple(v.shape)) for k, v in assistant.state_dict().items() if k != "lm_head.weight"]
    assert [(s.name, s.shape) for s in real.assistant_tensors(acfg)] == expected


@pytest.fixture(scope="module", params=["e2b", "26b-a4b"])
def written(request, tmp_path_factory):
    """(size, config, output folder) of a tiny build, target split over several shards."""
    size = request.param
    cfg = shrink(size)
    out = tmp_path_factory.mktemp(size)
    real.build(size, out, config=cfg, assistant=tiny_assistant(cfg, size), shard_bytes=400_000, quiet=True)
    return size, cfg, out


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(folder / name))
    assert set(state) == set(index["weight_map"])
    return state


def test_hf_folder_layout(written):
    size, cfg, out = written
    target = out / "target"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    state = _safetensors(target)
    specs = real.target_tensors(cfg)
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    assert index["metadata"]["total_parameters"] == real.parameter_count(specs)
    assert all(state[s.name].dtype == torch.bfloat16 and tuple(state[s.name].shape) == s.shape for s in specs)
    assert json.loads((target / "config.json").read_text()) == cfg
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == [1, 106, 50]
    # Scaled as promised: matrices ~ N(0, 1/fan_in), vectors near 1.
    q = state["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() * 64**0.5 - 1) < 0.05
    norm = state["model.norm.weight"].float()
    assert (norm - 1).abs().max() < 0.3
    assistant = json.loads((out / "assistant" / "config.json").read_text())
    astate = _safetensors(out / "assistant") if (out / "assistant" / "model.safetensors.index.json").exists() \
        else __import__("safetensors.torch", fromlist=["load_file"]).load_file(out / "assistant" / "model.safetensors")
    if assistant["use_ordered_embeddings"]:
        order = astate["masked_embedding.token_ordering"]
        assert order.dtype == torch.int64 and torch.equal(order.sort().values, torch.arange(cfg["vocab_size"]))


def test_deterministic_from_seed(tmp_path):
    cfg = shrink("e2b", layers=4)
    runs = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        real.build("e2b", tmp_path / name, seed=seed, config=cfg, assistant=tiny_assistant(cfg, "e2b"), quiet=True)
        runs.append((tmp_path / name / "target" / "model.safetensors").read_bytes())
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_gguf_round_trip(written):
    size, cfg, out = written
    reader = gguf.GGUFReader(out / "target.gguf")
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "gemma4" and fields["general.file_type"] == 7
    n = cfg["num_hidden_layers"]
    assert fields["gemma4.block_count"] == n
    assert fields["gemma4.embedding_length"] == 64
    assert fields["gemma4.attention.sliding_window_pattern"] == [t == SLIDING for t in cfg["layer_types"]]
    assert fields["gemma4.attention.shared_kv_layers"] == cfg["num_kv_shared_layers"]
    assert (fields["gemma4.attention.key_length"], fields["gemma4.attention.key_length_swa"]) == (32, 16)
    assert (fields["gemma4.rope.dimension_count"], fields["gemma4.rope.dimension_count_swa"]) == (32, 16)
    assert fields["gemma4.rope.freq_base_swa"] == 10_000.0 and fields["gemma4.final_logit_softcapping"] == 30.0
    assert fields["gemma4.embedding_length_per_layer_input"] == cfg["hidden_size_per_layer_input"]
    if size == "e2b":  # double-wide MLP in the KV-shared layers; one KV head count everywhere
        first = n - cfg["num_kv_shared_layers"]
        assert fields["gemma4.feed_forward_length"] == [64] * first + [128] * (n - first)
        assert fields["gemma4.attention.head_count_kv"] == cfg["num_key_value_heads"]
    else:  # k_eq_v full layers with their own KV head count; experts
        assert fields["gemma4.attention.head_count_kv"] == [2 if t == SLIDING else 1 for t in cfg["layer_types"]]
        assert (fields["gemma4.expert_count"], fields["gemma4.expert_used_count"],
                fields["gemma4.expert_feed_forward_length"]) == (8, 2, 32)

    tensors = {t.name: t for t in reader.tensors}
    specs = real.target_tensors(cfg)
    assert set(tensors) == {"rope_freqs.weight"} | {real.gguf_name(s.name) for s in specs}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    rope = tensors["rope_freqs.weight"]
    assert np.array_equal(rope.data, np.float32([1.0] * 4 + [1e30] * 12))  # 32 * 0.25 / 2 rotated pairs of 16
    state = _safetensors(out / "target")
    Q = gguf.GGMLQuantizationType
    for spec in specs:
        t = tensors[real.gguf_name(spec.name)]
        assert tuple(int(d) for d in reversed(t.shape)) == spec.shape  # ggml order: innermost first
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(spec.shape)
        original = state[spec.name].float().numpy()
        if len(spec.shape) == 1 or t.name.endswith(("_norm.weight", "ffn_gate_inp.weight", ".scale")):
            assert t.tensor_type == Q.F32 and np.array_equal(values, original), t.name
        else:
            assert t.tensor_type == Q.Q8_0, t.name
            # Q8_0: half a step (max |x| / 127 per 32 values) of rounding, plus the step's own fp16 rounding
            step = np.abs(original).reshape(-1, 32).max(1, keepdims=True) / 127
            assert (np.abs(values - original).reshape(-1, 32) <= step * 0.6 + 1e-6).all(), t.name
    if size != "e2b":
        assert tensors["blk.0.ffn_gate_up_exps.weight"].tensor_type == Q.Q8_0
        assert tensors["blk.0.ffn_down_exps.scale"].tensor_type == Q.F32
        assert "blk.5.attn_v.weight" not in tensors and "blk.0.attn_v.weight" in tensors  # k_eq_v full layer
    else:
        assert "blk.34.attn_k.weight" not in tensors  # KV-shared layers compute no K/V


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_finite_over_all_layers(written, dtype):
    transformers = pytest.importorskip("transformers")
    _, cfg, out = written
    model = transformers.Gemma4ForCausalLM.from_pretrained(out / "target", dtype=dtype).eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        result = model(ids, output_hidden_states=True)
    logits = result.logits.float()
    assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 5
    assert max(h.float().pow(2).mean().sqrt().item() for h in result.hidden_states) < 100


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_specdraft_reads_target_and_assistant(written):
    transformers = pytest.importorskip("transformers")
    from specdraft.drafters.mtp import load_mtp_drafter
    from specdraft.loading import load_folder

    size, cfg, out = written
    model, mcfg, _ = load_folder(out / "target", torch.float32, "cpu")
    assert mcfg.family == "gemma4" and mcfg.num_layers == cfg["num_hidden_layers"]
    ids = torch.randint(3, cfg["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model.logits(model(ids, model.new_cache(1, 16)))

    with torch.no_grad():
        ref = transformers.Gemma4ForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()(ids).logits
    tol = fp32_bound(cfg, ref)
    diff = (logits() - ref).abs().max().item()
    print(f"\n[{size}] max |logits diff| {diff:.3g}, bound {tol:.3g}")
    assert diff <= tol, (diff, tol)
    # Negative controls: a norm scaled by (1 + w) instead of w, and RoPE rotating the wrong way
    # (rotate_half's halves swapped), each in every layer, move the logits far past the bound.
    from specdraft.models.architectures import gemma4

    for bug, target, broken in [
        ("(1 + w) norm", gemma4.Gemma4RMSNorm, "forward"),
        ("swapped RoPE halves", gemma4, "apply_rope"),
    ]:
        with pytest.MonkeyPatch.context() as m:
            if broken == "forward":
                m.setattr(target, broken, _offset_norm)
            else:
                m.setattr(target, broken, lambda x, cos, sin: x * cos - x.roll(x.shape[-1] // 2, dims=-1) * sin)
            wrong = (logits() - ref).abs().max().item()
        print(f"[{size}] {bug}: max |logits diff| {wrong:.3g}")
        assert wrong > 10 * tol, (bug, wrong, tol)
    load_mtp_drafter(out / "assistant", model, torch.float32, "cpu")


def _offset_norm(self, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
    return (normed * (1.0 + self.weight.float()) if self.weight is not None else normed).type_as(x)


def fp32_bound(cfg: dict, ref: torch.Tensor) -> float:
    """How far two float32 computations of the same logits may drift apart by rounding alone.

    A layer's outputs are dot products over its widths W (the hidden size, the head width, the
    MLP's intermediate width, doubled where it is double wide, and the routed experts' widths).
    A sum of n float32 terms, each addition rounding by at most u = eps / 2 with no sign bias,
    is off by at most lambda x sqrt(n) x u relative to its terms (Higham & Mary's probabilistic
    bound; lambda = 4 fails with probability under 2 e^-8), and the layers' errors add up along
    the residual stream. So: 2 eps x layers x sqrt(W) x max |logit|; e.g. 4.6e-4 for E2B's 35
    layers at these widths, where 1.4e-5 was measured. The worst case, eps x layers x W (the
    suite's assert_fp32_close), would allow 3.5e-3; a wrong formula moves logits by O(1)."""
    from conftest import FP32_EPS

    mlp = cfg["intermediate_size"] * (2 if cfg.get("use_double_wide_mlp") else 1)
    if cfg.get("enable_moe_block"):
        mlp += cfg["top_k_experts"] * cfg["moe_intermediate_size"]
    widths = cfg["hidden_size"] + max(cfg["head_dim"], cfg.get("global_head_dim") or 0) + mlp
    return 2 * FP32_EPS * cfg["num_hidden_layers"] * widths ** 0.5 * float(ref.abs().max())
