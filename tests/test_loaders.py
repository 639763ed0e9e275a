"""Loaders: GGUF and safetensors routes give the same tensors; bad files fail clearly.

The GGUF files are written here with `gguf.GGUFWriter` the way llama.cpp's converter writes
them (Llama q/k permuted into interleaved-RoPE order, Gemma norms stored as 1 + w, Llama 3
RoPE as a `rope_freqs` tensor), from a tiny random HF model whose state dict is the oracle.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FP32, build_hf, load_ours, prompts_of, save_hf
from specdraft.errors import SpecdraftError
from specdraft.loading import load_folder
from specdraft.loading.gguf_file import convert_gguf
from specdraft.tokenizer import Tokenizer

# ------------------------------------------------------------------ writing GGUF like llama.cpp


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary halves -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_GGUF_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, *local, kind = hf_name.split(".")
    local = ".".join(local)
    names = {**_GGUF_LAYER, **(_GGUF_GEMMA_NORMS if arch == "gemma3" else {"post_attention_layernorm": "ffn_norm"})}
    return f"blk.{layer}.{names[local]}.{kind}"


def add_byte_level_vocab(w: gguf.GGUFWriter, n: int) -> None:
    """A minimal GPT-2 style vocabulary of n tokens (what gguf_tokenizer.py needs: model,
    tokens, types, merges, special ids)."""
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(0xA1, 0xAD)] + \
            [chr(c) for c in range(0xAE, 0x100)]
    tokens = ["<|endoftext|>", "ab"] + [c for c in chars if c not in "ab"][: n - 4] + ["a", "b"]
    assert len(tokens) == n
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (n - 1))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)


def add_sentencepiece_vocab(w: gguf.GGUFWriter, n: int) -> None:
    """A minimal SentencePiece ("llama") vocabulary: specials, pieces with descending scores."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "\u2581a", "ab"]
    tokens += [f"p{i}" for i in range(n - len(tokens))]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.NORMAL] * (n - 4)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(n - 4)])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)


