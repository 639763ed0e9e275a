"""GGUF -> Hugging Face folder (config.json, model.safetensors, tokenizer files, and the quantised
blocks as they are in gguf_blocks/, loading/gguf_blocks.py).

Weights are dequantised to float32 with the `gguf` package and renamed to HF names, undoing
the two things llama.cpp's converter changes: Gemma norm weights are stored as (1 + w), and
Llama q/k projections are permuted into interleaved-RoPE order. The folder is what any HF
tool can load too, which is how the tests and the benchmark's peers use the same weights.
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
SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3")


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
        if name is None:
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


def convert_gguf(path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, model.safetensors (float32) and tokenizer files for `path` into out_dir."""
    from gguf import quants
    from tqdm import tqdm

    from specdraft.loading.gguf_tokenizer import convert_gguf_tokenizer

    reader = open_gguf(path)
    arch = reader.value("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise SpecdraftError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise SpecdraftError(f"{path}: GGUF has no token_embd.weight")
    cfg = _hf_config(reader, arch, "output.weight" in names, int(embed.shape[-1]))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantising {path.name}", unit="tensor", disable=not progress):
        try:
            w = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except Exception as e:
            raise SpecdraftError(f"{path}: cannot dequantise {t.name} ({e}); is the file truncated or corrupt?") from None
        if t.name == "rope_freqs.weight":
            cfg["rope_parameters"] = _llama3_rope_from_freqs(w, cfg)
            continue
        name = _hf_name(t.name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # GGUF stores Gemma's (1 + w); HF stores w.
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = _unpermute(w, heads)
        if arch == "llama" and ".self_attn.k_proj." in name:
            w = _unpermute(w, kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    save_blocks(read_blocks(path, reader), out_dir / BLOCKS_FILE)  # the quantised codes too (--weights gguf)
    convert_gguf_tokenizer(reader, out_dir)

