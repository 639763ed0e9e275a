"""GGUF -> Hugging Face folder (config.json, model.safetensors, tokenizer files, and the quantised
blocks as they are in gguf_blocks/, loading/gguf_blocks.py).

Weights are dequantised to float32 with the `gguf` package and renamed to HF names, undoing
what llama.cpp's converter changes: Gemma 3 norm weights are stored as (1 + w), and Llama q/k
projections are permuted into interleaved-RoPE order. The folder is what any HF tool can load
too, which is how the tests and the benchmark's peers use the same weights.

Gemma 4 (architecture `gemma4`, as llama.cpp, Ollama and LM Studio users have it): norms are
stored as w (no shift), the layer scalar as `layer_output_scale`, the router's scale and
per-expert scale as `ffn_gate_inp.scale` / `ffn_down_exps.scale`, the experts as one
`ffn_gate_up_exps` stack (or, in some files, `ffn_gate_exps` + `ffn_up_exps`), PLE as
`per_layer_*` / `inp_gate` / `proj` / `post_norm`. Per-type shapes live in the keys: head dims
in attention.key_length (full) and key_length_swa (sliding), KV heads and the MLP width as
per-layer arrays (sliding vs full; double-wide KV-shared layers), the layer types as the bool
array attention.sliding_window_pattern, the full layers' proportional RoPE as freq factors in
`rope_freqs` (1 for rotated pairs, 1e30 for the rest). Full layers without attn_v use K as V
(attention_k_eq_v). Ollama's files say tokenizer model "llama" with pre-tokenizer "gemma4" and
keep the vision and audio towers (v.*, a.*, mm.*) in the same file; those are skipped, as the
towers of a Hugging Face folder are. A `gemma4-assistant` GGUF (the MTP drafter, llama.cpp's layout) becomes a
Gemma 4 assistant folder: its own tied table `token_embd`, `nextn.pre_projection` /
`nextn.post_projection`, query-only blocks; it carries no clustered head, so it drafts with a
dense one, as llama.cpp does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from specdraft.errors import SpecdraftError
from specdraft.loading.gguf_blocks import BLOCKS_FILE, SUPPORTED_BLOCK_FORMATS, decode_blocks, save_blocks
from specdraft.loading.gguf_gemma4 import GEMMA4_ASSISTANT, assistant_config, float32_values, gemma4_config
from specdraft.loading.gguf_reader import GGUFFile
from specdraft.loading.weights import text_decoder_weights
from specdraft.models.formats.block_linear import Blocks

# GGUF block-local names -> HF names (inside "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# Norm names differ between the two families: Llama's ffn_norm is its post-attention norm.
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LLAMA_NORMS = {"ffn_norm": "post_attention_layernorm"}
# Gemma 4: GGUF block-local name -> HF name inside "model.layers.{i}.", with its suffix ("" where
# the HF tensor has none). Names are llama.cpp's (gguf-py's tensor table for MODEL_ARCH.GEMMA4).
_GEMMA4_LAYER = {
    **{(local, "weight"): f"{hf}.weight" for local, hf in {**_LAYER_NAMES, **_GEMMA_NORMS}.items()},
    ("layer_output_scale", "weight"): "layer_scalar",
    ("pre_ffw_norm_2", "weight"): "pre_feedforward_layernorm_2.weight",
    ("post_ffw_norm_1", "weight"): "post_feedforward_layernorm_1.weight",
    ("post_ffw_norm_2", "weight"): "post_feedforward_layernorm_2.weight",
    ("ffn_gate_inp", "weight"): "router.proj.weight",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
    ("ffn_down_exps", "weight"): "experts.down_proj",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("inp_gate", "weight"): "per_layer_input_gate.weight",
    ("proj", "weight"): "per_layer_projection.weight",
    ("post_norm", "weight"): "post_per_layer_input_norm.weight",
}
_GEMMA4_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    # the gemma4-assistant drafter's projections between the target's width and its own
    "nextn.pre_projection.weight": "pre_projection.weight",
    "nextn.post_projection.weight": "post_projection.weight",
}
# Expert stacks some files keep apart; the HF layout stacks gate over up (gate_up_proj).
_SPLIT_EXPERTS = ("ffn_gate_exps", "ffn_up_exps")
SUPPORTED_ARCHS = ("gemma3", "gemma4", GEMMA4_ASSISTANT, "llama", "qwen2", "qwen3")
# Freq factors at or above this mark a pair llama.cpp leaves unrotated (the converter writes 1e30).
# Gemma 4 -it turn ends, stop tokens beside <eos> (transformers' GGUF loader adds the same ones).
# Vision and audio towers and their projectors, which Ollama keeps in the same file as the text
# decoder (llama.cpp puts them in a separate mmproj file); specdraft runs text only.
_GEMMA4_TOWERS = ("v.", "a.", "mm.")
# An assistant's clustered head (centroids, token ordering) under llama.cpp's names: its converter
# leaves it out, and where a file carries it, it is not read (the drafter's head is dense).
CLUSTERED_HEAD = "masked_embd"


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise SpecdraftError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(path)
    except Exception as e:  # the reader raises many kinds on bad bytes; all mean the same to a user
        raise SpecdraftError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e}); is it truncated or corrupt?") from None


def _hf_config(reader, arch: str, has_output: bool, vocab_size: int) -> dict[str, Any]:
    def a(key: str, default: Any = None) -> Any:
        return reader.value(f"{arch}.{key}", default)

    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    head_dim = int(a("attention.key_length", hidden // heads))
    cfg: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(a("context_length", 8192)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": reader.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.value("tokenizer.ggml.eos_token_id"),
        "pad_token_id": reader.value("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    theta = float(a("rope.freq_base", 10000.0))
    scaling = _rope_scaling(reader, arch)
    if arch == "gemma3":
        n = cfg["num_hidden_layers"]
        full = {"rope_type": "default", "rope_theta": theta, **scaling}
        # The GGUF does not store the sliding layers' theta; Gemma 3 uses 10000 there.
        sliding = {"rope_type": "default", "rope_theta": 10000.0}
        # Gemma 3 27B scales queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5.
        scalar = hidden // heads if n == 62 else head_dim
        cfg.update(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=scalar,
            sliding_window=int(a("attention.sliding_window", 4096)),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
            rope_parameters={"full_attention": full, "sliding_attention": sliding},
            final_logit_softcapping=a("final_logit_softcapping"),
            attn_logit_softcapping=a("attn_logit_softcapping"),
        )
    else:
        model_type = arch
        cfg.update(
            model_type=model_type,
            architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": theta, **scaling},
        )
    return cfg


def _rope_scaling(reader, arch: str) -> dict[str, Any]:
    kind = reader.value(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(reader.value(f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": float(reader.value(f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(reader.value(f"{arch}.rope.scaling.original_context_length")),
        }
    raise SpecdraftError(f"GGUF rope scaling type {kind!r} is not supported")


def _llama3_rope_from_freqs(freq_factors: np.ndarray, cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1+ GGUFs store per-frequency divisors (rope_freqs) instead of the parameters.
    Find the standard parameter set that reproduces them exactly, or refuse."""
    from specdraft.config import RopeParams
    from specdraft.models.architectures.rope import inverse_frequencies

    base = cfg["rope_parameters"]
    for factor, orig in ((8.0, 8192), (32.0, 8192), (16.0, 8192)):
        params = {**base, "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": orig}
        plain, _ = inverse_frequencies(RopeParams.from_dict({**base, "rope_type": "default"}), cfg["head_dim"], orig)
        scaled, _ = inverse_frequencies(RopeParams.from_dict(params), cfg["head_dim"], orig)
        if np.allclose((plain / scaled).numpy(), freq_factors, rtol=1e-3):
            return params
    raise SpecdraftError("GGUF has rope_freqs that match no known Llama 3 RoPE scaling")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each head; put them back.
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if arch in ("gemma4", GEMMA4_ASSISTANT):
        return _gemma4_hf_name(gguf_name, arch)
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "rope_freqs.weight":
        return None
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        raise SpecdraftError(f"GGUF tensor {gguf_name!r} is not one a {arch} model has")
    _, layer, local, kind = parts
    names = {**_LAYER_NAMES, **(_GEMMA_NORMS if arch == "gemma3" else _LLAMA_NORMS)}
    if local not in names:
        raise SpecdraftError(f"GGUF tensor {gguf_name!r} is not one a {arch} model has")
    return f"model.layers.{layer}.{names[local]}.{kind}"