def write_gguf(path: Path, hf, arch: str, rope_freqs: np.ndarray | None = None, linear_factor: float | None = None,
               drop: tuple[str, ...] = (), extra_tensor: str | None = None) -> Path:
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma3":
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(c.sliding_window)
        add_sentencepiece_vocab(w, c.vocab_size)
    else:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        add_byte_level_vocab(w, c.vocab_size)
    if linear_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_factor)
    state = hf.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        if name in drop:
            continue
        t = t.detach().float().clone()
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's (1 + w)
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            t = llama_cpp_permute(t, c.num_attention_heads)
        if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            t = llama_cpp_permute(t, c.num_key_value_heads)
        w.add_tensor(gguf_name(name, arch), t.numpy())
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float, old_len: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama 3 `rope_freqs`: the divisor of each inverse frequency."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def compare_with_hf_state(folder: Path, hf, norm_atol: float = 0.0) -> None:
    """Every tensor of the converted folder equals the HF model's, and none is missing."""
    converted = load_file(str(folder / "model.safetensors"))
    expected = hf.state_dict()
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert set(converted) == set(expected)
    for name, ref in expected.items():
        got = converted[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        if norm_atol and name.endswith("norm.weight"):
            # (w + 1) - 1 in float32 is exact only to half an ulp of 1 + w (< 2.4e-7 for |1 + w| < 4).
            assert (got - ref).abs().max().item() <= norm_atol, name
        else:
            assert torch.equal(got, ref), name


def same_logits(folder_a: Path, folder_b: Path, vocab: int) -> None:
    ids = torch.tensor([prompts_of([24], vocab, seed=3)[0]])
    out = []
    for folder in (folder_a, folder_b):
        model, _ = load_ours(folder)
        with torch.inference_mode():
            out.append(model.logits(model(ids, model.new_cache(1, 24))))
    assert (out[0] - out[1]).abs().max().item() <= 1e-5


# ------------------------------------------------------------------ GGUF == safetensors


@pytest.mark.parametrize("tied", [False, True])
def test_llama_gguf_unpermutes_q_k(tmp_path: Path, tied: bool) -> None:
    hf = build_hf("llama", seed=3, tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    path = write_gguf(tmp_path / "tiny-llama.gguf", hf, "llama")
    convert_gguf(path, tmp_path / "from_gguf", progress=False)
    compare_with_hf_state(tmp_path / "from_gguf", hf)
    cfg = json.loads((tmp_path / "from_gguf" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["rope_parameters"]["rope_theta"] == 500.0
    same_logits(tmp_path / "from_gguf", save_hf(hf, tmp_path / "hf"), hf.config.vocab_size)
    # The converted folder carries a working tokenizer built from the GGUF metadata.
    tok = Tokenizer(tmp_path / "from_gguf")
    assert tok.encode("ab!", add_special_tokens=False) == [1, tok.token_to_id("!")]


def test_llama_gguf_rope_freqs_become_llama3_parameters(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = build_hf("llama", seed=4, rope_parameters=rope, max_position_embeddings=131072)
    factors = llama_cpp_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 8192)
    assert len(set(np.round(factors, 6))) > 2  # all three regimes (kept, blended, scaled) occur
    path = write_gguf(tmp_path / "l3.gguf", hf, "llama", rope_freqs=factors)
    convert_gguf(path, tmp_path / "out", progress=False)
    compare_with_hf_state(tmp_path / "out", hf)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_parameters"] == rope
    same_logits(tmp_path / "out", save_hf(hf, tmp_path / "hf"), hf.config.vocab_size)


def test_gemma3_gguf_undoes_norm_offset(tmp_path: Path) -> None:
    n = 6  # the converter derives Gemma 3's layer types from the pattern of 6
    hf = build_hf("gemma3", seed=5, num_hidden_layers=n, query_pre_attn_scalar=16, sliding_window=8,
                  layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}})
    path = write_gguf(tmp_path / "g3.gguf", hf, "gemma3", linear_factor=4.0)
    convert_gguf(path, tmp_path / "out", progress=False)
    compare_with_hf_state(tmp_path / "out", hf, norm_atol=2.4e-7)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["sliding_window"] == 8 and cfg["query_pre_attn_scalar"] == 16
    assert cfg["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}
    # Loaded through specdraft, the GGUF route gives the HF model's logits.
    model, _ = load_ours(tmp_path / "out")
    ids = prompts_of([30], hf.config.vocab_size, seed=1)[0]
    with torch.inference_mode():
        ours = model.logits(model(torch.tensor([ids]), model.new_cache(1, 30)))[0]
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    tok = Tokenizer(tmp_path / "out")
    assert tok.eos_token_ids == [1] and tok.encode("a")[0] == 2  # BOS added by default for SentencePiece


# ------------------------------------------------------------------ bad files fail clearly


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    return save_hf(build_hf("llama", seed=6), tmp_path / "model")


def _load(folder: Path):
    return load_folder(folder, FP32, "cpu")


def test_good_folder_loads(hf_folder: Path) -> None:
    model, cfg, notes = _load(hf_folder)
    assert cfg.family == "llama" and notes == []


def test_truncated_safetensors(hf_folder: Path) -> None:
    f = hf_folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(SpecdraftError, match=r"model\.safetensors: cannot read safetensors file .*truncated or corrupt"):
        _load(hf_folder)


def test_garbage_safetensors(hf_folder: Path) -> None:
    (hf_folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(SpecdraftError, match="truncated or corrupt"):
        _load(hf_folder)


def test_config_shape_mismatch(hf_folder: Path) -> None:
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match=r"tensor layers\.\d+\.mlp\.\w+_proj\.weight has shape .* but the config implies"):
        _load(hf_folder)


def test_config_with_more_layers_than_the_weights(hf_folder: Path) -> None:
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match=r"checkpoint lacks \d+ tensor\(s\) the config needs, e\.g\. \['layers\.3\."):
        _load(hf_folder)


def test_missing_tensor(hf_folder: Path) -> None:
    state = load_file(str(hf_folder / "model.safetensors"))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(hf_folder / "model.safetensors"))
    with pytest.raises(SpecdraftError, match=r"lacks 1 tensor\(s\).*layers\.1\.self_attn\.v_proj\.weight"):
        _load(hf_folder)


def test_unexpected_tensor(hf_folder: Path) -> None:
    state = load_file(str(hf_folder / "model.safetensors"))
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(state, str(hf_folder / "model.safetensors"))
    with pytest.raises(SpecdraftError, match="does not describe.*extra"):
        _load(hf_folder)


def test_bad_config_json(hf_folder: Path) -> None:
    (hf_folder / "config.json").write_text("{not json")
    with pytest.raises(SpecdraftError, match="config.json: invalid JSON"):
        _load(hf_folder)


def test_unsupported_model_type(hf_folder: Path) -> None:
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg["model_type"] = "bert"
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="unsupported model_type 'bert'"):
        _load(hf_folder)


def test_sharded_index_loads_and_missing_shard_is_named(tmp_path: Path) -> None:
    hf = build_hf("llama", seed=7)
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="60KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").exists()
    model, _, _ = _load(folder)  # complete: loads, and equals the single-file route
    ref, _ = load_ours(save_hf(hf, tmp_path / "single", tokenizer=False))
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), ref.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    shards[-1].unlink()
    with pytest.raises(SpecdraftError, match=f"names shard\\(s\\) that are missing: .*{shards[-1].name}"):
        _load(folder)


