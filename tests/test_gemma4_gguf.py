"""Gemma 4 GGUF files as llama.cpp, Ollama and LM Studio users have them, loaded by specdraft.

A tiny Gemma 4 (tools/gemma4_tiny.py's configs, transformers' modules) is written to a GGUF in
llama.cpp's layout (tools/gemma4_real_size.py's writer: names, keys, per-tensor types, the
rope_freqs of proportional RoPE), with F32, F16 and Q8_0 tensors. The oracle is transformers'
model holding exactly the weights the file holds (each tensor quantised and dequantised with
the gguf package): specdraft's logits must equal its logits within float32 rounding, and
greedy tokens must be the same tokens.

The gemma4-assistant drafter GGUF (llama.cpp's layout: its own tied table token_embd,
nextn.pre_projection / nextn.post_projection, query-only blocks, no clustered head) is checked
against the same drafter loaded from a Hugging Face folder of the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from conftest import assert_fp32_close, reduction_depth  # noqa: E402
from gemma4_real_size import SIZES, Spec, gguf_metadata, gguf_tensor, rope_freqs  # noqa: E402
from gemma4_real_size import assistant_config as published_assistant  # noqa: E402
from gemma4_real_size import text_config as published_text  # noqa: E402
from gemma4_tiny import (  # noqa: E402
    assistant_config,
    greedy_sequences,
    moe_overrides,
    randomize_,
    target_text_config,
)
from specdraft.config import FULL, SLIDING  # noqa: E402
from specdraft.drafters.base import DraftInput  # noqa: E402
from specdraft.drafters.mtp import load_mtp_drafter  # noqa: E402
from specdraft.drafters.mtp.checkpoint import check_drafter_fits  # noqa: E402
from specdraft.drafters.mtp.config import MTPConfig  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.loading.gguf_file import convert_gguf, gguf_config  # noqa: E402
from specdraft.models.architectures.gemma4_config import gemma4_params  # noqa: E402
from specdraft.models.architectures.hf_config import read_model_config  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
TARGETS = {"ple_kv_shared": {}, "moe": moe_overrides()}

# A SentencePiece-style BPE vocabulary in llama.cpp's "gemma4" tokenizer form: specials, single
# characters ("▁" is a space), a few merged pieces, two byte tokens, a turn marker, then filler.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
CHARS = ["\u2581", "\n"] + list("abcdefghijklmnopqrstuvwxyz")
# Merges apply by their rank in the file, which is not the vocabulary's order: "b c" outranks
# "a b" although "ab" has the lower id, so "abc" is a + bc (a tokenizer ranking merges by the
# merged piece's id, as SentencePiece files without merges need, would give ab + c).
MERGES = ["h e", "l l", "he ll", "hell o", "\u2581 w", "\u2581w o", "\u2581wo r", "\u2581wor l", "\u2581worl d", "\n \n",
          "b c", "a b"]
PIECES = ["he", "ll", "hell", "hello", "\u2581w", "\u2581wo", "\u2581wor", "\u2581worl", "\u2581world", "\n\n", "ab", "bc"]
BYTES = ["<0x21>", "<0x3F>"]  # "!" and "?", reached only through byte fallback


def _vocab(size: int) -> tuple[list[str], list[int]]:
    merged = PIECES
    tokens = SPECIALS + CHARS + merged + BYTES
    types = ([int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * (len(CHARS) + len(merged))
             + [int(gguf.TokenType.BYTE)] * len(BYTES))
    filler = size - len(tokens)
    return tokens + [f"<unused{i}>" for i in range(filler)], types + [int(gguf.TokenType.UNUSED)] * filler


def _layer_attr(cfg, layer_type: str, name: str) -> int:
    return getattr(cfg.per_layer_config[cfg.layer_types.index(layer_type)], name)


def published_fields(text) -> dict:
    """A Gemma4TextConfig as the config.json fields llama.cpp's converter reads (global_* spelling)."""
    fields = {k: getattr(text, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types", "num_attention_heads",
        "sliding_window", "rms_norm_eps", "max_position_embeddings", "num_kv_shared_layers", "use_double_wide_mlp",
        "hidden_size_per_layer_input", "vocab_size_per_layer_input", "final_logit_softcapping", "enable_moe_block",
        "num_experts", "top_k_experts", "moe_intermediate_size", "attention_k_eq_v", "rope_parameters")}
    fields.update(head_dim=_layer_attr(text, SLIDING, "head_dim"), global_head_dim=_layer_attr(text, FULL, "head_dim"),
                  num_key_value_heads=_layer_attr(text, SLIDING, "num_key_value_heads"),
                  num_global_key_value_heads=_layer_attr(text, FULL, "num_key_value_heads"))
    return fields