def hf_name(gguf_name: str, arch: str) -> str | None:
    """A GGUF tensor's Hugging Face name (None: not a text-decoder weight, e.g. rope_freqs or a
    vision/audio tower's tensor; a split expert half keeps its GGUF name, "blk.N.ffn_gate_exps.weight")."""
    return _hf_name(gguf_name, arch)


def _gemma4_hf_name(gguf_name: str, arch: str) -> str | None:
    """A gemma4 / gemma4-assistant GGUF tensor's HF name (None: not a text-decoder weight: the
    rope_freqs read into the config, a vision/audio tower's tensor, an assistant's clustered head)."""
    if gguf_name == "rope_freqs.weight" or gguf_name.startswith(_GEMMA4_TOWERS + (CLUSTERED_HEAD,)):
        return None
    if gguf_name in _GEMMA4_TOP:
        return _GEMMA4_TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        if (parts[2], parts[3]) in _GEMMA4_LAYER:
            return f"model.layers.{parts[1]}.{_GEMMA4_LAYER[parts[2], parts[3]]}"
        if parts[2] in _SPLIT_EXPERTS and parts[3] == "weight":
            return gguf_name  # stacked into experts.gate_up_proj once both halves are read
    raise SpecdraftError(f"GGUF tensor {gguf_name!r} is not one a {arch} model has")