def test_pickle_checkpoint_is_refused_and_never_executed(tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    hf = build_hf("llama", seed=8)
    hf.config.save_pretrained(folder)
    marker = tmp_path / "pickle-was-executed"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(SpecdraftError, match=r"no \*\.safetensors weights found"):
        _load(folder)
    assert not marker.exists()
    # The same refusal through the full runtime path (model resolution + tokenizer).
    from specdraft.runtime import Runtime

    with pytest.raises(SpecdraftError, match="safetensors"):
        Runtime.load(str(folder), "float32", "cpu")
    assert not marker.exists()


def test_garbage_gguf(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(SpecdraftError, match="not a valid GGUF file"):
        convert_gguf(bad, tmp_path / "out", progress=False)
    from specdraft.loading import resolve_model

    with pytest.raises(SpecdraftError, match="not a valid GGUF file"):
        resolve_model(str(bad), progress=False)
    # Nothing half-converted is left in the cache to be picked up next time.
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not any(p.is_dir() and (p / "config.json").exists() for p in models.iterdir())


def test_truncated_gguf(tmp_path: Path) -> None:
    hf = build_hf("llama", seed=9)
    path = write_gguf(tmp_path / "t.gguf", hf, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(SpecdraftError, match="truncated or corrupt"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_gguf_missing_tensor_is_named(tmp_path: Path) -> None:
    hf = build_hf("llama", seed=10)
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", drop=("model.layers.0.mlp.up_proj.weight",))
    convert_gguf(path, tmp_path / "out", progress=False)  # the converter copies what is there...
    with pytest.raises(SpecdraftError, match=r"lacks 1 tensor\(s\).*layers\.0\.mlp\.up_proj\.weight"):
        _load(tmp_path / "out")  # ...and the loader names what is missing


def test_gguf_unknown_tensor_and_arch(tmp_path: Path) -> None:
    hf = build_hf("llama", seed=11)
    path = write_gguf(tmp_path / "x.gguf", hf, "llama", extra_tensor="blk.0.mystery.weight")
    with pytest.raises(SpecdraftError, match="'blk.0.mystery.weight' is not one a llama model has"):
        convert_gguf(path, tmp_path / "out", progress=False)
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdraftError, match="architecture 'bert' is not supported"):
        convert_gguf(tmp_path / "bert.gguf", tmp_path / "out2", progress=False)


def test_missing_paths_are_named(tmp_path: Path) -> None:
    from specdraft.loading import resolve_model

    with pytest.raises(SpecdraftError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdraftError, match="folder has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(SpecdraftError, match="expected a .gguf file"):
        resolve_model(str(tmp_path / "w.bin"))


def test_two_conversions_of_one_model_do_not_race(tmp_path, monkeypatch) -> None:
    """Two processes converting the same GGUF: one converts, the other waits and uses its folder;
    neither sees a half-written folder or deletes the other's."""
    import threading

    from specdraft.loading import gguf_file, presets

    calls = []

    def slow_convert(gguf, out, progress=True):
        calls.append(out)
        for name in ("config.json", "model.safetensors"):
            (out / name).write_text("x")
            time.sleep(0.05)  # the other one arrives mid-conversion
        (out / "tokenizer.json").write_text("x")

    monkeypatch.setattr(gguf_file, "convert_gguf", slow_convert)
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)  # a stale, incomplete folder from an interrupted older version
    results = []
    threads = [threading.Thread(target=lambda: results.append(presets._convert_into(tmp_path / "m.gguf", folder,
                                                                                      False))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [folder, folder] and presets.is_converted(folder)
    assert sorted(p.name for p in folder.parent.iterdir()) == [".m.lock", "m"]  # no temporary folder left


def test_loading_hands_the_freed_heap_back(gemma_tiny, monkeypatch) -> None:
    """Runtime.load trims the heap once everything is built (packing's and the tokenizer's
    temporaries: ~190 MB resident for Gemma 3 270M with gguf weights)."""
    import specdraft.runtime as runtime

    calls = []
    monkeypatch.setattr(runtime, "release_free_memory", lambda: calls.append("trim"))
    monkeypatch.setattr(runtime, "Tokenizer", lambda *a, **k: calls.append("tokenizer"))
    runtime.Runtime.load(str(gemma_tiny.folder), "float32", "cpu", progress=False, weights="dtype")
    assert calls == ["tokenizer", "trim"]