def _stored(values: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or numbers to write, the float32 values a reader gets back) for one tensor."""
    if qtype == Q.F32:
        data = values.astype(np.float32)
    elif qtype == Q.F16:
        data = values.astype(np.float16)
    else:
        data = gguf.quants.quantize(values.astype(np.float32), qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(values.shape)


def write_target_gguf(path: Path, model, tokenizer: bool = True, split_experts: bool = False,
                      ollama: bool = False) -> None:
    """`model` (transformers' Gemma4ForCausalLM) as a GGUF in llama.cpp's layout; afterwards the
    model holds exactly the values the file stores. `split_experts`: each expert stack as
    ffn_gate_exps + ffn_up_exps (the halves of gate_up_proj) instead of ffn_gate_up_exps.
    `ollama`: as Ollama's converter writes it: tokenizer model "llama" with pre-tokenizer
    "gemma4", and vision/audio tower tensors in the same file."""
    cfg = published_fields(model.config)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    gguf_metadata(writer, cfg, "tiny-gemma4")
    if tokenizer:
        tokens, types = _vocab(cfg["vocab_size"])
        writer.add_tokenizer_model("llama" if ollama else "gemma4")
        if ollama:
            writer.add_tokenizer_pre("gemma4")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(types)
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_pad_token_id(0)
        writer.add_unk_token_id(3)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    writer.add_tensor("rope_freqs.weight", rope_freqs(cfg))
    if ollama:  # a few tower tensors, as Ollama names them (values irrelevant: skipped)
        for name in ("v.blk.0.attn_q.weight", "a.blk.0.ffn_up.weight", "mm.input_projection.weight", "v.clamp_data"):
            writer.add_tensor(name, np.ones((4, 32), dtype=np.float32))
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
                continue
            values = param.float().numpy()
            t = gguf_tensor(Spec(name, tuple(values.shape), "vector" if values.ndim == 1 else "matrix"))
            halves = {t.name: values}
            if split_experts and name.endswith("experts.gate_up_proj"):
                gate, up = np.split(values, 2, axis=1)
                stem = t.name.removesuffix("ffn_gate_up_exps.weight")
                halves = {stem + "ffn_gate_exps.weight": gate, stem + "ffn_up_exps.weight": up}
            back = []
            for gguf_tensor_name, part in halves.items():
                data, part_back = _stored(part, t.qtype)
                writer.add_tensor(gguf_tensor_name, data, raw_dtype=t.qtype if t.qtype not in (Q.F32, Q.F16) else None)
                back.append(part_back)
            param.copy_(torch.from_numpy(np.concatenate(back, axis=1) if len(back) > 1 else back[0]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(TARGETS))
def pair(request, tmp_path_factory):
    """(transformers target holding the GGUF's values, the GGUF path, specdraft's model of it)."""
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**TARGETS[request.param])), seed=21)
    folder = tmp_path_factory.mktemp(f"gguf_{request.param}")
    path = folder / "tiny-gemma4.gguf"
    write_target_gguf(path, ref)
    convert_gguf(path, folder / "converted", progress=False)
    model, _, _ = load_folder(folder / "converted", torch.float32, "cpu")
    return ref, path, model


def test_gguf_holds_every_kind_of_tensor(pair):
    """The file is the mixed-type file the converter writes: Q8_0 matrices, F16 where rows are
    not a whole number of Q8_0 blocks, F32 vectors and router, and no output.weight."""
    _, path, _ = pair
    kinds = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {Q.F32, Q.Q8_0} <= kinds
    assert "output.weight" not in names and "rope_freqs.weight" in names
    assert "blk.0.layer_output_scale.weight" in names


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_logits_match_transformers_on_the_same_weights(pair):
    ref, _, model = pair
    ids = torch.randint(5, 250, (2, 19), generator=torch.Generator().manual_seed(22))
    cache = model.new_cache(2, 32)
    ours = model.logits(model(ids, cache))
    with torch.no_grad():
        theirs = ref(ids).logits
    assert_fp32_close(ours, theirs, reduction_depth(model.config))
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_tokens_equal_transformers(pair):
    ref, _, model = pair
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (5, 12)]
    expected = greedy_sequences(ref, prompts, 16)
    results = Engine(model).generate(prompts, max_new_tokens=16, eos_token_ids=[])
    assert [r.token_ids for r in results] == [s[len(p):] for s, p in zip(expected, prompts)]


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_split_expert_stacks_load(tmp_path):
    """Files that keep each expert stack as ffn_gate_exps + ffn_up_exps load as gate over up."""
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**moe_overrides())), seed=26)
    path = tmp_path / "split.gguf"
    write_target_gguf(path, ref, split_experts=True)
    assert "blk.0.ffn_gate_exps.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    convert_gguf(path, tmp_path / "converted", progress=False)
    model, _, _ = load_folder(tmp_path / "converted", torch.float32, "cpu")
    ids = torch.randint(5, 250, (1, 11), generator=torch.Generator().manual_seed(27))
    with torch.no_grad():
        theirs = ref(ids).logits
    assert_fp32_close(model.logits(model(ids, model.new_cache(1, 16))), theirs, reduction_depth(model.config))


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_ollama_layout_loads(tmp_path):
    """Ollama's single-file Gemma 4: the same text tensors, the vision/audio towers beside them
    (skipped), and the Gemma 4 tokenizer spelled as model "llama", pre-tokenizer "gemma4"."""
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config()), seed=28)
    path = tmp_path / "ollama.gguf"
    write_target_gguf(path, ref, ollama=True)
    convert_gguf(path, tmp_path / "converted", progress=False)
    model, _, _ = load_folder(tmp_path / "converted", torch.float32, "cpu")
    ids = torch.randint(5, 250, (1, 9), generator=torch.Generator().manual_seed(29))
    with torch.no_grad():
        theirs = ref(ids).logits
    assert_fp32_close(model.logits(model(ids, model.new_cache(1, 16))), theirs, reduction_depth(model.config))
    tokens, _ = _vocab(256)
    ids = Tokenizer(tmp_path / "converted").encode("hello world\n\nhello!abc")
    assert [tokens[i] for i in ids] == ["<bos>", "hello", "\u2581world", "\n\n", "hello", "<0x21>", "a", "bc"]


def test_runtime_loads_the_gguf_with_its_own_blocks(pair, tmp_path, monkeypatch):
    """The path a user takes (`--model file.gguf`): converted once into the cache, then run on the
    file's own Q8_0 blocks (--weights gguf); greedy tokens are transformers'."""
    from specdraft.runtime import Runtime

    ref, path, _ = pair
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    rt = Runtime.load(str(path), dtype="float32", device="cpu", weights="gguf", progress=False)
    prompts = [[5, 9, 33, 100, 7, 41]]
    expected = greedy_sequences(ref, prompts, 12)
    results = Engine(rt.model).generate(prompts, max_new_tokens=12, eos_token_ids=[])
    assert results[0].token_ids == expected[0][len(prompts[0]):]


def test_config_read_from_the_keys(pair):
    """Per-type shapes, KV sharing, double-wide MLP, experts and proportional RoPE come back
    from the keys and rope_freqs as the original config states them."""
    ref, _, model = pair
    text, p = ref.config, model.params
    assert model.config.layer_types == text.layer_types
    assert p.head_dim == {SLIDING: _layer_attr(text, SLIDING, "head_dim"), FULL: _layer_attr(text, FULL, "head_dim")}
    assert p.num_kv_heads[FULL] == _layer_attr(text, FULL, "num_key_value_heads")
    assert p.num_kv_shared_layers == (text.num_kv_shared_layers or 0)
    assert p.use_double_wide_mlp == bool(text.use_double_wide_mlp and text.num_kv_shared_layers)
    assert p.attention_k_eq_v and p.enable_moe_block == bool(text.enable_moe_block)
    assert model.config.rope[FULL].kind == "proportional"
    assert model.config.rope[FULL].partial == text.rope_parameters[FULL]["partial_rotary_factor"]
    assert model.config.sliding_window == text.sliding_window


def test_gemma4_tokenizer_from_the_gguf(pair):
    """llama.cpp's gemma4 tokenizer: spaces as "▁", newline runs split off, merges by rank,
    byte fallback, BOS added; and the turn marker counts as a stop token."""
    _, path, _ = pair
    folder = path.parent / "converted"
    tok = Tokenizer(folder)
    tokens, _ = _vocab(256)
    ids = tok.encode("hello world\n\nhello!abc")
    assert [tokens[i] for i in ids] == ["<bos>", "hello", "\u2581world", "\n\n", "hello", "<0x21>", "a", "bc"]
    assert tok.decode(ids[1:]) == "hello world\n\nhello!abc"
    assert tokens.index("<turn|>") in __import__("json").loads((folder / "config.json").read_text())["eos_token_id"]


def test_header_only_config_refuses_a_mismatched_assistant(pair, tmp_path):
    """check_drafter_fits reads a GGUF target's header only: a garbage-weight assistant folder
    and a truncated GGUF body are never read."""
    ref, path, _ = pair
    bad = transformers.Gemma4AssistantForCausalLM(assistant_config(ref.config, backbone_hidden_size=48))
    bad.config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpecdraftError, match="backbone_hidden_size 48 != target hidden size 64"):
        check_drafter_fits(tmp_path, str(path))


def _header_only_gguf(path: Path, cfg: dict) -> None:
    """A GGUF with a published config's keys and rope_freqs, and stand-ins (one column each) for
    the tensors whose presence or rows the config is read from: every key at its real value."""
    writer = gguf.GGUFWriter(str(path), "gemma4")
    gguf_metadata(writer, cfg, "published")
    writer.add_tensor("rope_freqs.weight", rope_freqs(cfg))
    writer.add_tensor("token_embd.weight", np.zeros((cfg["vocab_size"], 1), dtype=np.float32))
    if cfg["hidden_size_per_layer_input"]:
        writer.add_tensor("per_layer_token_embd.weight", np.zeros((cfg["vocab_size_per_layer_input"], 1), np.float32))
    first_shared = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
    for i, t in enumerate(cfg["layer_types"][:first_shared]):
        if t == SLIDING or not cfg["attention_k_eq_v"]:
            writer.add_tensor(f"blk.{i}.attn_v.weight", np.zeros((1, 1), np.float32))
    if cfg["enable_moe_block"]:
        writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((1, 1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("size", SIZES)
def test_published_sizes_read_back_from_the_keys(size, tmp_path):
    """At the published sizes, the config read from a GGUF's keys is the config the checkpoint's
    config.json gives (every shape, KV sharing, PLE, experts, RoPE, window)."""
    cfg = published_text(size)
    _header_only_gguf(tmp_path / "t.gguf", cfg)
    ours, theirs = read_model_config(gguf_config(tmp_path / "t.gguf")), read_model_config(cfg)
    assert gemma4_params(ours) == gemma4_params(theirs)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "layer_types",
                  "rope", "sliding_window", "rms_norm_eps", "final_softcap", "tie_word_embeddings",
                  "max_position_embeddings", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_published_assistants_checked_against_gguf_headers(tmp_path):
    """check_drafter_fits on real-size configs: each published assistant fits its own target's
    GGUF and is refused by name for another size's (no weights exist anywhere here)."""
    for size in ("e2b", "e4b"):
        _header_only_gguf(tmp_path / f"{size}.gguf", published_text(size))
        (tmp_path / f"{size}-assistant").mkdir()
        (tmp_path / f"{size}-assistant" / "config.json").write_text(__import__("json").dumps(published_assistant(size)))
    assert check_drafter_fits(tmp_path / "e2b-assistant", str(tmp_path / "e2b.gguf")).backbone_hidden_size == 1536
    assert check_drafter_fits(tmp_path / "e4b-assistant", str(tmp_path / "e4b.gguf")).backbone_hidden_size == 2560
    with pytest.raises(SpecdraftError, match=r"backbone_hidden_size 1536 != target hidden size 2560; .*KV heads 1 != "
                                             r"target layer \d+ KV heads 2"):
        check_drafter_fits(tmp_path / "e2b-assistant", str(tmp_path / "e4b.gguf"))


@pytest.mark.parametrize("size", ["26b-a4b", "31b"])
def test_published_assistant_gguf_headers(size, tmp_path):
    """The gemma4-assistant GGUF of a published assistant (keys at their real values) reads as
    that assistant's config and fits its target's GGUF, both from headers alone."""
    published = published_assistant(size)
    w = _assistant_keys(tmp_path / "a.gguf", published["text_config"], published["backbone_hidden_size"])
    w.add_tensor("token_embd.weight", np.zeros((published["text_config"]["vocab_size"], 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _header_only_gguf(tmp_path / "t.gguf", published_text(size))
    ours = check_drafter_fits(tmp_path / "a.gguf", str(tmp_path / "t.gguf"))
    theirs = MTPConfig.from_dict(published)
    for field in ("backbone_hidden_size", "hidden_size", "intermediate_size", "layer_types", "num_heads", "head_dim",
                  "num_kv_heads", "vocab_size", "rms_norm_eps", "sliding_window", "rope", "clustered"):
        value = getattr(ours, field)
        assert (value() if callable(value) else value) == (getattr(theirs, field)() if callable(value)
                                                           else getattr(theirs, field)), field


# ---------------------------------------------------------------- the gemma4-assistant GGUF

ASSISTANT_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight", "layer_scalar": "layer_output_scale.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
ASSISTANT_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "pre_projection.weight": "nextn.pre_projection.weight",
                 "post_projection.weight": "nextn.post_projection.weight"}


def _assistant_keys(path: Path, text: dict, backbone: int):
    """A gguf.GGUFWriter for a gemma4-assistant GGUF with the keys of `text` (a text_config in
    the published spelling) and its rope_freqs; the caller adds the tensors and writes it."""
    arch = "gemma4-assistant"
    w = gguf.GGUFWriter(str(path), arch)
    n = text["num_hidden_layers"]
    swa = [t == SLIDING for t in text["layer_types"]]
    kv_full = text.get("num_global_key_value_heads") or text["num_key_value_heads"]
    w.add_block_count(n)
    w.add_context_length(text["max_position_embeddings"])
    w.add_embedding_length(text["hidden_size"])
    w.add_uint32(f"{arch}.embedding_length_out", backbone)
    w.add_feed_forward_length(text["intermediate_size"])
    w.add_head_count(text["num_attention_heads"])
    w.add_head_count_kv([text["num_key_value_heads"] if s else kv_full for s in swa])
    w.add_key_length(text["global_head_dim"])
    w.add_value_length(text["global_head_dim"])
    w.add_key_length_swa(text["head_dim"])
    w.add_value_length_swa(text["head_dim"])
    w.add_rope_freq_base(text["rope_parameters"][FULL]["rope_theta"])
    w.add_rope_freq_base_swa(text["rope_parameters"][SLIDING]["rope_theta"])
    w.add_sliding_window(text["sliding_window"])
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(n)
    w.add_layer_norm_rms_eps(text["rms_norm_eps"])
    w.add_tensor("rope_freqs.weight", rope_freqs(text))
    return w


def write_assistant_gguf(path: Path, assistant) -> None:
    """A dense-head Gemma4AssistantForCausalLM as llama.cpp's gemma4-assistant GGUF (Q8_0 matrices,
    F32 vectors); afterwards the model holds exactly the values the file stores."""
    w = _assistant_keys(path, published_fields(assistant.config.get_text_config()),
                        assistant.config.backbone_hidden_size)
    with torch.no_grad():
        for name, param in assistant.state_dict().items():
            if name == "lm_head.weight":
                continue
            if name in ASSISTANT_TOP:
                target = ASSISTANT_TOP[name]
            else:
                _, _, layer, rest = name.split(".", 3)
                target = f"blk.{layer}.{ASSISTANT_LAYER[rest]}"
            values = param.float().numpy()
            qtype = Q.Q8_0 if values.ndim == 2 and values.shape[-1] % 32 == 0 else Q.F32
            data, back = _stored(values, qtype)
            w.add_tensor(target, data, raw_dtype=qtype if qtype != Q.F32 else None)
            param.copy_(torch.from_numpy(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_assistant_gguf_drafts_as_the_same_weights_do(pair, tmp_path, monkeypatch):
    """A gemma4-assistant GGUF loads as a dense-head drafter and drafts exactly what the same
    weights in a Hugging Face assistant folder draft (states, logits and tokens)."""
    ref_t, target_path, model = pair
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    ref_a = randomize_(transformers.Gemma4AssistantForCausalLM(
        assistant_config(ref_t.config, use_ordered_embeddings=False)), seed=24)
    path = tmp_path / "assistant.gguf"
    write_assistant_gguf(path, ref_a)
    ref_a.save_pretrained(tmp_path / "hf")
    assert not check_drafter_fits(path, str(target_path)).clustered  # header against header
    from_gguf = load_mtp_drafter(path, model, torch.float32, "cpu")
    from_hf = load_mtp_drafter(tmp_path / "hf", model, torch.float32, "cpu")
    assert from_gguf.net.masked_embedding is None
    for name, t in from_hf.net.state_dict().items():
        assert torch.equal(from_gguf.net.state_dict()[name], t), name
    ids = torch.randint(5, 250, (2, 14), generator=torch.Generator().manual_seed(25))
    cache = model.new_cache(2, 24)
    hidden = model(ids, cache)
    p = 12
    inp = DraftInput(ids[:, p + 1], hidden[:, p], torch.full((2,), p), cache, torch.zeros(2, 24, dtype=torch.long),
                     torch.ones(2, dtype=torch.bool))
    a = from_gguf.propose(inp, 3, SamplingParams(), None)
    b = from_hf.propose(inp, 3, SamplingParams(), None)
    assert a.tokens.tolist() == b.tokens.tolist()