def read_blocks(path: Path, reader: GGUFFile | None = None) -> dict[str, Blocks]:
    """Every block-quantised matrix of a GGUF file, named as our modules name their weights
    (`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`); other tensors are left out.
    `reader`: the file already opened (open_gguf)."""
    reader = reader if reader is not None else open_gguf(path)
    arch = reader.value("general.architecture")
    heads = {"q": reader.value(f"{arch}.attention.head_count"), "k": reader.value(f"{arch}.attention.head_count_kv")}
    found: dict[str, Blocks] = {}
    for t in reader.tensors:
        fmt = t.tensor_type.name
        if fmt not in SUPPORTED_BLOCK_FORMATS or len(t.shape) != 2:
            continue
        name = _hf_name(t.name, arch)
        if name is None or not name.endswith(".weight"):
            continue
        k, n = (int(d) for d in t.shape)  # GGUF lists the input width first
        try:
            blocks = decode_blocks(t.data, fmt, (n, k))
        except ValueError as e:
            raise SpecdraftError(f"{path}: cannot read the blocks of {t.name} ({e}); is the file corrupt?") from None
        for proj in ("q", "k"):  # llama.cpp interleaves Llama's q/k rows; undo it (rows only)
            if arch == "llama" and f".self_attn.{proj}_proj." in name:
                order = torch.from_numpy(_unpermute(np.arange(n), heads[proj]).copy())
                blocks = blocks.rows(order)
        found[name] = blocks
    renamed, _ = text_decoder_weights(found)
    return renamed


def gguf_config(path: Path, reader: GGUFFile | None = None) -> dict[str, Any]:
    """The config.json a GGUF converts to, from its header (and the small rope_freqs tensor)
    alone: what `check_drafter_fits` reads of a GGUF target before any weight is."""
    reader = reader if reader is not None else open_gguf(path)
    arch = reader.value("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise SpecdraftError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise SpecdraftError(f"{path}: GGUF has no token_embd.weight")
    vocab = int(embed.shape[-1])
    if arch == "gemma4":
        return gemma4_config(path, reader, tensors, vocab)
    if arch == GEMMA4_ASSISTANT:
        return assistant_config(path, reader, tensors, vocab)
    cfg = _hf_config(reader, arch, "output.weight" in tensors, vocab)
    if "rope_freqs.weight" in tensors:
        cfg["rope_parameters"] = _llama3_rope_from_freqs(float32_values(path, tensors["rope_freqs.weight"]), cfg)
    return cfg


def float_state(path: Path, reader: GGUFFile, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every text-decoder tensor of the file dequantised to float32, under its Hugging Face name
    (what convert_gguf writes; a gemma4-assistant drafter loads from it in memory)."""
    from gguf import quants
    from tqdm import tqdm

    arch = reader.value("general.architecture")
    cfg = gguf_config(path, reader)
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    state: dict[str, torch.Tensor] = {}
    split_experts: dict[str, dict[str, np.ndarray]] = {}
    for t in tqdm(reader.tensors, desc=f"dequantising {path.name}", unit="tensor", disable=not progress):
        name = _hf_name(t.name, arch)
        if name is None:  # rope_freqs (read into the config already), vision/audio towers
            continue
        try:
            w = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except Exception as e:
            raise SpecdraftError(f"{path}: cannot dequantise {t.name} ({e}); is the file truncated or corrupt?") from None
        if name.startswith("blk."):  # half of a split expert stack
            _, layer, local, _ = name.split(".")
            split_experts.setdefault(layer, {})[local] = w
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # GGUF stores Gemma 3's (1 + w); HF stores w. (Gemma 4 stores w itself.)
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = _unpermute(w, heads)
        if arch == "llama" and ".self_attn.k_proj." in name:
            w = _unpermute(w, kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    for layer, halves in split_experts.items():
        if set(halves) != set(_SPLIT_EXPERTS):
            raise SpecdraftError(f"{path}: GGUF layer {layer} has {sorted(halves)} but not both of {list(_SPLIT_EXPERTS)}")
        stacked = np.concatenate([halves["ffn_gate_exps"], halves["ffn_up_exps"]], axis=1)  # [E, 2I, H]: gate, then up
        state[f"model.layers.{layer}.experts.gate_up_proj"] = torch.from_numpy(np.ascontiguousarray(stacked))
    return state


def convert_gguf(path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, model.safetensors (float32) and tokenizer files for `path` into out_dir
    (a gemma4-assistant GGUF: a drafter folder, with tokenizer files only if it has a vocabulary)."""
    from specdraft.loading.gguf_tokenizer import convert_gguf_tokenizer

    reader = open_gguf(path)
    arch = reader.value("general.architecture")
    cfg = gguf_config(path, reader)
    state = float_state(path, reader, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    if arch == GEMMA4_ASSISTANT:
        if reader.value("tokenizer.ggml.tokens") is not None:
            convert_gguf_tokenizer(reader, out_dir)
        return
    save_blocks(read_blocks(path, reader), out_dir / BLOCKS_FILE)  # the quantised codes too (--weights gguf)
    convert_gguf_tokenizer(reader, out_dir)
